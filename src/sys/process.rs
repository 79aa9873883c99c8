//! Processes: the watcher's double fork, pidfds (a process's end, and how
//! it ended), signals to processes and groups, reopening a descriptor
//! without its locks, (for the etcd backend's parent) waiting for a
//! child, and what a process about to sleep long gives back of its memory.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::unistd::Pid;

#[cfg(feature = "etcd")]
/// What waitpid(2) said about a child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChildState {
    /// Still running (`WNOHANG`).
    Running,
    Exited(i32),
    Signaled(i32),
    /// Stopped by this signal (only asked with `WUNTRACED`).
    Stopped(i32),
}

#[cfg(feature = "etcd")]
/// One waitpid(2) without blocking: for `pid` (or any child, with `None`),
/// reporting stops too when `stops`. `Ok(None)` when there is no child to
/// wait for (ECHILD).
pub(crate) fn poll_child(
    pid: Option<libc::pid_t>,
    stops: bool,
) -> io::Result<Option<(libc::pid_t, ChildState)>> {
    use nix::sys::wait::{WaitPidFlag, WaitStatus};
    let mut flags = WaitPidFlag::WNOHANG;
    if stops {
        flags |= WaitPidFlag::WUNTRACED;
    }
    let status = match nix::sys::wait::waitpid(pid.map(Pid::from_raw), Some(flags)) {
        Ok(status) => status,
        Err(nix::errno::Errno::ECHILD) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(Some(match status {
        WaitStatus::StillAlive => (pid.unwrap_or(0), ChildState::Running),
        WaitStatus::Exited(pid, code) => (pid.as_raw(), ChildState::Exited(code)),
        WaitStatus::Signaled(pid, sig, _) => (pid.as_raw(), ChildState::Signaled(sig as i32)),
        WaitStatus::Stopped(pid, sig) => (pid.as_raw(), ChildState::Stopped(sig as i32)),
        other => (other.pid().map_or(0, Pid::as_raw), ChildState::Running),
    }))
}

/// kill(2): `sig` to `pid` (a negative pid names a process group). Whether
/// it was sent.
pub(crate) fn kill(pid: libc::pid_t, sig: libc::c_int) -> bool {
    // SAFETY: kill(2) only sends a signal; a pid that is gone gets ESRCH.
    unsafe { libc::kill(pid, sig) == 0 }
}

#[cfg(feature = "etcd")]
/// The process group of `pid`, if it is alive.
pub(crate) fn group_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    nix::unistd::getpgid(Some(Pid::from_raw(pid)))
        .ok()
        .map(Pid::as_raw)
}

/// This process's group.
pub(crate) fn own_group() -> libc::pid_t {
    nix::unistd::getpgrp().as_raw()
}

#[cfg(feature = "etcd")]
/// Whether this process leads its session (a terminal's hang-up is sent
/// to the session leader alone).
pub(crate) fn is_session_leader() -> bool {
    nix::unistd::getsid(None).is_ok_and(|sid| sid == nix::unistd::getpid())
}

/// The effective uid.
pub(crate) fn effective_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

#[cfg(feature = "etcd")]
/// Makes this process a child subreaper: what the command starts stays
/// under devlock when its parent exits first.
pub(crate) fn become_subreaper() {
    let _ = nix::sys::prctl::set_child_subreaper(true);
}

/// A process descriptor: names exactly one process, even once it is
/// reaped and its pid reused; closed when dropped.
#[derive(Debug)]
pub(crate) struct PidFd(OwnedFd);

