//! The library's watch of a hold: one thread for the life of the hold (the
//! command line's watcher process, without a command) that drives the
//! core's tick ([`HoldWatch`]: the usage record, sampler and idle policy,
//! and a memory budget's watch), does what it finds to the budget's hold
//! (step aside, mark over budget), and passes what it has to say on to the
//! caller, in the command line's words, for the caller to say its own way.

use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use crate::flock::budget::watch::{BudgetWatch, Monitor};
use crate::flock::entry::Held;
use crate::flock::record::Record;
use crate::hold_event::HoldEvent;
use crate::hold_watch::HoldWatch;
use crate::plan;
use crate::resource::Resource;
use crate::sys::signal::{self, SigSet};
use crate::usage::How;
use crate::usage::track::{HoldFacts, Tracker};

/// How often the watch ticks (the command line's watcher ticks once a
/// second too).
const TICK: Duration = Duration::from_secs(1);

/// What the watch of a budget has to say, for the caller to say its own way
/// (the command line writes these lines on stderr): the text is the
/// command line's line, without `devlock: `.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetEvent {
    /// This process's tree uses more than its budget by more than a tenth
    /// (said once per hold; status marks the holder over budget).
    OverBudget(String),
    /// With `mem_strict`: it stayed over for `settle`; the caller stops the
    /// work (the command line stops its command as a signal to it would).
    Stop(String),
}

/// Receives a hold's [`BudgetEvent`]s, on the watch's thread.
pub type BudgetSink = Box<dyn FnMut(BudgetEvent) + Send>;

/// What the idle policy of a hold (`idle_timeout`) says, for the caller to
/// say its own way: the text is the command line's line, without `devlock: `.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdleEvent {
    /// The hold's GPUs computed nothing for its idle timeout (said once per
    /// idle spell).
    Idle(String),
    /// It stayed idle through the grace: the caller stops the work (the
    /// command line stops its command as a signal to it would).
    Stop(String),
}

/// Receives a hold's [`IdleEvent`]s, on the watch's thread.
pub type IdleSink = Box<dyn FnMut(IdleEvent) + Send>;

/// What the take knows of the hold's usage.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub started: Instant,
    pub idle_timeout: Option<Duration>,
    /// Where its records go ([`crate::usage::dir_for`]).
    pub usage_dir: Option<std::path::PathBuf>,
    pub probe_timeout: Duration,
    pub mem_mib: Option<u64>,
}

/// A memory budget held (`mem`): what the work learns of it.
#[derive(Debug, Clone)]
pub(crate) struct BudgetHeld {
    pub resource: Resource,
    pub mem_mib: u64,
    /// The device's memory, MiB.
    pub total_mib: u64,
}

impl BudgetHeld {
    /// What the work learns of its budget (`DEVLOCK_MEM_MIB`,
    /// `XLA_PYTHON_CLIENT_MEM_FRACTION` unless set already), as for a command.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        crate::flock::budget::job_env(self.mem_mib, self.total_mib)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }
}

/// What the watch has to say to one sink: kept until the caller sets the
/// sink, then passed on outside the lock (the sink may wait for the
/// interpreter while the caller holds it and asks the outbox).
struct Outbox<E> {
    sink: Option<Box<dyn FnMut(E) + Send>>,
    /// Said before a sink was set.
    pending: Vec<E>,
    /// The line that said stop, once one did.
    stopped: Option<String>,
}

