//! The kernel's lock table, `/proc/locks` (every flock and byte-range lock
//! of this pid namespace, by file), with the descriptors read for the same
//! look ([`super::fdinfo`]). A fresh reading each time: callers check
//! records against it, never the other way.

use std::collections::HashMap;
use std::fs;
use std::io::Read;

use super::fdinfo::Descriptors;
use super::lock_entry::parse_leases;
use super::lock_entry::parse_range_locks;
use super::lock_entry::{FileId, KernelLock, RangeLock, parse_locks};

/// All lock entries of the machine (of this pid namespace), by file, and
/// what the processes' descriptors hold, read once for this look: every
/// question a look asks of a process's descriptors (does it hold this file,
/// who shares this lock, who owns that byte) is answered from one reading
/// of each process, made when first asked, so a look costs one pass over
/// the descriptors however many locks a stranger made or `dup`ed.
#[derive(Debug, Default)]
pub struct LockTable {
    by_file: HashMap<FileId, Vec<KernelLock>>,
    ranges: HashMap<FileId, Vec<RangeLock>>,
    leases: HashMap<FileId, Vec<KernelLock>>,
    descriptors: Descriptors,
}

impl LockTable {
    /// Reads the table. The kernel fills each read(2) of `/proc/locks` in
    /// one pass over its list, but only a page at a time, so on a busy
    /// machine an entry that moves between two reads can be skipped or
    /// repeated (two shared holders shown as one). When the table spans
    /// several reads, it is read again until two readings agree. Where the
    /// locks of others change faster than that, no two ever agree, and any
    /// one reading may lack a lock held all along (the lock shown free, its
    /// holder named nowhere): then every entry of any reading counts, each
    /// as often as the reading that shows it most often.
    pub fn read() -> std::io::Result<LockTable> {
        let (mut locks, pieces) = read_locks()?;
        if pieces > 1 {
            let mut readings = vec![locks.clone()];
            let mut agreed = false;
            for _ in 0..5 {
                let (again, _) = read_locks()?;
                agreed = again == locks;
                locks = again;
                if agreed {
                    break;
                }
                readings.push(locks.clone());
            }
            if !agreed {
                locks = (
                    every_entry(readings.iter().map(|r| &r.0)),
                    every_entry(readings.iter().map(|r| &r.1)),
                    every_entry(readings.iter().map(|r| &r.2)),
                );
            }
        }
        let (flocks, ranges, leases) = locks;
        let mut table = LockTable::from_locks(flocks);
        for lock in ranges {
            table.ranges.entry(lock.file).or_default().push(lock);
        }
        for lease in leases {
            table.leases.entry(lease.file).or_default().push(lease);
        }
        Ok(table)
    }

    /// A table of these flock entries (no byte-range locks).
    pub fn from_locks(locks: Vec<KernelLock>) -> LockTable {
        let mut by_file: HashMap<FileId, Vec<KernelLock>> = HashMap::new();
        for lock in locks {
            by_file.entry(lock.file).or_default().push(lock);
        }
        LockTable {
            by_file,
            ranges: HashMap::new(),
            leases: HashMap::new(),
            descriptors: Descriptors::default(),
        }
    }

    /// Granted locks on the file (one for an exclusive holder, several when shared).
    pub fn holders(&self, file: FileId) -> impl Iterator<Item = &KernelLock> {
        self.entries(file).filter(|l| !l.blocked)
    }

    /// Processes blocked in flock() on the file.
    pub fn blocked(&self, file: FileId) -> impl Iterator<Item = &KernelLock> {
        self.entries(file).filter(|l| l.blocked)
    }

    /// Whether anyone holds a flock on the file.
    pub fn is_locked(&self, file: FileId) -> bool {
        self.holders(file).next().is_some()
    }

