//! Running the command under the lock: it inherits the locked file, hears each
//! stopping signal once, and devlock waits for it whatever happens.

use std::ffi::CString;
use std::ffi::OsString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;

use anyhow::Result;

use crate::exit::{ExitCode, coded};

/// Variables set for the command, over devlock's own environment.
pub type Env = Vec<(OsString, OsString)>;

/// The signals that ask a job to stop, which devlock passes on to its command.
pub const STOP_SIGNALS: [libc::c_int; 4] =
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// A signal as sigwaitinfo reported it.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub signo: libc::c_int,
    /// Sent by a process with kill(2) (as opposed to raised by the kernel,
    /// which is how a terminal's Ctrl-C arrives).
    pub from_process: bool,
}

/// The signal that tells the waiting display its wait is over: a real-time
/// one, sent to that thread alone, so it never eats the SIGCHLD of the
/// command (which would then never be reaped).
pub fn wake_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

fn set_of(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data and sigemptyset initialises it.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for &sig in signals {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

/// Blocks the signals devlock handles itself (the stop signals, SIGCHLD,
/// SIGWINCH for the waiting line, and the wake signal) in this thread and
/// every thread it starts, so they queue up for sigwaitinfo instead of
/// killing devlock while its command still runs. Call before starting any
/// thread.
pub fn block_handled_signals() {
    let mut all = STOP_SIGNALS.to_vec();
    all.extend([libc::SIGCHLD, libc::SIGWINCH, wake_signal()]);
    let set = set_of(&all);
    // SAFETY: valid set pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Puts right what devlock may inherit from a careless parent: an ignored
/// SIGCHLD (children would be reaped behind its back and it would wait
/// forever) and closed standard descriptors (a lock file opened into fd 2
/// would become the command's stderr).
pub fn sane_start() {
    // SAFETY: plain syscalls on the calling process.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
        for fd in 0..3 {
            if libc::fcntl(fd, libc::F_GETFD) == -1 {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 && null != fd {
                    libc::dup2(null, fd);
                    libc::close(null);
                }
            }
        }
    }
}

/// A stopping signal that arrived before the command started (a Ctrl-C
/// during --require-idle's probe, say), taken off the queue without waiting.
pub fn pending_stop() -> Option<Received> {
    wait_in(&set_of(&STOP_SIGNALS), Some(std::time::Duration::ZERO))
}

/// The error that ends devlock when a stopping signal came before the
/// command started: nothing runs, the locks go with the process.
pub fn stopped_before_start(sig: Received) -> anyhow::Error {
    coded(
        ExitCode::Signal(sig.signo),
        format!("stopped by signal {} before the command started", sig.signo),
    )
}

/// Lets the stopping signals end devlock by their default action again.
pub fn unblock_stop_signals() {
    let set = set_of(&STOP_SIGNALS);
    // SAFETY: valid set pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
}

/// Takes any wake signal still pending off the queue: unblocked before an
/// exec, it would end the process (a real-time signal's default action).
pub fn discard_wakes() {
    while wait_in(&set_of(&[wake_signal()]), Some(std::time::Duration::ZERO)).is_some() {}
}

/// For the waiting display: a stopping signal, the wake signal or SIGWINCH
/// (the terminal changed size), up to `timeout`.
pub fn wait_stop_or_wake(timeout: std::time::Duration) -> Option<Received> {
    let mut signals = STOP_SIGNALS.to_vec();
    signals.extend([wake_signal(), libc::SIGWINCH]);
    wait_in(&set_of(&signals), Some(timeout))
}

/// For the supervisor: a stopping signal or SIGCHLD.
pub fn wait_signal(timeout: Option<std::time::Duration>) -> Option<Received> {
    let mut signals = STOP_SIGNALS.to_vec();
    signals.push(libc::SIGCHLD);
    wait_in(&set_of(&signals), timeout)
}

fn wait_in(set: &libc::sigset_t, timeout: Option<std::time::Duration>) -> Option<Received> {
    // SAFETY: siginfo_t is plain data filled by the kernel.
    let mut info = unsafe { std::mem::zeroed::<libc::siginfo_t>() };
    let signo = match timeout {
        None => unsafe { libc::sigwaitinfo(set, &mut info) },
        Some(t) => {
            let ts = libc::timespec {
                tv_sec: t.as_secs() as libc::time_t,
                tv_nsec: t.subsec_nanos() as libc::c_long,
            };
            // SAFETY: valid pointers.
            unsafe { libc::sigtimedwait(set, &mut info, &ts) }
        }
    };
    (signo > 0).then_some(Received {
        signo,
        from_process: info.si_code <= 0,
    })
}

/// A running command.
#[derive(Debug)]
pub struct Child {
    pid: libc::pid_t,
}

impl Child {
    /// A child started some other way, for [`supervise`] to wait for.
    pub fn adopt(pid: u32) -> Child {
        Child {
            pid: pid as libc::pid_t,
        }
    }

    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// The exit code devlock should pass on, once the command has ended.
    fn try_wait(&self) -> std::io::Result<Option<ExitCode>> {
        let mut status = 0;
        // SAFETY: waitpid on our own, not yet reaped, child.
        match unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) } {
            0 => Ok(None),
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(code_of(status)),
        }
    }

    /// Reaps every child that has ended, the command's status once it is
    /// among them.
    fn reap_until_ended(&self) -> std::io::Result<Option<ExitCode>> {
        loop {
            let mut status = 0;
            // SAFETY: waitpid on any child of ours.
            match unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } {
                0 => return Ok(None),
                -1 => return Err(std::io::Error::last_os_error()),
                pid if pid == self.pid => {
                    if let Some(code) = code_of(status) {
                        return Ok(Some(code));
                    }
                }
                _ => {}
            }
        }
    }
}

