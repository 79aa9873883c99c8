//! The library's usage of a hold ([`crate::usage`]): its record, sampler
//! and idle policy, driven once a second by a thread of the library (the
//! command line's supervisor tick, without a command), and what the idle
//! policy says, for the caller to say its own way.

use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::hold_event::HoldEvent;
use crate::resource::Resource;
use crate::sys::signal::{self, SigSet};
use crate::usage::How;
use crate::usage::track::{Hold, Tracker};

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

/// Receives a hold's [`IdleEvent`]s, on the usage thread.
pub type IdleSink = Box<dyn FnMut(IdleEvent) + Send>;

type Outbox = super::outbox::Outbox<IdleEvent>;

impl super::outbox::Event for IdleEvent {
    fn stop_line(&self) -> Option<&String> {
        match self {
            IdleEvent::Stop(line) => Some(line),
            _ => None,
        }
    }
}

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

/// A hold's usage, with its thread.
pub(crate) struct Usage {
    tracker: Arc<Mutex<Option<Tracker>>>,
    outbox: Arc<Mutex<Outbox>>,
    pid: u32,
    quit: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Usage").finish_non_exhaustive()
    }
}

impl Usage {
    /// Writes the start line for `resources`, held for `step`, and starts
    /// the thread that samples, writes progress lines and keeps the policy.
    pub(crate) fn start(resources: Vec<Resource>, step: &str, ask: Ask) -> Usage {
        let record = crate::flock::record::Record::for_this_process(step);
        // Quiet: a record that cannot be kept is not the caller's to hear.
        let (tracker, _no_record) = Tracker::start(&Hold {
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
        let tracker = Arc::new(Mutex::new(Some(tracker)));
        let outbox = Arc::new(Mutex::new(Outbox::default()));
        let (quit, quit_rx) = mpsc::channel::<()>();
        let thread = {
            let (tracker, outbox) = (tracker.clone(), outbox.clone());
            std::thread::Builder::new()
                .name("devlock-usage-tick".into())
                .stack_size(256 * 1024)
                .spawn(move || {
                    signal::block(&SigSet::all());
                    tick_loop(&tracker, &outbox, &quit_rx);
                })
                .ok()
        };
        Usage {
            tracker,
            outbox,
            pid: std::process::id(),
            quit: Some(quit),
            thread,
        }
    }

    /// Where the policy's events go from now on (those said before first).
    pub(crate) fn on_event(&self, mut sink: IdleSink) {
        let mut outbox = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        for event in std::mem::take(&mut outbox.pending) {
            sink(event);
        }
        outbox.sink = Some(sink);
    }

    /// Marks the hold kept past its block's end since `ended_ms` (or held
    /// by a block again, with `None`): the idle policy counts it idle from
    /// then, its stop lets the kept hold go rather than stop any work, and
    /// the end line says when the block ended.
    pub(crate) fn kept_since(&self, ended_ms: Option<u64>) {
        if let Some(t) = self
            .tracker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            t.kept_since_ms = ended_ms;
        }
    }

    /// The idle stop's line, once the policy said stop.
    pub(crate) fn stopped(&self) -> Option<String> {
        self.outbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stopped
            .clone()
    }

    /// Writes the end line (in the process that took the hold; a forked
    /// child's copy does nothing).
    pub(crate) fn end(&mut self, how: How) {
        if std::process::id() != self.pid {
            // A forked child: the thread is the parent's.
            if let Some(thread) = self.thread.take() {
                std::mem::forget(thread);
            }
            std::mem::forget(self.quit.take());
            if let Ok(mut t) = self.tracker.try_lock() {
                std::mem::forget(t.take());
            }
            return;
        }
        self.quit.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let tracker = self
            .tracker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(tracker) = tracker {
            tracker.finish(how, None, None);
        }
    }
}

impl Drop for Usage {
    fn drop(&mut self) {
        self.end(How::Released);
    }
}

fn tick_loop(tracker: &Mutex<Option<Tracker>>, outbox: &Mutex<Outbox>, quit: &mpsc::Receiver<()>) {
    loop {
        let (events, kept) = {
            let mut guard = tracker.lock().unwrap_or_else(|e| e.into_inner());
            let Some(t) = guard.as_mut() else { return };
            (t.tick(), t.kept_since_ms.is_some())
        };
        for event in events {
            let Some(line) = crate::watcher::words::plain(&event) else {
                continue;
            };
            let event = match event {
                HoldEvent::IdleStop { .. } if kept => {
                    // No work to stop: the keeper lets the hold go.
                    outbox.lock().unwrap_or_else(|e| e.into_inner()).stopped = Some(line);
                    continue;
                }
                HoldEvent::IdleStop { .. } => IdleEvent::Stop(line),
                HoldEvent::Idle { .. } => IdleEvent::Idle(line),
                _ => continue,
            };
            super::outbox::deliver(outbox, event);
        }
        match quit.recv_timeout(Duration::from_secs(1)) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}
