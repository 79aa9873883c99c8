//! A contended wait, shown, bounded by `-w` and ended by a stopping signal
//! on the one thread that sleeps in its lock calls: an alarm (or the
//! signal) interrupts the call when something is due. A wait that sleeps in
//! no such call (`--any`, `--slots`, budgets) has a helper thread for it.
//!
//! What it shows depends on where stderr goes. On a terminal whose line is
//! devlock's (its process group is the foreground group, and holds nothing
//! else, so no other devlock of the same job draws there), one line redrawn
//! in place, fitted to the terminal's width (asked again on every redraw
//! and on SIGWINCH) and cleared before the command starts. On a terminal
//! that is not devlock's to draw on (a background job, `make -j`), one line
//! when the wait starts and one when it ends. Elsewhere (a log), a line when
//! the wait starts, every `--report-every`, and when it ends. Every line
//! that stays names the waiter's own step.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::error::Busy;
use crate::flock::registration::Registration;
use crate::flock::trust::Notes;
use crate::flock::wait::{Observer, Wait};
use crate::interrupt::Stop;
use crate::show::sanitize;
use crate::supervise::{self, Received};
use crate::text::fit;
use crate::tty;

mod board;
mod helper;
mod line;

pub(crate) use board::Board;
use board::Shown;
use helper::wait_beside;
use line::Showing;

/// How long a wait lasts before it is shown: a shorter one (the usual
/// hand-off under contention, a few milliseconds) costs nothing beyond the
/// kernel's sleep, and prints nothing. A deadline that comes first shows
/// the wait at the deadline, just before the timeout says so.
pub(crate) const SHOW_AFTER: Duration = Duration::from_millis(200);

/// Width assumed for a terminal that does not say.
const DEFAULT_COLUMNS: usize = 80;

/// How to wait and what to show meanwhile.
#[derive(Debug, Clone)]
pub(crate) struct WaitPlan {
    pub deadline: Option<Instant>,
    pub timeout: Option<Duration>,
    pub quiet: bool,
    /// Whether stderr is a terminal (where the line may be devlock's).
    pub on_terminal: bool,
    pub report_every: Duration,
    /// The waiter's own step, which every line that stays names.
    pub step: String,
    /// What the run registered in the scratch directory, removed before a
    /// signal ends the run from the display's thread.
    pub made: crate::flock::made::Made,
}

/// How a wait is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Display {
    /// Redrawn in place on a terminal line that is devlock's.
    Live,
    /// On a terminal shared with others: a line at the start and the end.
    Static,
    /// Not a terminal: a line at the start, every interval, and the end.
    Log,
}

impl Display {
    /// Asked only once a wait begins: an uncontended take never pays for
    /// the look at the process group.
    fn for_plan(plan: &WaitPlan) -> Display {
        if !plan.on_terminal {
            Display::Log
        } else if tty::in_foreground() && tty::alone_in_group() {
            Display::Live
        } else {
            Display::Static
        }
    }
}

/// After a job stop (Ctrl-Z) gave up the line and the job was continued:
/// `devlock: continued; back in line for gpu:0, at the end`, by the rules
/// of the waiting lines (nothing with `-q`; fitted to a terminal; naming the
/// waiter's step where the line stays, on a shared terminal or in a log).
pub(crate) fn say_back_in_line(plan: &WaitPlan, resources: &str) {
    if plan.quiet {
        return;
    }
    let display = Display::for_plan(plan);
    let step = (display != Display::Live).then(|| format!(" ({})", sanitize(&plan.step)));
    let resources = format!(" for {resources}");
    let parts = [
        ("devlock: continued; back in line", false),
        (resources.as_str(), true),
        (", at the end", true),
        (step.as_deref().unwrap_or_default(), false),
    ];
    let line = match display {
        Display::Log => parts.iter().map(|(p, _)| *p).collect(),
        Display::Live | Display::Static => {
            let width = tty::columns().unwrap_or(DEFAULT_COLUMNS).saturating_sub(1);
            fit(&parts, width.max(1))
        }
    };
    say(&format!("{line}\n"));
}

/// How often an alarm that is due repeats until the waiting thread has
/// done what was due: its first signal may land just before the thread
/// enters its lock call.
const RETRY: Duration = Duration::from_millis(20);

