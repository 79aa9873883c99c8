//! Who holds a lease on a file, which setup asks before it takes over or
//! replaces a declared file: a lease is no lock, but it makes every open
//! for writing wait for the kernel's lease-break time.

use crate::proc::lock_entry::FileId;
use crate::proc::locks::LockTable;

/// The pids holding (or breaking) a lease on the file, from the one reader
/// of `/proc/locks` ([`LockTable`]); none when it cannot be read.
pub(super) fn lease_holders(id: FileId) -> Vec<u32> {
    LockTable::read()
        .map(|table| table.leases(id).iter().map(|lease| lease.pid).collect())
        .unwrap_or_default()
}
