//! The library's take for bindings (the Python package): the command line's
//! options as a [`Spec`], a wait on a thread of its own that the caller
//! watches, shows and can stop ([`Acquiring`]), a [`Busy`] that names the
//! holder in `devlock -n`'s words, holds that know which process took them
//! ([`Hold`]), and the status document.
//!
//! Nothing here takes a lock itself: every lock is taken by the command
//! line's own take ([`crate::flock::take::take`], `--any` by
//! [`crate::flock::any::take_any`]), so the files, the line, the records,
//! the rules and the words are the command line's.

use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::api::budget::{self, Budget, BudgetSink};
use crate::api::{Options, Wait};
use crate::exit::ExitCode;
use crate::flock::dir::ScratchDir;
use crate::flock::file::LockFile;
use crate::flock::nesting::{self, Inherited};
use crate::flock::take::{self as acquire, Context, Pending, Taken};
use crate::interrupt::Stop;
use crate::request::Request;
use crate::resource::Resource;
use crate::status::model as status;
use crate::sys::signal::{self, SigSet, Thread};
use crate::wait_display::Board;

/// What to take: the command line's `RESOURCE...` with `--shared`,
/// `--slots N`, `--any`/`--count K` and `--mem`, by the same rules (a
/// member `G:M` also takes its group `G` shared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// The resources, as the user wrote them (checked as the command line
    /// checks them).
    pub resources: Vec<String>,
    /// `--shared`.
    pub shared: bool,
    /// `--slots N`.
    pub slots: Option<u16>,
    /// `--any`.
    pub any: bool,
    /// `--count K` (with `any`).
    pub count: u8,
    /// `--mem` (the memory budget on `gpu:N`), as the command line's text
    /// (`20GiB`, `512MiB`, a bare number of MiB).
    pub mem: Option<String>,
    /// `--mem-headroom`, as the command line's text.
    pub mem_headroom: Option<String>,
    /// `--settle`.
    pub settle: Option<Duration>,
    /// `--mem-strict`: once over budget for `settle`, the hold's
    /// [`crate::BudgetEvent::Stop`] tells the caller to stop its work.
    pub mem_strict: bool,
}

impl Spec {
    /// An exclusive take of every resource named.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(resources: I) -> Spec {
        Spec {
            resources: resources.into_iter().map(Into::into).collect(),
            shared: false,
            slots: None,
            any: false,
            count: 1,
            mem: None,
            mem_headroom: None,
            settle: None,
            mem_strict: false,
        }
    }
}

/// One lock a hold keeps or passed through: a take made inside that hold
/// by this process passes through it instead of waiting for itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock {
    /// The lock's resource (a group taken on a member's behalf is one too).
    pub resource: String,
    /// Held exclusively (a `--slots` or `--shared` hold is not).
    pub exclusive: bool,
}

/// Who holds a lock, as `devlock -n` names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The holder's step (from a record the kernel backs).
    pub step: Option<String>,
    /// The process the kernel names.
    pub pid: Option<u32>,
    /// Its user, from the kernel.
    pub user: Option<String>,
}

/// A take that found the lock busy without waiting (`-n`), or whose wait
/// ran out of time (`-w`); the message is the command line's, word for word.
#[derive(Debug, Clone)]
pub struct Busy {
    /// The lock in the way (for `--any`: every candidate, space-separated).
    pub resource: String,
    /// Who holds it, when it can be told.
    pub holder: Option<Holder>,
    /// The wait ran out of time, rather than not waiting.
    pub timed_out: bool,
    /// The one line the command line says, without `devlock: `.
    pub message: String,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Busy {}

/// An option of the command line that this build does not have yet.
#[derive(Debug, Clone)]
pub struct NotSupported(pub String);

impl std::fmt::Display for NotSupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotSupported {}

/// The exit code the command line would end with for `err`.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    if err.downcast_ref::<Busy>().is_some() {
        return ExitCode::Busy.code();
    }
    if err.downcast_ref::<NotSupported>().is_some() {
        return ExitCode::Usage.code();
    }
    crate::exit::exit_code_of(err).code()
}

