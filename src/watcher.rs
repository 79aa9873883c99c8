//! The watcher: the one process that runs beside a chain-loaded command,
//! and only where a hold needs something done while it lasts (GPU usage
//! sampling with its end line, the idle policy, a memory budget's watch, a
//! check that lock files another user could rename are still in place).
//!
//! It is a copy of devlock made just before the exec ([`fork_detached`]:
//! a double fork, so the command never has it as a child to reap or wait
//! for), in the job's process group (a supervisor's group kill ends it with
//! the job), with the stopping signals blocked (they are the command's).
//! It holds no lock: every descriptor of a held lock is reopened as a new
//! open file description before it does anything (its labels are written
//! through those), and any other descriptor that holds a flock or OFD lock
//! is closed; a budget's place in line alone is kept, to step aside once
//! the job settled. It knows the command by a pidfd opened before the fork
//! (never a recycled pid), learns its end from it, and stops the job
//! through it: the command and, where it leads its process group, the
//! whole group. Killed alone, it leaves the job running and the lock held;
//! the record names it, so status says the watch is gone.
//!
//! [`fork_detached`]: crate::sys::process::fork_detached

pub(crate) mod words;

use std::io;
use std::time::{Duration, Instant};

use crate::flock::budget::Ask;
use crate::flock::budget::watch::{BudgetWatch, Monitor};
use crate::flock::dir::ScratchDir;
use crate::flock::entry::Held;
use crate::flock::record::Record;
use crate::flock::registration::{Kind, Registration};
use crate::hold_event::HoldEvent;
use crate::hold_watch::HoldWatch;
use crate::resource::Resource;
use crate::sys::process::{Forked, PidFd};
use crate::usage::track::{HoldFacts, Tracker};

/// What a hold needs done while its command runs.
pub(crate) struct Duties {
    /// GPU usage sampling, its end line, and the idle policy.
    pub usage: bool,
    /// A memory budget: its ask, resource, MiB, `--mem-strict`, `--settle`.
    pub budget: Option<(Ask, Resource, u64, bool, Duration)>,
    /// Lock files another user could rename or remove, or that hold
    /// somebody's data (which the command may lock itself).
    pub paths: bool,
}

impl Duties {
    /// Whether anything needs a watcher.
    pub(crate) fn any(&self) -> bool {
        self.usage || self.budget.is_some() || self.paths
    }
}

/// The start line alone, for a hold nothing watches, in the usage file
/// opened before the take; said on stderr (unless `-q`) when it cannot be
/// written.
pub(crate) fn start_line(hold: &HoldFacts, opened: crate::usage::Opened) {
    if let Some(event) = crate::usage::track::start_record(hold, opened) {
        say(&[event], hold.quiet);
    }
}

/// Says what `events` have to say beside the command: a stop always (even
/// with `-q`: the job is stopped), anything else unless `quiet`.
fn say(events: &[HoldEvent], quiet: bool) {
    for event in events {
        if let Some(text) = words::line(event)
            && (event.is_stop() || !quiet)
        {
            crate::tty::say_while_command_runs(&text);
        }
    }
}

/// Starts the watcher of this process, which is about to become its
/// command; in the watcher itself, never returns. The watcher's first act
/// is to label the held locks with its pid (status then knows a watch runs).
pub(crate) fn start(
    duties: Duties,
    hold: &HoldFacts,
    dir: &ScratchDir,
    held: &[Held],
    record: &Record,
    quiet: bool,
) -> io::Result<()> {
    let command = PidFd::open(std::process::id())
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSYS))?;
    match crate::sys::process::fork_detached()? {
        Forked::Caller => Ok(()),
        Forked::Detached => {
            let keep_line = duties.budget.is_some();
            let_go_of_locks(held, keep_line);
            let mut record = record.clone();
            record.watcher = Some(std::process::id());
            record.watcher_start = crate::proc::process::start_time(std::process::id());
            for lock in held {
                let _ = lock.label(&record);
            }
            watch(&duties, hold, dir, held, record, quiet, &command);
            // Nothing of the hold is let go here: the locks are the command's.
            std::process::exit(0)
        }
    }
}

#[cfg(feature = "etcd")]
/// Starts a watcher that does `duty` (given the command's pidfd) and
/// exits: the etcd backend's, which keeps its lease. Like [`start`]'s, it
/// holds no lock, is in the job's process group, and blocks the job's
/// stopping signals (a Ctrl-C or a supervisor's SIGTERM is the command's to
/// handle; the lease must be kept until the job has ended). It leaves the
/// job's standard output (a `$(devlock ...)` ends with the command's
/// output, not the watcher); it may say why it stops the job on standard
/// error. In the watcher, never returns.
pub(crate) fn start_with(duty: impl FnOnce(PidFd)) -> io::Result<()> {
    let command = PidFd::open(std::process::id())
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ENOSYS))?;
    match crate::sys::process::fork_detached()? {
        Forked::Caller => Ok(()),
        Forked::Detached => {
            become_watcher();
            crate::sys::signal::block(&crate::sys::signal::SigSet::of(&[libc::SIGPIPE]));
            crate::sys::fs::stdout_to_null();
            // It holds no lock: a descriptor of a lock this devlock runs
            // under (an outer hold's, inherited) is the job's alone.
            close_lock_fds_but(&[]);
            duty(command);
            std::process::exit(0)
        }
    }
}