impl<E> Default for Outbox<E> {
    fn default() -> Self {
        Outbox {
            sink: None,
            pending: Vec::new(),
            stopped: None,
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Passes `event` to the sink, outside the outbox's lock; `stop` is its
/// line when it is a stop.
fn deliver<E>(outbox: &Mutex<Outbox<E>>, event: E, stop: Option<String>) {
    let mut sink = {
        let mut o = lock(outbox);
        if stop.is_some() {
            o.stopped = stop;
        }
        match o.sink.take() {
            Some(sink) => sink,
            None => {
                o.pending.push(event);
                return;
            }
        }
    };
    sink(event);
    let mut o = lock(outbox);
    if o.sink.is_none() {
        o.sink = Some(sink);
    }
}

/// Where `sink` hears from now on (what was said before first).
fn set_sink<E>(outbox: &Mutex<Outbox<E>>, mut sink: Box<dyn FnMut(E) + Send>) {
    let mut o = lock(outbox);
    for event in std::mem::take(&mut o.pending) {
        sink(event);
    }
    o.sink = Some(sink);
}

/// What the thread and the hold share.
struct Shared {
    state: Mutex<State>,
    budget_out: Mutex<Outbox<BudgetEvent>>,
    idle_out: Mutex<Outbox<IdleEvent>>,
}

struct State {
    tick: HoldWatch,
    /// The budget's hold, which the watch steps aside and relabels.
    budget: Option<Held>,
    /// Its label, as the take wrote it: what a relabel starts from.
    record: Record,
    /// Kept past its block's end (see [`crate::Hold::release_when_device_free`]).
    kept: bool,
}

/// The watch of a library hold, with its thread.
pub(crate) struct Watching {
    shared: Arc<Shared>,
    /// The process that took the hold.
    pid: u32,
    quit: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Watching {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watching").finish_non_exhaustive()
    }
}

impl Watching {
    /// Writes the start line of `resources`, held for `step`, and starts
    /// the thread; with a budget, its hold `budget`, `planned`, is watched
    /// (its monitor measures this process's tree).
    pub(crate) fn start(
        resources: Vec<Resource>,
        step: &str,
        ask: Ask,
        budget: Option<(Held, &plan::Budget)>,
    ) -> Watching {
        let record = Record::for_this_process(step);
        // Quiet: a record that cannot be kept is not the caller's to hear.
        let (tracker, _no_record) = Tracker::start(&HoldFacts {
            resources,
            step: step.to_owned(),
            pid: record.pid,
            pid_start: record.pid_start,
            boot_id: record.boot_id.clone(),
            start_ms: record.since_ms,
            waited: ask.started.elapsed(),
            mem_mib: ask.mem_mib,
            idle_timeout: ask.idle_timeout,
            usage_dir: ask.usage_dir,
            from: "library",
            roots: vec![record.pid],
            probe_timeout: ask.probe_timeout,
            quiet: true,
        });
        let budget_watch = budget.as_ref().map(|(held, planned)| {
            let resource = held.request.name.clone();
            let budget_ask = planned.ask(&resource, ask.probe_timeout, planned.seen.clone());
            (budget_ask, resource, planned.settle, planned.strict)
        });
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                tick: HoldWatch {
                    usage: Some(tracker),
                    budget: None,
                },
                budget: budget.map(|(held, _)| held),
                record,
                kept: false,
            }),
            budget_out: Mutex::default(),
            idle_out: Mutex::default(),
        });
        let (quit, quit_rx) = mpsc::channel::<()>();
        let step = step.to_owned();
        let spawned = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("devlock-watch".into())
                .stack_size(256 * 1024)
                .spawn(move || {
                    // The caller's threads hear the signals (Ctrl-C), not
                    // this one nor the monitor it starts.
                    signal::block(&SigSet::all());
                    if let Some((ask, resource, settle, strict)) = budget_watch {
                        let monitor = Monitor::start(&ask, vec![std::process::id()], settle);
                        lock(&shared.state).tick.budget = Some(BudgetWatch {
                            strict,
                            ..BudgetWatch::new(monitor, resource, step, ask.mem_mib, settle)
                        });
                    }
                    run(&shared, &quit_rx);
                })
        };
        let thread = match spawned {
            Ok(thread) => Some(thread),
            Err(_) => {
                // Nothing to watch with: step aside at once rather than
                // keep the line behind waiting for a settle nobody measures.
                if let Some(held) = lock(&shared.state).budget.as_ref() {
                    held.step_aside();
                }
                None
            }
        };
        Watching {
            shared,
            pid: std::process::id(),
            quit: Some(quit),
            thread,
        }
    }

    /// Runs `f` on the budget's hold (none without one, once let go, or in
    /// a forked child where the watch's thread held it at the fork).
    pub(crate) fn with_budget<T>(&self, f: impl FnOnce(&Held) -> T) -> Option<T> {
        let state = if std::process::id() == self.pid {
            lock(&self.shared.state)
        } else {
            // A forked child: the watch's thread is not here, and may
            // have held this at the fork.
            self.shared.state.try_lock().ok()?
        };
        state.budget.as_ref().map(f)
    }

    /// Marks the hold kept past its block's end since `ended_ms` (or held
    /// by a block again, with `None`): the idle policy counts it idle from
    /// then, its stop lets the kept hold go rather than stop any work, the
    /// end line says when the block ended; the budget's watch rests (no
    /// work is left to measure, relabel or stop) and its hold steps aside
    /// for the next budget.
    pub(crate) fn set_kept(&self, ended_ms: Option<u64>) {
        let mut state = lock(&self.shared.state);
        state.kept = ended_ms.is_some();
        if let Some(tracker) = state.tick.usage.as_mut() {
            tracker.kept_since_ms = ended_ms;
        }
        if let Some(held) = state.budget.as_ref().filter(|_| ended_ms.is_some()) {
            held.step_aside();
        }
    }

    /// Where the budget's events go from now on (those said before first).
    pub(crate) fn on_budget_event(&self, sink: BudgetSink) {
        set_sink(&self.shared.budget_out, sink);
    }

    /// Where the idle policy's events go from now on (those said before first).
    pub(crate) fn on_idle_event(&self, sink: IdleSink) {
        set_sink(&self.shared.idle_out, sink);
    }

    /// The strict stop's line, once the budget's watch said stop.
    pub(crate) fn stopped_over_budget(&self) -> Option<String> {
        lock(&self.shared.budget_out).stopped.clone()
    }

    /// The idle stop's line, once the policy said stop.
    pub(crate) fn stopped_idle(&self) -> Option<String> {
        lock(&self.shared.idle_out).stopped.clone()
    }

    /// The watch stops; then the budget's hold is let go and the end line
    /// written (in the process that took the hold: a forked child's copy
    /// closes its copies only).
    pub(crate) fn end(&mut self, how: How) {
        if std::process::id() != self.pid {
            // A forked child: the handle names the parent's thread, not
            // joinable here.
            if let Some(thread) = self.thread.take() {
                std::mem::forget(thread);
            }
            std::mem::forget(self.quit.take());
            if let Ok(mut state) = self.shared.state.try_lock() {
                if let Some(held) = state.budget.take() {
                    held.close_copy();
                }
                std::mem::forget(state.tick.usage.take());
            }
            return;
        }
        self.quit.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let (held, tracker) = {
            let mut state = lock(&self.shared.state);
            drop(state.tick.budget.take());
            (state.budget.take(), state.tick.usage.take())
        };
        drop(held);
        if let Some(tracker) = tracker {
            tracker.finish(how, None, None);
        }
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.end(How::Released);
    }
}