    /// Every file someone holds or waits for a flock on.
    pub fn flocked_files(&self) -> impl Iterator<Item = FileId> + '_ {
        self.by_file.keys().copied()
    }

    /// File leases on the file (and opens waiting for one to break).
    pub fn leases(&self, file: FileId) -> &[KernelLock] {
        self.leases.get(&file).map_or(&[], Vec::as_slice)
    }

    /// Byte-range locks and requests on the file.
    pub fn ranges(&self, file: FileId) -> &[RangeLock] {
        self.ranges.get(&file).map_or(&[], Vec::as_slice)
    }

    /// Whether any lock of any kind, granted or requested, is on the file.
    pub fn any_on(&self, file: FileId) -> bool {
        self.entries(file).next().is_some() || !self.ranges(file).is_empty()
    }

    fn entries(&self, file: FileId) -> impl Iterator<Item = &KernelLock> {
        self.by_file.get(&file).into_iter().flatten()
    }

    /// Whether `pid` holds a granted flock on `file` through one of its
    /// descriptors, as this look read them; `None` when this user may not
    /// read them (another user's process, without privilege).
    pub(crate) fn holds_flock(&self, pid: u32, file: FileId) -> Option<bool> {
        let locks = self.descriptors.of(pid)?;
        Some(locks.flocks.iter().any(|l| l.file == file && !l.blocked))
    }

    /// The byte-range locks `pid`'s descriptors hold on `file`, as this
    /// look read them (`None` when this user may not read them).
    pub(crate) fn range_locks_of(&self, pid: u32, file: FileId) -> Option<Vec<RangeLock>> {
        let locks = self.descriptors.of(pid)?;
        Some(
            locks
                .ranges
                .iter()
                .filter(|l| l.file == file)
                .cloned()
                .collect(),
        )
    }

    /// The processes whose descriptors hold byte-range locks on `file`
    /// (OFD locks show no pid in `/proc/locks`: this is the only way to
    /// name their owners), from this look's reading of every process.
    pub(crate) fn range_lock_owners(&self, file: FileId) -> Vec<(u32, RangeLock)> {
        self.descriptors
            .everyone()
            .ranges
            .get(&file)
            .cloned()
            .unwrap_or_default()
    }

    /// The processes holding `file` through a flock that `taker` took
    /// (the pid its `lock:` line names: a command that inherited devlock's
    /// descriptor shows devlock's pid there), from this look's reading of
    /// every process.
    pub(crate) fn sharers(&self, file: FileId, taker: u32) -> Vec<u32> {
        self.descriptors
            .everyone()
            .flocks
            .get(&file)
            .into_iter()
            .flatten()
            .filter(|(_, t)| *t == taker)
            .map(|(p, _)| *p)
            .collect()
    }
}

type Locks = (Vec<KernelLock>, Vec<RangeLock>, Vec<KernelLock>);

/// Every entry of any of `readings`, each as many times as the reading
/// that has it most often, in the order first seen.
fn every_entry<'r, T: Clone + Eq + std::hash::Hash + 'r>(
    readings: impl Iterator<Item = &'r Vec<T>>,
) -> Vec<T> {
    let mut most: HashMap<&T, usize> = HashMap::new();
    let mut order = Vec::new();
    for reading in readings {
        let mut here: HashMap<&T, usize> = HashMap::new();
        for entry in reading {
            *here.entry(entry).or_default() += 1;
            if !most.contains_key(entry) {
                most.insert(entry, 0);
                order.push(entry);
            }
        }
        for (entry, n) in here {
            let seen = most.entry(entry).or_default();
            *seen = (*seen).max(n);
        }
    }
    order
        .into_iter()
        .flat_map(|entry| std::iter::repeat_n(entry.clone(), most[entry]))
        .collect()
}

/// The entries of `/proc/locks`, and how many reads it took.
fn read_locks() -> std::io::Result<(Locks, usize)> {
    let mut file = fs::File::open("/proc/locks")?;
    let mut text = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut pieces = 0;
    loop {
        let n = file.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        pieces += 1;
        text.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&text);
    Ok((
        (
            parse_locks(&text),
            parse_range_locks(&text),
            parse_leases(&text),
        ),
        pieces,
    ))
}

/// Where a holder's tag lies in a lock file (and a registration): one
/// byte far past anything written into it.
pub(crate) const TAG_AT: i64 = 1 << 40;

/// Takes the holder's tag on a file this process holds a flock on: a
/// POSIX read lock on [`TAG_AT`], which `/proc/locks` shows every user
/// under this process's pid, and which ends with this process (never
/// inherited, never left to a pid reused later). Only where flock and POSIX
/// locks do not meet (on NFS flock is made of POSIX locks, and the tag
/// would merge into it). A label only: a failure is ignored.
pub(crate) fn tag(file: &std::fs::File) {
    use std::os::fd::AsFd;
    if crate::sys::fs::is_local(file.as_fd()) {
        let _ = crate::sys::fs::posix_tag(file, TAG_AT);
    }
}

/// Whether `pid` holds the flock on `file` now, as far as this user can
/// tell from the kernel: its descriptors, where this user may read them;
/// else its tag ([`tag`]) in the lock table. `None` when neither says (a
/// process of another user without a tag: its pid may have been reused
/// since the lock was taken).
pub(crate) fn holds_now(table: &LockTable, pid: u32, file: FileId) -> Option<bool> {
    if let Some(holds) = table.holds_flock(pid, file) {
        return Some(holds);
    }
    let tagged = table
        .ranges(file)
        .iter()
        .any(|l| !l.ofd && !l.blocked && l.pid == Some(pid) && l.start == TAG_AT as u64);
    tagged.then_some(true)
}

#[cfg(test)]
mod tests {
    use super::every_entry;

    #[test]
    fn every_entry_of_readings_that_disagree_counts_each_as_its_fullest_reading() {
        // `b` skipped by the second reading, `a` repeated by the third, `c`
        // gone by then, `d` new: nothing any reading saw is left out, and
        // no entry is counted more often than one reading shows it.
        let readings = [
            vec!['a', 'b', 'b', 'c'],
            vec!['a', 'b', 'c'],
            vec!['a', 'a', 'b', 'b', 'd'],
        ];
        assert_eq!(
            every_entry(readings.iter()),
            vec!['a', 'a', 'b', 'b', 'c', 'd']
        );
    }
}
