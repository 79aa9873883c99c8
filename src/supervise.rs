//! Running the command under the lock: it inherits the locked file, hears each
//! stopping signal once, and devlock waits for it whatever happens.

use std::ffi::CString;
use std::ffi::OsString;
use std::os::fd::BorrowedFd;
#[cfg(feature = "etcd")]
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use anyhow::Result;

use crate::exit::{ExitCode, coded};
use crate::sys::process::{self, ChildState};
use crate::sys::signal::{self, SigSet};
use crate::tty;

/// Variables set for the command, over devlock's own environment.
pub(crate) type Env = Vec<(OsString, OsString)>;

/// The signals that ask a job to stop, which devlock passes on to its command.
pub(crate) const STOP_SIGNALS: [libc::c_int; 4] =
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

pub(crate) use crate::sys::signal::Received;

/// The signal that tells the waiting display its wait is over: a real-time
/// one, sent to that thread alone, so it never eats the SIGCHLD of the
/// command (which would then never be reaped).
pub(crate) fn wake_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

/// Blocks the signals devlock handles itself (the stop signals, SIGCHLD,
/// SIGWINCH for the waiting line, and the wake signal) in this thread and
/// every thread it starts, so they queue up for sigwaitinfo instead of
/// killing devlock while its command still runs. Call before starting any
/// thread.
pub(crate) fn block_handled_signals() {
    let mut all = STOP_SIGNALS.to_vec();
    all.extend([libc::SIGCHLD, libc::SIGWINCH, wake_signal()]);
    signal::block(&SigSet::of(&all));
}

/// Puts right what devlock may inherit from a careless parent: an ignored
/// SIGCHLD (children would be reaped behind its back and it would wait
/// forever) and closed standard descriptors (a lock file opened into fd 2
/// would become the command's stderr).
pub(crate) fn sane_start() {
    signal::set_default(libc::SIGCHLD);
    crate::sys::fs::open_std_descriptors();
}

/// A stopping signal that arrived before the command started (a Ctrl-C
/// during --require-idle's probe, say), taken off the queue without waiting.
pub(crate) fn pending_stop() -> Option<Received> {
    signal::wait(&SigSet::of(&STOP_SIGNALS), Some(Duration::ZERO))
}

