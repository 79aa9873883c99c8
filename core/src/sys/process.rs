//! Processes: the watcher's double fork, pidfds (a process's end, and how
//! it ended), signals to processes and groups, reopening a descriptor
//! without its locks.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::unistd::Pid;

/// kill(2): `sig` to `pid` (a negative pid names a process group). Whether
/// it was sent.
pub fn kill(pid: libc::pid_t, sig: libc::c_int) -> bool {
    // SAFETY: kill(2) only sends a signal; a pid that is gone gets ESRCH.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// This process's group.
pub fn own_group() -> libc::pid_t {
    nix::unistd::getpgrp().as_raw()
}

/// The effective uid.
pub fn effective_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// A process descriptor: names exactly one process, even once it is
/// reaped and its pid reused; closed when dropped.
#[derive(Debug)]
pub struct PidFd(OwnedFd);

impl PidFd {
    /// A pidfd for process `pid` (this process, or one whose pid cannot
    /// have been reused: a child not yet reaped, or one checked after the
    /// open); `None` where the kernel has no pidfd_open or it is gone.
    pub fn open(pid: u32) -> Option<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new
        // descriptor, which is ours alone.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        // SAFETY: a descriptor pidfd_open just returned, owned by nobody else.
        (fd >= 0).then(|| PidFd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
    }

    /// Sends `sig` to the process (nothing if it is gone).
    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: pidfd_send_signal on a pidfd we own, with no siginfo.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                sig,
                std::ptr::null::<()>(),
                0,
            )
        };
    }
}

impl PidFd {
    /// Waits up to `timeout` for the process to end; whether it has.
    pub fn wait_ended(&self, timeout: std::time::Duration) -> bool {
        let mut poll = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: poll(2) on one pollfd of ours.
        let n = unsafe { libc::poll(&mut poll, 1, ms) };
        n > 0 && poll.revents != 0
    }

    /// How the process ended, as a wait status, where the kernel tells any
    /// holder of its pidfd (Linux 6.15's `PIDFD_INFO_EXIT`, once its parent
    /// reaped it); `None` elsewhere, or while it is not reaped.
    pub fn exit_status(&self) -> Option<i32> {
        /// `struct pidfd_info` as of its first version (64 bytes).
        #[repr(C)]
        #[derive(Default)]
        struct PidfdInfo {
            mask: u64,
            cgroupid: u64,
            ids: [u32; 11],
            exit_code: i32,
        }
        const PIDFD_INFO_EXIT: u64 = 1 << 3;
        // _IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, struct pidfd_info)
        const PIDFD_GET_INFO: libc::c_ulong = (3 << 30) | (64 << 16) | (0xFF << 8) | 11;
        let mut info = PidfdInfo {
            mask: PIDFD_INFO_EXIT,
            ..PidfdInfo::default()
        };
        // SAFETY: the ioctl fills at most the 64 bytes of `info`.
        let ok = unsafe { libc::ioctl(self.0.as_raw_fd(), PIDFD_GET_INFO, &mut info) } == 0;
        (ok && info.mask & PIDFD_INFO_EXIT != 0).then_some(info.exit_code)
    }
}

/// Names this process (its `comm`, as ps and /proc show it).
pub fn set_name(name: &std::ffi::CStr) {
    let _ = nix::sys::prctl::set_name(name);
}

/// Which side of [`fork_detached`] this is.
#[derive(Debug)]
pub enum Forked {
    /// The new process: no child of the caller's (a grandchild, whose
    /// parent has ended), a copy of it with only the calling thread.
    Detached,
    /// The caller.
    Caller,
}

/// Starts a copy of this process that is not its child: a fork that forks
/// again and ends at once, so the copy is reparented (to init or the
/// nearest subreaper) and whatever this process becomes after an exec never
/// sees it as a child to reap. The copy runs on as Rust code, as after any
/// fork in a process that may have other threads: it must not rely on a
/// lock another thread held (glibc's malloc is made safe across fork).
pub fn fork_detached() -> io::Result<Forked> {
    // SAFETY: the child makes only async-signal-safe calls (fork, _exit)
    // until it ends; the grandchild goes on as a copy of this thread.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => {
            // SAFETY: as above; nothing of this intermediate process runs on.
            unsafe {
                if libc::fork() == 0 {
                    return Ok(Forked::Detached);
                }
                libc::_exit(0);
            }
        }
        child => {
            let _ = nix::sys::wait::waitpid(Pid::from_raw(child), None);
            Ok(Forked::Caller)
        }
    }
}

/// Makes descriptor number `fd` name a new open file description of the
/// same file, opened afresh through `/proc/self/fd`: it shares no flock or
/// OFD lock with the description it named before (which the other
/// processes that have it keep). The access mode is kept.
pub fn reopen_unlocked(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL reads the flags of a descriptor number of ours.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let path = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a number");
    let access = flags & libc::O_ACCMODE;
    // SAFETY: open(2) of a NUL-terminated path; the result is ours.
    let fresh = unsafe { libc::open(path.as_ptr(), access | libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fresh < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: dup3 over a descriptor number of ours, then the new one is
    // closed: `fd` now names the fresh description.
    let moved = unsafe { libc::dup3(fresh, fd, libc::O_CLOEXEC) };
    let err = io::Error::last_os_error();
    // SAFETY: `fresh` is ours, and no longer needed.
    unsafe { libc::close(fresh) };
    if moved < 0 { Err(err) } else { Ok(()) }
}

/// Closes descriptor number `fd` of this process, which nothing else in
/// it owns any more.
pub fn close_raw(fd: RawFd) {
    // SAFETY: close(2) of a descriptor number the caller gave up.
    unsafe { libc::close(fd) };
}

/// Lets a thread started from now on share the main heap rather than get
/// an arena of its own (glibc reserves 64 MiB of address space and touches
/// tens of kB for each): for the one helper thread of a wait, whose few
/// allocations gain nothing from an arena of their own.
pub fn one_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's settings.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Hands the heap's free pages back to the kernel (the allocator keeps
/// what was freed, for the next allocation).
pub fn give_back_free_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
    }
}
