//! What the kernel says about locks and processes, read from `/proc`.
//!
//! Everything here is a fresh reading: callers use it to check records, never
//! the other way round.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::path::Path;

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
}

/// Parses the flock(2) entries of `/proc/locks`; byte-range entries are left
/// out (they never conflict with flock on local filesystems).
pub fn parse_locks(text: &str) -> Vec<KernelLock> {
    text.lines()
        .filter_map(|l| match parse_entry(l)? {
            Entry::Flock(lock) => Some(lock),
            Entry::Range(_) => None,
        })
        .collect()
}

/// The byte-range entries of `/proc/locks` (POSIX and OFD).
pub(crate) fn parse_range_locks(text: &str) -> Vec<RangeLock> {
    text.lines()
        .filter_map(|l| match parse_entry(l)? {
            Entry::Range(lock) => Some(lock),
            Entry::Flock(_) => None,
        })
        .collect()
}

fn parse_lock_line(line: &str) -> Option<KernelLock> {
    match parse_entry(line)? {
        Entry::Flock(lock) => Some(lock),
        Entry::Range(_) => None,
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
    if !matches!(kind, "FLOCK" | "POSIX" | "OFDLCK") {
        return None;
    }
    words.next()?; // ADVISORY / MANDATORY
    let exclusive = match words.next()? {
        "WRITE" => true,
        "READ" => false,
        _ => return None,
    };
    let pid: i64 = words.next()?.parse().ok()?;
    let mut dev = words.next()?.split(':');
    let major = u32::from_str_radix(dev.next()?, 16).ok()?;
    let minor = u32::from_str_radix(dev.next()?, 16).ok()?;
    let ino = dev.next()?.parse().ok()?;
    let file = FileId { major, minor, ino };
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
        let (flocks, ranges) = locks;
        let mut table = LockTable::from_locks(flocks);
        for lock in ranges {
            table.ranges.entry(lock.file).or_default().push(lock);
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

type Locks = (Vec<KernelLock>, Vec<RangeLock>);

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
    Ok(((parse_locks(&text), parse_range_locks(&text)), pieces))
}

/// The fields of `/proc/PID/stat` devlock uses, from one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    /// `R`, `S`, `D`, `Z`, ... (field 3).
    pub state: char,
    /// Parent pid (field 4).
    pub ppid: u32,
    /// Start time in clock ticks since boot (field 22). Together with the pid
    /// this names one process for the life of the machine, so a recycled pid
    /// is not mistaken for the process a record describes.
    pub start: u64,
}

pub(crate) fn stat(pid: u32) -> Option<Stat> {
    let text = read_small(format!("/proc/{pid}/stat"))?;
    Some(Stat {
        state: stat_field(&text, 3)?.chars().next()?,
        ppid: stat_field(&text, 4)?.parse().ok()?,
        start: stat_field(&text, 22)?.parse().ok()?,
    })
}

/// Start time of a process in clock ticks since boot (see [`Stat::start`]).
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|s| s.start)
}

/// Parent pid.
pub(crate) fn parent_pid(pid: u32) -> Option<u32> {
    stat(pid).map(|s| s.ppid)
}

/// The ancestors of `pid`, nearest first, each with its stat, up to but not
/// including init (at most 64: a loop in /proc cannot hang a caller).
pub(crate) fn ancestors(pid: u32) -> impl Iterator<Item = (u32, Stat)> {
    let mut next = parent_pid(pid);
    std::iter::from_fn(move || {
        let parent = next.filter(|&p| p > 1)?;
        let stat = stat(parent)?;
        next = Some(stat.ppid);
        Some((parent, stat))
    })
    .take(64)
}

/// Field `n` (1-based, as in proc(5)) of a stat line; the command name may hold
/// spaces and parentheses, so counting starts after its last `)`.
fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(n.checked_sub(3)?)
}