/// Runs `block` (which sleeps in the kernel until the locks are ours) and
/// shows the wait meanwhile, stops it at the deadline (it then ends in
/// [`Busy`], timed out) and ends the run on a stopping signal: nothing has
/// started yet, so nothing is left running, and the kernel drops every
/// lock and place in line. A `lazy` wait sleeps in lock calls an alarm
/// interrupts, and does all of it on this thread; any other wait has a
/// helper thread do it. Settle the returned [`Waited`] to learn of a
/// stopping signal that arrived at the very moment the locks were taken.
fn wait_for<T>(
    parts: Parts,
    plan: &WaitPlan,
    stop: &Stop,
    lazy: bool,
    block: impl FnOnce() -> Result<T>,
) -> Result<(T, Waited)> {
    // An alarm (or the helper) interrupts this thread's lock calls.
    crate::interrupt::install();
    let started = Instant::now();
    if !lazy {
        return wait_beside(parts, plan, stop, started, block);
    }
    // A quiet wait with no deadline has nothing to show and no moment to
    // stop at: no alarm either.
    if plan.quiet && plan.deadline.is_none() {
        return wait_here(parts, plan, stop, started, None, block);
    }
    let due = line::first_due(plan, started);
    match crate::interrupt::Alarm::at(due, RETRY) {
        Some(alarm) => wait_here(parts, plan, stop, started, Some((alarm, due)), block),
        // No timer to be had: a helper thread keeps the time.
        None => wait_beside(parts, plan, stop, started, block),
    }
}

/// What a lazy wait's own thread does when its lock call is interrupted:
/// nothing before `due`; then the line is shown (and the stopping signals
/// caught: until then they stay pending, as they did for the helper that
/// started then), and the alarm set again for what falls due next.
struct Here {
    parts: Option<Parts>,
    plan: WaitPlan,
    started: Instant,
    alarm: Option<crate::interrupt::Alarm>,
    due: Instant,
    showing: Option<Showing>,
    stops: Option<crate::interrupt::CatchStops>,
    resize: Option<crate::interrupt::CatchResize>,
    timed_out: Option<Busy>,
}

impl Here {
    fn on_interrupt(&mut self, stop: &Stop) {
        let now = Instant::now();
        let resized = self.resize.is_some() && crate::interrupt::take_resize();
        if now < self.due && !resized {
            return;
        }
        let Some(alarm) = &self.alarm else {
            return;
        };
        // Its repeats would interrupt the look that follows, not a lock call.
        alarm.disarm();
        if self.showing.is_none() {
            let Some(parts) = self.parts.take() else {
                return;
            };
            let showing = Showing::new(parts, self.plan.clone(), self.started);
            self.stops = Some(crate::interrupt::CatchStops::new(supervise::stop_signals()));
            if showing.display == Display::Live && !self.plan.quiet {
                self.resize = Some(crate::interrupt::CatchResize::new());
            }
            self.showing = Some(showing);
        }
        let Some(showing) = self.showing.as_mut() else {
            return;
        };
        if resized {
            showing.resized();
        }
        self.due = showing.report(now);
        if showing.past_deadline(now) {
            self.timed_out = Some(showing.time_out());
            stop.request();
            return;
        }
        alarm.rearm(self.due, RETRY);
    }
}

fn lock_here(here: &Mutex<Here>) -> std::sync::MutexGuard<'_, Here> {
    here.lock().unwrap_or_else(|e| e.into_inner())
}

