//! Signals: sets and masks, waiting for a signal with its sender, handlers
//! that interrupt a lock call, signals to one thread, and POSIX timers. nix
//! has no real-time signals in its `Signal` type, and devlock uses two
//! (`SIGRTMIN+1` to interrupt a lock call, `SIGRTMIN+2` to wake the waiting
//! display), so these are libc calls, each in one place.

use std::time::Duration;

/// A set of signals.
#[derive(Clone, Copy)]
pub struct SigSet(libc::sigset_t);

impl std::fmt::Debug for SigSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // libc's sigset_t has no Debug without its extra_traits feature.
        f.write_str("SigSet")
    }
}

impl SigSet {
    /// The set of `signals`.
    pub fn of(signals: &[libc::c_int]) -> SigSet {
        // SAFETY: sigset_t is plain data, and sigemptyset initialises it
        // before sigaddset adds to it.
        unsafe {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            for &sig in signals {
                libc::sigaddset(&mut set, sig);
            }
            SigSet(set)
        }
    }

    /// The empty set.
    pub fn empty() -> SigSet {
        SigSet::of(&[])
    }

    /// Every signal.
    pub fn all() -> SigSet {
        // SAFETY: sigfillset initialises the plain-data set it is given.
        unsafe {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigfillset(&mut set);
            SigSet(set)
        }
    }
}

fn mask(how: libc::c_int, set: &SigSet) -> SigSet {
    let mut old = SigSet::empty();
    // SAFETY: pthread_sigmask reads one initialised set and writes one.
    unsafe { libc::pthread_sigmask(how, &set.0, &mut old.0) };
    old
}

/// Blocks `set` in the calling thread (and the threads it starts); the
/// mask before.
pub fn block(set: &SigSet) -> SigSet {
    mask(libc::SIG_BLOCK, set)
}

/// Unblocks `set` in the calling thread; the mask before.
pub fn unblock(set: &SigSet) -> SigSet {
    mask(libc::SIG_UNBLOCK, set)
}

/// Sets the calling thread's mask; the mask before.
pub fn set_mask(set: &SigSet) -> SigSet {
    mask(libc::SIG_SETMASK, set)
}

/// A signal as sigwaitinfo reported it.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub signo: libc::c_int,
}

/// Takes one signal of `set` (blocked by the caller) off the queue,
/// waiting up to `timeout` (forever with `None`; not at all with zero).
pub fn wait(set: &SigSet, timeout: Option<Duration>) -> Option<Received> {
    // SAFETY: siginfo_t is plain data, filled by the kernel.
    let mut info = unsafe { std::mem::zeroed::<libc::siginfo_t>() };
    let signo = match timeout {
        // SAFETY: an initialised set and a siginfo_t to fill.
        None => unsafe { libc::sigwaitinfo(&set.0, &mut info) },
        Some(t) => {
            let ts = timespec(t);
            // SAFETY: as above, and a timespec that lives through the call.
            unsafe { libc::sigtimedwait(&set.0, &mut info, &ts) }
        }
    };
    (signo > 0).then_some(Received { signo })
}

/// Installs `handler` for `sig`, without `SA_RESTART`: a lock call the
/// signal lands in returns `EINTR`. The handler must be async-signal-safe.
/// Returns what `sig` did before, for [`Disposition::restore`].
pub(crate) fn set_handler(sig: libc::c_int, handler: extern "C" fn(libc::c_int)) -> Disposition {
    // SAFETY: sigaction is plain data, its mask initialised by
    // sigemptyset; the handler is a plain function that stays valid for the
    // life of the process; the kernel writes the old action.
    unsafe {
        let mut action = std::mem::zeroed::<libc::sigaction>();
        action.sa_sigaction = handler as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        let mut old = std::mem::zeroed::<libc::sigaction>();
        libc::sigaction(sig, &action, &mut old);
        Disposition { sig, old }
    }
}

/// What a signal did before [`set_handler`] changed it (its default action,
/// ignored, a handler), to put back.
#[derive(Clone, Copy)]
pub(crate) struct Disposition {
    sig: libc::c_int,
    old: libc::sigaction,
}

impl std::fmt::Debug for Disposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // libc's sigaction has no Debug without its extra_traits feature.
        write!(f, "Disposition({})", self.sig)
    }
}

impl Disposition {
    /// Puts the signal's action back as it was.
    pub(crate) fn restore(&self) {
        // SAFETY: an action the kernel itself returned for this signal.
        unsafe { libc::sigaction(self.sig, &self.old, std::ptr::null_mut()) };
    }
}

/// Whether `sig` is ignored now (`SIG_IGN`: left so by `nohup`, `trap ''
/// HUP`, or a shell that starts a job in the background without job
/// control).
pub fn is_ignored(sig: libc::c_int) -> bool {
    // SAFETY: a query: with no new action the kernel changes nothing and
    // only writes the current one into `now`.
    unsafe {
        let mut now = std::mem::zeroed::<libc::sigaction>();
        libc::sigaction(sig, std::ptr::null(), &mut now) == 0 && now.sa_sigaction == libc::SIG_IGN
    }
}