impl PidFd {
    /// A pidfd for our child `pid` (not yet reaped); `None` where the
    /// kernel has no pidfd_open.
    pub(crate) fn open(pid: u32) -> Option<PidFd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new
        // descriptor, which is ours alone.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        // SAFETY: a descriptor pidfd_open just returned, owned by nobody else.
        (fd >= 0).then(|| PidFd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }))
    }

    #[cfg(feature = "etcd")]
    /// The descriptor, for a process that is to inherit it.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Sends `sig` to the process (nothing if it is gone).
    pub(crate) fn signal(&self, sig: libc::c_int) {
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
    pub(crate) fn wait_ended(&self, timeout: std::time::Duration) -> bool {
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
    pub(crate) fn exit_status(&self) -> Option<i32> {
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
pub(crate) fn set_name(name: &std::ffi::CStr) {
    let _ = nix::sys::prctl::set_name(name);
}

/// Which side of [`fork_detached`] this is.
pub(crate) enum Forked {
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
pub(crate) fn fork_detached() -> io::Result<Forked> {
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
pub(crate) fn reopen_unlocked(fd: RawFd) -> io::Result<()> {
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
pub(crate) fn close_raw(fd: RawFd) {
    // SAFETY: close(2) of a descriptor number the caller gave up.
    unsafe { libc::close(fd) };
}

#[cfg(feature = "etcd")]
/// Makes a command started with std's `Command` die with devlock (the
/// kernel sends it SIGKILL when devlock's thread ends), start with an empty
/// signal mask, and, given `terminal`, take that terminal for its process
/// group (the one it leads, or its guard's) before it execs.
pub(crate) fn tie_to_parent(cmd: &mut std::process::Command, terminal: Option<RawFd>) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: only async-signal-safe calls between fork and exec, on data
    // the closure owns.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The parent may have died before the line above: then nobody
            // would send the SIGKILL.
            if libc::getppid() as u32 != parent {
                libc::raise(libc::SIGKILL);
            }
            let mut empty = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut empty);
            if let Some(fd) = terminal {
                // Its own group (set just before) takes the terminal before
                // it can read it; from the background that needs SIGTTOU
                // blocked, as it is until the mask is emptied below.
                let mut ttou = empty;
                libc::sigaddset(&mut ttou, libc::SIGTTOU);
                libc::pthread_sigmask(libc::SIG_BLOCK, &ttou, std::ptr::null_mut());
                libc::tcsetpgrp(fd, libc::getpgrp());
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            Ok(())
        });
    }
}

/// Before a long sleep (a wait in line that lasted long enough to be
/// shown): takes the read-only pages of this program and its libraries
/// (their code and constants: about 3 MiB of a waiting devlock's resident
/// set, touched starting up) out of this process's page tables, and gives
/// the allocator's free memory back. The pages stay in the page cache,
/// shared with every other process that maps them; the few a wake needs
/// come back as minor faults, without I/O. Only segments the program
/// headers mark read-only: a writable one (relocated data, .data, .bss)
/// would be reset to the file's bytes. Safe from any thread at any time,
/// as nothing ever writes those pages (the vDSO, not a file, is left).
pub(crate) fn shed_clean_pages() {
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    // SAFETY: the callback only reads the program headers glibc hands it
    // and writes into `ranges`, which outlives the call.
    unsafe {
        libc::dl_iterate_phdr(
            Some(read_only_segments),
            (&raw mut ranges).cast::<libc::c_void>(),
        );
    }
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    for (start, end) in ranges {
        // Whole pages inside the segment only.
        let first = start.div_ceil(page) * page;
        let last = end / page * page;
        if last > first {
            // SAFETY: the range lies inside a read-only file mapping of a
            // loaded object, which nothing writes: MADV_DONTNEED only drops
            // this process's mappings of unchanged file pages, and a later
            // touch maps the same bytes again from the file.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    last - first,
                    libc::MADV_DONTNEED,
                );
            }
        }
    }
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// dl_iterate_phdr's callback: the read-only PT_LOAD segments of each
/// loaded object but the vDSO.
extern "C" fn read_only_segments(
    info: *mut libc::dl_phdr_info,
    _size: libc::size_t,
    ranges: *mut libc::c_void,
) -> libc::c_int {
    // SAFETY: glibc passes a valid dl_phdr_info whose dlpi_phdr points to
    // dlpi_phnum program headers and whose dlpi_name is a C string (or
    // null), and `ranges` is the Vec shed_clean_pages passed in.
    let (info, ranges) = unsafe { (&*info, &mut *ranges.cast::<Vec<(usize, usize)>>()) };
    if info.dlpi_phdr.is_null() {
        return 0;
    }
    if !info.dlpi_name.is_null() {
        // SAFETY: as above.
        let name = unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) };
        if name.to_bytes().starts_with(b"linux-vdso") {
            return 0;
        }
    }
    // SAFETY: as above, dlpi_phnum headers at dlpi_phdr.
    let headers =
        unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    for header in headers {
        if header.p_type == libc::PT_LOAD && header.p_flags & libc::PF_W == 0 {
            let start = (info.dlpi_addr as usize).wrapping_add(header.p_vaddr as usize);
            ranges.push((start, start.wrapping_add(header.p_memsz as usize)));
        }
    }
    0
}

/// Lets a thread started from now on share the main heap rather than get
/// an arena of its own (glibc reserves 64 MiB of address space and touches
/// tens of kB for each): for the one helper thread of a wait, whose few
/// allocations gain nothing from an arena of their own.
pub(crate) fn one_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes the allocator's settings.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
