//! The kernel's lock tables: `/proc/locks` (every flock and byte-range lock
//! of this pid namespace, by file) and the `lock:` lines of
//! `/proc/PID/fdinfo/FD` (which name every process sharing a lock). A fresh
//! reading each time: callers check records against it, never the other way.

use std::collections::HashMap;
use std::fs;
use std::io::Read;

use super::read_small;

/// Identity of a file as the kernel's lock tables name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId {
    /// Major and minor number of the filesystem's device.
    pub major: u32,
    /// (see `major`)
    pub minor: u32,
    /// The inode number.
    pub ino: u64,
}

impl FileId {
    /// The id of a file with these `st_dev` and `st_ino`.
    pub fn from_metadata(st_dev: u64, st_ino: u64) -> FileId {
        FileId {
            major: libc::major(st_dev),
            minor: libc::minor(st_dev),
            ino: st_ino,
        }
    }
}

/// One line of `/proc/locks` (or a `lock:` line of `/proc/PID/fdinfo/FD`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelLock {
    /// The locked file.
    pub file: FileId,
    /// The pid the kernel recorded when the lock was taken (or the waiter's pid).
    pub pid: u32,
    /// `WRITE` (exclusive) or `READ` (shared).
    pub exclusive: bool,
    /// A `->` line: a process blocked waiting for this lock.
    pub blocked: bool,
}

/// A byte-range lock (POSIX `fcntl` or open-file-description) from
/// `/proc/locks` or an fdinfo `lock:` line. devlock's queue files use OFD
/// locks; anything else on them is somebody else's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeLock {
    /// The locked file.
    pub file: FileId,
    /// POSIX locks name their process; OFD locks belong to an open file
    /// description, and the kernel shows them with pid -1 (`None`).
    pub pid: Option<u32>,
    /// An OFD lock (`OFDLCK`), not a POSIX one.
    pub ofd: bool,
    /// A write lock.
    pub exclusive: bool,
    /// A `->` line: a request blocked waiting for this range.
    pub blocked: bool,
    /// First byte.
    pub start: u64,
    /// Last byte, inclusive; `None` to the end of the file (`EOF`).
    pub end: Option<u64>,
}

impl RangeLock {
    /// Whether the lock covers exactly the one byte at `at`.
    pub fn is_byte(&self, at: u64) -> bool {
        self.start == at && self.end == Some(at)
    }

    /// `1048577-1048580` or `1048577-EOF`.
    pub fn range_text(&self) -> String {
        match self.end {
            Some(end) if end == self.start => self.start.to_string(),
            Some(end) => format!("{}-{end}", self.start),
            None => format!("{}-EOF", self.start),
        }
    }
}

enum Entry {
    Flock(KernelLock),
    Range(RangeLock),
    /// A file lease (fcntl F_SETLEASE): `exclusive` for a write lease.
    Lease(KernelLock),
}

/// Parses the flock(2) entries of `/proc/locks`; byte-range entries are left
/// out (they never conflict with flock on local filesystems).
pub fn parse_locks(text: &str) -> Vec<KernelLock> {
    text.lines()
        .filter_map(|l| match parse_entry(l)? {
            Entry::Flock(lock) => Some(lock),
            _ => None,
        })
        .collect()
}

/// The file leases of `/proc/locks`.
fn parse_leases(text: &str) -> Vec<KernelLock> {
    text.lines()
        .filter_map(|l| match parse_entry(l)? {
            Entry::Lease(lock) => Some(lock),
            _ => None,
        })
        .collect()
}

/// The byte-range entries of `/proc/locks` (POSIX and OFD).
pub(crate) fn parse_range_locks(text: &str) -> Vec<RangeLock> {
    text.lines()
        .filter_map(|l| match parse_entry(l)? {
            Entry::Range(lock) => Some(lock),
            _ => None,
        })
        .collect()
}

fn parse_lock_line(line: &str) -> Option<KernelLock> {
    match parse_entry(line)? {
        Entry::Flock(lock) => Some(lock),
        _ => None,
    }
}

