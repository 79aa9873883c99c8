//! The library's take for bindings (the Python package): a wait on a
//! thread of its own that the caller watches, shows and can stop
//! ([`Acquiring`]), in the command line's words: the plan is the command
//! line's ([`crate::plan`]), and so are the take ([`crate::take`]), the
//! files, the line, the records and the busy lock's words.

use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::api::hold::Hold;
use crate::api::{Options, Wait};
use crate::error::{Busy, Error, Result};
use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Context, Taken};
use crate::flock::wait::Quiet;
use crate::interrupt::Stop;
use crate::messages::in_library_words;
use crate::plan::Plan;
use crate::plan::Spec;
use crate::resource::Resource;
use crate::sys::signal::{self, SigSet, Thread};
use crate::take::{HeldLock, Takes, holder_of};
use crate::wait_display::Board;

/// A take in progress: done at once when free, else waiting in line on a
/// thread of its own until [`Acquiring::wait`] reports the outcome or
/// [`Acquiring::cancel`] leaves the line.
#[derive(Debug)]
pub struct Acquiring {
    done: Option<anyhow::Result<Hold>>,
    waiting: Option<Waiting>,
    started: Instant,
    step: String,
    /// What the last wait was for (for the line that says it is over).
    label: String,
    /// Whether it had to wait.
    waited: bool,
    /// Who was in the way when the take found it busy: what a timeout
    /// says when it runs out before the waiting thread has shown its wait.
    found_busy: Option<Busy>,
}

#[derive(Debug)]
struct Waiting {
    rx: mpsc::Receiver<anyhow::Result<Hold>>,
    stop: Stop,
    thread: Option<std::thread::JoinHandle<()>>,
    board: Arc<Board>,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
    /// The process whose thread waits (a forked child has no such thread).
    pid: u32,
    /// Readable once the outcome is there (an event loop's wake-up).
    ready: Option<std::io::PipeReader>,
}

impl Acquiring {
    /// Checks `spec` as the command line checks its arguments, then takes it
    /// at once if it is free (on this thread, without joining the line).
    /// Otherwise, with [`Wait::NoWait`] it fails with [`Busy`]; else it
    /// joins the line on a thread of its own. Locks in `inside` (held by
    /// enclosing holds of this process) pass through.
    ///
    /// The plan is the command line's (a member `G:M` takes its group `G`
    /// shared; a GPU outside the caller's `CUDA_VISIBLE_DEVICES` is a usage
    /// error), and so are the files, line, records, usage record and typed
    /// [`crate::Error`]. A lock held through a descriptor inherited from a
    /// `devlock` parent passes through. To wait on the calling thread, as a
    /// Rust program's `devlock NAME --` does, [`Acquiring::hold`].
    ///
    /// # Signals
    ///
    /// The first wait installs a handler for `SIGRTMIN+1` that does
    /// nothing, without `SA_RESTART`, for the life of the process: the
    /// waiting thread blocks every other signal (so the caller's threads
    /// hear the signals, Ctrl-C, and decide), and a timeout (or a cancel)
    /// sends it that signal to interrupt its lock call (the way util-linux
    /// flock's `-w` uses SIGALRM, but aimed at one thread). A program that
    /// uses `SIGRTMIN+1` itself should not wait here. No other signal is
    /// touched.
    pub fn start(spec: &Spec, options: &Options, inside: &[HeldLock]) -> Result<Acquiring> {
        Acquiring::begin(spec, options, inside).map_err(Error::from)
    }

