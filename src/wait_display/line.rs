//! The waiting line of one shown wait and what falls due while it waits:
//! the line once the wait is worth showing and at each report after, the
//! timeout at the deadline, the `got` line at the end. Done by the waiting
//! thread itself when an alarm interrupts its lock call, or by the helper
//! thread of a wait that sleeps in no such call.

use std::time::{Duration, Instant};

use super::{DEFAULT_COLUMNS, Display, Parts, SHOW_AFTER, WaitPlan, say};
use crate::error::Busy;
use crate::messages;
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

    /// Clears the live line if it is on the screen.
    fn clear(&mut self) {
        if std::mem::take(&mut self.drawn) {
            say("\r\x1b[K");
        }
    }
}

/// A wait being shown, from the moment it is worth showing (the display is
/// asked for then: on a terminal that costs a look at the process group).
pub(super) struct Showing {
    parts: Option<Parts>,
    pub(super) plan: WaitPlan,
    pub(super) display: Display,
    started: Instant,
    /// How long between two lines: a live line's clock, `--report-every`
    /// in a log, and on a shared terminal only the deadline wakes it.
    tick: Duration,
    next_report: Instant,
    line: Line,
}

impl Showing {
    pub(super) fn new(parts: Parts, plan: WaitPlan, started: Instant) -> Showing {
        let display = Display::for_plan(&plan);
        let tick = match display {
            Display::Live => Duration::from_secs(1),
            Display::Log => plan.report_every,
            Display::Static => Duration::from_secs(86_400),
        };
        Showing {
            parts: Some(parts),
            next_report: first_due(&plan, started),
            plan,
            display,
            started,
            tick,
            line: Line::default(),
        }
    }

    /// Shows the line if a report is due at `now`; returns the next moment
    /// something falls due (a report, or the deadline).
    pub(super) fn report(&mut self, now: Instant) -> Instant {
        let Some((shown, _)) = &self.parts else {
            return now + Duration::from_secs(3600);
        };
        if !self.plan.quiet && now >= self.next_report {
            let step = (self.display != Display::Live).then_some(self.plan.step.as_str());
            self.line
                .show(self.display, &shown.parts(now - self.started, step));
            // The look is over: its memory goes back now, not at the
            // command's start (see forget_look).
            crate::view::forget_look();
            self.next_report = now
                .checked_add(self.tick)
                .unwrap_or(now + Duration::from_secs(86_400));
        }
        let until = match self.plan.quiet {
            true => now + Duration::from_secs(3600),
            false => self.next_report,
        };
        self.plan.deadline.map_or(until, |d| until.min(d))
    }

    pub(super) fn past_deadline(&self, now: Instant) -> bool {
        self.plan.deadline.is_some_and(|d| now >= d)
    }

    /// The deadline passed: the line goes, the registrations too, and what
    /// is left is the take's error, worded as `-w` says it, naming who is
    /// in the way as the line last showed it.
    pub(super) fn time_out(&mut self) -> Busy {
        self.line.clear();
        let step = (self.display != Display::Live).then_some(self.plan.step.as_str());
        let (shown, registrations) = self.parts.take().expect("a wait times out once");
        drop(registrations);
        shown.timed_out(self.plan.timeout.unwrap_or_default(), step)
    }

    /// The terminal changed size: a live line is drawn again now.
    pub(super) fn resized(&mut self) {
        if self.display == Display::Live && self.line.said {
            self.next_report = Instant::now();
        }
    }

    /// The wait ended without the locks: the line and the registrations go.
    pub(super) fn leave(&mut self) {
        self.line.clear();
        self.parts = None;
    }

    /// The locks are taken: the live line goes, and the `got` line to say
    /// as the command starts, where one is due (on a shared terminal, in a
    /// log, or where the live line was lost).
    pub(super) fn got(&mut self) -> Option<String> {
        self.line.clear();
        let (shown, _) = self.parts.as_ref()?;
        let due =
            !self.plan.quiet && self.line.said && (self.display != Display::Live || self.line.lost);
        due.then(|| messages::busy::got(&shown.label, self.started.elapsed(), &self.plan.step))
    }
}

/// When a wait started at `started` is first worth showing: after
/// [`SHOW_AFTER`], or at its deadline if that comes first.
pub(super) fn first_due(plan: &WaitPlan, started: Instant) -> Instant {
    let show_at = started + SHOW_AFTER;
    plan.deadline.map_or(show_at, |d| d.min(show_at))
}