/// `1: FLOCK  ADVISORY  WRITE 3023 fe:00:10010754 0 EOF`, or with `->`
/// after the number for a blocked request; POSIX and OFDLCK lines alike.
fn parse_entry(line: &str) -> Option<Entry> {
    let mut words = line.split_whitespace();
    words.next()?; // "1:"
    let mut kind = words.next()?;
    let blocked = kind == "->";
    if blocked {
        kind = words.next()?;
    }
    if !matches!(kind, "FLOCK" | "POSIX" | "OFDLCK" | "LEASE") {
        return None;
    }
    words.next()?; // ADVISORY / MANDATORY, or a lease's ACTIVE / BREAKING / BREAKER
    let exclusive = match words.next()? {
        "WRITE" => true,
        "READ" => false,
        // A lease being broken.
        "UNLCK" if kind == "LEASE" => false,
        _ => return None,
    };
    let pid: i64 = words.next()?.parse().ok()?;
    let mut dev = words.next()?.split(':');
    let major = u32::from_str_radix(dev.next()?, 16).ok()?;
    let minor = u32::from_str_radix(dev.next()?, 16).ok()?;
    let ino = dev.next()?.parse().ok()?;
    let file = FileId { major, minor, ino };
    if kind == "LEASE" {
        return Some(Entry::Lease(KernelLock {
            file,
            pid: u32::try_from(pid).ok()?,
            exclusive,
            blocked,
        }));
    }
    if kind == "FLOCK" {
        return Some(Entry::Flock(KernelLock {
            file,
            pid: u32::try_from(pid).ok()?,
            exclusive,
            blocked,
        }));
    }
    let start = words.next()?.parse().ok()?;
    let end = match words.next()? {
        "EOF" => None,
        n => Some(n.parse().ok()?),
    };
    Some(Entry::Range(RangeLock {
        file,
        pid: u32::try_from(pid).ok().filter(|&p| p > 0),
        ofd: kind == "OFDLCK",
        exclusive,
        blocked,
        start,
        end,
    }))
}

/// All lock entries of the machine (of this pid namespace), by file.
#[derive(Debug, Default)]
pub struct LockTable {
    by_file: HashMap<FileId, Vec<KernelLock>>,
    ranges: HashMap<FileId, Vec<RangeLock>>,
    leases: HashMap<FileId, Vec<KernelLock>>,
}

impl LockTable {
    /// Reads the table. The kernel fills each read(2) of `/proc/locks` in
    /// one pass over its list, but only a page at a time, so on a busy
    /// machine an entry that moves between two reads can be skipped or
    /// repeated (two shared holders shown as one). When the table spans
    /// several reads, it is read again until two readings agree.
    pub fn read() -> std::io::Result<LockTable> {
        let (mut locks, pieces) = read_locks()?;
        if pieces > 1 {
            for _ in 0..5 {
                let (again, _) = read_locks()?;
                if again == locks {
                    break;
                }
                locks = again;
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
}

type Locks = (Vec<KernelLock>, Vec<RangeLock>, Vec<KernelLock>);

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

/// Whether `pid` holds a granted flock on `file` through one of its
/// descriptors, from its fdinfo; `None` when its descriptors cannot be read
/// (another user's process, without privilege).
pub(crate) fn holds_flock(pid: u32, file: FileId) -> Option<bool> {
    let locks = fd_locks(&pid.to_string())?;
    Some(locks.iter().any(|(_, l)| l.file == file && !l.blocked))
}

/// What holds a lock no process this user can see shows in its
/// descriptors: for root, who sees every process's, a descriptor no process
/// has open (sent over a unix socket and not received yet); for anyone
/// else, a process this user cannot see.
pub(crate) fn unseen_owner() -> &'static str {
    if nix::unistd::geteuid().is_root() && !fd_scan().cut_short {
        "a descriptor no process has open (one sent over a unix socket, say)"
    } else {
        "a process this user cannot see"
    }
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
    if crate::flock::dir::is_local(file.as_fd()) {
        let _ = crate::sys::fs::posix_tag(file, TAG_AT);
    }
}

/// Whether `pid` holds the flock on `file` now, as far as this user can
/// tell from the kernel: its descriptors, where this user may read them;
/// else its tag ([`tag`]) in the lock table. `None` when neither says (a
/// process of another user without a tag: its pid may have been reused
/// since the lock was taken).
pub(crate) fn holds_now(table: &LockTable, pid: u32, file: FileId) -> Option<bool> {
    if let Some(holds) = holds_flock(pid, file) {
        return Some(holds);
    }
    let tagged = table
        .ranges(file)
        .iter()
        .any(|l| !l.ofd && !l.blocked && l.pid == Some(pid) && l.start == TAG_AT as u64);
    tagged.then_some(true)
}

/// The processes whose descriptors hold byte-range locks on `file`, from
/// the one scan of every process's descriptors ([`fd_scan`]). OFD locks
/// show no pid in `/proc/locks`; this is the only way to name their owners.
pub(crate) fn range_lock_owners(file: FileId) -> Vec<(u32, RangeLock)> {
    fd_scan().ranges.get(&file).cloned().unwrap_or_default()
}

/// What the descriptors of every process this user may inspect (root: all)
/// hold, by file: the `lock:` lines of `/proc/PID/fdinfo/FD`, read in one
/// pass over the processes. It costs one read per descriptor (linear in
/// processes times descriptors, a descriptor whose fdinfo repeats the one
/// before it, a `dup`, parsed once), and is made at most once per
/// [`SCAN_FRESH`] and shared by every question asked meanwhile, so any
/// number of locks a stranger makes costs one pass, not one each. A stop
/// signal waiting to be taken (SIGTERM, SIGINT, SIGHUP, SIGQUIT) cuts the
/// pass short between two processes: what was seen so far is the answer,
/// and the caller gets to the signal at once.
#[derive(Debug, Default)]
pub(crate) struct FdScan {
    /// Granted flocks: (holding pid, the pid its `lock:` line names).
    pub flocks: HashMap<FileId, Vec<(u32, u32)>>,
    /// Byte-range locks (granted and requested), with the holding pid.
    pub ranges: HashMap<FileId, Vec<(u32, RangeLock)>>,
    /// A stop signal cut the pass short.
    pub cut_short: bool,
}

/// How long one pass over the processes answers for: a look (a status, a
/// busy message, one round of a waiting line) asks within it.
pub(crate) const SCAN_FRESH: std::time::Duration = std::time::Duration::from_millis(250);

static SCAN: std::sync::Mutex<Option<(std::time::Instant, std::sync::Arc<FdScan>)>> =
    std::sync::Mutex::new(None);

/// The scan of every process's descriptors, made now unless one made less
/// than [`SCAN_FRESH`] ago answers.
pub(crate) fn fd_scan() -> std::sync::Arc<FdScan> {
    fd_scan_within(SCAN_FRESH)
}

/// The scan, made now unless one made less than `fresh` ago answers (a
/// question whose answer decides, not only names: is this lock a
/// devlock's, asked again after the cached scan did not show its owner).
pub(crate) fn fd_scan_within(fresh: std::time::Duration) -> std::sync::Arc<FdScan> {
    let mut cached = SCAN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, scan)) = cached.as_ref()
        && at.elapsed() < fresh
    {
        return scan.clone();
    }
    let scan = std::sync::Arc::new(scan_all());
    *cached = Some((std::time::Instant::now(), scan.clone()));
    scan
}

