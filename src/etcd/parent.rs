//! The etcd backend's run, still a parent: devlock starts the command as
//! its child, keeps the lease alive while it runs, passes each stopping
//! signal on once, and a guard process ends the job if devlock is killed.
//! (The file backend chain-loads its command instead: see `cmd::run`.)

use std::os::fd::RawFd;

use crate::exit::ExitCode;
use crate::supervise::{Received, wait_signal};
use crate::sys::process::{self, ChildState};
use crate::tty;

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

/// Waits for the command to end and returns the exit code devlock should
/// end with, also reaping other children as they end when `reap_all`
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
    let (code, first, _) = supervise_loop(child, pending, reap_all);
    (code, first)
}

fn supervise_loop(
    mut child: Child,
    pending: Option<Received>,
    reap_all: bool,
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
    let code = loop {
        match child.poll() {
            Ok(Some(Ended::Exited(code))) => {
                if let Some(guard) = child.guard.as_mut() {
                    guard.command_reaped();
                }
                break code;
            }
            Ok(Some(Ended::Stopped(signo))) => {
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
        if let Some(sig) = wait_signal(None) {
            on_signal(sig, &child);
        }
    };
    child.take_terminal_back();
    (code, first, child.guard.take())
}