    fn begin(spec: &Spec, options: &Options, inside: &[HeldLock]) -> anyhow::Result<Acquiring> {
        let started = Instant::now();
        let mut plan = Plan::from_spec(spec).map_err(in_library_words)?;
        plan.look().map_err(in_library_words)?;
        let takes = Takes::new(&plan, &plan.resources, inside)?;
        let dir = ScratchDir::open_or_create(&options.dir)?;
        let label = takes.label();
        let usage = usage_ask(spec, &dir, &plan, &takes, started)?;
        let first = {
            let now = Context {
                dir: &dir,
                step: options.step.clone(),
                no_wait: true,
                stop: Stop::default(),
                observer: &Quiet,
            };
            take_all(&now, &takes)
        };
        let found_busy = match first {
            Ok(taken) => {
                return Ok(Acquiring {
                    done: Some(Ok(Hold::new(taken, &takes, &options.step, usage))),
                    waiting: None,
                    started,
                    step: options.step.clone(),
                    label,
                    waited: false,
                    found_busy: None,
                });
            }
            Err(e) if options.wait == Wait::NoWait || e.downcast_ref::<Busy>().is_none() => {
                return Err(e);
            }
            // Busy: what it took is let go, and it waits in line.
            Err(e) => e.downcast_ref::<Busy>().cloned(),
        };
        let timeout = match options.wait {
            Wait::Timeout(t) => Some(t),
            _ => None,
        };
        // Before the thread exists: a stop may be sent to it at once.
        crate::interrupt::install();
        let board = Arc::new(Board::default());
        let stop = Stop::default();
        let (tx, rx) = mpsc::channel();
        // A pipe that cannot be made leaves the event loops to poll.
        let (ready, mut ready_tx) = match std::io::pipe() {
            Ok((r, w)) => (Some(r), Some(w)),
            Err(_) => (None, None),
        };
        let thread = {
            let (board, stop, step) = (board.clone(), stop.clone(), options.step.clone());
            std::thread::Builder::new()
                .name("devlock-wait".into())
                .spawn(move || {
                    signal::block(&SigSet::all());
                    crate::interrupt::unblock_here();
                    let ctx = Context {
                        dir: &dir,
                        step,
                        no_wait: false,
                        stop: stop.clone(),
                        observer: &*board,
                    };
                    let result = {
                        let _finished = stop.finished_on_drop();
                        take_all(&ctx, &takes)
                    };
                    // A receiver that gave up drops the hold: released.
                    let _ = tx.send(result.map(|taken| Hold::new(taken, &takes, &ctx.step, usage)));
                    if let Some(w) = ready_tx.as_mut() {
                        use std::io::Write;
                        let _ = w.write_all(b"!");
                    }
                })?
        };
        Ok(Acquiring {
            done: None,
            waiting: Some(Waiting {
                rx,
                stop,
                thread: Some(thread),
                board,
                deadline: timeout.and_then(|t| started.checked_add(t)),
                timeout,
                pid: std::process::id(),
                ready,
            }),
            started,
            step: options.step.clone(),
            label,
            waited: true,
            found_busy,
        })
    }

    /// Whether the take had to wait in line (it was not free at once).
    pub fn is_waiting(&self) -> bool {
        self.waited
    }

    /// A descriptor that becomes readable once the wait has an outcome (for
    /// an event loop: then [`Acquiring::wait`] with no time returns it);
    /// `None` when there is no wait to watch. Owned by the take: valid
    /// until it is dropped or cancelled.
    pub fn ready_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.waiting
            .as_ref()
            .and_then(|w| w.ready.as_ref())
            .map(AsRawFd::as_raw_fd)
    }

    /// When a timeout given to the take runs out.
    pub fn deadline(&self) -> Option<Instant> {
        self.waiting.as_ref().and_then(|w| w.deadline)
    }

    /// Waits up to `limit` for the outcome: `None` while still waiting. When
    /// the timeout passes first, the take leaves the line and the outcome is
    /// a [`Busy`] with `timed_out`, worded as the command line's `-w`.
    pub fn wait(&mut self, limit: Duration) -> Option<Result<Hold>> {
        self.wait_inner(limit).map(|o| o.map_err(Error::from))
    }

    /// Waits for the outcome on the calling thread, as long as the take's
    /// [`Wait`] allows (a timeout ends the wait itself): the hold, kept
    /// until it is dropped.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let options = devlock::Options { dir: dir.path().into(), ..Default::default() };
    /// let hold = devlock::Acquiring::start(&"gpu".into(), &options, &[])?.hold()?;
    /// // ... use the GPU; every other devlock of "gpu" in this directory waits ...
    /// let busy = std::process::Command::new("flock")
    ///     .args(["-n", &dir.path().join("gpu.lock").to_string_lossy(), "true"])
    ///     .status()?;
    /// assert!(!busy.success());
    /// drop(hold);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn hold(mut self) -> Result<Hold> {
        loop {
            if let Some(outcome) = self.wait(Duration::MAX) {
                return outcome;
            }
        }
    }

    fn wait_inner(&mut self, limit: Duration) -> Option<anyhow::Result<Hold>> {
        if let Some(done) = self.done.take() {
            return Some(done);
        }
        let w = self.waiting.as_mut()?;
        let until = w.deadline.map_or(limit, |d| {
            limit.min(d.saturating_duration_since(Instant::now()))
        });
        match w.rx.recv_timeout(until) {
            Ok(result) => {
                self.note_label();
                let mut w = self.waiting.take().expect("waiting");
                if let Some(thread) = w.thread.take() {
                    let _ = thread.join();
                }
                Some(result)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if w.deadline.is_some_and(|d| Instant::now() >= d) {
                    Some(self.give_up())
                } else {
                    None
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.waiting = None;
                Some(Err(anyhow::anyhow!(
                    "the waiting thread ended without an answer"
                )))
            }
        }
    }

    fn note_label(&mut self) {
        if let Some(label) = self.waiting.as_ref().and_then(|w| w.board.label()) {
            self.label = label;
        }
    }

    /// The timeout: who is in the way is looked at while still in line,
    /// then the line is left. A timeout that runs out before the waiting
    /// thread has shown its wait (a short one, on a loaded machine) names
    /// who was in the way when the take found it busy, as the command
    /// line's `-w` always can (its deadline is watched by the display of
    /// the wait, which exists only once the wait does).
    fn give_up(&mut self) -> anyhow::Result<Hold> {
        let mut w = self.waiting.take().expect("waiting");
        let seen = w
            .board
            .in_the_way()
            .map(|(label, phrase, holder, resource)| {
                (label, phrase, holder.as_ref().map(holder_of), resource)
            });
        match w.leave() {
            // Taken at the very moment the time ran out: it counts.
            Some(Ok(hold)) => Ok(hold),
            _ => {
                let (label, phrase, holder, resource) = seen.unwrap_or_else(|| {
                    let found = self.found_busy.take();
                    let phrase = found
                        .as_ref()
                        .and_then(|b| b.message.find(": ").map(|at| b.message[at..].to_owned()))
                        .unwrap_or_default();
                    let holder = found.as_ref().and_then(|b| b.holder.clone());
                    let resource = found.map_or_else(|| self.label.clone(), |b| b.resource);
                    (self.label.clone(), phrase, holder, resource)
                });
                Err(anyhow::Error::new(crate::messages::busy::timed_out_busy(
                    w.timeout.unwrap_or_default(),
                    &label,
                    &phrase,
                    None,
                    holder,
                    resource,
                )))
            }
        }
    }

    /// Leaves the line: the wait stops at once (its lock calls are
    /// interrupted, racing threads of `--slots` and `--any` included) and
    /// its places in line and registrations go; a lock taken at that very
    /// moment is let go.
    pub fn cancel(mut self) {
        self.done = None;
        if let Some(mut w) = self.waiting.take() {
            let _ = w.leave();
        }
    }

    /// The command line's waiting line for the wait now (`devlock: gpu ·
    /// waiting 5s for train (pid 4242, alice), held 1m02s · 2nd in line`):
    /// with `width`, as drawn on a terminal line of its own (fitted to it);
    /// without, as a log line, which names the waiter's step. Empty between
    /// waits, and before the wait has lasted as long as the command line
    /// lets a wait last before it shows it (0.2 s).
    pub fn waiting_line(&mut self, width: Option<usize>) -> String {
        self.note_label();
        let waited = self.started.elapsed();
        // As on the command line, a wait shorter than this shows nothing.
        if waited < crate::wait_display::SHOW_AFTER {
            return String::new();
        }
        self.waiting
            .as_ref()
            .and_then(|w| w.board.line(waited, &self.step, width))
            .unwrap_or_default()
    }

    /// What the command line says in a log once a wait is over: `devlock:
    /// got gpu after 5s (train)`.
    pub fn done_line(&self) -> String {
        without_newline(&crate::messages::busy::got(
            &self.label,
            self.started.elapsed(),
            &self.step,
        ))
    }

    /// How long since the take started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for Acquiring {
    fn drop(&mut self) {
        if let Some(mut w) = self.waiting.take() {
            let _ = w.leave();
        }
    }
}