fn code_of(status: libc::c_int) -> Option<ExitCode> {
    if libc::WIFEXITED(status) {
        Some(ExitCode::Command(libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(ExitCode::Signal(libc::WTERMSIG(status)))
    } else {
        None
    }
}

/// Starts `command` with the lock descriptors `keep` inherited across exec.
///
/// posix_spawn rather than fork: no page tables to copy, on every start and
/// every hand-off. The child gets an empty signal mask (devlock blocks the
/// signals it handles); signals the caller ignored stay ignored (`nohup`),
/// and devlock's own handlers vanish at exec as always. The lock
/// descriptors lose close-on-exec in the parent just before.
pub fn spawn(command: &[OsString], keep: &[RawFd], env: &Env) -> Result<Child> {
    for &fd in keep {
        // SAFETY: fcntl on a descriptor we own.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) == 0
        };
        if !ok {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    let program = &command[0];
    let c_strings = |items: Vec<Vec<u8>>| -> Result<Vec<CString>> {
        items
            .into_iter()
            .map(|b| {
                CString::new(b)
                    .map_err(|_| coded(ExitCode::Usage, "an argument contains a NUL byte"))
            })
            .collect()
    };
    let argv = c_strings(command.iter().map(|a| a.as_bytes().to_vec()).collect())?;
    let mut vars: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| !env.iter().any(|(name, _)| k == name))
        .collect();
    vars.extend(env.iter().cloned());
    let envp = c_strings(
        vars.iter()
            .map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()].concat())
            .collect(),
    )?;
    let mut argv_ptrs: Vec<*mut libc::c_char> = argv.iter().map(|a| a.as_ptr() as *mut _).collect();
    argv_ptrs.push(std::ptr::null_mut());
    let mut envp_ptrs: Vec<*mut libc::c_char> = envp.iter().map(|e| e.as_ptr() as *mut _).collect();
    envp_ptrs.push(std::ptr::null_mut());

    let mut pid: libc::pid_t = 0;
    // SAFETY: attrs are initialised before use and destroyed after; every
    // pointer passed stays alive for the call.
    let err = unsafe {
        let mut attrs = std::mem::zeroed::<libc::posix_spawnattr_t>();
        libc::posix_spawnattr_init(&mut attrs);
        let empty = set_of(&[]);
        libc::posix_spawnattr_setsigmask(&mut attrs, &empty);
        libc::posix_spawnattr_setflags(&mut attrs, libc::POSIX_SPAWN_SETSIGMASK as libc::c_short);
        let err = libc::posix_spawnp(
            &mut pid,
            argv[0].as_ptr(),
            std::ptr::null(),
            &attrs,
            argv_ptrs.as_ptr(),
            envp_ptrs.as_ptr(),
        );
        libc::posix_spawnattr_destroy(&mut attrs);
        err
    };
    if err == 0 {
        return Ok(Child { pid });
    }
    Err(cannot_start(
        program,
        &std::io::Error::from_raw_os_error(err),
    ))
}