/// Ignores `sig` from now on.
pub fn ignore(sig: libc::c_int) {
    // SAFETY: SIG_IGN is always a valid disposition.
    unsafe { libc::signal(sig, libc::SIG_IGN) };
}

/// Gives `sig` its default action back.
pub fn set_default(sig: libc::c_int) {
    // SAFETY: SIG_DFL is always a valid disposition.
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// Sends `sig` to the calling thread.
pub fn raise(sig: libc::c_int) {
    // SAFETY: raise(3) only sends a signal.
    unsafe { libc::raise(sig) };
}

/// A thread that signals can be sent to: made by the thread itself, and
/// kept by others only while that thread has not been joined or detached
/// (a joinable thread that has exited keeps its id valid until joined).
#[derive(Debug, Clone, Copy)]
pub struct Thread(libc::pthread_t);

impl Thread {
    /// The calling thread.
    pub fn current() -> Thread {
        // SAFETY: pthread_self cannot fail.
        Thread(unsafe { libc::pthread_self() })
    }

    /// The thread `handle` joins.
    pub fn of<T>(handle: &std::thread::JoinHandle<T>) -> Thread {
        Thread(std::os::unix::thread::JoinHandleExt::as_pthread_t(handle))
    }

    /// Sends `sig` to the thread.
    pub fn signal(self, sig: libc::c_int) {
        // SAFETY: a Thread is only held while its thread is joinable (see
        // the type), so the id is valid.
        unsafe { libc::pthread_kill(self.0, sig) };
    }
}

/// A POSIX timer that sends a signal: to the whole process, or to one
/// thread (Linux's `SIGEV_THREAD_ID`). Deleted when dropped.
#[derive(Debug)]
pub(crate) struct Timer(libc::timer_t);

// SAFETY: a timer id is a plain handle the kernel checks; timer_settime
// and timer_delete may be called from any thread.
unsafe impl Send for Timer {}
// SAFETY: as above; nothing in the handle is mutated.
unsafe impl Sync for Timer {}

impl Timer {
    /// A timer on CLOCK_MONOTONIC that sends `sig` to the process, or with
    /// `thread`, to that thread of it (by `gettid`).
    pub(crate) fn new(sig: libc::c_int, thread: Option<libc::pid_t>) -> Option<Timer> {
        // SAFETY: sigevent is plain data; the kernel writes the timer id.
        unsafe {
            let mut event = std::mem::zeroed::<libc::sigevent>();
            event.sigev_signo = sig;
            match thread {
                Some(tid) => {
                    event.sigev_notify = libc::SIGEV_THREAD_ID;
                    event.sigev_notify_thread_id = tid;
                }
                None => event.sigev_notify = libc::SIGEV_SIGNAL,
            }
            let mut timer: libc::timer_t = std::ptr::null_mut();
            (libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, &mut timer) == 0)
                .then_some(Timer(timer))
        }
    }

    /// Fires after `first` (at least a nanosecond), then every `every`
    /// (never again when zero). Async-signal-safe.
    pub(crate) fn arm(&self, first: Duration, every: Duration) -> bool {
        let spec = libc::itimerspec {
            it_interval: timespec(every),
            it_value: timespec(first.max(Duration::from_nanos(1))),
        };
        // SAFETY: our own timer and a spec that lives through the call.
        unsafe { libc::timer_settime(self.0, 0, &spec, std::ptr::null_mut()) == 0 }
    }

    /// Stops it. Async-signal-safe.
    pub(crate) fn disarm(&self) {
        let off = libc::itimerspec {
            it_interval: timespec(Duration::ZERO),
            it_value: timespec(Duration::ZERO),
        };
        // SAFETY: as above; a zero spec disarms.
        unsafe { libc::timer_settime(self.0, 0, &off, std::ptr::null_mut()) };
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: our own timer, deleted once.
        unsafe { libc::timer_delete(self.0) };
    }
}

/// The calling thread's kernel id (for a timer aimed at it).
pub(crate) fn thread_id() -> libc::pid_t {
    nix::unistd::gettid().as_raw()
}

fn timespec(d: Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    }
}

/// Whether one of `set` is pending for the calling thread or the process
/// (blocked, so it waits for a sigwaitinfo or an unblock).
pub(crate) fn any_pending(set: &SigSet) -> bool {
    let mut pending = SigSet::empty();
    // SAFETY: sigpending writes one initialised set.
    if unsafe { libc::sigpending(&mut pending.0) } != 0 {
        return false;
    }
    // SAFETY: sigismember reads two initialised sets' members.
    (1..libc::SIGRTMIN()).any(|sig| unsafe {
        libc::sigismember(&set.0, sig) == 1 && libc::sigismember(&pending.0, sig) == 1
    })
}