/// A lazy wait, on this thread alone. `alarm`: when the first thing is due
/// (none: a quiet wait with no deadline, which catches the stopping signals
/// from the start).
fn wait_here<T>(
    parts: Parts,
    plan: &WaitPlan,
    stop: &Stop,
    started: Instant,
    alarm: Option<(crate::interrupt::Alarm, Instant)>,
    block: impl FnOnce() -> Result<T>,
) -> Result<(T, Waited)> {
    let quiet = alarm.is_none();
    let (alarm, due) = alarm.map_or((None, started), |(a, due)| (Some(a), due));
    let shared = Arc::new(Mutex::new(Here {
        parts: Some(parts),
        plan: plan.clone(),
        started,
        alarm,
        due,
        showing: None,
        stops: quiet.then(|| crate::interrupt::CatchStops::new(supervise::stop_signals())),
        resize: None,
        timed_out: None,
    }));
    if !quiet {
        let (here, hook_stop) = (shared.clone(), stop.clone());
        stop.on_interrupt(Some(Box::new(move || {
            lock_here(&here).on_interrupt(&hook_stop)
        })));
    }
    let held = {
        let _stops = crate::interrupt::CatchJobStops::new();
        block()
    };
    stop.on_interrupt(None);
    let mut here = lock_here(&shared);
    if let Some(alarm) = here.alarm.take() {
        alarm.disarm();
    }
    // Blocked again: one that comes now waits for the check before the start.
    drop((here.stops.take(), here.resize.take()));
    let timed_out = here.timed_out.take();
    if let Some(sig) = crate::interrupt::take_stop() {
        if held.is_ok() || timed_out.is_some() {
            // The locks were taken (or the wait timed out) at this very
            // moment: pending again, for the check before the command starts.
            crate::sys::signal::raise(sig);
        } else {
            if let Some(showing) = here.showing.as_mut() {
                showing.leave();
            }
            here.parts = None;
            leave_line_for(sig, plan);
        }
    }
    if let Some(busy) = timed_out {
        // A lock taken at that very moment goes with the take's error, unused.
        return Err(busy.into());
    }
    let got = match (&held, here.showing.as_mut()) {
        (Ok(_), Some(showing)) => showing.got(),
        (Err(_), Some(showing)) => {
            showing.leave();
            None
        }
        (_, None) => None,
    };
    drop(here);
    // The registrations go now.
    drop(shared);
    Ok((
        held?,
        Waited {
            helper: None,
            on_terminal: false,
            got: got.map(|line| Arc::new(GotLine(Mutex::new(Got::Line(line))))),
        },
    ))
}

/// A stopping signal `sig` ended the wait before the locks came (the
/// caller has dropped its registrations): what the run made goes, and the
/// exit status says the signal. One end for the waiting thread and the
/// helper.
fn leave_line_for(sig: libc::c_int, plan: &WaitPlan) -> ! {
    plan.made.remove_all_before_exit();
    std::process::exit(crate::exit::ExitCode::Signal(sig).code());
}

/// What a wait shows, and the registrations it keeps until it ends.
type Parts = (Shown, Vec<Option<Registration>>);

/// The last line of a wait that is over (`got gpu:0 after 4s (train)`):
/// said only as the command is about to start, by whichever comes second,
/// the helper with its line or the run's go-ahead; never for a run that a
/// signal (a Ctrl-C under make -j) stops before its command starts.
#[derive(Debug, Default)]
pub(crate) struct GotLine(Mutex<Got>);

#[derive(Debug, Default)]
enum Got {
    #[default]
    Waiting,
    Line(String),
    Go,
    Said,
}

impl GotLine {
    fn lock(&self) -> std::sync::MutexGuard<'_, Got> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The helper's line: said now if the command is starting, else kept.
    fn offer(&self, line: String) {
        let mut got = self.lock();
        match *got {
            Got::Go => {
                say(&line);
                *got = Got::Said;
            }
            Got::Waiting => *got = Got::Line(line),
            Got::Line(_) | Got::Said => {}
        }
    }

    /// The command is about to start: the line, if the helper has it.
    fn go(&self) {
        let mut got = self.lock();
        match std::mem::replace(&mut *got, Got::Said) {
            Got::Line(line) => say(&line),
            Got::Waiting => *got = Got::Go,
            Got::Go | Got::Said => {}
        }
    }
}

/// The command line's observer of its takes: each wait shown by
/// [`wait_for`] by the rules of `plan`, the trust warnings said before a
/// long wait, and the waits that are over kept until they are settled.
#[derive(Debug)]
pub(crate) struct WaitDisplay<'a> {
    plan: &'a WaitPlan,
    notes: &'a Notes,
    /// The last wait, until its take is done.
    current: Mutex<Option<Waited>>,
    pending: Mutex<Pending>,
    /// Done as a wait begins (the run's usage file opened ahead).
    before_wait: BeforeWait<'a>,
}

/// What a run does as its take begins to wait, so that it is not done
/// between the grant and the command's start: only a take that waits pays
/// for it there.
#[derive(Clone, Copy)]
pub(crate) struct BeforeWait<'a>(pub &'a (dyn Fn() + Sync));