/// The error that ends devlock when a stopping signal came before the
/// command started: nothing runs, the locks go with the process.
pub(crate) fn stopped_before_start(sig: Received) -> anyhow::Error {
    coded(
        ExitCode::Signal(sig.signo),
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
    let mut signals = STOP_SIGNALS.to_vec();
    signals.extend([wake_signal(), libc::SIGWINCH]);
    signal::wait(&SigSet::of(&signals), Some(timeout))
}

/// For the supervisor: a stopping signal or SIGCHLD.
pub(crate) fn wait_signal(timeout: Option<Duration>) -> Option<Received> {
    let mut signals = STOP_SIGNALS.to_vec();
    signals.push(libc::SIGCHLD);
    signal::wait(&SigSet::of(&signals), timeout)
}

/// Where the command runs, which decides which signals reach it without
/// devlock: see the module's [`Placement::choose`].
#[derive(Debug)]
pub(crate) enum Placement {
    /// In a process group of its own, so that whatever is sent to devlock
    /// or to devlock's group reaches the command only through devlock,
    /// once. When devlock's job had the terminal to itself, the command's
    /// group gets the terminal (a prompt and `python -i` work, Ctrl-C and
    /// Ctrl-Z reach it), and gives it back when it stops or ends.
    OwnGroup {
        terminal: Option<tty::Terminal>,
        hand_over: bool,
    },
    /// In devlock's process group, which is the terminal's foreground
    /// group and shared with others (make -j, xargs -P, a script): the
    /// terminal's signals (Ctrl-C) and its input reach the command as
    /// they would without devlock; devlock passes on only what a process
    /// sent, and a signal sent to the whole group arrives twice.
    Shared,
}

impl Placement {
    /// The command gets a group of its own unless devlock's group is the
    /// terminal's foreground group and holds other processes too: then
    /// taking the terminal from that group would leave the others (make,
    /// its other jobs) without Ctrl-C, and leaving the command outside it
    /// would stop it on its first read of the terminal.
    pub(crate) fn choose() -> Placement {
        let terminal = tty::Terminal::open();
        let foreground = terminal.as_ref().is_some_and(tty::Terminal::is_ours);
        if foreground && !tty::alone_in_group() {
            return Placement::Shared;
        }
        Placement::OwnGroup {
            terminal,
            hand_over: foreground,
        }
    }

    fn own_group(&self) -> bool {
        matches!(self, Placement::OwnGroup { .. })
    }

    #[cfg(feature = "etcd")]
    /// For a start by other means than [`spawn`]: whether the command gets
    /// a group of its own, and the terminal it is to take before it execs.
    pub(crate) fn spawn_settings(&self) -> (bool, Option<RawFd>) {
        (
            self.own_group(),
            self.hand_over().map(tty::Terminal::raw_fd),
        )
    }

    fn terminal(&self) -> Option<&tty::Terminal> {
        match self {
            Placement::OwnGroup { terminal, .. } => terminal.as_ref(),
            Placement::Shared => None,
        }
    }

    fn hand_over(&self) -> Option<&tty::Terminal> {
        match self {
            Placement::OwnGroup {
                terminal: Some(terminal),
                hand_over: true,
            } => Some(terminal),
            _ => None,
        }
    }
}

/// A running command.
#[derive(Debug)]
pub(crate) struct Child {
    pid: libc::pid_t,
    /// The process group it was started in: its guard's where it has a
    /// group of its own (else devlock's).
    group: libc::pid_t,
    placement: Placement,
    /// Ends the job should devlock die before it has reaped the command;
    /// dismissed once it has.
    guard: Option<Guard>,
}

/// The job's guard ([`crate::sys::guard`]): a process forked before
/// devlock opens any lock file, that outlives a killed devlock and then
/// ends the job: the process group it leads and the command starts in, or,
/// where the command shares devlock's group with other jobs, the command
/// and its descendants. A process the command detached on purpose
/// (`setsid`, a daemon that left the group) is not the guard's to end.
/// Dropped once the command has been reaped, it is dismissed (what the
/// command left running is not ended); dropped before (devlock gave up),
/// it ends whatever it was told of. Either way it is reaped.
#[derive(Debug)]
pub(crate) struct Guard {
    pid: libc::pid_t,
    /// Taken when dropped: closed before the guard is waited for.
    line: Option<std::os::fd::OwnedFd>,
    reaped: bool,
}

impl Guard {
    /// Forks the guard. Call before any lock file is opened (a fork holds
    /// every descriptor until the child closes them) and after the handled
    /// signals are blocked. Where it cannot be started (a fork refused
    /// under a process limit), the job runs unguarded, and devlock says so.
    pub(crate) fn start() -> Option<Guard> {
        match crate::sys::guard::start() {
            Ok((pid, line)) => Some(Guard {
                pid,
                line: Some(line),
                reaped: false,
            }),
            Err(err) => {
                eprintln!("devlock: {}", crate::messages::no_guard(&err));
                None
            }
        }
    }

    /// Makes the guard lead a new process group for the command to start
    /// in; its id, if it could.
    fn lead_group(&self) -> Option<libc::pid_t> {
        crate::sys::guard::lead_group(self.pid).then_some(self.pid)
    }

    /// The command runs: the guard learns its pid and gets a pidfd for it
    /// (opened while it is surely our unreaped child; ours closes here).
    fn arm(&self, command: libc::pid_t, placement: &Placement) {
        use crate::sys::guard::Reach;
        let reach = if placement.own_group() {
            Reach::Group
        } else {
            Reach::Tree
        };
        let Some(line) = &self.line else { return };
        let armed = process::PidFd::open(command as u32)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOSYS))
            .and_then(|pidfd| crate::sys::guard::arm(line, command, pidfd.raw_fd(), reach));
        if let Err(err) = armed {
            eprintln!("devlock: {}", crate::messages::no_guard(&err));
        }
    }

    /// The command has been reaped: the guard is dismissed now, so that it
    /// has exited (on the other CPU, at nice 19, off the hand-off's path)
    /// by the time devlock lets go of its locks and drops it.
    fn command_reaped(&mut self) {
        if let Some(line) = &self.line
            && !self.reaped
        {
            crate::sys::guard::dismiss(line);
        }
        self.reaped = true;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // Closed here: the guard acts on that if it was not dismissed.
        drop(self.line.take());
        // A guard told to end the job is waited for, so that devlock exits
        // after the kill. A dismissed one only exits, and is reaped if it
        // has: waiting for it would put its turn on a busy CPU (it runs at
        // nice 19) into devlock's own exit, 10% of an uncontended run at
        // load 3; one that has not yet is reaped by whoever inherits it.
        let flags = self.reaped.then_some(nix::sys::wait::WaitPidFlag::WNOHANG);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid), flags);
    }
}

