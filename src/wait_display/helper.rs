//! The helper thread of a shown wait: it draws the waiting line, stops the
//! wait at the deadline and answers stopping signals while the main thread
//! sleeps in flock(2).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use super::{
    ACQUIRED, DEFAULT_COLUMNS, Display, GotLine, LEFT, Parts, SHOW_AFTER, WAITING, WaitPlan,
    Waiter, clear, give_up, say,
};
use crate::error::Busy;
use crate::messages;
use crate::supervise::{self, Received};
use crate::text::fit;
use crate::tty;

/// The waiting line as it stands on stderr.
#[derive(Default)]
struct Line {
    /// A live line is on the screen, on the row the cursor is on.
    drawn: bool,
    /// Something was said about this wait, so its end is said too.
    said: bool,
    /// The live line was lost (devlock went to the background): its end is
    /// said as on a shared terminal.
    lost: bool,
}

impl Line {
    /// Shows `parts` as `display` has it.
    fn show(&mut self, display: Display, parts: &[(String, bool)]) {
        let parts: Vec<(&str, bool)> = parts.iter().map(|(p, s)| (p.as_str(), *s)).collect();
        match display {
            Display::Live if tty::in_foreground() => {
                // One column short of the edge: a line that ends in the
                // last column leaves some terminals waiting to wrap.
                let width = tty::columns().unwrap_or(DEFAULT_COLUMNS).saturating_sub(1);
                say(&format!("\r\x1b[K{}", fit(&parts, width.max(1))));
                self.drawn = true;
                self.said = true;
                self.lost = false;
            }
            Display::Live => {
                // In the background now: whatever row the line was on,
                // the cursor has moved on; never draw over a prompt.
                if self.drawn {
                    self.lost = true;
                }
                self.drawn = false;
            }
            Display::Static => {
                let width = tty::columns().unwrap_or(DEFAULT_COLUMNS).saturating_sub(1);
                say(&format!("{}\n", fit(&parts, width.max(1))));
                self.said = true;
            }
            Display::Log => {
                let line: String = parts.iter().map(|(p, _)| *p).collect();
                say(&format!("{line}\n"));
                self.said = true;
            }
        }
    }
}

pub(super) fn helper_thread(
    (shown, registration): Parts,
    state: Arc<AtomicU8>,
    started: Instant,
    plan: WaitPlan,
    display: Display,
    got: &GotLine,
    waiter: &Waiter,
) -> Result<Option<Received>, Busy> {
    let tick = match display {
        Display::Live => Duration::from_secs(1),
        Display::Log => plan.report_every,
        // One line at the start: the deadline is the only other reason to wake.
        Display::Static => Duration::from_secs(86_400),
    };
    let step = (display != Display::Live).then_some(plan.step.as_str());
    // Nothing is looked at or said before the wait is worth showing.
    let show_at = started + SHOW_AFTER;
    let mut next_report = plan.deadline.map_or(show_at, |d| d.min(show_at));
    let mut line = Line::default();
    loop {
        let now = Instant::now();
        if !plan.quiet && now >= next_report {
            line.show(display, &shown.parts(now - started, step));
            // The look is over: its memory goes back now, not at the
            // command's start (see forget_look).
            crate::view::forget_look();
            next_report = now
                .checked_add(tick)
                .unwrap_or(now + Duration::from_secs(86_400));
        }
        if let Some(deadline) = plan.deadline
            && now >= deadline
            && give_up(&state)
        {
            // Who is in the way as the line last showed it; the waiting
            // thread then leaves its wait, as the library's take does, and
            // says it (or, with -q, only exits with the conflict code).
            clear(&mut line.drawn);
            let busy = shown.timed_out(plan.timeout.unwrap_or_default(), step);
            drop(registration);
            waiter.stop();
            return Err(busy);
        }
        let mut until = if plan.quiet {
            now + Duration::from_secs(3600)
        } else {
            next_report
        };
        if let Some(deadline) = plan.deadline {
            until = until.min(deadline);
        }
        let signal = supervise::wait_stop_or_wake(until.saturating_duration_since(Instant::now()));
        if signal.is_some_and(|s| s.signo == libc::SIGWINCH) {
            // The terminal changed size: redraw now, to the new width.
            if display == Display::Live && line.said && state.load(Ordering::Acquire) == WAITING {
                next_report = Instant::now();
            }
            continue;
        }
        let stop = signal.filter(|s| s.signo != supervise::wake_signal());
        if state.load(Ordering::Acquire) == LEFT {
            clear(&mut line.drawn);
            return Ok(None);
        }
        if state.load(Ordering::Acquire) == ACQUIRED {
            clear(&mut line.drawn);
            if !plan.quiet && line.said && (display != Display::Live || line.lost) {
                got.offer(messages::busy::got(
                    &shown.label,
                    started.elapsed(),
                    &plan.step,
                ));
            }
            return Ok(stop);
        }
        if let Some(sig) = stop {
            if give_up(&state) {
                clear(&mut line.drawn);
                drop(registration);
                super::leave_line_for(sig.signo, &plan);
            }
            // The locks were taken at this very moment: the command must hear it.
            clear(&mut line.drawn);
            return Ok(Some(sig));
        }
    }
}
