//! One entry of the kernel's lock tables (a line of `/proc/locks`, or a
//! `lock:` line of `/proc/PID/fdinfo/FD`), parsed: the types both
//! [`super::locks`] and [`super::fdinfo`] speak, so that neither needs the
//! other's.

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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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

pub(super) enum Entry {
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
pub(super) fn parse_leases(text: &str) -> Vec<KernelLock> {
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

/// `1: FLOCK  ADVISORY  WRITE 3023 fe:00:10010754 0 EOF`, or with `->`
/// after the number for a blocked request; POSIX and OFDLCK lines alike.
pub(super) fn parse_entry(line: &str) -> Option<Entry> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_found_by_file_and_locks_are_not_leases() {
        let text = "1: FLOCK  ADVISORY  WRITE 5026 fe:00:10027111 0 EOF\n\
                    2: LEASE  ACTIVE    READ 10064 fe:00:10035432 0 EOF\n\
                    3: LEASE  BREAKING  READ 10065 fe:00:10035432 0 EOF\n\
                    4: LEASE  ACTIVE    READ 10066 fe:01:10035432 0 EOF\n";
        let pids_on = |id: FileId| -> Vec<u32> {
            parse_leases(text)
                .into_iter()
                .filter(|lease| lease.file == id)
                .map(|lease| lease.pid)
                .collect()
        };
        let id = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10_035_432,
        };
        assert_eq!(pids_on(id), [10064, 10065]);
        let flocked = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10_027_111,
        };
        assert!(pids_on(flocked).is_empty());
    }
}