impl Child {
    #[cfg(feature = "etcd")]
    /// A child started some other way, by `start`, for [`supervise`] to
    /// wait for, guarded as [`spawn`] guards its command: `start` is given
    /// the process group to start it in (the guard's) where `placement`
    /// gives it one of its own, `None` for a new one it leads.
    pub(crate) fn start_with(
        placement: Placement,
        guard: Option<Guard>,
        start: impl FnOnce(Option<libc::pid_t>) -> std::io::Result<u32>,
    ) -> std::io::Result<Child> {
        let group = guard
            .as_ref()
            .filter(|_| placement.own_group())
            .and_then(Guard::lead_group);
        let pid = start(group)? as libc::pid_t;
        Ok(Child::started(pid, group, placement, guard))
    }

    /// The command has started (as `pid`, in `group` or a new group it
    /// leads, or devlock's): its guard learns of it.
    fn started(
        pid: libc::pid_t,
        group: Option<libc::pid_t>,
        placement: Placement,
        guard: Option<Guard>,
    ) -> Child {
        if let Some(guard) = &guard {
            guard.arm(pid, &placement);
        }
        let group = group.unwrap_or(if placement.own_group() {
            pid
        } else {
            process::own_group()
        });
        Child {
            pid,
            group,
            placement,
            guard,
        }
    }

    pub(crate) fn id(&self) -> u32 {
        self.pid as u32
    }

    /// What became of the command, if anything did: its exit code once it
    /// has ended, or the signal that stopped it (in a group of its own,
    /// where its stops are devlock's to pass on).
    fn poll(&self) -> std::io::Result<Option<Ended>> {
        let own_group = self.placement.own_group();
        match process::poll_child(Some(self.pid), own_group)? {
            None | Some((_, ChildState::Running)) => Ok(None),
            Some((_, ChildState::Stopped(sig))) => Ok(Some(Ended::Stopped(sig))),
            Some((_, ChildState::Exited(code))) => Ok(Some(Ended::Exited(ExitCode::Command(code)))),
            Some((_, ChildState::Signaled(sig))) => Ok(Some(Ended::Exited(ExitCode::Signal(sig)))),
        }
    }

    /// Reaps every other child that has ended; the command's status if it
    /// was among them.
    fn reap_others(&self) -> std::io::Result<Option<ExitCode>> {
        loop {
            match process::poll_child(None, false)? {
                None | Some((_, ChildState::Running)) => return Ok(None),
                Some((pid, ChildState::Exited(code))) if pid == self.pid => {
                    return Ok(Some(ExitCode::Command(code)));
                }
                Some((pid, ChildState::Signaled(sig))) if pid == self.pid => {
                    return Ok(Some(ExitCode::Signal(sig)));
                }
                Some(_) => {}
            }
        }
    }

