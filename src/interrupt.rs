//! Stopping a thread that sleeps in a lock call: a signal with a handler that
//! does nothing and does not restart the call, so flock(2) and fcntl(2)
//! return EINTR and the thread can see it was asked to stop. The job-control
//! stops (Ctrl-Z: SIGTSTP, SIGTTIN, SIGTTOU) interrupt a wait the same way,
//! so that a stopped waiter gives up its place before it stops.

use std::sync::Arc;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

/// The job-control stop signals a waiter leaves the line for.
pub const JOB_STOPS: [libc::c_int; 3] = [libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU];

/// The job-control stop that interrupted a wait, 0 when none did.
static SUSPEND: AtomicI32 = AtomicI32::new(0);

/// Whether job stops are caught in this process now (threads that sleep in
/// lock calls then let them in).
static CATCHING: AtomicBool = AtomicBool::new(false);

/// Whether the handler was ever installed (the uncontended path never
/// does, and need not put the default action back).
static HANDLED: AtomicBool = AtomicBool::new(false);

/// A timer that sends the interrupt signal to this process, armed by a job
/// stop: the stop may land just before a thread enters its next lock call
/// (too late to interrupt it), so it is repeated until the wait is over.
static TIMER: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

extern "C" fn note_job_stop(sig: libc::c_int) {
    SUSPEND.store(sig, Ordering::Release);
    if let Some(&timer) = TIMER.get() {
        let every = libc::timespec {
            tv_sec: 0,
            tv_nsec: 2_000_000,
        };
        let spec = libc::itimerspec {
            it_interval: every,
            it_value: every,
        };
        // SAFETY: timer_settime is async-signal-safe; the timer lives as
        // long as the process.
        unsafe { libc::timer_settime(timer as libc::timer_t, 0, &spec, std::ptr::null_mut()) };
    }
}

fn interrupt_timer() -> Option<libc::timer_t> {
    let timer = *TIMER.get_or_init(|| {
        // SAFETY: sigevent is plain data; the kernel fills the timer id.
        unsafe {
            let mut event = std::mem::zeroed::<libc::sigevent>();
            event.sigev_notify = libc::SIGEV_SIGNAL;
            event.sigev_signo = signal();
            let mut timer: libc::timer_t = std::ptr::null_mut();
            if libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, &mut timer) == 0 {
                timer as usize
            } else {
                0
            }
        }
    });
    (timer != 0).then_some(timer as libc::timer_t)
}

fn disarm_interrupt_timer() {
    if let Some(timer) = TIMER.get().copied().filter(|&t| t != 0) {
        // SAFETY: a zero itimerspec disarms our own timer.
        unsafe {
            let off = std::mem::zeroed::<libc::itimerspec>();
            libc::timer_settime(timer as libc::timer_t, 0, &off, std::ptr::null_mut());
        }
    }
}

