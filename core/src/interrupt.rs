//! Stopping a thread that sleeps in a lock call: a signal with a handler that
//! does nothing and does not restart the call, so flock(2) and fcntl(2)
//! return EINTR and the thread can see it was asked to stop. The job-control
//! stops (Ctrl-Z: SIGTSTP, SIGTTIN, SIGTTOU) interrupt a wait the same way,
//! so that a stopped waiter gives up its place before it stops.

use std::sync::Arc;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use crate::sys::signal::{self, SigSet, Thread, Timer};

/// The job-control stop signals a waiter leaves the line for.
pub(crate) const JOB_STOPS: [libc::c_int; 3] = [libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU];

/// The job-control stop that interrupted a wait, 0 when none did.
static SUSPEND: AtomicI32 = AtomicI32::new(0);

/// The stopping signal (SIGINT, SIGTERM, ...) that interrupted a wait with
/// no other thread to answer it ([`CatchStops`]), 0 when none did.
static STOPPED: AtomicI32 = AtomicI32::new(0);

/// Whether job stops are caught in this process now (threads that sleep in
/// lock calls then let them in).
static CATCHING: AtomicBool = AtomicBool::new(false);

/// Whether the handler was ever installed (the uncontended path never
/// does, and need not put the default action back).
static HANDLED: AtomicBool = AtomicBool::new(false);

/// A timer that sends the interrupt signal to this process, armed by a job
/// stop: the stop may land just before a thread enters its next lock call
/// (too late to interrupt it), so it is repeated until the wait is over.
static TIMER: std::sync::OnceLock<Option<Timer>> = std::sync::OnceLock::new();

extern "C" fn note_job_stop(sig: libc::c_int) {
    SUSPEND.store(sig, Ordering::Release);
    // Async-signal-safe: an atomic load and timer_settime.
    if let Some(Some(timer)) = TIMER.get() {
        let every = Duration::from_millis(2);
        timer.arm(every, every);
    }
}

extern "C" fn note_stop(sig: libc::c_int) {
    STOPPED.store(sig, Ordering::Release);
    // Async-signal-safe, as above: the stop may land just before the lock
    // call, which the timer's signals then interrupt.
    if let Some(Some(timer)) = TIMER.get() {
        let every = Duration::from_millis(2);
        timer.arm(every, every);
    }
}

fn interrupt_timer() {
    TIMER.get_or_init(|| Timer::new(interrupt_signal(), None));
}

fn disarm_interrupt_timer() {
    if let Some(Some(timer)) = TIMER.get() {
        timer.disarm();
    }
}

fn job_stop_set() -> SigSet {
    SigSet::of(&JOB_STOPS)
}

/// Keeps job stops pending in this thread (and the threads it starts) until
/// a wait catches them or the command is about to start: a stop that comes
/// while devlock holds a place, but is not asleep in a wait, must not leave
/// the place held by a stopped process.
pub fn hold_job_stops() {
    signal::block(&job_stop_set());
}

/// While a wait sleeps: a job stop interrupts the lock call it sleeps in
/// (the handler does not restart it) and marks the wait to be given up.
/// Lets them in on this thread; dropping it holds them again.
#[derive(Debug)]
pub struct CatchJobStops(());

impl CatchJobStops {
    pub fn new() -> CatchJobStops {
        install();
        interrupt_timer();
        unblock_here();
        for sig in JOB_STOPS {
            signal::set_handler(sig, note_job_stop);
        }
        HANDLED.store(true, Ordering::Release);
        CATCHING.store(true, Ordering::Release);
        signal::unblock(&job_stop_set());
        CatchJobStops(())
    }
}

impl Default for CatchJobStops {
    fn default() -> Self {
        CatchJobStops::new()
    }
}

impl Drop for CatchJobStops {
    fn drop(&mut self) {
        hold_job_stops();
        disarm_interrupt_timer();
        CATCHING.store(false, Ordering::Release);
    }
}

