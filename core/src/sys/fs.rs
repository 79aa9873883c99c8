//! Files: opening relative to a directory's descriptor, flock(2) (without
//! nix's `Flock`, whose `Drop` would unlock a lock the command inherited),
//! open-file-description byte-range locks, modes, owners, the filesystem
//! type and access checks. Every descriptor comes back owned.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::fcntl::{FcntlArg, FdFlag, OFlag};
use nix::sys::stat::Mode;

/// `openat(dir, name, flags, mode)`, the descriptor owned.
pub fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: OFlag, mode: u32) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::openat(
        dir,
        name,
        flags,
        Mode::from_bits_truncate(mode),
    )?)
}

/// `open(path, flags)`, the descriptor owned.
pub(crate) fn open(path: &CStr, flags: OFlag) -> io::Result<OwnedFd> {
    Ok(nix::fcntl::open(path, flags, Mode::empty())?)
}

/// `fchmod(fd, mode)`.
pub fn fchmod(fd: impl AsFd, mode: u32) -> io::Result<()> {
    Ok(nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(mode))?)
}

/// `fchown(fd, uid, gid)`.
pub fn fchown(fd: impl AsFd, uid: u32, gid: u32) -> io::Result<()> {
    Ok(nix::unistd::fchown(
        fd,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )?)
}

/// What to do with a flock(2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flock {
    Shared,
    Exclusive,
    Unlock,
}