/// Makes sure this process holds no lock: each held lock's descriptors are
/// reopened as descriptions of their own (the labels are written through
/// them), and any other descriptor that shares a flock or OFD lock (one
/// devlock inherited from an outer holder) is closed. A budget's place in
/// line is kept when `keep_line`.
fn let_go_of_locks(held: &[Held], keep_line: bool) {
    use std::os::fd::AsRawFd;
    become_watcher();
    crate::sys::signal::ignore(libc::SIGPIPE);
    let mut kept = Vec::new();
    for hold in held {
        for fd in hold.inheritable_fds() {
            let _ = crate::sys::process::reopen_unlocked(fd.as_raw_fd());
        }
        if let Some(line) = hold.line_fd() {
            if keep_line && hold.is_budget() {
                kept.push(line.as_raw_fd());
            } else {
                let _ = crate::sys::process::reopen_unlocked(line.as_raw_fd());
            }
        }
    }
    close_lock_fds_but(&kept);
}

/// Blocks the stopping signals, which are the command's (a Ctrl-C, a
/// supervisor's SIGTERM); a job stop (Ctrl-Z) too: the watcher sees the
/// job stopped and pauses its policies instead. And names the process.
fn become_watcher() {
    let mut stopping = crate::supervise::STOP_SIGNALS.to_vec();
    stopping.extend([libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU]);
    crate::sys::signal::block(&crate::sys::signal::SigSet::of(&stopping));
    crate::sys::process::set_name(c"devlock-watch");
}

/// Closes each descriptor of this process that holds a flock or OFD lock,
/// but those in `kept`.
fn close_lock_fds_but(kept: &[i32]) {
    let me = std::process::id().to_string();
    for (fd, _) in crate::proc::fdinfo::fd_locks(&me).unwrap_or_default() {
        let fd = fd as i32;
        if !kept.contains(&fd) {
            crate::sys::process::close_raw(fd);
        }
    }
}

/// The watch itself, once a second until the command has ended; then the
/// end line.
fn watch(
    duties: &Duties,
    hold: &HoldFacts,
    dir: &ScratchDir,
    held: &[Held],
    record: Record,
    quiet: bool,
    command: &PidFd,
) {
    let usage = duties.usage.then(|| {
        let (tracker, no_record) = Tracker::start(hold);
        say(no_record.as_slice(), quiet);
        tracker
    });
    let label = std::cell::RefCell::new(record.clone());
    let budget = duties
        .budget
        .as_ref()
        .map(|(ask, resource, mem, strict, settle)| {
            let monitor = Monitor::start(ask, vec![hold.pid], *settle);
            BudgetWatch {
                strict: *strict,
                ..BudgetWatch::new(monitor, resource.clone(), hold.step.clone(), *mem, *settle)
            }
        });
    let mut hold_watch = HoldWatch { usage, budget };
    let mut paths = duties.paths.then(|| PathWatch {
        dir,
        held,
        record: &record,
        warned: false,
        lost: Vec::new(),
        self_wait_warned: false,
    });
    let mut next = Instant::now() + Duration::from_secs(1);
    loop {
        if command.wait_ended(next.saturating_duration_since(Instant::now())) {
            break;
        }
        next = Instant::now() + Duration::from_secs(1);
        if crate::proc::process::is_stopped(hold.pid) {
            // A stopped job allocates nothing and computes nothing: a
            // starting budget lets the next one in, and no policy counts
            // the pause against it.
            if let Some(budget) = hold_watch.budget.as_mut()
                && !budget.stepped_aside
            {
                budget.stepped_aside = true;
                act(&[HoldEvent::StepAside], Some(budget), held, &label);
            }
            continue;
        }
        if let Some(paths) = paths.as_mut() {
            paths.check();
        }
        let events = hold_watch.tick(false);
        // Marked first: status says what the line says by the time it is read.
        let stop = act(&events, hold_watch.budget.as_ref(), held, &label);
        say(&events, quiet);
        if stop {
            stop_job(command, hold.pid);
        }
    }
    drop(paths);
    let over_budget = hold_watch.budget.as_ref().is_some_and(|b| b.stopped);
    drop(hold_watch.budget.take());
    if let Some(usage) = hold_watch.usage.take() {
        let (how, code, signal) = how_it_ended(command, hold, over_budget);
        usage.finish(how, code, signal);
    }
}