/// The same document as `devlock status --json [RESOURCE...]` (pretty JSON
/// with a final newline); with `probe_timeout`, the GPUs too.
pub fn status_document(
    dir: &Path,
    resources: &[String],
    probe_timeout: Option<Duration>,
) -> Result<String> {
    let names: Vec<std::ffi::OsString> = resources.iter().map(Into::into).collect();
    let wanted = Resource::parse_all(&names)?;
    let report = status::gather(dir, &wanted, probe_timeout)?;
    let mut json = serde_json::to_string_pretty(&report)?;
    json.push('\n');
    Ok(json)
}

/// What a hold took, and which process took it.
#[derive(Debug)]
pub struct Hold {
    taken: Vec<(Resource, Taken)>,
    /// The resources it is for: what was asked for, or an `--any`'s picks.
    members: Vec<Resource>,
    /// Locks an enclosing hold of this process keeps, passed through.
    passed: Vec<HeldLock>,
    /// A memory budget held (`mem`), watched while held; let go after
    /// `taken` (the group first, as the command line lets go).
    budget: Option<Budget>,
    pid: u32,
}

impl Hold {
    fn new(mut taken: Vec<(Resource, Taken)>, planned: &Planned, step: &str) -> Hold {
        let mut members = planned.members.clone();
        if planned.count > 0 {
            // An --any's picks: the members taken, not their groups.
            members.extend(
                taken
                    .iter()
                    .filter(|(_, t)| !matches!(t, Taken::Held(h) if h.request.via.is_some()))
                    .filter(|(r, _)| planned.candidates.iter().any(|c| c.name == *r))
                    .map(|(r, _)| r.clone()),
            );
        }
        members.sort();
        members.dedup();
        let budget = planned.budget.as_ref().and_then(|b| {
            let at = taken.iter().position(|(r, t)| {
                r.gpu_index().is_some() && matches!(t, Taken::Held(h) if h.request.via.is_none())
            })?;
            let Taken::Held(held) = taken.remove(at).1 else {
                unreachable!("matched above")
            };
            Some(Budget::start(held, b, step))
        });
        Hold {
            taken,
            members,
            passed: planned.passed.clone(),
            budget,
            pid: std::process::id(),
        }
    }

    /// The memory budget this hold keeps (`mem`), MiB; `None` without one
    /// (or when it passed through an enclosing hold).
    pub fn budget_mib(&self) -> Option<u64> {
        self.budget.as_ref().map(|b| b.mem_mib)
    }

    /// What the work inside a budget learns, as a command under `devlock
    /// --mem` does: `DEVLOCK_MEM_MIB`, and `XLA_PYTHON_CLIENT_MEM_FRACTION`
    /// (the budget's share of the device) unless the process has it set
    /// already. Empty without a budget.
    pub fn budget_env(&self) -> Vec<(String, String)> {
        self.budget.as_ref().map(Budget::env).unwrap_or_default()
    }

    /// Where the budget's watch says what it has to say (over budget; with
    /// `mem_strict`, stop), on the watch's thread; what it said before this
    /// call is passed on at once. Nothing without a budget.
    pub fn on_budget_event(&self, sink: BudgetSink) {
        if let Some(b) = &self.budget {
            b.on_event(sink);
        }
    }

    /// With `mem_strict`: the line that said stop, once the watch said it.
    pub fn stopped_over_budget(&self) -> Option<String> {
        self.budget.as_ref().and_then(Budget::stopped)
    }

    /// The resources this hold is for: what was asked for, or an `--any`'s picks.
    pub fn resources(&self) -> Vec<String> {
        self.members.iter().map(Resource::to_string).collect()
    }

    /// Every lock it keeps or passed through, for takes inside it.
    pub fn locks(&self) -> Vec<HeldLock> {
        let mut locks = self.passed.clone();
        if let Some(b) = &self.budget {
            locks.push(HeldLock {
                resource: b.resource.to_string(),
                exclusive: false,
            });
        }
        for (resource, taken) in &self.taken {
            let exclusive = match taken {
                Taken::Held(held) => held.request.exclusive && held.request.slots == 0,
                Taken::Inherited(lock) => nesting::inherited(lock, true) == Inherited::Yes,
            };
            locks.push(HeldLock {
                resource: resource.to_string(),
                exclusive,
            });
        }
        locks
    }

