//! The watch of a budget's job while it runs: a thread samples what the
//! job's process tree uses on its device ([`Monitor`]), and once a tick the
//! [`BudgetWatch`] decides: step aside once the job settled, mark it over budget
//! (and tell the front end to say so), and with `--mem-strict` stop it. It
//! returns [`HoldEvent`]s: the words are the front end's.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Ask, SAMPLE_HELD, SAMPLE_STARTING, settle_delta};
use crate::gpu::memory;
use crate::hold_event::HoldEvent;
use crate::resource::Resource;

/// What the monitor thread measured.
#[derive(Debug, Default)]
struct Measures {
    /// The job's use, MiB, once sampled.
    used_mib: AtomicU64,
    sampled: AtomicBool,
    settled: AtomicBool,
    quit: AtomicBool,
}

/// Watches a budget's job while it runs: a thread samples what its process
/// tree uses on the device (every [`SAMPLE_STARTING`] while it starts, then
/// every [`SAMPLE_HELD`]); the supervisor's tick reads what it found.
#[derive(Debug)]
pub struct Monitor {
    measures: Arc<Measures>,
}

impl Monitor {
    pub fn start(ask: &Ask, roots: Vec<u32>, settle: Duration) -> Monitor {
        let measures = Arc::new(Measures::default());
        let (m, ask) = (measures.clone(), ask.clone());
        let spawned = std::thread::Builder::new()
            .name("devlock-mem".into())
            .stack_size(256 * 1024)
            .spawn(move || sample(&m, &ask, &roots, settle));
        if spawned.is_err() {
            // Nothing to measure with: the job starts alone for --settle.
            measures.sampled.store(false, Ordering::Release);
        }
        Monitor { measures }
    }

    /// The job's measured use, once sampled.
    pub(crate) fn used_mib(&self) -> Option<u64> {
        self.measures
            .sampled
            .load(Ordering::Acquire)
            .then(|| self.measures.used_mib.load(Ordering::Acquire))
    }

    /// Whether its memory stopped growing.
    pub(crate) fn settled(&self) -> bool {
        self.measures.settled.load(Ordering::Acquire)
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.measures.quit.store(true, Ordering::Release);
    }
}

fn sample(m: &Measures, ask: &Ask, roots: &[u32], settle: Duration) {
    let started = Instant::now();
    let mut last: VecDeque<u64> = VecDeque::new();
    while !m.quit.load(Ordering::Acquire) {
        let settled = m.settled.load(Ordering::Acquire);
        // Past --settle the job no longer starts: sample as for one held.
        std::thread::sleep(if settled || started.elapsed() >= settle {
            SAMPLE_HELD
        } else {
            SAMPLE_STARTING
        });
        let report = memory::probe(ask.probe_timeout);
        let Ok(device) = memory::device(&report, ask.index) else {
            continue;
        };
        let used = memory::tree_use(device, roots);
        m.used_mib.store(used, Ordering::Release);
        m.sampled.store(true, Ordering::Release);
        if settled {
            continue;
        }
        if used == 0 && last.is_empty() {
            continue;
        }
        last.push_back(used);
        if last.len() > 3 {
            last.pop_front();
        }
        let (lo, hi) = (
            last.iter().min().copied().unwrap_or(0),
            last.iter().max().copied().unwrap_or(0),
        );
        if last.len() == 3 && hi - lo <= settle_delta(ask.mem_mib) {
            m.settled.store(true, Ordering::Release);
        }
    }
}

/// The watch's part, once a second while the job runs: the starting job
/// steps aside once settled (or at `--settle`), and a job over its budget
/// by more than a tenth is reported once, marked in its registration, and
/// with `--mem-strict` stopped once it has stayed over for `--settle`.
#[derive(Debug)]
pub struct BudgetWatch {
    pub monitor: Monitor,
    pub resource: Resource,
    pub step: String,
    pub mem_mib: u64,
    pub settle: Duration,
    pub strict: bool,
    pub started: Instant,
    pub stepped_aside: bool,
    pub warned: bool,
    pub over_since: Option<Instant>,
    pub stopped: bool,
}

impl BudgetWatch {
    /// The watch of a hold whose command just started: not strict, nothing
    /// reported or stepped aside yet (callers set the rest with struct
    /// update syntax).
    pub fn new(
        monitor: Monitor,
        resource: Resource,
        step: String,
        mem_mib: u64,
        settle: Duration,
    ) -> BudgetWatch {
        BudgetWatch {
            monitor,
            resource,
            step,
            mem_mib,
            settle,
            strict: false,
            started: Instant::now(),
            stepped_aside: false,
            warned: false,
            over_since: None,
            stopped: false,
        }
    }

