//! The library's memory budget held (`mem=`, the command line's `--mem`,
//! planned by [`crate::plan`] and taken by the one take): the watch of what
//! this process's tree uses, on a thread of the library for the life of the
//! hold (the command line's supervisor tick, without a command).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use crate::flock::budget::watch::{Monitor, Watch};
use crate::flock::entry::Held;
use crate::flock::record::Record;
use crate::hold_event::HoldEvent;
use crate::plan;
use crate::resource::Resource;
use crate::sys::signal::{self, SigSet};

/// How often the watch looks at what its monitor measured (the command
/// line's supervisor looks once a second too).
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

type Outbox = super::outbox::Outbox<BudgetEvent>;

impl super::outbox::Event for BudgetEvent {
    fn stop_line(&self) -> Option<&String> {
        match self {
            BudgetEvent::Stop(line) => Some(line),
            _ => None,
        }
    }
}

/// A budget held: its hold (shared with the watch, which steps aside and
/// relabels it), the device's total and the watch's thread.
pub(crate) struct Budget {
    held: Arc<Mutex<Option<Held>>>,
    pub resource: Resource,
    pub mem_mib: u64,
    pub total_mib: u64,
    outbox: Arc<Mutex<Outbox>>,
    /// Kept past its block's end (see [`crate::api::keep`]): the watch rests.
    kept: Arc<AtomicBool>,
    /// The process that took it.
    pid: u32,
    quit: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("resource", &self.resource)
            .field("mem_mib", &self.mem_mib)
            .finish_non_exhaustive()
    }
}

impl Budget {
    /// Starts the watch of `held`, the budget `planned` on its resource,
    /// labelled for `step`: it measures this process's tree.
    pub(crate) fn start(
        held: Held,
        planned: &plan::Budget,
        probe_timeout: Duration,
        step: &str,
    ) -> Budget {
        let resource = held.request.name.clone();
        let held = Arc::new(Mutex::new(Some(held)));
        let outbox = Arc::new(Mutex::new(Outbox::default()));
        let (quit, quit_rx) = mpsc::channel::<()>();
        let ask = planned.ask(&resource, probe_timeout, planned.seen.clone());
        let (settle, strict, step_name) = (planned.settle, planned.strict, step.to_owned());
        let watched = resource.clone();
        let record = Record::for_this_process(step);
        let kept = Arc::new(AtomicBool::new(false));
        let spawned = {
            let (held, outbox, kept) = (held.clone(), outbox.clone(), kept.clone());
            std::thread::Builder::new()
                .name("devlock-budget".into())
                .stack_size(256 * 1024)
                .spawn(move || {
                    // The caller's threads hear the signals (Ctrl-C), not this
                    // one nor the monitor it starts.
                    signal::block(&SigSet::all());
                    let monitor = Monitor::start(&ask, vec![std::process::id()], settle);
                    let watch = Watch {
                        strict,
                        ..Watch::new(monitor, watched, step_name, ask.mem_mib, settle)
                    };
                    watch_loop(watch, &held, &outbox, &record, &kept, &quit_rx);
                })
        };
        let thread = match spawned {
            Ok(thread) => Some(thread),
            Err(_) => {
                // Nothing to watch with: step aside at once rather than
                // keep the line behind waiting for a settle nobody measures.
                if let Some(h) = held.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    h.step_aside();
                }
                None
            }
        };
        Budget {
            held,
            total_mib: planned.total(&resource),
            resource,
            mem_mib: planned.mem_mib,
            outbox,
            kept,
            pid: std::process::id(),
            quit: Some(quit),
            thread,
        }
    }

    /// Runs `f` on the hold (none once let go, or in a forked child that
    /// could not have it).
    pub(crate) fn with<T>(&self, f: impl FnOnce(&Held) -> T) -> Option<T> {
        let guard = if std::process::id() == self.pid {
            self.held.lock().unwrap_or_else(|e| e.into_inner())
        } else {
            // A forked child: the watch's thread is not here, and may
            // have held this at the fork.
            self.held.try_lock().ok()?
        };
        guard.as_ref().map(f)
    }

    /// Kept past its block's end, or held by a block again: while kept the
    /// watch rests (no work is left to measure, relabel or stop; the keeper
    /// labels the hold), and the hold steps aside for the next budget.
    pub(crate) fn set_kept(&self, kept: bool) {
        self.kept.store(kept, Ordering::SeqCst);
        if kept {
            self.with(Held::step_aside);
        }
    }

    /// Where the watch's events go from now on (those said before first).
    pub(crate) fn on_event(&self, mut sink: BudgetSink) {
        let mut outbox = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        for event in std::mem::take(&mut outbox.pending) {
            sink(event);
        }
        outbox.sink = Some(sink);
    }

    /// The strict stop's line, once the watch said stop.
    pub(crate) fn stopped(&self) -> Option<String> {
        self.outbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stopped
            .clone()
    }

    /// What the work learns of its budget (`DEVLOCK_MEM_MIB`,
    /// `XLA_PYTHON_CLIENT_MEM_FRACTION` unless set already), as for a command.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        crate::flock::budget::job_env(self.mem_mib, self.total_mib)
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect()
    }

    /// Lets go: the watch stops first, then the budget's hold is released.
    pub(crate) fn release(&mut self) {
        self.quit.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(held);
    }

    /// In a forked child: closes the child's copies only.
    pub(crate) fn close_copy(&mut self) {
        // The handle names the parent's thread: not joinable here.
        if let Some(thread) = self.thread.take() {
            std::mem::forget(thread);
        }
        std::mem::forget(self.quit.take());
        if let Ok(mut guard) = self.held.try_lock()
            && let Some(held) = guard.take()
        {
            held.close_copy();
        }
    }
}

fn watch_loop(
    mut watch: Watch,
    held: &Mutex<Option<Held>>,
    outbox: &Mutex<Outbox>,
    record: &Record,
    kept: &AtomicBool,
    quit: &mpsc::Receiver<()>,
) {
    loop {
        if kept.load(Ordering::SeqCst) {
            match quit.recv_timeout(TICK) {
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                _ => return,
            }
        }
        for event in watch.check() {
            let guard = held.lock().unwrap_or_else(|e| e.into_inner());
            let Some(hold) = guard.as_ref() else { return };
            match &event {
                HoldEvent::StepAside => hold.step_aside(),
                HoldEvent::OverMark(over) => {
                    let mut record = record.clone();
                    record.over_mib = *over;
                    let _ = hold.label(&record);
                }
                _ => {}
            }
            drop(guard);
            let said = crate::watcher::words::plain(&event);
            let event = match (event.is_stop(), said) {
                (_, None) => continue,
                (true, Some(line)) => BudgetEvent::Stop(line),
                (false, Some(line)) => BudgetEvent::OverBudget(line),
            };
            super::outbox::deliver(outbox, event);
        }
        match quit.recv_timeout(TICK) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}