impl Waiting {
    /// Stops the waiting thread and returns what it came to.
    fn leave(&mut self) -> Option<anyhow::Result<Hold>> {
        let thread = self.thread.take()?;
        if std::process::id() != self.pid {
            // A forked child's copy: the thread, and its place in line, are
            // the parent's; the handle names no thread here.
            std::mem::forget(thread);
            return None;
        }
        // Returns once the thread is out of its take.
        self.stop.stop(Thread::of(&thread));
        let outcome = self.rx.recv().ok();
        let _ = thread.join();
        outcome
    }
}

/// What a hold's watch thread records and polices: the usage record, and
/// the idle timeout (the spec's, or the site's).
fn usage_ask(
    spec: &Spec,
    dir: &ScratchDir,
    plan: &Plan,
    takes: &Takes,
    started: Instant,
) -> anyhow::Result<crate::api::watch::Ask> {
    Ok(crate::api::watch::Ask {
        started,
        idle_timeout: crate::usage::idle::within_site(spec.idle_timeout, dir, &plan.resources)?,
        usage_dir: crate::usage::dir_for(Some(dir)),
        probe_timeout: takes.probe_timeout,
        mem_mib: None,
    })
}

/// Takes every lock of `takes` with the one take, labelling each with this
/// process's record as soon as it is held. A wait that was stopped says so.
fn take_all(ctx: &Context, takes: &Takes) -> anyhow::Result<Vec<(Resource, Taken)>> {
    let seen = takes.budget.as_ref().and_then(|b| b.seen.clone());
    takes
        .take(ctx, seen, true)
        .map_err(|e| interrupted_or(crate::messages::busy::worded(ctx.dir, e), ctx))
}

/// A wait that was stopped says so; anything else as it is.
fn interrupted_or(err: anyhow::Error, ctx: &Context) -> anyhow::Error {
    if ctx.stop.was_requested() && is_interrupted(&err) {
        return err.context("the wait was stopped (cancelled or timed out)");
    }
    err
}

fn is_interrupted(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
    }) || err.to_string() == "interrupted"
}

fn without_newline(line: &str) -> String {
    line.trim_end_matches('\n').to_owned()
}

#[cfg(test)]
mod tests;