/// While a wait that no other thread watches sleeps: the stopping signals
/// `signals` (blocked, as the front end keeps them) are let in on this
/// thread with a handler that notes them and does not restart the lock
/// call, so the wait ends ([`Stop::keep_waiting`] is false) and its caller
/// learns which with [`take_stop`] (the front end leaves out those the
/// caller ignored, which stay ignored and never come). Dropping it blocks them
/// again and puts back what they did before, so one that comes later
/// waits, pending, for whoever looks next. A thread
/// that only waited for these signals cost a waiter its stack and the
/// code that starts it (bench/run, section 5).
#[derive(Debug)]
pub struct CatchStops {
    signals: SigSet,
    before: Vec<signal::Disposition>,
}

impl CatchStops {
    pub fn new(signals: &[libc::c_int]) -> CatchStops {
        CatchStops::with(signals, note_stop)
    }

    fn with(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int)) -> CatchStops {
        install();
        interrupt_timer();
        unblock_here();
        let before = signals
            .iter()
            .map(|&sig| signal::set_handler(sig, handler))
            .collect();
        let signals = SigSet::of(signals);
        signal::unblock(&signals);
        CatchStops { signals, before }
    }
}

impl Drop for CatchStops {
    fn drop(&mut self) {
        signal::block(&self.signals);
        // Ignored by the caller, a signal stays ignored for the command.
        for disposition in &self.before {
            disposition.restore();
        }
        disarm_interrupt_timer();
    }
}

/// Whether the terminal changed size while a [`CatchResize`] was held.
static RESIZED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_resize(_: libc::c_int) {
    RESIZED.store(true, Ordering::Release);
    // As note_stop: the resize may land just before the lock call. The
    // waiting thread disarms the timer once it has redrawn.
    if let Some(Some(timer)) = TIMER.get() {
        let every = Duration::from_millis(2);
        timer.arm(every, every);
    }
}

/// While a live waiting line is shown by the waiting thread itself: SIGWINCH
/// (blocked, as the front end keeps it) interrupts the lock call, and
/// [`take_resize`] says it came, so the line is drawn again at the new
/// width. Dropping it blocks SIGWINCH again and puts back its action.
#[derive(Debug)]
pub struct CatchResize {
    _caught: CatchStops,
}

impl CatchResize {
    pub fn new() -> CatchResize {
        CatchResize {
            _caught: CatchStops::with(&[libc::SIGWINCH], note_resize),
        }
    }
}

impl Default for CatchResize {
    fn default() -> Self {
        CatchResize::new()
    }
}

/// Whether the terminal changed size since last asked (taken: the timer
/// that repeated the interruption stops).
pub fn take_resize() -> bool {
    let resized = RESIZED.swap(false, Ordering::AcqRel);
    if resized {
        disarm_interrupt_timer();
    }
    resized
}

/// The stopping signal a [`CatchStops`] wait was ended by, if one was
/// (taken: asked again, none).
pub fn take_stop() -> Option<libc::c_int> {
    match STOPPED.swap(0, Ordering::AcqRel) {
        0 => None,
        sig => Some(sig),
    }
}

/// In a thread that sleeps in a lock call on behalf of a waiting one: lets
/// job stops in when they are being caught.
pub(crate) fn let_job_stops_in_here() {
    if CATCHING.load(Ordering::Acquire) {
        signal::unblock(&job_stop_set());
    }
}

/// Keeps job stops (and the interrupt signal their timer sends) away from
/// the calling thread, one that waits on other threads and not in a lock
/// call of its own, returning the mask to restore.
pub(crate) fn keep_job_stops_off_here() -> SigSet {
    let set = if CATCHING.load(Ordering::Acquire) {
        SigSet::of(&[JOB_STOPS[0], JOB_STOPS[1], JOB_STOPS[2], interrupt_signal()])
    } else {
        SigSet::of(&[interrupt_signal()])
    };
    signal::block(&set)
}

/// The job stop that interrupted a wait, if one did (not cleared).
pub fn suspended() -> Option<libc::c_int> {
    match SUSPEND.load(Ordering::Acquire) {
        0 => None,
        sig => Some(sig),
    }
}

/// A job stop that came while none was caught, taken off the queue (it
/// was held pending by [`hold_job_stops`]), or the one a wait noted.
pub fn take_job_stop() -> Option<libc::c_int> {
    if let Some(sig) = suspended() {
        SUSPEND.store(0, Ordering::Release);
        return Some(sig);
    }
    signal::wait(&job_stop_set(), Some(Duration::ZERO)).map(|r| r.signo)
}