/// How the command ended, for its end line: the stop the watcher made
/// itself (over budget; an idle stop is the tracker's to say), else its
/// wait status, read from its stat line while it is a zombie or, once its
/// parent reaped it, from its pidfd (Linux 6.15 and later), given a moment;
/// else an exit whose status only its parent knew.
fn how_it_ended(
    command: &PidFd,
    hold: &HoldFacts,
    over_budget: bool,
) -> (crate::usage::How, Option<i32>, Option<i32>) {
    use crate::usage::How;
    if over_budget {
        return (How::OverBudget, None, None);
    }
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut pause = Duration::from_millis(1);
    loop {
        let status = crate::proc::process::zombie_exit_status(hold.pid, hold.pid_start)
            .or_else(|| command.exit_status());
        if let Some(status) = status {
            return if libc::WIFSIGNALED(status) {
                (How::Signal, None, Some(libc::WTERMSIG(status)))
            } else {
                (How::Exit, Some(libc::WEXITSTATUS(status)), None)
            };
        }
        if Instant::now() >= deadline {
            return (How::Exit, None, None);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Stops the job as a SIGTERM to devlock once did: the whole process group
/// where the command leads the one the watcher is in (a group with a living
/// member, the watcher, cannot be a recycled id), else the command alone,
/// through its pidfd (a group shared with other jobs is not the job's).
fn stop_job(command: &PidFd, pid: u32) {
    let pid = pid as libc::pid_t;
    if crate::sys::process::own_group() == pid {
        crate::sys::process::kill(-pid, libc::SIGTERM);
    } else {
        command.signal(libc::SIGTERM);
    }
}

/// Does what the watch's events say to the held locks: the budget's steps
/// aside once its job started and is marked over budget (or back under),
/// and every held lock is marked idle (or no longer). Whether the job is to
/// be stopped (`--mem-strict`, the idle policy).
fn act(
    events: &[HoldEvent],
    budget: Option<&BudgetWatch>,
    held: &[Held],
    label: &std::cell::RefCell<Record>,
) -> bool {
    let budget_hold = budget.and_then(|b| {
        held.iter()
            .find(|h| h.request.name == b.resource && h.request.via.is_none())
    });
    let mut stop = false;
    for event in events {
        match event {
            HoldEvent::StepAside => {
                if let Some(hold) = budget_hold {
                    hold.step_aside();
                }
            }
            HoldEvent::OverMark(over) => {
                if let Some(hold) = budget_hold {
                    let mut record = label.borrow_mut();
                    record.over_mib = *over;
                    let _ = hold.label(&record);
                }
            }
            HoldEvent::IdleMark(idle) => {
                let mut record = label.borrow_mut();
                record.idle_since_ms = *idle;
                for hold in held {
                    let _ = hold.label(&record);
                }
            }
            _ => stop |= event.is_stop(),
        }
    }
    stop
}

/// Once a second while the command runs: whether each held lock file is
/// still the file its path names. If someone renamed or removed it, the
/// next devlock makes a fresh one and runs beside this job: that is said
/// once on stderr (even with `-q`: exclusion is broken), and registered for
/// status to show as long as the watcher lives.
struct PathWatch<'a> {
    dir: &'a ScratchDir,
    held: &'a [Held],
    record: &'a Record,
    warned: bool,
    lost: Vec<Registration>,
    /// Whether the command was found waiting for a lock this job holds.
    self_wait_warned: bool,
}

impl PathWatch<'_> {
    fn check(&mut self) {
        self.check_self_wait();
        if self.warned {
            return;
        }
        for held in self.held {
            for file in held.files() {
                let name = &held.request.name;
                if file.still_at_path(self.dir) {
                    continue;
                }
                self.warned = true;
                crate::tty::say_while_command_runs(&format!(
                    "devlock: warning: {} no longer names the file this job holds (someone renamed or \
                     removed it); another devlock may now take {name} beside this one\n",
                    crate::show::show_path(file.path())
                ));
                if let Ok(reg) = Registration::create(self.dir, name, self.record, Kind::Lost) {
                    self.lost.push(reg);
                }
                return;
            }
        }
    }

    /// A lock file that holds somebody's data (`--dir . Cargo` with a
    /// `Cargo.lock`) may be one the command locks itself (cargo does): it
    /// then waits for this job's own hold for ever. Said once, naming it;
    /// looked for only where such a file is held.
    fn check_self_wait(&mut self) {
        let command = self.record.pid;
        if self.self_wait_warned || self.held.iter().all(Held::labelled) {
            return;
        }
        let Ok(table) = crate::proc::locks::LockTable::read() else {
            return;
        };
        for held in self.held.iter().filter(|h| !h.labelled()) {
            let file = held.lock();
            let waiter = table.blocked(file.id()).map(|l| l.pid).find(|&pid| {
                pid == command || crate::proc::process::ancestors(pid).any(|(p, _)| p == command)
            });
            let Some(pid) = waiter else { continue };
            self.self_wait_warned = true;
            let name = crate::proc::process::comm_of(pid)
                .map(|comm| crate::show::sanitize(&comm))
                .unwrap_or_else(|| "a process".to_owned());
            crate::tty::say_while_command_runs(&format!(
                "devlock: warning: {name} (pid {pid}), part of this job, waits for a lock on {}, \
                 which this job holds as {}: it will wait for ever; name the lock after no file \
                 the command locks itself (e.g. devlock --dir . build -- ...)\n",
                crate::show::show_path(file.path()),
                held.request.name
            ));
            return;
        }
    }
}