impl std::fmt::Debug for BeforeWait<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BeforeWait")
    }
}

impl<'a> WaitDisplay<'a> {
    pub(crate) fn new(
        plan: &'a WaitPlan,
        notes: &'a Notes,
        before_wait: BeforeWait<'a>,
    ) -> WaitDisplay<'a> {
        WaitDisplay {
            plan,
            notes,
            current: Mutex::default(),
            pending: Mutex::default(),
            before_wait,
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the last wait's display must be cleared before the command starts.
    pub(crate) fn must_settle_before_spawn(&self) -> bool {
        self.pending().must_settle_before_spawn()
    }

    /// Settles every wait; a stopping signal that arrived as the locks were
    /// taken, for the command to hear.
    pub(crate) fn settle(&self) -> Option<Received> {
        self.pending().settle()
    }

    /// The command is about to start: each wait's `got` line is said (now,
    /// or by its helper as it finishes).
    pub(crate) fn command_starts(&self) {
        let pending = self.pending();
        for got in pending.got.iter().chain(pending.last.got.as_ref()) {
            got.go();
        }
    }
}

impl Observer for WaitDisplay<'_> {
    fn shows(&self) -> bool {
        !self.plan.quiet
    }

    fn wait(&self, wait: Wait, stop: &Stop, block: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        (self.before_wait.0)();
        // What another user could break is said before a long wait, not
        // only once the wait is over.
        crate::status::notes::say_notes(self.notes, self.plan.quiet);
        // Waited for on this thread, in lock calls a signal interrupts: the
        // display may start late.
        let parts = (
            Shown {
                label: wait.label,
                watches: wait.watches,
            },
            wait.registrations,
        );
        let ((), waited) = wait_for(parts, self.plan, stop, wait.lazy, block)?;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(waited);
        Ok(())
    }

    fn took(&self) -> Result<()> {
        let waited = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default();
        self.pending().add(waited)
    }
}

/// Waits that are over, and what their helpers caught as they ended.
#[derive(Debug, Default)]
struct Pending {
    last: Waited,
    /// The last lines of the waits settled so far.
    got: Vec<Arc<GotLine>>,
}

impl Pending {
    /// Notes a finished wait; the one before it is settled now (its display
    /// must be gone before the next wait shows its own).
    /// A stopping signal caught then ends the run: nothing has started.
    fn add(&mut self, waited: Waited) -> Result<()> {
        let before = std::mem::replace(&mut self.last, waited);
        let (signal, got) = before.settle();
        self.got.extend(got);
        match signal {
            Some(sig) => Err(supervise::stopped_before_start(sig)),
            None => Ok(()),
        }
    }

    fn must_settle_before_spawn(&self) -> bool {
        self.last.must_settle_before_spawn()
    }

    fn settle(&mut self) -> Option<Received> {
        let (signal, got) = std::mem::take(&mut self.last).settle();
        self.got.extend(got);
        signal
    }
}

/// The helper thread's end: a stopping signal caught as the locks were
/// taken, or the timeout.
type HelperHandle = std::thread::JoinHandle<std::result::Result<Option<Received>, Busy>>;

/// A wait that is over but whose helper thread may still be finishing.
#[derive(Debug, Default)]
pub(crate) struct Waited {
    helper: Option<HelperHandle>,
    on_terminal: bool,
    got: Option<Arc<GotLine>>,
}

impl Waited {
    /// Whether the helper still has to finish its lines on a terminal
    /// (clear the live line, or say "got"), which must happen before the
    /// command writes to it.
    pub(crate) fn must_settle_before_spawn(&self) -> bool {
        self.helper.is_some() && self.on_terminal
    }

    /// Joins the helper; returns a stopping signal it caught at the moment
    /// the locks were taken, for the command to hear, and the wait's last
    /// line, for when the command starts.
    pub(crate) fn settle(self) -> (Option<Received>, Option<Arc<GotLine>>) {
        let caught = self
            .helper
            .and_then(|h| h.join().ok().and_then(|r| r.ok().flatten()));
        (caught, self.got)
    }
}

fn say(text: &str) {
    let _ = std::io::stderr().write_all(text.as_bytes());
}