    /// The process group the command is in now: the one it was started
    /// in, or one of its own that it moved to (an interactive shell makes
    /// itself a group leader). Our unreaped child's pid cannot be recycled.
    fn job_group(&self) -> libc::pid_t {
        process::group_of(self.pid).unwrap_or(self.group)
    }

    /// Passes a stopping signal on: to the command's whole group when it
    /// has one (what a job's group would have got), else to the command.
    /// (The guard in that group blocks every signal.)
    fn forward(&self, signo: libc::c_int) {
        if !self.placement.own_group() || !process::kill(-self.job_group(), signo) {
            process::kill(self.pid, signo);
        }
    }

    /// Whether the command (or a process of its own group) sent `sig`:
    /// passing that back would have the command stop itself (as sudo
    /// reasons; think of `kill(-1, SIGTERM)`).
    fn sent_by_command(&self, sig: &Received) -> bool {
        let Some(sender) = sig.sender else {
            return false;
        };
        sender == self.pid
            || (self.placement.own_group() && process::group_of(sender) == Some(self.job_group()))
    }

    /// The command stopped, in a group of its own. A terminal's job-control
    /// stop (Ctrl-Z, or a read of the terminal from the background) would
    /// have stopped devlock's group with it: so devlock stops its group the
    /// same way (the shell then sees the job stopped and takes the
    /// terminal back), and once continued (fg, bg) hands the terminal back
    /// if it is in the foreground, and continues the command. A stop sent
    /// to the command alone (SIGSTOP, a debugger) is left alone.
    fn stopped(&self, signo: libc::c_int) {
        let Some(terminal) = self.placement.terminal() else {
            return;
        };
        let group = self.job_group();
        let commands = terminal.foreground() == Some(group);
        match signo {
            // Raced the hand-over: it has the terminal now.
            libc::SIGTTIN | libc::SIGTTOU if commands => {}
            libc::SIGTTIN | libc::SIGTTOU => self.stop_as_a_job(signo, terminal),
            libc::SIGTSTP if commands => self.stop_as_a_job(signo, terminal),
            _ => return,
        }
        process::kill(-group, libc::SIGCONT);
    }

    fn stop_as_a_job(&self, signo: libc::c_int, terminal: &tty::Terminal) {
        let own = process::own_group();
        let group = self.job_group();
        if terminal.foreground() == Some(group) {
            terminal.give_to(own);
        }
        // Stops devlock here until SIGCONT; the kernel discards it when
        // nobody could continue the group (an orphaned group), and then
        // devlock goes straight on.
        process::kill(0, signo);
        if terminal.is_ours() {
            terminal.give_to(group);
        }
    }

    /// A job stop (Ctrl-Z) that reached devlock while it held job stops
    /// back, just before the command started: the whole job stops, the
    /// command with it. A command that has the terminal is stopped through
    /// its group, which the loop in [`supervise`] relays as a stop of the
    /// job (devlock takes the terminal back, stops, and on `fg` hands it
    /// over again). Otherwise devlock stops as the signal would have stopped
    /// it, and a command in devlock's own group gets its copy too. Call
    /// with job stops at their default action.
    pub(crate) fn pass_on_job_stop(&self, signo: libc::c_int) {
        if self.placement.hand_over().is_some() {
            if process::kill(-self.job_group(), signo) {
                return;
            }
        } else if !self.placement.own_group() {
            process::kill(self.pid, signo);
        }
        signal::raise(signo);
    }

    /// Takes the terminal back from the command's group once it has ended,
    /// before devlock says anything or exits.
    fn take_terminal_back(&self) {
        if let Some(terminal) = self.placement.terminal()
            && terminal.foreground() == Some(self.job_group())
        {
            terminal.give_to(process::own_group());
        }
    }
}