/// Whether `pid` is the very process that had `start` as its start time.
#[cfg(any(test, feature = "etcd"))]
pub(crate) fn is_same_process(pid: u32, start: Option<u64>) -> bool {
    match (start_time(pid), start) {
        (Some(now), Some(then)) => now == then,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Real uid of a live process, from `/proc/PID/status` (readable for every user).
pub(crate) fn uid_of(pid: u32) -> Option<u32> {
    let status = read_small(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Short command name of a live process (`/proc/PID/comm`).
pub(crate) fn comm_of(pid: u32) -> Option<String> {
    Some(
        read_small(format!("/proc/{pid}/comm"))?
            .trim_end()
            .to_owned(),
    )
}

/// The command line of a live process, read now (so `hidepid` is
/// respected); `None` when it cannot be read or is empty (a zombie, a
/// kernel thread). Each argument is cleaned of control and format
/// characters.
pub(crate) fn cmdline_of(pid: u32) -> Option<Vec<String>> {
    let mut file = fs::File::open(format!("/proc/{pid}/cmdline")).ok()?;
    let mut buf = Vec::with_capacity(256);
    file.by_ref().take(8 * 1024).read_to_end(&mut buf).ok()?;
    let args: Vec<String> = buf
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| crate::text::clean(&String::from_utf8_lossy(a)))
        .collect();
    (!args.is_empty()).then_some(args)
}

/// Whether a live process is stopped (`T`, by a signal, or `t`, by a tracer).
pub fn is_stopped(pid: u32) -> bool {
    stat(pid).is_some_and(|s| matches!(s.state, 'T' | 't'))
}

/// Whether this process lives in a child PID namespace, where `/proc/locks`
/// leaves out every lock whose owner is outside it. Its `NSpid` line has
/// more than one pid, unless `/proc` was mounted inside the namespace
/// (`unshare --mount-proc`, a container); then the namespace is not the
/// initial one, whose inode number the kernel fixes (`PROC_PID_INIT_INO`).
pub(crate) fn in_child_pid_namespace() -> bool {
    const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;
    static CHILD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHILD.get_or_init(|| {
        let nspid = read_small("/proc/self/status").is_some_and(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .is_some_and(|pids| pids.split_whitespace().count() > 1)
        });
        let ns = fs::metadata("/proc/self/ns/pid")
            .is_ok_and(|m| std::os::unix::fs::MetadataExt::ino(&m) != INIT_PID_NS_INO);
        nspid || ns
    })
}

/// The pid in this PID namespace of the process the host calls
/// `host_pid` (NVML and amd-smi report the host's pids, also inside a
/// container). Outside a child namespace the two are one. Inside, `None`:
/// since Linux 4.14 the kernel shows a PID namespace nothing but its own
/// numbers (`NSpid`, and `/proc/PID/sched`, which once gave the host's
/// pid), so a host pid cannot be told from a local pid that happens to
/// have the same number, and is never taken for one.
pub(crate) fn local_pid(host_pid: u32) -> Option<u32> {
    (!in_child_pid_namespace()).then_some(host_pid)
}

/// The container a process runs in, as seen from here: `docker 1a2b3c4d5e6f`,
/// `podman ...`, `kubernetes ...`, `lxc NAME` from its cgroup, else `PID
/// namespace, pid N there`; `None` when it shares this PID namespace (its
/// `NSpid` line is no longer than ours) or cannot be read.
pub(crate) fn container_of(pid: u32) -> Option<String> {
    fn nspids(text: &str) -> Option<Vec<&str>> {
        text.lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .map(|pids| pids.split_whitespace().collect())
    }
    let mine = nspids(&read_small("/proc/self/status")?)?.len();
    let status = read_small(format!("/proc/{pid}/status"))?;
    let theirs = nspids(&status)?;
    if theirs.len() <= mine {
        return None;
    }
    let inner = theirs.last().copied().unwrap_or("?");
    let named = read_small(format!("/proc/{pid}/cgroup")).and_then(|c| container_in_cgroup(&c));
    Some(match named {
        Some(name) => format!("{name}, pid {inner} there"),
        None => format!("PID namespace, pid {inner} there"),
    })
}

/// A container engine's name for the cgroup a process is in: Docker's
/// `docker-ID.scope` or `/docker/ID`, Podman's `libpod-ID.scope`,
/// containerd's and CRI-O's `cri-containerd-ID.scope`, `crio-ID.scope` or
/// `/kubepods/.../ID`, LXC's `lxc.payload.NAME` or `/lxc/NAME`. IDs are cut
/// to 12 characters, as `docker ps` shows them.
pub(crate) fn container_in_cgroup(cgroup: &str) -> Option<String> {
    let short = |id: &str| {
        let id: String = id
            .chars()
            .take_while(|c| c.is_ascii_hexdigit())
            .take(12)
            .collect();
        (id.len() == 12).then_some(id)
    };
    for line in cgroup.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        for part in path.split('/').rev() {
            let part = part.strip_suffix(".scope").unwrap_or(part);
            for (prefix, engine) in [
                ("docker-", "docker"),
                ("libpod-", "podman"),
                ("cri-containerd-", "kubernetes"),
                ("crio-", "kubernetes"),
            ] {
                if let Some(id) = part.strip_prefix(prefix).and_then(short) {
                    return Some(format!("{engine} {id}"));
                }
            }
            if let Some(name) = part.strip_prefix("lxc.payload.") {
                return Some(format!("lxc {}", crate::text::sanitize(name)));
            }
        }
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        match parts[..] {
            ["docker", id, ..] => return short(id).map(|id| format!("docker {id}")),
            ["lxc", name, ..] => return Some(format!("lxc {}", crate::text::sanitize(name))),
            ["kubepods", .., id] => {
                if let Some(id) = short(id) {
                    return Some(format!("kubernetes {id}"));
                }
            }
            _ => {}
        }
    }
    None
}

/// An OS error as words, without Rust's `(os error N)`.
pub(crate) fn os_text(err: &std::io::Error) -> String {
    match err.raw_os_error() {
        Some(code) => nix::errno::Errno::from_raw(code).desc().to_owned(),
        None => err.to_string(),
    }
}

/// Whether `pid` holds a granted flock on `file` through one of its
/// descriptors, from its fdinfo; `None` when its descriptors cannot be read
/// (another user's process, without privilege).
pub(crate) fn holds_flock(pid: u32, file: FileId) -> Option<bool> {
    let locks = fd_locks(&pid.to_string())?;
    Some(locks.iter().any(|(_, l)| l.file == file && !l.blocked))
}

/// The processes whose descriptors hold byte-range locks on `file`, found
/// by scanning the fdinfo of every process this user may inspect (root:
/// all). OFD locks show no pid in `/proc/locks`; this is the only way to
/// name their owners. Expensive: used only to explain a lock nobody owns.
pub(crate) fn range_lock_owners(file: FileId) -> Vec<(u32, RangeLock)> {
    let mut found = Vec::new();
    let Ok(proc_dir) = fs::read_dir("/proc") else {
        return found;
    };
    for entry in proc_dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Some(info) = read_small(fd.path()) else {
                continue;
            };
            for line in info.lines() {
                let Some(rest) = line.strip_prefix("lock:") else {
                    continue;
                };
                if let Some(Entry::Range(lock)) = parse_entry(rest.trim_start())
                    && lock.file == file
                {
                    found.push((pid, lock));
                }
            }
        }
    }
    found
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