fn stop_pending() -> bool {
    crate::sys::signal::any_pending(&crate::sys::signal::SigSet::of(&[
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGQUIT,
    ]))
}

fn scan_all() -> FdScan {
    let mut scan = FdScan::default();
    let Ok(proc_dir) = fs::read_dir("/proc") else {
        return scan;
    };
    for entry in proc_dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if stop_pending() {
            scan.cut_short = true;
            break;
        }
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
            continue;
        };
        let mut last = String::new();
        for fd in fds.flatten() {
            let Some(info) = read_small(fd.path()) else {
                continue;
            };
            // Only the lock lines matter; a dup of the descriptor before
            // shows the same ones.
            let Some(first) = info.find("lock:") else {
                continue;
            };
            let locks = &info[first..];
            if locks == last {
                continue;
            }
            for line in locks.lines() {
                let Some(rest) = line.strip_prefix("lock:") else {
                    continue;
                };
                match parse_entry(rest.trim_start()) {
                    Some(Entry::Range(lock)) => {
                        let list = scan.ranges.entry(lock.file).or_default();
                        if !list.iter().any(|(p, l)| *p == pid && *l == lock) {
                            list.push((pid, lock));
                        }
                    }
                    Some(Entry::Flock(lock)) if !lock.blocked => {
                        let list = scan.flocks.entry(lock.file).or_default();
                        if !list.contains(&(pid, lock.pid)) {
                            list.push((pid, lock.pid));
                        }
                    }
                    _ => {}
                }
            }
            last = locks.to_owned();
        }
    }
    scan
}

/// The byte-range locks `pid`'s descriptors hold on `file`, from its fdinfo
/// (`None` when this user may not read it): one process's share of what
/// [`range_lock_owners`] finds, at the cost of its descriptors alone.
pub(crate) fn range_locks_of(pid: u32, file: FileId) -> Option<Vec<RangeLock>> {
    let fds = fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?;
    let mut found = Vec::new();
    for fd in fds.flatten() {
        let Some(info) = read_small(fd.path()) else {
            continue;
        };
        for line in info.lines() {
            if let Some(rest) = line.strip_prefix("lock:")
                && let Some(Entry::Range(lock)) = parse_entry(rest.trim_start())
                && lock.file == file
            {
                found.push(lock);
            }
        }
    }
    Some(found)
}

/// The file ids on which one process's descriptor holds a flock, read from the
/// `lock:` lines of `/proc/PID/fdinfo/*` (Linux 4.1+). Unlike `/proc/locks`,
/// these name every process that shares a lock through an inherited descriptor.
/// Returns `None` when the process's descriptors cannot be read (another user's
/// process, without privilege).
pub(crate) fn fd_locks(pid: &str) -> Option<Vec<(u32, KernelLock)>> {
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

/// The locks one descriptor holds, from the `lock:` lines of its fdinfo.
pub(crate) fn locks_of_fd(pid: &str, fd: &str) -> Vec<KernelLock> {
    let Some(info) = read_small(format!("/proc/{pid}/fdinfo/{fd}")) else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|line| parse_lock_line(line.strip_prefix("lock:")?.trim_start()))
        .collect()
}

/// Every process holding a granted flock, by file, each with the pid its
/// `lock:` line names (the process that took the lock: a command that
/// inherited devlock's descriptor shows devlock's pid there), from the one
/// scan of every process's descriptors ([`fd_scan`]).
pub(crate) fn all_flock_holders() -> HashMap<FileId, Vec<(u32, u32)>> {
    fd_scan().flocks.clone()
}