    /// Whether `used` is over the budget by more than a tenth.
    fn over(&self, used: u64) -> bool {
        used.saturating_mul(10) > self.mem_mib.saturating_mul(11)
    }

    /// Looks once; returns what to do (at most a few per tick).
    pub(crate) fn check(&mut self) -> Vec<HoldEvent> {
        let mut events = Vec::new();
        if !self.stepped_aside && (self.monitor.settled() || self.started.elapsed() >= self.settle)
        {
            self.stepped_aside = true;
            events.push(HoldEvent::StepAside);
        }
        let Some(used) = self.monitor.used_mib() else {
            return events;
        };
        match (self.over(used), self.over_since) {
            (true, None) => {
                self.over_since = Some(Instant::now());
                if !self.warned {
                    events.push(HoldEvent::OverBudget {
                        resource: self.resource.clone(),
                        step: self.step.clone(),
                        used_mib: used,
                        mem_mib: self.mem_mib,
                    });
                }
                self.warned = true;
                events.push(HoldEvent::OverMark(Some(used)));
            }
            (true, Some(since)) => {
                if self.strict && !self.stopped && since.elapsed() >= self.settle {
                    self.stopped = true;
                    events.push(HoldEvent::BudgetStop {
                        resource: self.resource.clone(),
                        step: self.step.clone(),
                        used_mib: used,
                        mem_mib: self.mem_mib,
                        settle: self.settle,
                    });
                }
            }
            (false, Some(_)) => {
                self.over_since = None;
                events.push(HoldEvent::OverMark(None));
            }
            (false, None) => {}
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(strict: bool, settle: Duration) -> BudgetWatch {
        let monitor = Monitor {
            measures: Arc::new(Measures::default()),
        };
        BudgetWatch {
            strict,
            ..BudgetWatch::new(
                monitor,
                "gpu:0".parse().unwrap(),
                "job".into(),
                10_000,
                settle,
            )
        }
    }

    fn measure(w: &BudgetWatch, used: u64, settled: bool) {
        let m = &w.monitor.measures;
        m.used_mib.store(used, Ordering::Release);
        m.sampled.store(true, Ordering::Release);
        m.settled.store(settled, Ordering::Release);
    }

    #[test]
    fn a_job_steps_aside_once_settled_and_is_marked_over_past_a_tenth() {
        let mut w = watch(false, Duration::from_secs(3600));
        assert_eq!(w.check(), [], "nothing measured, not settled");
        measure(&w, 11_000, false);
        assert_eq!(w.check(), [], "10 % over is within");
        measure(&w, 11_001, true);
        assert_eq!(
            w.check(),
            [
                HoldEvent::StepAside,
                HoldEvent::OverBudget {
                    resource: "gpu:0".parse().unwrap(),
                    step: "job".into(),
                    used_mib: 11_001,
                    mem_mib: 10_000
                },
                HoldEvent::OverMark(Some(11_001))
            ]
        );
        assert_eq!(w.check(), [], "said once, stepped aside once");
        measure(&w, 9_000, true);
        assert_eq!(w.check(), [HoldEvent::OverMark(None)], "back under");
        measure(&w, 12_000, true);
        assert_eq!(
            w.check(),
            [HoldEvent::OverMark(Some(12_000))],
            "over again: marked, not said again"
        );
    }

    #[test]
    fn strict_stops_a_job_that_stays_over_for_the_settle_time() {
        let mut w = watch(true, Duration::ZERO);
        measure(&w, 20_000, false);
        let first = w.check();
        assert!(
            matches!(
                first.as_slice(),
                [
                    HoldEvent::StepAside,
                    HoldEvent::OverBudget { .. },
                    HoldEvent::OverMark(Some(20_000))
                ]
            ),
            "{first:?}"
        );
        let second = w.check();
        assert!(
            matches!(
                second.as_slice(),
                [HoldEvent::BudgetStop {
                    used_mib: 20_000,
                    mem_mib: 10_000,
                    ..
                }]
            ),
            "{second:?}"
        );
        assert!(second[0].is_stop());
        assert_eq!(w.check(), [], "stopped once");
        let mut lenient = watch(false, Duration::ZERO);
        measure(&lenient, 20_000, false);
        lenient.check();
        assert_eq!(lenient.check(), [], "without --mem-strict, only said");
    }

    #[test]
    fn settling_allows_allocator_chunks() {
        assert_eq!(settle_delta(1024), 128);
        assert_eq!(settle_delta(20_480), 409);
    }
}