/// The boot id, which tells records written before the last reboot apart.
pub(crate) fn boot_id() -> Option<String> {
    Some(
        read_small("/proc/sys/kernel/random/boot_id")?
            .trim()
            .to_owned(),
    )
}

/// User name for a uid, or the number when the passwd database has none.
/// Cached: a lookup can cost a round of NSS (files, nscd, LDAP).
pub fn user_name(uid: u32) -> String {
    static NAMES: std::sync::Mutex<Option<HashMap<u32, String>>> = std::sync::Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    names
        .get_or_insert_with(HashMap::new)
        .entry(uid)
        .or_insert_with(
            || match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
                Ok(Some(user)) => user.name,
                _ => uid.to_string(),
            },
        )
        .clone()
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
/// inherited devlock's descriptor shows devlock's pid there), found by
/// scanning the descriptors of all processes this user may inspect.
/// Expensive on a big machine: used only when `/proc/locks` names a pid that
/// is gone, or is not the holder any more.
pub(crate) fn all_flock_holders() -> HashMap<FileId, Vec<(u32, u32)>> {
    let mut found: HashMap<FileId, Vec<(u32, u32)>> = HashMap::new();
    let Ok(proc_dir) = fs::read_dir("/proc") else {
        return found;
    };
    for entry in proc_dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        for (_, lock) in fd_locks(&pid.to_string()).unwrap_or_default() {
            if lock.blocked {
                continue;
            }
            let pids = found.entry(lock.file).or_default();
            if !pids.contains(&(pid, lock.pid)) {
                pids.push((pid, lock.pid));
            }
        }
    }
    found
}

