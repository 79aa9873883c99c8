//! Starting the command under the lock: the look-up before the wait, the
//! signals devlock handles while it waits, and the exec that makes devlock
//! the command, its lock descriptors inherited (either backend).

use std::ffi::CString;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use anyhow::Result;

use crate::exit::ExitCode;
use crate::sys::signal::{self, SigSet};

use crate::job_env::Env;

/// The signals that ask a job to stop: a waiter's to handle (it leaves the
/// line), the command's once it runs.
pub(crate) const STOP_SIGNALS: [libc::c_int; 4] =
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

pub(crate) use crate::sys::signal::Received;

/// The stopping signals this devlock takes while it waits: [`STOP_SIGNALS`]
/// but those its parent left ignored (`nohup`'s SIGHUP; SIGINT and SIGQUIT
/// of a job a script starts with `&`). The command inherits them ignored,
/// and so does the wait: a hang-up under `nohup` leaves the waiter in line,
/// as it leaves the command running. Asked once, at the start, before
/// devlock sets a handler of its own; left unblocked, the kernel drops them.
pub(crate) fn stop_signals() -> &'static [libc::c_int] {
    static TAKEN: std::sync::OnceLock<Vec<libc::c_int>> = std::sync::OnceLock::new();
    TAKEN.get_or_init(|| {
        STOP_SIGNALS
            .into_iter()
            .filter(|&sig| !signal::is_ignored(sig))
            .collect()
    })
}

/// The signal that tells the waiting display (or the etcd backend's main
/// thread) its wait is over: a real-time one, sent to that thread alone.
pub(crate) fn wake_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

/// Blocks the signals devlock handles itself (the stop signals, SIGWINCH
/// for the waiting line, and the wake signal) in this thread and every
/// thread it starts, so they queue up for sigwaitinfo instead of
/// killing devlock while it waits (the exec unblocks them). Call before
/// starting any thread.
pub(crate) fn block_handled_signals() {
    let mut all = stop_signals().to_vec();
    all.extend([libc::SIGWINCH, wake_signal()]);
    signal::block(&SigSet::of(&all));
}

/// Puts right what devlock may inherit from a careless parent: an ignored
/// SIGCHLD (the children it waits for, a GPU tool and the watcher's first
/// fork, would be reaped behind its back, and the command would inherit
/// it) and closed standard descriptors (a lock file opened into fd 2 would
/// become the command's stderr).
pub(crate) fn sane_start() {
    signal::set_default(libc::SIGCHLD);
    crate::sys::fs::open_std_descriptors();
}

/// Ends the process by a stopping signal that is waiting to be taken, as
/// its default action would have, if one is (a look that a stopping signal
/// cut short, in a run that starts no command).
pub(crate) fn die_of_pending_stop() {
    if let Some(received) = pending_stop() {
        signal::set_default(received.signo);
        signal::raise(received.signo);
        signal::unblock(&SigSet::of(&[received.signo]));
        signal::raise(received.signo);
    }
}

/// A stopping signal that arrived before the command started (a Ctrl-C
/// during --require-idle's probe, say), taken off the queue without waiting.
pub(crate) fn pending_stop() -> Option<Received> {
    signal::wait(&SigSet::of(stop_signals()), Some(Duration::ZERO))
}

/// The error that ends devlock when a stopping signal came before the
/// command started: nothing runs, the locks go with the process.
pub(crate) fn stopped_before_start(sig: Received) -> anyhow::Error {
    crate::error::signal(
        sig.signo,
        format!("stopped by signal {} before the command started", sig.signo),
    )
}

/// Takes any wake signal still pending off the queue: unblocked before an
/// exec, it would end the process (a real-time signal's default action).
pub(crate) fn discard_wakes() {
    while signal::wait(&SigSet::of(&[wake_signal()]), Some(Duration::ZERO)).is_some() {}
}

/// For the waiting display: a stopping signal, the wake signal or SIGWINCH
/// (the terminal changed size), up to `timeout`.
pub(crate) fn wait_stop_or_wake(timeout: Duration) -> Option<Received> {
    let mut signals = stop_signals().to_vec();
    signals.extend([wake_signal(), libc::SIGWINCH]);
    signal::wait(&SigSet::of(&signals), Some(timeout))
}

