//! Stopping a thread that sleeps in a lock call: a signal with a handler that
//! does nothing and does not restart the call, so flock(2) and fcntl(2)
//! return EINTR and the thread can see it was asked to stop.

use std::sync::Arc;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

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

/// A request to stop, shared between a waiting thread and whoever decides.
#[derive(Debug, Clone, Default)]
pub struct Stop {
    requested: Arc<AtomicBool>,
    finished: Arc<AtomicBool>,
}

impl Stop {
    /// Whether the waiting thread should keep waiting after an EINTR.
    pub fn keep_waiting(&self) -> bool {
        !self.requested.load(Ordering::Acquire)
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