/// Sends `signal` to every process under devlock.
#[cfg(feature = "etcd")]
pub(crate) fn signal_descendants(signal: libc::c_int) {
    signal_descendants_outside(signal, None);
}

/// Sends `signal` to every process under devlock but those in process
/// group `skip` (which a terminal's signal has reached already).
#[cfg(feature = "etcd")]
pub(crate) fn signal_descendants_outside(signal: libc::c_int, skip: Option<libc::pid_t>) {
    for pid in descendants(std::process::id()) {
        let pid = pid as libc::pid_t;
        if skip.is_some() && crate::sys::process::group_of(pid) == skip {
            continue;
        }
        // A process under us (ours until reaped); one gone meanwhile gets ESRCH.
        crate::sys::process::kill(pid, signal);
    }
}

/// The processes under `root` that have not ended (zombies left out).
#[cfg(feature = "etcd")]
pub(crate) fn live_descendants(root: u32) -> Vec<u32> {
    tree_under(root)
        .into_iter()
        .filter(|(_, stat)| stat.state != 'Z')
        .map(|(pid, _)| pid)
        .collect()
}

/// Every process under `root`.
#[cfg(any(test, feature = "etcd"))]
pub(crate) fn descendants(root: u32) -> Vec<u32> {
    tree_under(root).into_iter().map(|(pid, _)| pid).collect()
}

/// Every process under `root` with its stat, from one read of each process
/// in /proc.
#[cfg(any(test, feature = "etcd"))]
fn tree_under(root: u32) -> Vec<(u32, Stat)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let all: Vec<(u32, Stat)> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, stat(pid)?)))
        .collect();
    let mut found: Vec<(u32, Stat)> = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for &(pid, stat) in all.iter().filter(|(_, stat)| stat.ppid == parent) {
            found.push((pid, stat));
            parents.push(pid);
        }
    }
    found
}