/// `flock(fd, op)`, with `LOCK_NB` when `nonblocking`. An interrupted
/// blocking call returns `Interrupted`; a busy non-blocking one
/// `WouldBlock`.
pub fn flock(fd: impl AsFd, op: Flock, nonblocking: bool) -> io::Result<()> {
    let mut arg = match op {
        Flock::Shared => libc::LOCK_SH,
        Flock::Exclusive => libc::LOCK_EX,
        Flock::Unlock => libc::LOCK_UN,
    };
    if nonblocking {
        arg |= libc::LOCK_NB;
    }
    // SAFETY: flock(2) on a descriptor the borrow keeps open; it touches no
    // memory of ours.
    if unsafe { libc::flock(fd.as_fd().as_raw_fd(), arg) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A byte-range lock request or report: kind, first byte, length (0: to
/// the end of the file).
fn range(kind: libc::c_int, start: i64, len: i64) -> libc::flock {
    libc::flock {
        l_type: kind as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: start,
        l_len: len,
        // Must be 0 for OFD locks.
        l_pid: 0,
    }
}

/// The first lock (of another open file description) that would conflict
/// with a lock of `kind` on `[start, start + len)`.
pub(crate) fn ofd_conflict(
    fd: impl AsFd,
    kind: libc::c_int,
    start: i64,
    len: i64,
) -> io::Result<Option<libc::flock>> {
    let mut probe = range(kind, start, len);
    nix::fcntl::fcntl(fd, FcntlArg::F_OFD_GETLK(&mut probe))?;
    Ok((probe.l_type != libc::F_UNLCK as libc::c_short).then_some(probe))
}

/// Takes (or with `F_UNLCK` lets go of) an OFD lock of `kind` on `[start,
/// start + len)`; `wait` sleeps until it is granted (a signal interrupts it
/// with `Interrupted`).
pub(crate) fn ofd_lock(
    fd: impl AsFd,
    kind: libc::c_int,
    start: i64,
    len: i64,
    wait: bool,
) -> io::Result<()> {
    let request = range(kind, start, len);
    let arg = if wait {
        FcntlArg::F_OFD_SETLKW(&request)
    } else {
        FcntlArg::F_OFD_SETLK(&request)
    };
    nix::fcntl::fcntl(fd, arg)?;
    Ok(())
}

/// Takes a POSIX (per-process) read lock on the one byte at `at`: the
/// kernel lists it in `/proc/locks` under this process's pid, for every
/// user to read, and drops it when this process ends (or closes any
/// descriptor of the file), never passing it to a child.
pub(crate) fn posix_tag(fd: impl AsFd, at: i64) -> io::Result<()> {
    let request = range(libc::F_RDLCK, at, 1);
    nix::fcntl::fcntl(fd, FcntlArg::F_SETLK(&request))?;
    Ok(())
}

/// The filesystem type (`f_type` of fstatfs(2)).
pub(crate) fn filesystem_type(fd: impl AsFd) -> io::Result<u64> {
    Ok(nix::sys::statfs::fstatfs(fd)?.filesystem_type().0 as u64)
}

/// Filesystems whose flock(2) is the kernel's own, where the probe of
/// `flock/dir.rs`'s `flock_excludes` is not needed: ext2/3/4, XFS, Btrfs, tmpfs, ramfs,
/// overlayfs (a container's root), ZFS, F2FS, bcachefs.
pub(crate) const LOCAL_FILESYSTEMS: [u64; 9] = [
    0xEF53,
    0x5846_5342,
    0x9123_683E,
    0x0102_1994,
    0x8584_58F6,
    0x794C_7630,
    0x2FC1_2FC1,
    0xF2F5_2010,
    0xCA45_1A4E,
];

/// Whether `fd` is on a filesystem whose flock(2) is the kernel's own (where
/// flock and POSIX locks never meet: see [`LOCAL_FILESYSTEMS`]).
pub(crate) fn is_local(fd: BorrowedFd<'_>) -> bool {
    filesystem_type(fd).is_ok_and(|t| LOCAL_FILESYSTEMS.contains(&t))
}

/// Removes the extended attribute `name` if it is there; whether it was.
pub fn remove_xattr(fd: impl AsFd, name: &CStr) -> bool {
    let fd = fd.as_fd().as_raw_fd();
    // SAFETY: a descriptor the borrow keeps open and a NUL-terminated name;
    // a null buffer of size 0 only asks for the size.
    let present = unsafe { libc::fgetxattr(fd, name.as_ptr(), std::ptr::null_mut(), 0) } > 0;
    // SAFETY: as above; fremovexattr reads only the name.
    present && unsafe { libc::fremovexattr(fd, name.as_ptr()) } == 0
}

/// `renameat2` within one directory, with `RENAME_NOREPLACE` or
/// `RENAME_EXCHANGE`.
pub fn rename_in(dir: BorrowedFd<'_>, from: &str, to: &str, exchange: bool) -> io::Result<()> {
    let flags = if exchange {
        nix::fcntl::RenameFlags::RENAME_EXCHANGE
    } else {
        nix::fcntl::RenameFlags::RENAME_NOREPLACE
    };
    Ok(nix::fcntl::renameat2(dir, from, dir, to, flags)?)
}

/// Whether this process (by its effective ids) may execute `path`.
pub fn executable(path: &CStr) -> bool {
    nix::unistd::faccessat(
        nix::fcntl::AT_FDCWD,
        path,
        nix::unistd::AccessFlags::X_OK,
        nix::fcntl::AtFlags::AT_EACCESS,
    )
    .is_ok()
}

/// The close-on-exec flag of the descriptor numbered `fd`, which this
/// process may or may not have open (`None` when it has not).
pub(crate) fn close_on_exec(fd: RawFd) -> Option<bool> {
    // SAFETY: F_GETFD reads the flags of a descriptor number; one that is
    // not open just fails with EBADF, and nothing is kept of the borrow.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    (flags >= 0).then_some(flags & libc::FD_CLOEXEC != 0)
}

/// The device and inode of the file open as descriptor number `fd`, if
/// this process has it open (fstat, not a walk of `/proc/self/fd/N`).
pub(crate) fn file_id_of(fd: RawFd) -> Option<(u64, u64)> {
    close_on_exec(fd)?;
    // SAFETY: the descriptor is open (just checked), and the borrow ends
    // with this call, before anything here could close it.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let st = nix::sys::stat::fstat(borrowed).ok()?;
    Some((st.st_dev, st.st_ino))
}

/// Lets a child inherit `fd` across exec (clears `FD_CLOEXEC`).
pub fn set_inheritable(fd: impl AsFd) -> io::Result<()> {
    let flags = nix::fcntl::fcntl(fd.as_fd(), FcntlArg::F_GETFD)?;
    let flags = FdFlag::from_bits_truncate(flags) - FdFlag::FD_CLOEXEC;
    nix::fcntl::fcntl(fd, FcntlArg::F_SETFD(flags))?;
    Ok(())
}

/// A copy of `fd` numbered `above` or higher that a child inherits across
/// exec (F_DUPFD leaves close-on-exec clear); its number. The copy stays
/// open for the life of the process (it is for an exec).
pub fn inheritable_copy_above(fd: impl AsFd, above: RawFd) -> io::Result<RawFd> {
    Ok(nix::fcntl::fcntl(fd, FcntlArg::F_DUPFD(above))?)
}

/// Puts `/dev/null` on standard input, output and error where a careless
/// parent left them closed (a lock file opened into fd 2 would become the
/// command's stderr).
pub fn open_std_descriptors() {
    for fd in 0..3 {
        if close_on_exec(fd).is_some() {
            continue;
        }
        let Ok(null) = nix::fcntl::open(c"/dev/null", OFlag::O_RDWR, Mode::empty()) else {
            return;
        };
        if null.as_raw_fd() == fd {
            // The lowest free number: it is the one that was missing. Kept
            // open for the life of the process.
            let _ = std::os::fd::IntoRawFd::into_raw_fd(null);
            continue;
        }
        // SAFETY: dup2 onto a standard descriptor number that is not open;
        // `null` stays owned and is closed when dropped.
        unsafe { libc::dup2(null.as_raw_fd(), fd) };
    }
}

/// Points standard output at /dev/null (a process that writes nothing
/// there lets go of the pipe a `$(...)` reads; the etcd backend's).
pub fn stdout_to_null() {
    let Ok(null) = nix::fcntl::open(c"/dev/null", OFlag::O_WRONLY, Mode::empty()) else {
        return;
    };
    // Onto standard output, which nothing in this process owns as a Rust
    // object; `null` stays owned and is closed when dropped.
    let _ = nix::unistd::dup2_stdout(&null);
}

/// Empties the file open as `fd`, a descriptor the caller keeps open.
pub(crate) fn truncate_fd(fd: RawFd) -> io::Result<()> {
    // SAFETY: the caller keeps `fd` open for the length of this call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    Ok(nix::unistd::ftruncate(fd, 0)?)
}

/// `unlinkat(dir, name, 0)`, `dir` a descriptor the caller keeps open.
pub(crate) fn unlinkat_raw(dir: RawFd, name: &str) -> io::Result<()> {
    // SAFETY: the caller keeps `dir` open for the length of this call.
    let dir = unsafe { BorrowedFd::borrow_raw(dir) };
    Ok(nix::unistd::unlinkat(
        dir,
        name,
        nix::unistd::UnlinkatFlags::NoRemoveDir,
    )?)
}

/// `pread` from descriptor number `fd` of this process, which the caller
/// found open (no new descriptor: closing one would end the process's POSIX
/// locks on the file).
pub(crate) fn pread_raw(fd: RawFd, buf: &mut [u8], at: u64) -> io::Result<usize> {
    close_on_exec(fd).ok_or_else(|| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the descriptor is open (just checked), and the borrow ends
    // with this call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    Ok(nix::sys::uio::pread(fd, buf, at as libc::off_t)?)
}

/// Eight bytes from the kernel's random source (getrandom(2)): a name no
/// other user can guess before it exists.
pub(crate) fn random_u64() -> io::Result<u64> {
    let mut bytes = [0u8; 8];
    let mut got = 0;
    while got < bytes.len() {
        let rest = &mut bytes[got..];
        // SAFETY: getrandom writes at most `rest.len()` bytes into `rest`,
        // a buffer of ours that outlives the call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        got += n as usize;
    }
    Ok(u64::from_ne_bytes(bytes))
}
