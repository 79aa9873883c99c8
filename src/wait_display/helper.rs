//! The helper thread of a shown wait that sleeps in no lock call an alarm
//! could interrupt (`--any`, `--slots`, budgets: their racers sleep on
//! threads of their own): it shows the wait, stops it at the deadline and
//! answers stopping signals while the waiting thread waits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Instant;

use anyhow::Result;

use super::line::Showing;
use super::{Display, GotLine, HelperHandle, Parts, WaitPlan, Waited};
use crate::error::Busy;
use crate::interrupt::Stop;
use crate::supervise::{self, Received};
use crate::sys::signal::Thread;

const WAITING: u8 = 0;
const ACQUIRED: u8 = 1;
const GAVE_UP: u8 = 2;
/// The wait ended without the locks (a job stop, an error): the helper
/// clears its display and ends.
const LEFT: u8 = 3;

/// The waiting thread of a wait, as its helper stops it at the deadline:
/// through the take's [`Stop`], as the library's timeout does.
struct Waiter {
    stop: Stop,
    thread: Thread,
    /// Set by the waiting thread once its lock call is over.
    out: Arc<AtomicBool>,
}

impl Waiter {
    /// Interrupts the wait until the waiting thread is out of it.
    fn stop(&self) {
        self.stop
            .stop_until(self.thread, &|| self.out.load(Ordering::Acquire));
    }
}

/// A wait whose waiting thread sleeps in no lock call an alarm could
/// interrupt: a helper thread shows it, stops it at the deadline and takes
/// the stopping signals, from [`SHOW_AFTER`] on.
pub(super) fn wait_beside<T>(
    parts: Parts,
    plan: &WaitPlan,
    stop: &Stop,
    started: Instant,
    block: impl FnOnce() -> Result<T>,
) -> Result<(T, Waited)> {
    let waiter = Waiter {
        stop: stop.clone(),
        thread: Thread::current(),
        out: Arc::default(),
    };
    let out = waiter.out.clone();
    let state = Arc::new(AtomicU8::new(WAITING));
    let got = Arc::new(GotLine::default());
    let showing = Showing::new(parts, plan.clone(), started);
    // On a terminal (live or shared) the last line, "got ..." or the
    // cleared live line, comes before the command's own output; in a log
    // the command may start first (hand-off latency).
    let on_terminal = showing.display != Display::Log && !plan.quiet;
    crate::sys::process::one_heap();
    let spawned = {
        let (state, got) = (state.clone(), got.clone());
        std::thread::Builder::new()
            .name("devlock-wait".into())
            .stack_size(256 * 1024)
            .spawn(move || helper_thread(showing, state, &got, &waiter))
    };
    let held = {
        // Job stops reach this thread only (the helper keeps them held), and
        // interrupt its lock call.
        let _stops = crate::interrupt::CatchJobStops::new();
        block()
    };
    out.store(true, Ordering::Release);
    let Ok(handle) = spawned else {
        return Ok((held?, Waited::default()));
    };
    let held = end_wait(held, &state, handle)?;
    Ok((
        held.0,
        Waited {
            helper: Some(held.1),
            on_terminal,
            got: Some(got),
        },
    ))
}

/// Ends a shown wait as the lock call `held` ended: an error first stops
/// the helper (which takes its display and the registrations with it);
/// locks taken are the helper's to hear of. If the helper gave up first
/// (the deadline), the wait timed out, whatever the lock call came to: a
/// lock taken at that very moment goes with the take's error, unused.
fn end_wait<T>(
    held: Result<T>,
    state: &AtomicU8,
    handle: HelperHandle,
) -> Result<(T, HelperHandle)> {
    let gave_up = |handle: HelperHandle| match handle.join() {
        Ok(Err(busy)) => anyhow::Error::new(busy),
        _ => anyhow::anyhow!("the waiting display ended without an answer"),
    };
    let held = match held {
        Ok(held) => held,
        Err(e) => {
            if state
                .compare_exchange(WAITING, LEFT, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return Err(gave_up(handle));
            }
            // The helper then sees LEFT and ends, taking its display and
            // the registrations with it.
            Thread::of(&handle).signal(supervise::wake_signal());
            let _ = handle.join();
            return Err(e);
        }
    };
    if state
        .compare_exchange(WAITING, ACQUIRED, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Err(gave_up(handle));
    }
    // The helper has the wake signal blocked (every thread has), so this
    // only ends its sigtimedwait.
    Thread::of(&handle).signal(supervise::wake_signal());
    Ok((held, handle))
}

fn give_up(state: &AtomicU8) -> bool {
    state
        .compare_exchange(WAITING, GAVE_UP, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

fn helper_thread(
    mut showing: Showing,
    state: Arc<AtomicU8>,
    got: &GotLine,
    waiter: &Waiter,
) -> Result<Option<Received>, Busy> {
    loop {
        let now = Instant::now();
        let until = showing.report(now);
        if showing.past_deadline(now) && give_up(&state) {
            // The waiting thread then leaves its wait, as the library's
            // take does, and says it (or, with -q, only exits with the
            // conflict code).
            let busy = showing.time_out();
            waiter.stop();
            return Err(busy);
        }
        let signal = supervise::wait_stop_or_wake(until.saturating_duration_since(Instant::now()));
        if signal.is_some_and(|s| s.signo == libc::SIGWINCH) {
            if state.load(Ordering::Acquire) == WAITING {
                showing.resized();
            }
            continue;
        }
        let stop = signal.filter(|s| s.signo != supervise::wake_signal());
        if state.load(Ordering::Acquire) == LEFT {
            showing.leave();
            return Ok(None);
        }
        if state.load(Ordering::Acquire) == ACQUIRED {
            if let Some(line) = showing.got() {
                got.offer(line);
            }
            return Ok(stop);
        }
        if let Some(sig) = stop {
            showing.leave();
            if give_up(&state) {
                super::leave_line_for(sig.signo, &showing.plan);
            }
            // The locks were taken at this very moment: the command must hear it.
            return Ok(Some(sig));
        }
    }
}
