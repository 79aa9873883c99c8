//! What processes' descriptors hold: the `lock:` lines of
//! `/proc/PID/fdinfo/FD` (Linux 4.1+), which name every process sharing a
//! lock where `/proc/locks` names only the one that took it. Readable for
//! this user's own processes, and root's for all.
//!
//! Reading them is the costly part of a look: one read per descriptor, and
//! a stranger can open as many as its limit allows (200 locks each `dup`ed
//! 1,000 times is 200,000 reads). So each process is read at most once per
//! look ([`Descriptors`], kept in the look's [`super::locks::LockTable`]),
//! whatever is asked of it and however many locks ask; and a descriptor
//! whose `lock:` lines were seen before in that process (a `dup`) is read
//! but not parsed again.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::lock_entry::{Entry, FileId, KernelLock, RangeLock, parse_entry};
use super::read_small;

/// What one process's descriptors hold, each lock once however many of its
/// descriptors share it.
#[derive(Debug, Default)]
pub(crate) struct ProcessLocks {
    /// Flocks: the file, and the pid the `lock:` line names (the process
    /// that took it).
    pub flocks: Vec<KernelLock>,
    /// Byte-range locks, granted and requested.
    pub ranges: Vec<RangeLock>,
}

/// How many descriptors are read between two looks for a stop signal: a
/// process with a million of them cannot hold a SIGTERM off for long.
const STOP_CHECK_EVERY: usize = 1024;

/// Whether any reading in this process was cut short by a stop signal:
/// what was read is then not all there is (see [`unseen_owner`]).
static CUT_SHORT: AtomicBool = AtomicBool::new(false);

fn stop_pending() -> bool {
    let pending = crate::sys::signal::any_pending(&crate::sys::signal::SigSet::of(&[
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGQUIT,
    ]));
    if pending {
        CUT_SHORT.store(true, Ordering::Relaxed);
    }
    pending
}

/// Reads what `pid`'s descriptors hold; `None` when this user may not read
/// them. A stop signal waiting to be taken (SIGTERM, SIGINT, SIGHUP,
/// SIGQUIT) ends the reading where it is: the caller gets to the signal at
/// once.
pub(crate) fn read_process(pid: u32) -> Option<ProcessLocks> {
    let fds = fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?;
    let mut seen: HashSet<String> = HashSet::new();
    let mut flocks: HashSet<KernelLock> = HashSet::new();
    let mut ranges: HashSet<RangeLock> = HashSet::new();
    let mut locks = ProcessLocks::default();
    for (n, fd) in fds.flatten().enumerate() {
        if n % STOP_CHECK_EVERY == STOP_CHECK_EVERY - 1 && stop_pending() {
            break;
        }
        let Some(info) = read_small(fd.path()) else {
            continue;
        };
        // Only the lock lines matter; a dup of a descriptor seen before
        // shows the same ones.
        let Some(first) = info.find("lock:") else {
            continue;
        };
        let lines = &info[first..];
        if seen.contains(lines) {
            continue;
        }
        for line in lines.lines() {
            let Some(rest) = line.strip_prefix("lock:") else {
                continue;
            };
            match parse_entry(rest.trim_start()) {
                Some(Entry::Flock(lock)) if flocks.insert(lock.clone()) => locks.flocks.push(lock),
                Some(Entry::Range(lock)) if ranges.insert(lock.clone()) => locks.ranges.push(lock),
                _ => {}
            }
        }
        seen.insert(lines.to_owned());
    }
    Some(locks)
}

/// The descriptors of one look: each process read when first asked about,
/// then answered from that reading; every process read at most once, the
/// pass over all of them ([`Descriptors::everyone`]) included.
#[derive(Debug, Default)]
pub(crate) struct Descriptors {
    processes: Mutex<HashMap<u32, Option<Arc<ProcessLocks>>>>,
    everyone: OnceLock<Arc<FdScan>>,
}

impl Descriptors {
    /// What `pid`'s descriptors hold (`None`: not readable by this user).
    pub(crate) fn of(&self, pid: u32) -> Option<Arc<ProcessLocks>> {
        let lock = || self.processes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(known) = lock().get(&pid) {
            return known.clone();
        }
        let read = read_process(pid).map(Arc::new);
        lock().insert(pid, read.clone());
        read
    }

    /// What the descriptors of every process this user may inspect (root:
    /// all) hold, by file: the scan another look made less than
    /// [`SCAN_FRESH`] ago (the candidates of one `--any` share it), else
    /// one made now from this look's readings.
    pub(crate) fn everyone(&self) -> Arc<FdScan> {
        self.everyone
            .get_or_init(|| shared_scan(SCAN_FRESH, || FdScan::of(|pid| self.of(pid))))
            .clone()
    }
}

/// What the descriptors of every process this user may inspect (root: all)
/// hold, by file, from one pass over the processes.
#[derive(Debug, Default)]
pub(crate) struct FdScan {
    /// Granted flocks: (holding pid, the pid its `lock:` line names).
    pub flocks: HashMap<FileId, Vec<(u32, u32)>>,
    /// Byte-range locks (granted and requested), with the holding pid.
    pub ranges: HashMap<FileId, Vec<(u32, RangeLock)>>,
}