/// Stops this process as `sig` would have by its default action (the shell
/// sees the job stopped; in an orphaned process group the kernel discards
/// it, as it would have) and returns once it is continued. Job stops are
/// held pending again afterwards.
pub fn stop_as(sig: libc::c_int) {
    // Default action, one pending copy, then let it be delivered.
    signal::set_default(sig);
    signal::raise(sig);
    let one = SigSet::of(&[sig]);
    signal::unblock(&one);
    signal::block(&one);
}

/// Gives the job stops their default action back, unblocked: devlock
/// supervising its command stops with it, as any job does.
pub fn release_job_stops() {
    if HANDLED.load(Ordering::Acquire) {
        for sig in JOB_STOPS {
            signal::set_default(sig);
        }
    }
    signal::unblock(&job_stop_set());
}

/// The signal that interrupts a lock call: a real-time one, so it cannot be
/// confused with the signals people send to jobs. The library installs a
/// handler for it that does nothing (see `Acquiring::start`).
pub(crate) fn interrupt_signal() -> libc::c_int {
    libc::SIGRTMIN() + 1
}

extern "C" fn ignore(_: libc::c_int) {}

/// Installs the handler once per process.
pub fn install() {
    static INSTALL: Once = Once::new();
    // No SA_RESTART, so a blocked lock call returns EINTR.
    INSTALL.call_once(|| {
        signal::set_handler(interrupt_signal(), ignore);
    });
}

/// Lets the interrupt signal reach the calling thread (a parent may have
/// left it blocked), returning the mask to restore.
pub fn unblock_here() -> SigSet {
    signal::unblock(&SigSet::of(&[interrupt_signal()]))
}

/// Restores a mask saved by [`unblock_here`].
pub(crate) fn restore(mask: &SigSet) {
    signal::set_mask(mask);
}

/// Something the waiting thread itself does when its lock call is
/// interrupted (the waiting display's late start).
type Hook = Box<dyn FnMut() + Send>;