/// A waitpid(2) that failed: said (the command's fate is unknown; its
/// guard ends it as devlock exits), and a general failure.
fn cannot_wait(child: &Child, err: &std::io::Error) -> ExitCode {
    eprintln!(
        "devlock: cannot wait for the command (pid {}): {}; ending it",
        child.pid,
        crate::proc::os_text(err)
    );
    ExitCode::GeneralError
}

/// What became of the command.
enum Ended {
    Exited(ExitCode),
    Stopped(libc::c_int),
}

/// Starts `command` with the lock descriptors `keep` inherited across exec,
/// placed as `placement` says, watched by `guard`.
///
/// posix_spawn rather than fork: no page tables to copy, on every start and
/// every hand-off. The child gets an empty signal mask (devlock blocks the
/// signals it handles); signals the caller ignored stay ignored (`nohup`),
/// and devlock's own handlers vanish at exec as always. The lock
/// descriptors lose close-on-exec in the parent just before. A command in a
/// group of its own that is to have the terminal takes it itself before it
/// execs (glibc 2.35's tcsetpgrp file action), so it never reads the
/// terminal from the background; without that, devlock hands it over just
/// after, and a read that came first is continued.
pub(crate) fn spawn(
    command: &[OsString],
    found: Option<&CString>,
    keep: &[BorrowedFd<'_>],
    env: &Env,
    placement: Placement,
    guard: Option<Guard>,
) -> Result<Child> {
    for &fd in keep {
        crate::sys::fs::set_inheritable(fd)
            .map_err(|e| anyhow::anyhow!("letting the command inherit the lock: {e}"))?;
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
    // The guard leads the group the command starts in: no process of the
    // job is ever outside its reach.
    let group = guard
        .as_ref()
        .filter(|_| placement.own_group())
        .and_then(Guard::lead_group);
    let mut how = process::Spawn {
        program: &argv[0],
        found,
        argv: &argv,
        envp: &envp,
        own_group: placement.own_group(),
        group,
        terminal: placement.hand_over().map(tty::Terminal::raw_fd),
    };
    let mut started = process::spawn(&how);
    if started.is_err() && how.terminal.is_some() {
        // The terminal refused (it went away, say): start it without.
        how.terminal = None;
        started = process::spawn(&how);
    }
    let pid =
        started.map_err(|err| cannot_start(program, &std::io::Error::from_raw_os_error(err)))?;
    let child = Child::started(pid, group, placement, guard);
    if let Some(terminal) = child.placement.hand_over()
        && terminal.foreground() != Some(child.group)
    {
        terminal.give_to(child.group);
    }
    Ok(child)
}

/// Looks `program` up as posix_spawnp(3) will when it starts it (on `PATH`,
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

/// Why the supervisor calls its tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tick {
    /// About once a second while the command runs.
    Second,
    /// The command has stopped (a job stop, SIGSTOP), and devlock may stop
    /// with it, when no tick comes until it is continued.
    Stopped,
}

/// Waits for the command to end and returns the exit code devlock should end
/// with, calling `tick` about once a second while the command runs
/// (the holder's check that its lock files are still where they were), and
/// as the command stops. Also returns the command's guard: drop it once the
/// locks are let go (it is dismissed then if the command was reaped).
pub(crate) fn supervise_watching(
    child: Child,
    pending: Option<Received>,
    tick: &mut dyn FnMut(Tick),
) -> (ExitCode, Option<Guard>) {
    let (code, _, guard) = supervise_loop(child, pending, false, Some(tick));
    (code, guard)
}

#[cfg(feature = "etcd")]
/// [`supervise_watching`] without a tick, also reaping other children as they end when `reap_all`
/// (devlock as a subreaper collects what the command left behind), and
/// saying which stopping signal, if any, came meanwhile.
///
/// Which signals devlock passes on follows from where the command runs.
/// In a group of its own, nothing sent to devlock or to its group, nor the
/// terminal's signals to that group, reaches the command but through
/// devlock: each first stopping signal goes on to the command's group
/// (once: a second copy, such as timeout(1)'s to its whole group, is
/// absorbed). Sharing devlock's group, the command already got whatever
/// the terminal sent: devlock passes on only what a process sent (and the
/// hang-up a terminal sends its session leader alone). Signals sent by
/// the command itself are never passed back to it.
pub(crate) fn supervise_reaping(
    child: Child,
    pending: Option<Received>,
    reap_all: bool,
) -> (ExitCode, Option<Received>) {
    // The dismissed guard goes now, before what the command left is waited for.
    let (code, first, _) = supervise_loop(child, pending, reap_all, None);
    (code, first)
}

fn supervise_loop(
    mut child: Child,
    pending: Option<Received>,
    reap_all: bool,
    mut tick: Option<&mut dyn FnMut(Tick)>,
) -> (ExitCode, Option<Received>, Option<Guard>) {
    // The first stopping signal reaches the command once; later ones are
    // absorbed, so a second Ctrl-C or kill does not cut its clean-up short.
    let mut first = None;
    let session_leader = process::is_session_leader();
    let mut on_signal = |sig: Received, child: &Child| {
        if matches!(sig.signo, libc::SIGCHLD | libc::SIGWINCH)
            || first.is_some()
            || child.sent_by_command(&sig)
        {
            return;
        }
        first = Some(sig);
        let hang_up_for_leader = sig.signo == libc::SIGHUP && session_leader;
        if child.placement.own_group() || sig.from_process || hang_up_for_leader {
            child.forward(sig.signo);
        }
    };
    if let Some(sig) = pending {
        on_signal(sig, &child);
    }
    let mut next_tick = std::time::Instant::now() + Duration::from_secs(1);
    let code = loop {
        match child.poll() {
            Ok(Some(Ended::Exited(code))) => {
                if let Some(guard) = child.guard.as_mut() {
                    guard.command_reaped();
                }
                break code;
            }
            Ok(Some(Ended::Stopped(signo))) => {
                if let Some(tick) = tick.as_mut() {
                    tick(Tick::Stopped);
                }
                child.stopped(signo);
                continue;
            }
            Ok(None) => {}
            Err(e) => break cannot_wait(&child, &e),
        }
        if reap_all {
            match child.reap_others() {
                Ok(Some(code)) => {
                    if let Some(guard) = child.guard.as_mut() {
                        guard.command_reaped();
                    }
                    break code;
                }
                Ok(None) => {}
                Err(e) => break cannot_wait(&child, &e),
            }
        }
        // Due by the clock, not only after a quiet second: a job whose own
        // children end often (or a probe devlock runs) must not starve it.
        let every = tick
            .is_some()
            .then(|| next_tick.saturating_duration_since(std::time::Instant::now()));
        if let Some(sig) = wait_signal(every) {
            on_signal(sig, &child);
        }
        if let Some(tick) = tick.as_mut()
            && std::time::Instant::now() >= next_tick
        {
            tick(Tick::Second);
            next_tick = std::time::Instant::now() + Duration::from_secs(1);
        }
    };
    child.take_terminal_back();
    (code, first, child.guard.take())
}

/// Replaces devlock with the command: an inherited lock already covers it
/// (either backend's pass-through).
pub(crate) fn pass_through(command: &[OsString], env: &Env) -> ExitCode {
    use std::os::unix::process::CommandExt;
    discard_wakes();
    // An empty mask unblocks what block_handled_signals blocked.
    signal::set_mask(&SigSet::empty());
    let err = std::process::Command::new(&command[0])
        .args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .exec();
    let err = cannot_start(&command[0], &err);
    eprintln!("devlock: {}", crate::text::clean(&format!("{err:#}")));
    crate::exit::exit_code_of(&err)
}