/// Looks `program` up as posix_spawnp(3) will when it starts it (on `PATH`,
/// or the path itself when it has a slash) and checks that it can be
/// executed, so that a typo fails at once with 127, or 126, instead of
/// after its turn in line. The start itself still decides: this is a
/// check, not the lookup.
pub fn check_command(program: &std::ffi::OsStr) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bytes = program.as_bytes();
    let candidates: Vec<std::path::PathBuf> = if bytes.contains(&b'/') {
        vec![program.into()]
    } else if bytes.is_empty() {
        Vec::new()
    } else {
        // glibc's default when PATH is unset; an empty entry is the
        // current directory, as execvp has it.
        let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
        path.as_bytes()
            .split(|&b| b == b':')
            .map(|dir| {
                let dir = if dir.is_empty() { b".".as_slice() } else { dir };
                std::path::Path::new(std::ffi::OsStr::from_bytes(dir)).join(program)
            })
            .collect()
    };
    let mut denied = false;
    for candidate in &candidates {
        let Ok(meta) = std::fs::metadata(candidate) else {
            continue;
        };
        let Ok(c_path) = CString::new(candidate.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path; faccessat only reads it.
        let executable = meta.is_file()
            && meta.permissions().mode() & 0o111 != 0
            && unsafe {
                libc::faccessat(
                    libc::AT_FDCWD,
                    c_path.as_ptr(),
                    libc::X_OK,
                    libc::AT_EACCESS,
                )
            } == 0;
        if executable {
            return Ok(());
        }
        denied = true;
    }
    let err = if denied {
        std::io::Error::from_raw_os_error(libc::EACCES)
    } else {
        std::io::Error::from_raw_os_error(libc::ENOENT)
    };
    Err(cannot_start(program, &err))
}

/// Why `program` could not be started, with the shell's exit code: 127 when
/// it is not found, 126 when it cannot be executed.
pub fn cannot_start(program: &std::ffi::OsStr, err: &std::io::Error) -> anyhow::Error {
    let shown = program.to_string_lossy();
    match err.kind() {
        std::io::ErrorKind::NotFound => {
            coded(ExitCode::NotFound, format!("{shown}: command not found"))
        }
        std::io::ErrorKind::PermissionDenied => coded(
            ExitCode::CannotExecute,
            format!("{shown}: cannot execute: permission denied"),
        ),
        _ => coded(
            ExitCode::CannotExecute,
            format!("{shown}: cannot execute: {err}"),
        ),
    }
}

/// Waits for the command to end and returns the exit code devlock should end
/// with. A stopping signal sent to devlock reaches the command once; a
/// terminal's Ctrl-C already reached it, and later signals are absorbed, so
/// the lock stays held until the command has really finished cleaning up.
pub fn supervise(child: Child, pending: Option<Received>) -> ExitCode {
    supervise_reaping(child, pending, false).0
}

/// [`supervise`], also reaping other children as they end when `reap_all`
/// (devlock as a subreaper collects what the command left behind), and
/// saying which stopping signal, if any, came meanwhile.
pub fn supervise_reaping(
    child: Child,
    pending: Option<Received>,
    reap_all: bool,
) -> (ExitCode, Option<Received>) {
    // The first stopping signal reaches the command once; later ones are
    // absorbed, so a second Ctrl-C or kill does not cut its clean-up short.
    let mut first = None;
    // SAFETY: getsid and getpid cannot fail for the calling process.
    let session_leader = unsafe { libc::getsid(0) == libc::getpid() };
    let mut on_signal = |sig: Received, child: &Child| {
        if sig.signo == libc::SIGCHLD || first.is_some() {
            return;
        }
        first = Some(sig);
        // The kernel's own signals (a terminal's Ctrl-C) already went to the
        // whole foreground group, command included; the one exception is
        // the hang-up a terminal sends to its session leader alone.
        let hang_up_for_leader = sig.signo == libc::SIGHUP && session_leader;
        if sig.from_process || hang_up_for_leader {
            // SAFETY: plain kill of our own child, which we have not reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, sig.signo) };
        }
    };
    if let Some(sig) = pending {
        on_signal(sig, &child);
    }
    loop {
        let ended = if reap_all {
            child.reap_until_ended()
        } else {
            child.try_wait()
        };
        match ended {
            Ok(Some(code)) => return (code, first),
            Ok(None) => {}
            Err(_) => return (ExitCode::GeneralError, first),
        }
        if let Some(sig) = wait_signal(None) {
            on_signal(sig, &child);
        }
    }
}