/// Reads a small `/proc` file in one bounded read.
fn read_small(path: impl AsRef<Path>) -> Option<String> {
    let mut file = fs::File::open(path).ok()?;
    // One read is the whole of a small /proc file: the kernel fills the
    // buffer from its one rendering, and only a file that fills it needs
    // the reads after it.
    let mut first = [0u8; 2048];
    let n = file.read(&mut first).ok()?;
    let mut buf = first[..n].to_vec();
    if n == first.len() {
        file.by_ref().take(62 * 1024).read_to_end(&mut buf).ok()?;
    }
    String::from_utf8(buf).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn containers_are_named_from_their_cgroup() {
        let id = "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b";
        for (cgroup, want) in [
            (
                format!("0::/system.slice/docker-{id}.scope\n"),
                Some("docker 1a2b3c4d5e6f"),
            ),
            (
                format!("12:pids:/docker/{id}\n0::/\n"),
                Some("docker 1a2b3c4d5e6f"),
            ),
            (
                format!("0::/machine.slice/libpod-{id}.scope/container\n"),
                Some("podman 1a2b3c4d5e6f"),
            ),
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-{id}.scope\n"
                ),
                Some("kubernetes 1a2b3c4d5e6f"),
            ),
            (
                format!("11:cpu:/kubepods/burstable/pod0b1c/{id}\n"),
                Some("kubernetes 1a2b3c4d5e6f"),
            ),
            (
                "0::/lxc.payload.web1/init.scope\n".to_owned(),
                Some("lxc web1"),
            ),
            (
                "0::/user.slice/user-1000.slice/session-2.scope\n".to_owned(),
                None,
            ),
            ("0::/system.slice/docker-xyz.scope\n".to_owned(), None),
            ("0::/\n".to_owned(), None),
        ] {
            assert_eq!(container_in_cgroup(&cgroup).as_deref(), want, "{cgroup}");
        }
        assert_eq!(
            container_of(std::process::id()),
            None,
            "we share our own namespace"
        );
        assert_eq!(local_pid(std::process::id()), Some(std::process::id()));
    }

    use super::*;

    #[test]
    fn parses_granted_and_blocked_flock_lines() {
        let text = "1: FLOCK  ADVISORY  WRITE 3023 fe:00:10010754 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 3050 fe:00:10010754 0 EOF\n\
                    2: POSIX  ADVISORY  WRITE 99 08:01:7 0 EOF\n\
                    3: FLOCK  ADVISORY  READ 12 103:1f:42 0 EOF\n";
        let locks = parse_locks(text);
        assert_eq!(locks.len(), 3);
        assert_eq!(
            locks[0],
            KernelLock {
                file: FileId {
                    major: 0xfe,
                    minor: 0,
                    ino: 10010754
                },
                pid: 3023,
                exclusive: true,
                blocked: false,
            }
        );
        assert!(locks[1].blocked);
        assert_eq!(
            locks[2].file,
            FileId {
                major: 0x103,
                minor: 0x1f,
                ino: 42
            }
        );
        assert!(!locks[2].exclusive);
        let table = LockTable::from_locks(locks);
        let file = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10010754,
        };
        assert!(table.is_locked(file));
        assert_eq!(
            table.blocked(file).map(|l| l.pid).collect::<Vec<_>>(),
            [3050]
        );
    }

    #[test]
    fn parses_byte_range_lines_with_their_ranges() {
        let text = "1: OFDLCK ADVISORY  WRITE -1 08:01:7 1048577 1048577\n\
                    2: POSIX  ADVISORY  READ 99 08:01:7 0 EOF\n\
                    3: -> OFDLCK ADVISORY  READ -1 08:01:7 1048577 1048580\n\
                    4: FLOCK  ADVISORY  WRITE 3 08:01:7 0 EOF\n";
        let ranges = parse_range_locks(text);
        assert_eq!(ranges.len(), 3);
        assert_eq!((ranges[0].pid, ranges[0].ofd), (None, true));
        assert!(ranges[0].is_byte(1_048_577));
        assert_eq!((ranges[1].pid, ranges[1].end), (Some(99), None));
        assert_eq!(ranges[1].range_text(), "0-EOF");
        assert!(ranges[2].blocked && !ranges[2].exclusive);
        assert_eq!(parse_locks(text).len(), 1);
    }

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let stat = "42 (a) b (c)) S 7 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0";
        assert_eq!(stat_field(stat, 4), Some("7"));
        assert_eq!(stat_field(stat, 22), Some("987654"));
    }

    #[test]
    fn this_process_is_under_its_parent() {
        let parent = parent_pid(std::process::id()).unwrap();
        assert!(descendants(parent).contains(&std::process::id()));
        assert!(!descendants(std::process::id()).contains(&parent));
    }

    #[test]
    fn own_process_is_recognised_and_a_wrong_start_time_is_not() {
        let me = std::process::id();
        let start = start_time(me);
        assert!(start.is_some());
        assert!(is_same_process(me, start));
        assert!(!is_same_process(me, start.map(|s| s + 1)));
        assert_eq!(uid_of(me), Some(nix::unistd::getuid().as_raw()));
    }
}