/// Looks `program` up as execvp(3) will when it starts it (on `PATH`,
/// or the path itself when it has a slash) and checks that it can be
/// executed, so that a typo fails at once with 127, or 126, instead of
/// after its turn in line. The start itself still decides: this is a
/// check, not the lookup.
pub(crate) fn check_command(program: &std::ffi::OsStr) -> Result<CString> {
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
        let executable = meta.is_file()
            && meta.permissions().mode() & 0o111 != 0
            && crate::sys::fs::executable(&c_path);
        if executable {
            return Ok(c_path);
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
pub(crate) fn cannot_start(program: &std::ffi::OsStr, err: &std::io::Error) -> anyhow::Error {
    let shown = program.to_string_lossy();
    match err.kind() {
        std::io::ErrorKind::NotFound => crate::error::command(
            crate::error::CommandKind::NotFound,
            format!("{shown}: command not found"),
        ),
        std::io::ErrorKind::PermissionDenied => crate::error::command(
            crate::error::CommandKind::CannotExecute,
            format!("{shown}: cannot execute: permission denied"),
        ),
        _ => crate::error::command(
            crate::error::CommandKind::CannotExecute,
            format!("{shown}: cannot execute: {err}"),
        ),
    }
}

/// Replaces devlock with the command (as `flock -F`, chpst and setlock
/// do): same pid, process group, session and terminal, so whatever a
/// supervisor or a terminal sends the job reaches the command itself, once,
/// and the exit status is the command's own. `keep` (a shared holder's
/// label, whose tag a close would drop, etcd's pipe) and `after` (the
/// places in line) lose close-on-exec where they are; so do `locks`, the
/// lock files, unless there are places in line: then the command inherits
/// copies of them numbered above everything else. The kernel lets go of a
/// dead process's files newest descriptor first (each last close is a task
/// work, run last in, first out), so the locks go first, and the next in
/// line wakes before, not after, the queue file's teardown, which walks
/// every byte-range lock on it (two per request in line). Every other
/// descriptor devlock opened closes at the exec. Returns only if the exec
/// failed: the code to end with (the locks go with devlock).
pub(crate) fn exec(
    command: &[OsString],
    found: Option<&CString>,
    keep: &[BorrowedFd<'_>],
    locks: &[BorrowedFd<'_>],
    after: &[BorrowedFd<'_>],
    env: &Env,
) -> ExitCode {
    let all = || keep.iter().chain(locks).chain(after);
    let mut above = all().map(|fd| fd.as_raw_fd()).max().unwrap_or(2) + 1;
    for &fd in keep.iter().chain(after) {
        if let Err(e) = crate::sys::fs::set_inheritable(fd) {
            eprintln!("devlock: letting the command inherit the lock: {e}");
            return ExitCode::GeneralError;
        }
    }
    for &fd in locks {
        let inherited = match after.is_empty() {
            true => crate::sys::fs::set_inheritable(fd),
            false => crate::sys::fs::inheritable_copy_above(fd, above).map(|copy| above = copy + 1),
        };
        if let Err(e) = inherited {
            eprintln!("devlock: letting the command inherit the lock: {e}");
            return ExitCode::GeneralError;
        }
    }
    discard_wakes();
    // An empty mask undoes what block_handled_signals did (execve keeps
    // the mask).
    signal::set_mask(&SigSet::empty());
    // The command starts with SIGPIPE's default action, whatever the
    // parent left (as std's exec, which devlock used before, did).
    signal::set_default(libc::SIGPIPE);
    // Where the look-up before the wait found the program, from there
    // without a second walk of PATH (or by name again, should it be gone
    // since).
    let mut err = crate::sys::exec::exec(found.map(|path| path.as_c_str()), command, env);
    if found.is_some()
        && matches!(
            err.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
        )
    {
        err = crate::sys::exec::exec(None, command, env);
    }
    let err = cannot_start(&command[0], &err);
    eprintln!("devlock: {}", crate::show::clean(&format!("{err:#}")));
    crate::exit::of(&err)
}

/// Replaces devlock with the command: an inherited lock already covers it
/// (either backend's pass-through).
pub(crate) fn pass_through(command: &[OsString], env: &Env) -> ExitCode {
    exec(command, None, &[], &[], &[], env)
}