    /// The descriptors a child process must inherit to run inside this hold
    /// (`devlock` passes through only on an inherited descriptor that holds
    /// the lock): the lock files, the slot, a shared holder's label, and
    /// for a lock this process itself runs inside, the descriptors it
    /// inherited.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut fds = Vec::new();
        for (_, taken) in &self.taken {
            match taken {
                Taken::Held(held) => {
                    fds.extend(held.inheritable_fds().iter().map(AsRawFd::as_raw_fd));
                }
                Taken::Inherited(lock) => fds.extend(nesting::inherited_fds(lock)),
            }
        }
        if let Some(b) = &self.budget {
            fds.extend(
                b.with(|held| {
                    held.inheritable_fds()
                        .iter()
                        .map(AsRawFd::as_raw_fd)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
            );
        }
        fds
    }

    /// The semaphore slot (`--slots`), from 1.
    pub fn slot(&self) -> Option<u64> {
        self.taken.iter().find_map(|(_, t)| match t {
            Taken::Held(held) => held.slot().map(|s| s.number),
            Taken::Inherited(_) => None,
        })
    }

    /// `CUDA_VISIBLE_DEVICES` for this hold, as the command line sets it for
    /// its command (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`): the indices of its
    /// `gpu:N` resources; `None` when it holds none.
    pub fn cuda_visible_devices(&self) -> Option<String> {
        crate::gpu::cuda::child_env(&self.members)
            .into_iter()
            .find(|(name, _)| *name == "CUDA_VISIBLE_DEVICES")
            .map(|(_, value)| value)
    }

    /// Whether this hold took nothing of its own (everything passed through).
    pub fn is_nested(&self) -> bool {
        self.budget.is_none()
            && self
                .taken
                .iter()
                .all(|(_, t)| matches!(t, Taken::Inherited(_)))
    }

    /// The process that took it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether this process holds it now, asked of the kernel: each lock's
    /// descriptor is open here, on the same file, with the lock granted (a
    /// forked child that closed its descriptors does not).
    pub fn holds_here(&self) -> bool {
        let budget_here = self.budget.as_ref().is_none_or(|b| {
            b.with(|held| nesting::fd_holds(held.lock().file().as_raw_fd(), held.lock()))
                .unwrap_or(false)
        });
        budget_here
            && self.taken.iter().all(|(_, taken)| match taken {
                Taken::Held(held) => nesting::fd_holds(held.lock().file().as_raw_fd(), held.lock()),
                Taken::Inherited(lock) => nesting::inherited(lock, false) != Inherited::No,
            })
    }

    /// Lets go: in the process that took it, the label is cleared and the
    /// lock released (unless a forked child or a command still has a
    /// descriptor to it); in a forked child, only the child's copies of the
    /// descriptors are closed: the label, the place in line and the hold
    /// stay with whoever still has them.
    pub fn release(self) {
        drop(self);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            // The watch stops first; the holds' own Drop lets go, in the
            // command line's order (the group, then the budget's device).
            let budget = self.budget.take();
            drop(std::mem::take(&mut self.taken));
            if let Some(mut budget) = budget {
                budget.release();
            }
            return;
        }
        if let Some(budget) = self.budget.as_mut() {
            budget.close_copy();
        }
        for (_, taken) in self.taken.drain(..) {
            match taken {
                Taken::Held(held) => held.close_copy(),
                Taken::Inherited(lock) => drop(lock),
            }
        }
    }
}

/// A take in progress: done at once when free, else waiting in line on a
/// thread of its own until [`Acquiring::wait`] reports the outcome or
/// [`Acquiring::cancel`] leaves the line.
#[derive(Debug)]
pub struct Acquiring {
    done: Option<Result<Hold>>,
    waiting: Option<Waiting>,
    started: Instant,
    step: String,
    /// What the last wait was for (for the line that says it is over).
    label: String,
    /// Whether it had to wait.
    waited: bool,
}

#[derive(Debug)]
struct Waiting {
    rx: mpsc::Receiver<Result<Hold>>,
    stop: Stop,
    thread: Option<std::thread::JoinHandle<()>>,
    board: Arc<Board>,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
    /// The process whose thread waits (a forked child has no such thread).
    pid: u32,
}

