//! The helper thread of a shown wait that sleeps in no lock call an alarm
//! could interrupt (`--any`, `--slots`, budgets: their racers sleep on
//! threads of their own): it shows the wait, stops it at the deadline and
//! answers stopping signals while the waiting thread waits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use super::line::Showing;
use super::{ACQUIRED, GotLine, LEFT, WAITING, Waiter, give_up};
use crate::error::Busy;
use crate::supervise::{self, Received};

pub(super) fn helper_thread(
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