/// A request to stop, shared between a waiting thread and whoever decides.
#[derive(Clone, Default)]
pub struct Stop {
    requested: Arc<AtomicBool>,
    finished: Arc<AtomicBool>,
    on_interrupt: Arc<std::sync::Mutex<Option<Hook>>>,
    /// The stops of threads that wait on the waiting thread's behalf (the
    /// racers of `--slots` and `--any`, see [`Stop::adopt`]): stopped with it.
    children: Arc<std::sync::Mutex<Vec<(Stop, Thread)>>>,
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("requested", &self.requested)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl Stop {
    /// Whether the waiting thread should keep waiting after an EINTR: not
    /// when asked to stop, nor when a job stop or a caught stopping signal
    /// ([`CatchStops`]) came. Runs the hook set with
    /// [`Stop::on_interrupt`] first (on the waiting thread).
    pub(crate) fn keep_waiting(&self) -> bool {
        if let Ok(mut hook) = self.on_interrupt.try_lock()
            && let Some(hook) = hook.as_mut()
        {
            hook();
        }
        !self.stopping()
    }

    /// Whether the wait is to end, by what [`Stop::keep_waiting`] looks at,
    /// without running the hook.
    pub(crate) fn stopping(&self) -> bool {
        self.requested.load(Ordering::Acquire)
            || suspended().is_some()
            || STOPPED.load(Ordering::Acquire) != 0
    }

    /// Asks the wait to stop, from its own thread (the hook set with
    /// [`Stop::on_interrupt`], at the deadline): the lock call it is in
    /// then ends, as after [`Stop::stop`].
    pub fn request(&self) {
        self.requested.store(true, Ordering::Release);
    }

    /// Sets (or with `None` clears) what the waiting thread does each time
    /// it looks whether to keep waiting.
    pub fn on_interrupt(&self, hook: Option<Hook>) {
        *self.on_interrupt.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    /// A guard the waiting thread holds while it may sleep in a lock call:
    /// dropping it, on return or on a panic, tells [`Stop::stop`] that the
    /// thread is out, so a stop never waits for a job that is gone.
    pub fn finished_on_drop(&self) -> Finished<'_> {
        Finished(self)
    }

    /// Whether someone asked the wait to stop (a deadline, a winner among
    /// racing candidates), as opposed to another interruption.
    pub fn was_requested(&self) -> bool {
        self.requested.load(Ordering::Acquire)
    }

    /// Asks `thread` to stop and interrupts it until it has. The signal may
    /// land just before the thread enters its lock call, so it is repeated
    /// until the thread says it is out.
    /// The threads it adopted are stopped first: the waiting thread itself
    /// may be waiting for them, not in a lock call of its own.
    pub fn stop(&self, thread: Thread) {
        self.stop_until(thread, &|| self.finished.load(Ordering::Acquire));
    }

    /// [`Stop::stop`], for a thread that says it is out by `out` rather
    /// than by its [`Finished`] guard (the command line's waiting thread,
    /// out of one wait and not yet of its take).
    pub fn stop_until(&self, thread: Thread, out: &dyn Fn() -> bool) {
        self.requested.store(true, Ordering::Release);
        let children = std::mem::take(&mut *lock_children(&self.children));
        for (child, child_thread) in &children {
            child.stop(*child_thread);
        }
        while !out() {
            thread.signal(interrupt_signal());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Stop {
    /// Makes the waits of `children` (threads the waiting thread started to
    /// wait on its behalf, and waits for) part of this one: a stop of this
    /// wait stops them too, at once if it came already. Until the returned
    /// guard is dropped, when they are over.
    pub(crate) fn adopt(&self, children: Vec<(Stop, Thread)>) -> Adopted<'_> {
        let ids: Vec<usize> = children.iter().map(|(c, _)| c.id()).collect();
        let late = {
            let mut held = lock_children(&self.children);
            if self.requested.load(Ordering::Acquire) {
                children
            } else {
                held.extend(children);
                Vec::new()
            }
        };
        for (child, thread) in &late {
            child.stop(*thread);
        }
        Adopted { parent: self, ids }
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.requested) as usize
    }
}

fn lock_children(
    children: &std::sync::Mutex<Vec<(Stop, Thread)>>,
) -> std::sync::MutexGuard<'_, Vec<(Stop, Thread)>> {
    children.lock().unwrap_or_else(|e| e.into_inner())
}

/// Children adopted by a [`Stop`], let go of when dropped.
#[derive(Debug)]
pub(crate) struct Adopted<'a> {
    parent: &'a Stop,
    ids: Vec<usize>,
}

impl Drop for Adopted<'_> {
    fn drop(&mut self) {
        lock_children(&self.parent.children).retain(|(c, _)| !self.ids.contains(&c.id()));
    }
}

/// Marks a [`Stop`]'s waiting thread finished when dropped.
#[derive(Debug)]
pub struct Finished<'a>(&'a Stop);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.finished.store(true, Ordering::Release);
    }
}

/// A timer that interrupts the calling thread's lock call with the
/// interrupt signal at a given moment, and again every `every` after it
/// (the first may land just before the thread enters its call), until it
/// is dropped or [`Alarm::disarm`]ed.
#[derive(Debug)]
pub struct Alarm(Timer);

impl Alarm {
    /// Arms the alarm for this thread; `None` when the kernel refuses a
    /// timer (then the caller does what it would have done on time at once).
    pub fn at(when: std::time::Instant, every: Duration) -> Option<Alarm> {
        install();
        let timer = Timer::new(interrupt_signal(), Some(signal::thread_id()))?;
        let first = when.saturating_duration_since(std::time::Instant::now());
        timer.arm(first, every).then_some(Alarm(timer))
    }

    /// Sets the alarm again, for `when` and every `every` after it.
    pub fn rearm(&self, when: std::time::Instant, every: Duration) -> bool {
        let first = when.saturating_duration_since(std::time::Instant::now());
        self.0.arm(first, every)
    }

    /// Stops the alarm (a signal already sent interrupts nothing that is
    /// not retried).
    pub fn disarm(&self) {
        self.0.disarm();
    }
}
