//! Processes: starting the command (posix_spawn, with glibc's terminal hand
//! over where there is one), waiting for it, signals to processes and
//! groups, pidfds, and the process group and session facts the supervisor
//! asks about.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::unistd::Pid;

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

    /// The descriptor, for a process that is to inherit it.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    #[cfg(feature = "etcd")]
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

/// How [`spawn`] places the command.
pub(crate) struct Spawn<'a> {
    /// The program, as given: a path, or a name looked up on `PATH`.
    pub(crate) program: &'a CString,
    /// Where the look-up before the wait found it: started from there
    /// without a second walk of `PATH` (failed execs in the child while the
    /// parent waits), or by name again if it is gone.
    pub(crate) found: Option<&'a CString>,
    pub(crate) argv: &'a [CString],
    pub(crate) envp: &'a [CString],
    /// A process group of its own: a new one it leads, or `group`.
    pub(crate) own_group: bool,
    /// The existing group (of the job's guard) to start it in.
    pub(crate) group: Option<libc::pid_t>,
    /// The terminal its group takes before it execs (glibc 2.35's
    /// tcsetpgrp file action), if there is one and glibc has it.
    pub(crate) terminal: Option<RawFd>,
}

/// posix_spawnp(3): the child with an empty signal mask (signals the caller
/// ignores stay ignored, handlers go at exec as always). `Err` is the errno.
pub(crate) fn spawn(how: &Spawn) -> Result<libc::pid_t, i32> {
    if let Some(path) = how.found {
        match spawn_one(how, path, false) {
            Err(libc::ENOENT | libc::EACCES | libc::ENOTDIR) => {}
            done => return done,
        }
    }
    spawn_one(how, how.program, true)
}

/// posix_spawn of `program` (posix_spawnp when `search`).
fn spawn_one(how: &Spawn, program: &CString, search: bool) -> Result<libc::pid_t, i32> {
    let mut argv: Vec<*mut libc::c_char> = how.argv.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let mut envp: Vec<*mut libc::c_char> = how.envp.iter().map(|e| e.as_ptr().cast_mut()).collect();
    envp.push(std::ptr::null_mut());
    let mut pid: libc::pid_t = 0;
    // SAFETY: attrs and file actions are initialised before use and
    // destroyed after; every pointer passed (program, argv, envp, each
    // NUL-terminated and the arrays null-terminated) outlives the call.
    let err = unsafe {
        let mut attrs = std::mem::zeroed::<libc::posix_spawnattr_t>();
        libc::posix_spawnattr_init(&mut attrs);
        let empty = crate::sys::signal::SigSet::empty();
        libc::posix_spawnattr_setsigmask(&mut attrs, empty.raw());
        let mut flags = libc::POSIX_SPAWN_SETSIGMASK;
        if how.own_group {
            flags |= libc::POSIX_SPAWN_SETPGROUP;
            libc::posix_spawnattr_setpgroup(&mut attrs, how.group.unwrap_or(0));
        }
        libc::posix_spawnattr_setflags(&mut attrs, flags as libc::c_short);
        let mut actions = std::mem::zeroed::<libc::posix_spawn_file_actions_t>();
        libc::posix_spawn_file_actions_init(&mut actions);
        let with_actions = how
            .terminal
            .is_some_and(|fd| add_tcsetpgrp(&mut actions, fd));
        let start = if search {
            libc::posix_spawnp
        } else {
            libc::posix_spawn
        };
        let err = start(
            &mut pid,
            program.as_ptr(),
            if with_actions {
                &actions
            } else {
                std::ptr::null()
            },
            &attrs,
            argv.as_ptr(),
            envp.as_ptr(),
        );
        libc::posix_spawn_file_actions_destroy(&mut actions);
        libc::posix_spawnattr_destroy(&mut attrs);
        err
    };
    if err == 0 { Ok(pid) } else { Err(err) }
}

/// Adds glibc's tcsetpgrp file action (2.35 and later), looked up when
/// needed so that devlock still runs on an older glibc.
fn add_tcsetpgrp(actions: &mut libc::posix_spawn_file_actions_t, fd: RawFd) -> bool {
    type AddTcsetpgrp =
        unsafe extern "C" fn(*mut libc::posix_spawn_file_actions_t, libc::c_int) -> libc::c_int;
    static FOUND: std::sync::OnceLock<Option<AddTcsetpgrp>> = std::sync::OnceLock::new();
    let found = FOUND.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; a non-null result is
        // that function, whose type glibc documents.
        unsafe {
            let symbol = libc::dlsym(
                libc::RTLD_DEFAULT,
                c"posix_spawn_file_actions_addtcsetpgrp_np".as_ptr(),
            );
            (!symbol.is_null())
                .then(|| std::mem::transmute::<*mut libc::c_void, AddTcsetpgrp>(symbol))
        }
    });
    // SAFETY: initialised file actions and a descriptor the caller keeps open.
    found.is_some_and(|add| unsafe { add(actions, fd) } == 0)
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