impl FdScan {
    /// The scan of every process, each read by `read`.
    fn of(read: impl Fn(u32) -> Option<Arc<ProcessLocks>>) -> FdScan {
        let mut scan = FdScan::default();
        for pid in super::process::pids() {
            if stop_pending() {
                break;
            }
            let Some(locks) = read(pid) else {
                continue;
            };
            for lock in locks.flocks.iter().filter(|l| !l.blocked) {
                let list = scan.flocks.entry(lock.file).or_default();
                if !list.contains(&(pid, lock.pid)) {
                    list.push((pid, lock.pid));
                }
            }
            for lock in &locks.ranges {
                scan.ranges
                    .entry(lock.file)
                    .or_default()
                    .push((pid, lock.clone()));
            }
        }
        scan
    }
}

/// How long one pass over every process answers for, to later looks and
/// to a take's questions (is this agreement byte a devlock's).
pub(crate) const SCAN_FRESH: Duration = Duration::from_millis(250);

static SCAN: Mutex<Option<(Instant, Arc<FdScan>)>> = Mutex::new(None);

/// The scan of every process's descriptors, made now unless one made less
/// than [`SCAN_FRESH`] ago answers.
pub(crate) fn fd_scan() -> Arc<FdScan> {
    fd_scan_within(SCAN_FRESH)
}

/// The scan, made now unless one made less than `fresh` ago answers (a
/// question whose answer decides, not only names: is this lock a
/// devlock's, asked again after the cached scan did not show its owner).
pub(crate) fn fd_scan_within(fresh: Duration) -> Arc<FdScan> {
    shared_scan(fresh, || FdScan::of(|pid| read_process(pid).map(Arc::new)))
}

/// Drops the shared scan (a look that is over needs it no more): it lists
/// every lock of every process, a megabyte behind a line of 500, which a
/// waiter would otherwise keep for as long as it waits, and unmap at the
/// exec that ends its take.
pub(crate) fn forget_shared_scan() {
    SCAN.lock().unwrap_or_else(|e| e.into_inner()).take();
}

/// The shared scan if one made less than `fresh` ago answers, else the one
/// `make` makes now, shared from then on.
fn shared_scan(fresh: Duration, make: impl FnOnce() -> FdScan) -> Arc<FdScan> {
    let mut cached = SCAN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, scan)) = cached.as_ref()
        && at.elapsed() < fresh
    {
        return scan.clone();
    }
    let scan = Arc::new(make());
    *cached = Some((Instant::now(), scan.clone()));
    scan
}

/// The processes whose descriptors hold byte-range locks on `file`, from
/// the shared scan ([`fd_scan`]).
pub(crate) fn range_lock_owners(file: FileId) -> Vec<(u32, RangeLock)> {
    fd_scan().ranges.get(&file).cloned().unwrap_or_default()
}

/// Whether `pid` holds a granted flock on `file` through one of its
/// descriptors, read now; `None` when its descriptors cannot be read
/// (another user's process, without privilege).
pub(crate) fn holds_flock(pid: u32, file: FileId) -> Option<bool> {
    let locks = read_process(pid)?;
    Some(locks.flocks.iter().any(|l| l.file == file && !l.blocked))
}

/// What holds a lock no process this user can see shows in its
/// descriptors: for root, who sees every process's, a descriptor no process
/// has open (sent over a unix socket and not received yet), unless a stop
/// signal cut a reading short; for anyone else, a process this user cannot
/// see.
pub fn unseen_owner() -> &'static str {
    if nix::unistd::geteuid().is_root() && !CUT_SHORT.load(Ordering::Relaxed) {
        "a descriptor no process has open (one sent over a unix socket, say)"
    } else {
        "a process this user cannot see"
    }
}

/// The locks each of one process's descriptors holds, read from the
/// `lock:` lines of `/proc/PID/fdinfo/*`, with the descriptor's number.
/// Returns `None` when the process's descriptors cannot be read (another
/// user's process, without privilege).
pub fn fd_locks(pid: &str) -> Option<Vec<(u32, KernelLock)>> {
    let dir = fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?;
    let mut found = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(fd) = name.to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        found.extend(
            locks_of_fd(pid, name.to_str().unwrap_or_default())
                .into_iter()
                .map(|l| (fd, l)),
        );
    }
    Some(found)
}

/// The flocks one descriptor holds, from the `lock:` lines of its fdinfo.
pub(crate) fn locks_of_fd(pid: &str, fd: &str) -> Vec<KernelLock> {
    let Some(info) = read_small(format!("/proc/{pid}/fdinfo/{fd}")) else {
        return Vec::new();
    };
    info.lines()
        .filter_map(
            |line| match parse_entry(line.strip_prefix("lock:")?.trim_start())? {
                Entry::Flock(lock) => Some(lock),
                _ => None,
            },
        )
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A look that is over lets go of the shared scan: the next question
    /// scans again instead of keeping every process's locks for good.
    #[test]
    fn a_forgotten_scan_is_made_again() {
        // Fresh for 250 ms: without the forgetting, the same scan answers.
        let first = fd_scan();
        forget_shared_scan();
        assert!(!Arc::ptr_eq(&first, &fd_scan()), "forgotten: made again");
    }
}
