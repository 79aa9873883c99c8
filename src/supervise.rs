//! Running the command under the lock: it inherits the locked file, hears each
//! stopping signal once, and devlock waits for it whatever happens.

use std::ffi::OsString;
use std::os::fd::RawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command};

use anyhow::Result;

use crate::exit::{ExitCode, coded};

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

/// The signals devlock handles itself: the stop signals and SIGCHLD.
pub fn handled_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data and sigemptyset initialises it.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for sig in STOP_SIGNALS {
            libc::sigaddset(&mut set, sig);
        }
        libc::sigaddset(&mut set, libc::SIGCHLD);
        set
    }
}

/// Blocks the handled signals in this thread (and every thread it starts), so
/// they queue up for [`wait_signal`] instead of killing devlock while its
/// command still runs. Call before starting any thread.
pub fn block_handled_signals() {
    let set = handled_set();
    // SAFETY: valid set pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Waits for one of the handled signals, up to `timeout` (forever if `None`).
pub fn wait_signal(timeout: Option<std::time::Duration>) -> Option<Received> {
    let set = handled_set();
    // SAFETY: siginfo_t is plain data filled by the kernel.
    let mut info = unsafe { std::mem::zeroed::<libc::siginfo_t>() };
    let signo = match timeout {
        None => unsafe { libc::sigwaitinfo(&set, &mut info) },
        Some(t) => {
            let ts = libc::timespec {
                tv_sec: t.as_secs() as libc::time_t,
                tv_nsec: t.subsec_nanos() as libc::c_long,
            };
            // SAFETY: valid pointers.
            unsafe { libc::sigtimedwait(&set, &mut info, &ts) }
        }
    };
    (signo > 0).then(|| Received {
        signo,
        from_process: info.si_code <= 0,
    })
}

/// Starts `command` with the lock descriptors `keep` inherited across exec.
pub fn spawn(command: &[OsString], keep: &[RawFd], env: &[(String, String)]) -> Result<Child> {
    let program = &command[0];
    let mut cmd = Command::new(program);
    cmd.args(&command[1..]);
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    let keep = keep.to_vec();
    // SAFETY: only async-signal-safe calls (fcntl, sigprocmask) run in the
    // child between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &keep {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            let empty = std::mem::zeroed::<libc::sigset_t>();
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            Ok(())
        });
    }
    cmd.spawn().map_err(|e| {
        let shown = program.to_string_lossy();
        match e.kind() {
            std::io::ErrorKind::NotFound => {
                coded(ExitCode::NotFound, format!("{shown}: command not found"))
            }
            std::io::ErrorKind::PermissionDenied => coded(
                ExitCode::CannotExecute,
                format!("{shown}: cannot execute: permission denied"),
            ),
            _ => coded(
                ExitCode::CannotExecute,
                format!("{shown}: cannot execute: {e}"),
            ),
        }
    })
}

/// Waits for the command to end and returns the exit code devlock should end
/// with. A stopping signal sent to devlock reaches the command once; a
/// terminal's Ctrl-C already reached it, and later signals are absorbed, so
/// the lock stays held until the command has really finished cleaning up.
pub fn supervise(mut child: Child, pending: Option<Received>) -> ExitCode {
    let mut passed_on = false;
    let mut on_signal = |sig: Received, child: &Child| {
        if sig.signo == libc::SIGCHLD || passed_on {
            return;
        }
        passed_on = true;
        if sig.from_process {
            // SAFETY: plain kill of our own child, which we have not reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, sig.signo) };
        }
    };
    if let Some(sig) = pending {
        on_signal(sig, &child);
    }
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return exit_code_of(status),
            Ok(None) => {}
            Err(_) => return ExitCode::GeneralError,
        }
        if let Some(sig) = wait_signal(None) {
            on_signal(sig, &child);
        }
    }
}

fn exit_code_of(status: std::process::ExitStatus) -> ExitCode {
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::Command(code),
        (None, Some(sig)) => ExitCode::Signal(sig),
        (None, None) => ExitCode::GeneralError,
    }
}
