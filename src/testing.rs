//! What the integration tests read of devlock's internals, and nothing
//! else: the record format (to forge, tear and check records), the kernel
//! readings status is built on (so the tests' oracles use the crate's one
//! `/proc/locks` parser), and the width the waiting line is measured in.
//! Not a stable API.

/// The holder record (see the protocol in the flock backend's docs).
pub mod record {
    pub use crate::flock::record::{MAX_RECORD_BYTES, ReadRecord, Record, parse, read_from};
}

/// Kernel readings from `/proc`.
pub mod procfs {
    pub use crate::proc::lock_entry::{FileId, KernelLock, RangeLock, parse_locks};
    pub use crate::proc::locks::LockTable;
    pub use crate::proc::process::{is_stopped, start_time, user_name};
}

/// Text measured as the waiting line measures it.
pub mod text {
    pub use crate::text::columns;
}