/// The thread: once a [`TICK`] until told to quit.
fn run(shared: &Shared, quit: &mpsc::Receiver<()>) {
    loop {
        let (events, kept) = {
            let mut state = lock(&shared.state);
            let kept = state.kept;
            let events = state.tick.tick(kept);
            state.act(&events);
            (events, kept)
        };
        for event in events {
            say(shared, event, kept);
        }
        match quit.recv_timeout(TICK) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

impl State {
    /// Does what the tick found to the budget's hold: steps aside, marks
    /// it over budget (or back under).
    fn act(&self, events: &[HoldEvent]) {
        let Some(held) = self.budget.as_ref() else {
            return;
        };
        for event in events {
            match event {
                HoldEvent::StepAside => held.step_aside(),
                HoldEvent::OverMark(over) => {
                    let mut record = self.record.clone();
                    record.over_mib = *over;
                    let _ = held.label(&record);
                }
                _ => {}
            }
        }
    }
}

/// Passes what `event` says to its sink, in the command line's words.
fn say(shared: &Shared, event: HoldEvent, kept: bool) {
    let Some(line) = crate::watcher::words::plain(&event) else {
        return;
    };
    match event {
        HoldEvent::OverBudget { .. } => {
            deliver(&shared.budget_out, BudgetEvent::OverBudget(line), None);
        }
        HoldEvent::BudgetStop { .. } => {
            deliver(
                &shared.budget_out,
                BudgetEvent::Stop(line.clone()),
                Some(line),
            );
        }
        HoldEvent::Idle { .. } => deliver(&shared.idle_out, IdleEvent::Idle(line), None),
        // No work to stop: the keeper lets the hold go.
        HoldEvent::IdleStop { .. } if kept => lock(&shared.idle_out).stopped = Some(line),
        HoldEvent::IdleStop { .. } => {
            deliver(&shared.idle_out, IdleEvent::Stop(line.clone()), Some(line));
        }
        _ => {}
    }
}