impl Acquiring {
    /// Checks `spec` as the command line checks its arguments, then takes it
    /// at once if it is free (on this thread, without joining the line).
    /// Otherwise, with [`Wait::NoWait`] it fails with [`Busy`]; else it
    /// joins the line on a thread of its own. Locks in `inside` (held by
    /// enclosing holds of this process) pass through.
    ///
    /// The waiting thread blocks every signal but the one that interrupts
    /// its lock calls (`SIGRTMIN+1`, see [`crate::Lock::acquire`]), so the
    /// caller's threads hear the signals (Ctrl-C) and decide.
    pub fn start(spec: &Spec, options: &Options, inside: &[HeldLock]) -> Result<Acquiring> {
        let started = Instant::now();
        let planned = plan(spec, inside)?;
        let dir = ScratchDir::open_or_create(&options.dir)?;
        let label = planned.label();
        let first = {
            let now = Context {
                dir: &dir,
                step: options.step.clone(),
                no_wait: true,
                plan: None,
                stop: Stop::default(),
                board: None,
            };
            take_all(&now, &planned)
        };
        match first {
            Ok(taken) => {
                return Ok(Acquiring {
                    done: Some(Ok(Hold::new(taken, &planned, &options.step))),
                    waiting: None,
                    started,
                    step: options.step.clone(),
                    label,
                    waited: false,
                });
            }
            Err(e) if options.wait == Wait::NoWait || e.downcast_ref::<Busy>().is_none() => {
                return Err(e);
            }
            // Busy: what it took is let go, and it waits in line.
            Err(_) => {}
        }
        let timeout = match options.wait {
            Wait::Timeout(t) => Some(t),
            _ => None,
        };
        // Before the thread exists: a stop may be sent to it at once.
        crate::interrupt::install();
        let board = Arc::new(Board::default());
        let stop = Stop::default();
        let (tx, rx) = mpsc::channel();
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
                        plan: None,
                        stop: stop.clone(),
                        board: Some(&board),
                    };
                    let result = {
                        let _finished = stop.finished_on_drop();
                        take_all(&ctx, &planned)
                    };
                    // A receiver that gave up drops the hold: released.
                    let _ = tx.send(result.map(|taken| Hold::new(taken, &planned, &ctx.step)));
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
            }),
            started,
            step: options.step.clone(),
            label,
            waited: true,
        })
    }

    /// Whether the take had to wait in line (it was not free at once).
    pub fn is_waiting(&self) -> bool {
        self.waited
    }

    /// Waits up to `limit` for the outcome: `None` while still waiting. When
    /// the timeout passes first, the take leaves the line and the outcome is
    /// a [`Busy`] with `timed_out`, worded as the command line's `-w`.
    pub fn wait(&mut self, limit: Duration) -> Option<Result<Hold>> {
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
    /// then the line is left.
    fn give_up(&mut self) -> Result<Hold> {
        let mut w = self.waiting.take().expect("waiting");
        let seen = w.board.in_the_way();
        match w.leave() {
            // Taken at the very moment the time ran out: it counts.
            Some(Ok(hold)) => Ok(hold),
            _ => {
                let (label, phrase, holder, resource) = seen.unwrap_or_else(|| {
                    (self.label.clone(), String::new(), None, self.label.clone())
                });
                let line = crate::messages::timed_out(
                    w.timeout.unwrap_or_default(),
                    &label,
                    &phrase,
                    None,
                );
                Err(anyhow::Error::new(Busy {
                    resource,
                    holder: holder.as_ref().map(holder_of),
                    timed_out: true,
                    message: without_prefix(&line),
                }))
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
        without_newline(&crate::messages::got(
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
    fn leave(&mut self) -> Option<Result<Hold>> {
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

/// The takes a [`Spec`] stands for, in the one global order.
#[derive(Debug, Clone)]
struct Planned {
    /// Taken in order, each waiting in its line.
    fixed: Vec<Request>,
    /// `--any`'s candidates (not passed through), and how many to pick.
    candidates: Vec<Request>,
    count: usize,
    /// The resources asked for, or an `--any`'s picks that passed through.
    members: Vec<Resource>,
    passed: Vec<HeldLock>,
    /// A memory budget (`mem`) on the one `gpu:N` of `fixed`, or on each
    /// candidate.
    budget: Option<budget::Planned>,
}

impl Planned {
    /// What the waiting lines call the whole take, before any wait names a part.
    fn label(&self) -> String {
        match self.fixed.last() {
            Some(last) => crate::messages::label_of(last),
            None => {
                let names: Vec<&str> = self.candidates.iter().map(|r| r.name.as_str()).collect();
                format!("any of {}", names.join(" "))
            }
        }
    }
}

/// Checks `spec` as the command line checks its arguments and plans its
/// requests, leaving out what an enclosing hold in `inside` covers.
fn plan(spec: &Spec, inside: &[HeldLock]) -> Result<Planned> {
    let resources = within_visible_devices(spec, validate(spec)?)?;
    // The one place a budget joins the requests: a budget takes gpu:N (and
    // its group) shared, as the command line's take_budget does.
    let budget = budget::plan(spec, &resources, PROBE_TIMEOUT)?;
    let exclusive = !spec.shared && budget.is_none();
    let slots = u64::from(spec.slots.unwrap_or(0));
    let mut planned = Planned {
        fixed: Vec::new(),
        candidates: Vec::new(),
        count: 0,
        members: Vec::new(),
        passed: Vec::new(),
        budget,
    };
    if spec.any {
        let mut count = usize::from(spec.count);
        for resource in resources {
            let request = Request {
                name: resource.clone(),
                exclusive,
                via: None,
                slots,
            };
            // A candidate an enclosing hold keeps is a pick that passes through.
            if count > 0 && covered(&request, inside)? {
                count -= 1;
                planned.passed.push(HeldLock {
                    resource: resource.to_string(),
                    exclusive: exclusive && slots == 0,
                });
                planned.members.push(resource);
            } else {
                planned.candidates.push(request);
            }
        }
        planned.count = count;
    } else {
        for request in crate::request::in_order(&resources, exclusive, slots) {
            if covered(&request, inside)? {
                planned.passed.push(HeldLock {
                    resource: request.name.to_string(),
                    exclusive: request.exclusive && request.slots == 0,
                });
            } else {
                planned.fixed.push(request);
            }
        }
        planned.members = resources;
    }
    Ok(planned)
}

/// Takes every lock of the plan with the command line's takes, labelling
/// each with this process's record. Without waiting, a busy lock is a
/// [`Busy`] naming who is in the way.
fn take_all(ctx: &Context, planned: &Planned) -> Result<Vec<(Resource, Taken)>> {
    let mut taken = Vec::new();
    for request in &planned.fixed {
        let attempt = match &planned.budget {
            Some(b) if request.via.is_none() => {
                crate::flock::budget::take(ctx, request, &b.ask(&request.name, PROBE_TIMEOUT))
            }
            _ => acquire::take(ctx, request),
        };
        let took = match attempt {
            Ok((took, _)) => took,
            // No room for a budget: the figures are the command line's words.
            Err(e) if ctx.no_wait && planned.budget.is_some() && crate::exit::is_busy(&e) => {
                return Err(budget_busy(ctx.dir, request, &e));
            }
            Err(e) if ctx.no_wait && crate::exit::is_busy(&e) => {
                return Err(busy_error(ctx.dir, request));
            }
            Err(e) => return Err(interrupted_or(e, ctx)),
        };
        if let Taken::Held(held) = &took {
            held.label(&ctx.record());
        }
        taken.push((request.name.clone(), took));
    }
    if let (Some(b), true) = (&planned.budget, planned.count > 0) {
        let asks: Vec<(Request, crate::flock::budget::Ask)> = planned
            .candidates
            .iter()
            .map(|r| (r.clone(), b.ask(&r.name, PROBE_TIMEOUT)))
            .collect();
        let mut pending = Pending::default();
        let chosen = match crate::flock::budget::take_any(ctx, &asks, &mut pending) {
            Ok(chosen) => chosen,
            Err(e) if ctx.no_wait && crate::exit::is_busy(&e) => {
                return Err(any_busy(&planned.candidates, &e));
            }
            Err(e) => return Err(interrupted_or(e, ctx)),
        };
        for (name, took) in chosen {
            if let Taken::Held(held) = &took {
                held.label(&ctx.record());
            }
            taken.push((name, took));
        }
        return Ok(taken);
    }
    if planned.count > 0 {
        let mut pending = Pending::default();
        let chosen = match crate::flock::any::take_any(
            ctx,
            &planned.candidates,
            planned.count,
            &mut pending,
        ) {
            Ok(chosen) => chosen,
            Err(e) if ctx.no_wait && crate::exit::is_busy(&e) => {
                return Err(any_busy(&planned.candidates, &e));
            }
            Err(e) => return Err(interrupted_or(e, ctx)),
        };
        for took in chosen {
            let name = match &took {
                Taken::Held(held) => {
                    held.label(&ctx.record());
                    held.request.name.clone()
                }
                Taken::Inherited(lock) => {
                    Resource::from_lock_path(lock.path()).expect("a lock file of ours")
                }
            };
            taken.push((name, took));
        }
    }
    Ok(taken)
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

/// `-n`'s error for `request`, in the command line's words
/// ([`crate::messages::busy`]), with the holder those words name.
fn busy_error(dir: &ScratchDir, request: &Request) -> anyhow::Error {
    let view = match LockFile::open(dir, &request.name.file_name()) {
        Ok(lock) => status::describe(&lock, dir, &request.name),
        Err(e) => return e,
    };
    let words = crate::messages::busy(request, &view, ExitCode::Busy);
    anyhow::Error::new(Busy {
        resource: request.name.to_string(),
        holder: view.holders.first().map(holder_of),
        timed_out: false,
        message: words.to_string(),
    })
}

/// `-n`'s error for a budget with no room (or one starting ahead of it),
/// with the command line's figures, naming the first holder in the way.
fn budget_busy(dir: &ScratchDir, request: &Request, err: &anyhow::Error) -> anyhow::Error {
    let holder = LockFile::open(dir, &request.name.file_name())
        .ok()
        .and_then(|lock| {
            status::describe(&lock, dir, &request.name)
                .holders
                .first()
                .map(holder_of)
        });
    anyhow::Error::new(Busy {
        resource: request.name.to_string(),
        holder,
        timed_out: false,
        message: err.to_string(),
    })
}

fn holder_of(h: &status::Holder) -> Holder {
    Holder {
        step: h.step.clone(),
        pid: h.pid,
        user: h.user.clone(),
    }
}

fn without_newline(line: &str) -> String {
    line.trim_end_matches('\n').to_owned()
}

fn without_prefix(line: &str) -> String {
    let line = without_newline(line);
    line.strip_prefix("devlock: ").unwrap_or(&line).to_owned()
}

/// Whether an enclosing hold of this process covers `request`: the same
/// lock held in a mode at least as strong, or the request's group held
/// exclusively. The same lock held only shared while this asks for it
/// exclusively is refused: waiting would wait for ourselves.
fn covered(request: &Request, inside: &[HeldLock]) -> Result<bool> {
    let wants_exclusive = request.exclusive && request.slots == 0;
    let group_exclusive = request.name.group().is_some_and(|g| {
        inside
            .iter()
            .any(|h| h.exclusive && h.resource == g.as_str())
    });
    if group_exclusive {
        return Ok(true);
    }
    match inside.iter().find(|h| h.resource == request.name.as_str()) {
        None => Ok(false),
        Some(h) if h.exclusive || !wants_exclusive => Ok(true),
        Some(_) => Err(crate::messages::held_only_shared_here(&request.name)),
    }
}

/// How long a look at the GPUs may take (the command line's default
/// `--probe-timeout`): only `CUDA_VISIBLE_DEVICES` entries that are UUIDs
/// need one.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The command line's rule for the caller's `CUDA_VISIBLE_DEVICES` (the
/// process's environment now, so a `gpu:N` block's own setting too): a GPU
/// outside it is a usage error, and `--any` skips the candidates outside it.
fn within_visible_devices(spec: &Spec, resources: Vec<Resource>) -> Result<Vec<Resource>> {
    if !crate::gpu::cuda::concerns(&resources) {
        return Ok(resources);
    }
    let Some(visible) = crate::gpu::cuda::Visible::from_env(PROBE_TIMEOUT)? else {
        return Ok(resources);
    };
    if spec.any {
        return visible.filter_candidates(&resources, usize::from(spec.count));
    }
    visible.check(&resources)?;
    Ok(resources)
}

/// The command line's checks of its resources and their options, in its words.
/// A `--any` that found every candidate busy (`wait=False`): the command
/// line's message, naming no single holder.
fn any_busy(candidates: &[Request], e: &anyhow::Error) -> anyhow::Error {
    let names: Vec<&str> = candidates.iter().map(|r| r.name.as_str()).collect();
    anyhow::Error::new(Busy {
        resource: names.join(" "),
        holder: None,
        timed_out: false,
        message: e.to_string(),
    })
}

fn validate(spec: &Spec) -> Result<Vec<Resource>> {
    if spec.resources.is_empty() {
        return Err(crate::messages::no_resource());
    }
    let names: Vec<std::ffi::OsString> = spec.resources.iter().map(Into::into).collect();
    let mut resources = Resource::parse_all(&names)?;
    resources.sort();
    resources.dedup();
    // The command line's rules, in its words.
    crate::request::check_count(spec.count, spec.count != 1, spec.any, &resources)?;
    crate::request::check_slots(spec.slots, spec.any, spec.shared, &resources)?;
    Ok(resources)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(dir: &Path, wait: Wait) -> Options {
        Options {
            dir: dir.into(),
            wait,
            step: "unit".into(),
        }
    }

    fn take_now(dir: &Path, spec: &Spec, inside: &[HeldLock]) -> Result<Hold> {
        let mut acquiring = Acquiring::start(spec, &options(dir, Wait::NoWait), inside)?;
        acquiring.wait(Duration::ZERO).expect("done at once")
    }

    #[test]
    fn a_member_takes_its_group_shared_and_sets_cuda() {
        let tmp = tempfile::tempdir().unwrap();
        let hold = take_now(tmp.path(), &Spec::new(["gpu:1", "gpu:0"]), &[]).unwrap();
        assert_eq!(hold.resources(), ["gpu:0", "gpu:1"]);
        assert_eq!(hold.cuda_visible_devices().as_deref(), Some("0,1"));
        assert!(hold.locks().contains(&HeldLock {
            resource: "gpu".into(),
            exclusive: false
        }));
        assert!(hold.holds_here() && !hold.is_nested());
        assert_eq!(
            hold.fds().len(),
            4,
            "the group's lock and label, and both members' locks"
        );
    }

    #[test]
    fn an_enclosing_hold_passes_through_and_busy_names_the_holder_as_dash_n() {
        let tmp = tempfile::tempdir().unwrap();
        let outer = take_now(tmp.path(), &Spec::new(["gpu"]), &[]).unwrap();
        let inner = take_now(tmp.path(), &Spec::new(["gpu:3"]), &outer.locks()).unwrap();
        assert!(inner.is_nested());
        assert_eq!(inner.cuda_visible_devices().as_deref(), Some("3"));
        let err = take_now(tmp.path(), &Spec::new(["gpu"]), &[]).unwrap_err();
        let busy = err.downcast_ref::<Busy>().expect("a Busy");
        assert_eq!(busy.resource, "gpu");
        let holder = busy.holder.as_ref().expect("a holder");
        assert_eq!(holder.step.as_deref(), Some("unit"));
        assert_eq!(holder.pid, Some(std::process::id()));
        assert!(
            busy.message.starts_with("gpu is busy: held by unit (pid "),
            "{}",
            busy.message
        );
        assert_eq!(exit_code(&err), 75);
    }

    #[test]
    fn exclusive_inside_a_shared_hold_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = Spec::new(["r"]);
        spec.shared = true;
        let outer = take_now(tmp.path(), &spec, &[]).unwrap();
        let err = take_now(tmp.path(), &Spec::new(["r"]), &outer.locks()).unwrap_err();
        assert!(err.to_string().contains("would wait for itself"), "{err}");
    }

    #[test]
    fn usage_errors_are_the_command_lines() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = Spec::new(["a", "b"]);
        spec.slots = Some(2);
        let err = take_now(tmp.path(), &spec, &[]).unwrap_err();
        assert_eq!(exit_code(&err), 2);
        let err = take_now(tmp.path(), &Spec::new(["-x"]), &[]).unwrap_err();
        assert!(err.to_string().contains("must not start with"), "{err}");
    }

    fn mem_spec(resources: &[&str], mem: Option<&str>) -> Spec {
        let mut spec = Spec::new(resources.iter().copied());
        spec.mem = mem.map(Into::into);
        spec
    }

    /// Every budget usage error is found before the device is asked (no
    /// probe runs: these need no GPU, fake or real), in the command line's
    /// words, exit 2.
    #[test]
    fn a_budget_is_planned_by_the_command_lines_rules_before_any_probe() {
        let cases: Vec<(Spec, &str)> = vec![
            (mem_spec(&["gpu:0"], Some("0")), "--mem must be more than 0"),
            (
                mem_spec(&["gpu:0"], Some("20XB")),
                "invalid value '20XB' for '--mem <SIZE>': unknown size unit",
            ),
            (
                mem_spec(&["gpu"], Some("20GiB")),
                "--mem budgets one GPU's memory: give gpu:N, not gpu",
            ),
            (
                mem_spec(&["gpu:0", "gpu:1"], Some("1GiB")),
                "--mem takes one gpu:N, or several candidates with --any",
            ),
            (
                Spec {
                    shared: true,
                    ..mem_spec(&["gpu:0"], Some("1GiB"))
                },
                "--mem cannot be combined with --shared or --slots",
            ),
            (
                Spec {
                    any: true,
                    count: 2,
                    ..mem_spec(&["gpu:0", "gpu:1"], Some("1GiB"))
                },
                "--count must be 1",
            ),
            (
                Spec {
                    settle: Some(Duration::from_secs(1)),
                    ..mem_spec(&["gpu:0"], None)
                },
                "--mem-headroom, --settle and --mem-strict need --mem",
            ),
            (
                Spec {
                    mem_headroom: Some("1".into()),
                    ..mem_spec(&["gpu:0"], Some("1GiB"))
                },
                "",
            ),
        ];
        for (spec, words) in cases {
            let planned = budget::plan(&spec, &validate(&spec).unwrap(), Duration::ZERO);
            if words.is_empty() {
                // Well formed: the probe is asked (given no time, it cannot
                // answer: the device's memory is unknown, exit 69).
                let err = planned.expect_err("no time to probe");
                assert_eq!(exit_code(&err), 69, "{err:#}");
                continue;
            }
            let err = planned.expect_err(words);
            assert_eq!(exit_code(&err), 2, "{err:#}");
            assert!(err.to_string().contains(words), "{err:#} lacks {words}");
        }
        // No budget asked: none planned, and nothing probed.
        let plain = mem_spec(&["gpu:0"], None);
        assert!(
            budget::plan(&plain, &validate(&plain).unwrap(), Duration::ZERO)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_wait_is_shown_cancelled_and_timed_out_in_the_command_lines_words() {
        let tmp = tempfile::tempdir().unwrap();
        let _outer = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap();
        let mut waiting =
            Acquiring::start(&Spec::new(["r"]), &options(tmp.path(), Wait::Block), &[]).unwrap();
        assert!(waiting.is_waiting());
        let line = loop {
            assert!(waiting.wait(Duration::from_millis(10)).is_none());
            let line = waiting.waiting_line(None);
            if !line.is_empty() {
                break line;
            }
        };
        assert!(
            line.starts_with("devlock: r · waiting 0s for unit (pid "),
            "{line}"
        );
        assert!(line.ends_with("· 1st in line (unit)"), "{line}");
        waiting.cancel();
        let mut timing = Acquiring::start(
            &Spec::new(["r"]),
            &options(tmp.path(), Wait::Timeout(Duration::from_millis(50))),
            &[],
        )
        .unwrap();
        let err = loop {
            if let Some(outcome) = timing.wait(Duration::from_millis(10)) {
                break outcome.unwrap_err();
            }
        };
        let busy = err.downcast_ref::<Busy>().expect("a Busy");
        assert!(busy.timed_out);
        assert!(
            busy.message
                .starts_with("timed out after 50ms waiting for r: held by unit"),
            "{}",
            busy.message
        );
    }

    #[test]
    fn a_cancel_leaves_a_slots_wait_at_the_front_of_the_line_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = Spec::new(["pool"]);
        spec.slots = Some(2);
        let _a = take_now(tmp.path(), &spec, &[]).unwrap();
        let _b = take_now(tmp.path(), &spec, &[]).unwrap();
        let mut waiting = Acquiring::start(&spec, &options(tmp.path(), Wait::Block), &[]).unwrap();
        // At the front of the line, racing for a slot: the board says so.
        while waiting.waiting_line(None).is_empty() {
            assert!(waiting.wait(Duration::from_millis(5)).is_none());
        }
        // Returns only once every racing thread is out (Stop::stop waits).
        waiting.cancel();
    }

    #[test]
    fn status_is_the_command_lines_document() {
        let tmp = tempfile::tempdir().unwrap();
        let _hold = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap();
        let doc: serde_json::Value =
            serde_json::from_str(&status_document(tmp.path(), &[], None).unwrap()).unwrap();
        assert_eq!(doc["resources"][0]["name"], "r");
        assert_eq!(doc["resources"][0]["holders"][0]["step"], "unit");
    }
}