fn job_stop_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data and sigemptyset initialises it.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for sig in JOB_STOPS {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

/// Keeps job stops pending in this thread (and the threads it starts) until
/// a wait catches them or the command is about to start: a stop that comes
/// while devlock holds a place, but is not asleep in a wait, must not leave
/// the place held by a stopped process.
pub fn hold_job_stops() {
    let set = job_stop_set();
    // SAFETY: valid set pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// While a wait sleeps: a job stop interrupts the lock call it sleeps in
/// (the handler does not restart it) and marks the wait to be given up.
/// Lets them in on this thread; dropping it holds them again.
pub struct CatchJobStops(());

impl CatchJobStops {
    pub fn new() -> CatchJobStops {
        install();
        interrupt_timer();
        unblock_here();
        // SAFETY: a handler that stores to an atomic and arms a timer
        // (both async-signal-safe); no SA_RESTART.
        unsafe {
            let mut action = std::mem::zeroed::<libc::sigaction>();
            action.sa_sigaction = note_job_stop as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            for sig in JOB_STOPS {
                libc::sigaction(sig, &action, std::ptr::null_mut());
            }
        }
        HANDLED.store(true, Ordering::Release);
        CATCHING.store(true, Ordering::Release);
        let set = job_stop_set();
        // SAFETY: valid set pointer.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
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

/// In a thread that sleeps in a lock call on behalf of a waiting one: lets
/// job stops in when they are being caught.
pub fn let_job_stops_in_here() {
    if CATCHING.load(Ordering::Acquire) {
        let set = job_stop_set();
        // SAFETY: valid set pointer.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}

/// Keeps job stops (and the interrupt signal their timer sends) away from
/// the calling thread, one that waits on other threads and not in a lock
/// call of its own, returning the mask to restore.
pub fn keep_job_stops_off_here() -> libc::sigset_t {
    let mut set = job_stop_set();
    if !CATCHING.load(Ordering::Acquire) {
        // SAFETY: emptying a set we own: the call below then only reads.
        unsafe { libc::sigemptyset(&mut set) };
    }
    // SAFETY: adding to a set we initialised.
    unsafe { libc::sigaddset(&mut set, signal()) };
    // SAFETY: plain signal-mask calls on sets we initialise.
    unsafe {
        let mut old = std::mem::zeroed::<libc::sigset_t>();
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        old
    }
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
    let set = job_stop_set();
    // SAFETY: siginfo_t is plain data; a zero timeout only polls.
    unsafe {
        let mut info = std::mem::zeroed::<libc::siginfo_t>();
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let sig = libc::sigtimedwait(&set, &mut info, &ts);
        (sig > 0).then_some(sig)
    }
}

/// Stops this process as `sig` would have by its default action (the shell
/// sees the job stopped; in an orphaned process group the kernel discards
/// it, as it would have) and returns once it is continued. Job stops are
/// held pending again afterwards.
pub fn stop_as(sig: libc::c_int) {
    // SAFETY: plain signal calls on this process: default action, one
    // pending copy, then let it be delivered.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
        let mut one = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut one);
        libc::sigaddset(&mut one, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
        libc::pthread_sigmask(libc::SIG_BLOCK, &one, std::ptr::null_mut());
    }
}

/// Gives the job stops their default action back, unblocked: devlock
/// supervising its command stops with it, as any job does.
pub fn release_job_stops() {
    // SAFETY: plain signal calls on this process.
    unsafe {
        if HANDLED.load(Ordering::Acquire) {
            for sig in JOB_STOPS {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        let set = job_stop_set();
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

/// The signal used; a real-time one, so it cannot be confused with the
/// signals people send to jobs.
pub fn signal() -> libc::c_int {
    libc::SIGRTMIN() + 1
}

extern "C" fn ignore(_: libc::c_int) {}

/// Installs the handler once per process.
pub fn install() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // SAFETY: a plain handler that touches nothing; no SA_RESTART, so a
        // blocked lock call returns EINTR.
        unsafe {
            let mut action = std::mem::zeroed::<libc::sigaction>();
            action.sa_sigaction = ignore as *const () as usize;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal(), &action, std::ptr::null_mut());
        }
    });
}

/// Lets the interrupt signal reach the calling thread (a parent may have
/// left it blocked), returning the mask to restore.
pub fn unblock_here() -> libc::sigset_t {
    // SAFETY: plain signal-mask calls on sets we initialise.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, signal());
        let mut old = std::mem::zeroed::<libc::sigset_t>();
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, &mut old);
        old
    }
}

/// Restores a mask saved by [`unblock_here`].
pub fn restore(mask: &libc::sigset_t) {
    // SAFETY: a mask pthread_sigmask gave us.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
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
    /// when asked to stop, nor when a job stop came. Runs the hook set with
    /// [`Stop::on_interrupt`] first (on the waiting thread).
    pub fn keep_waiting(&self) -> bool {
        if let Ok(mut hook) = self.on_interrupt.try_lock()
            && let Some(hook) = hook.as_mut()
        {
            hook();
        }
        !self.requested.load(Ordering::Acquire) && suspended().is_none()
    }

    /// Sets (or with `None` clears) what the waiting thread does each time
    /// it looks whether to keep waiting.
    pub fn on_interrupt(&self, hook: Option<Hook>) {
        *self.on_interrupt.lock().unwrap_or_else(|e| e.into_inner()) = hook;
    }

    /// Called by the waiting thread when it no longer sleeps in a lock call.
    pub fn mark_finished(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// Asks `thread` to stop and interrupts it until it has. The signal may
    /// land just before the thread enters its lock call, so it is repeated
    /// until the thread says it is out.
    pub fn stop(&self, thread: libc::pthread_t) {
        self.requested.store(true, Ordering::Release);
        while !self.finished.load(Ordering::Acquire) {
            // SAFETY: the thread is joinable (not yet joined), so the handle is valid.
            unsafe { libc::pthread_kill(thread, signal()) };
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A timer that interrupts the calling thread's lock call with the
/// interrupt signal at a given moment, and again every `every` after it
/// (the first may land just before the thread enters its call), until it
/// is dropped or [`Alarm::disarm`]ed.
#[derive(Debug)]
pub struct Alarm {
    timer: libc::timer_t,
}

impl Alarm {
    /// Arms the alarm for this thread; `None` when the kernel refuses a
    /// timer (then the caller does what it would have done on time at once).
    pub fn at(when: std::time::Instant, every: Duration) -> Option<Alarm> {
        install();
        let first = when.saturating_duration_since(std::time::Instant::now());
        // SAFETY: sigevent is plain data; the kernel fills the timer id, and
        // the thread id is this thread's, which outlives the alarm (it is
        // dropped on the thread that made it).
        let timer = unsafe {
            let mut event = std::mem::zeroed::<libc::sigevent>();
            event.sigev_notify = libc::SIGEV_THREAD_ID;
            event.sigev_signo = signal();
            event.sigev_notify_thread_id = libc::gettid();
            let mut timer: libc::timer_t = std::ptr::null_mut();
            if libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, &mut timer) != 0 {
                return None;
            }
            timer
        };
        let alarm = Alarm { timer };
        let spec = libc::itimerspec {
            it_interval: timespec(every),
            // Zero would disarm it: at least a nanosecond.
            it_value: timespec(first.max(Duration::from_nanos(1))),
        };
        // SAFETY: our own timer, and a spec that lives through the call.
        if unsafe { libc::timer_settime(alarm.timer, 0, &spec, std::ptr::null_mut()) } != 0 {
            return None;
        }
        Some(alarm)
    }

    /// Stops the alarm (it may still have one signal in flight, which
    /// interrupts nothing that is not retried).
    pub fn disarm(&self) {
        // SAFETY: a zero itimerspec disarms our own timer.
        unsafe {
            let off = std::mem::zeroed::<libc::itimerspec>();
            libc::timer_settime(self.timer, 0, &off, std::ptr::null_mut());
        }
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        // SAFETY: our own timer, deleted once.
        unsafe { libc::timer_delete(self.timer) };
    }
}

fn timespec(d: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    }
}
