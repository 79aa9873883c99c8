//! `devlock report --by day`: the rows by UTC day, summed without a pass
//! over every day a job spans, so that a record costs the same whatever it
//! says it lasted.

use std::collections::BTreeMap;

use super::{DAY_MS, Job, Row, add, day_name, job_gpus};

/// The rows by UTC day, summed without a pass over every day a job spans:
/// a job adds the parts of its first and last day, and its whole days
/// between as one change where they begin and one where they end, so a
/// record costs the same whatever it says it lasted.
#[derive(Debug, Default)]
pub(super) struct Days {
    /// Parts of days (a job's first and last), by day number.
    parts: BTreeMap<u64, Row>,
    /// Changes to what each whole day adds, by the day they take effect.
    changes: BTreeMap<u64, Whole>,
}

/// What whole days of jobs add to each day's row (none starts there).
#[derive(Debug, Clone, Copy, Default)]
struct Whole {
    jobs: i64,
    gpus: f64,
    computing: f64,
    idle: f64,
    sampled: f64,
}

impl Whole {
    /// A whole day of `job`.
    fn of(job: &Job) -> Whole {
        let length = job.end_ms.saturating_sub(job.start.start_ms).max(1);
        let scale = DAY_MS as f64 / length as f64 / 3600.0;
        let m = &job.measured;
        Whole {
            jobs: 1,
            gpus: job_gpus(job) as f64,
            computing: m.busy_gpu_s * scale,
            idle: m.idle_gpu_s * scale,
            sampled: m.sampled_gpu_s * scale,
        }
    }

    fn add(&mut self, other: &Whole, sign: f64) {
        self.jobs += sign as i64 * other.jobs;
        self.gpus += sign * other.gpus;
        self.computing += sign * other.computing;
        self.idle += sign * other.idle;
        self.sampled += sign * other.sampled;
    }
}

impl Days {
    /// The part `[lo, hi)` of `job`.
    pub(super) fn add(&mut self, job: &Job, lo: u64, hi: u64) {
        let start = job.start.start_ms;
        let (first, last) = (lo / DAY_MS, hi.saturating_sub(1).max(lo) / DAY_MS);
        let mut part = |day: u64| {
            let (from, to) = (day * DAY_MS, (day + 1).saturating_mul(DAY_MS));
            let (a, b) = (lo.max(from), hi.min(to));
            let started_here = (from..to).contains(&start);
            add(self.parts.entry(day).or_default(), job, a, b, started_here);
        };
        part(first);
        if last > first {
            part(last);
        }
        if last > first + 1 {
            let whole = Whole::of(job);
            self.changes.entry(first + 1).or_default().add(&whole, 1.0);
            self.changes.entry(last).or_default().add(&whole, -1.0);
        }
    }

    /// A row for each day something held, by name.
    pub(super) fn rows(mut self) -> BTreeMap<String, Row> {
        let mut marks: Vec<u64> = self
            .parts
            .keys()
            .chain(self.changes.keys())
            .copied()
            .collect();
        marks.sort_unstable();
        marks.dedup();
        let mut rows = BTreeMap::new();
        let mut whole = Whole::default();
        for (i, &day) in marks.iter().enumerate() {
            if let Some(change) = self.changes.get(&day) {
                whole.add(change, 1.0);
                if whole.jobs == 0 {
                    // Exactly nothing, not what rounding left of it.
                    whole = Whole::default();
                }
            }
            // Every day up to the next change has the same whole jobs.
            let next = if whole.jobs > 0 {
                marks.get(i + 1).copied().unwrap_or(day + 1)
            } else {
                day + 1
            };
            for d in day..next {
                let part = if d == day {
                    self.parts.remove(&d)
                } else {
                    None
                };
                if part.is_none() && whole.jobs == 0 {
                    continue;
                }
                let mut row = part.unwrap_or_default();
                let jobs = whole.jobs.max(0) as u64;
                row.jobs += jobs;
                row.hours += 24.0 * jobs as f64;
                row.gpu_hours += 24.0 * whole.gpus.max(0.0);
                row.gpu_hours_computing += whole.computing.max(0.0);
                row.gpu_hours_idle += whole.idle.max(0.0);
                row.gpu_hours_sampled += whole.sampled.max(0.0);
                rows.insert(day_name(d * DAY_MS), row);
            }
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::job;
    use crate::report::{By, rows};
    use proptest::prelude::*;

    /// 2026-12-01T00:00:00Z.
    const NOW: u64 = 1_796_083_200_000;

    /// The rows by day as a pass over each day of each job makes them.
    fn by_day_one_day_at_a_time(jobs: &[Job], since: u64, until: u64) -> BTreeMap<String, Row> {
        let mut rows: BTreeMap<String, Row> = BTreeMap::new();
        for job in jobs {
            let (start, end) = (job.start.start_ms, job.end_ms.max(job.start.start_ms));
            let (lo, hi) = (start.max(since), end.min(until));
            if !(lo < hi || (start == end && (since..until).contains(&start))) {
                continue;
            }
            let mut day = lo - lo % DAY_MS;
            loop {
                let (a, b) = (lo.max(day), hi.min(day + DAY_MS));
                let row = rows.entry(day_name(day)).or_default();
                add(row, job, a, b, (day..day + DAY_MS).contains(&start));
                day += DAY_MS;
                if day >= hi {
                    break;
                }
            }
        }
        rows
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn a_job_of_years_costs_what_a_job_of_hours_does() {
        // Fifty years, by day: the rows are the days, not a pass per job.
        let jobs: Vec<Job> = (0..20_000)
            .map(|_| job(0, NOW, 1, (1e9, 5e8, 5e8)))
            .collect();
        let started = std::time::Instant::now();
        let (rows, total) = rows(&jobs, By::Day, 0, NOW);
        assert_eq!(rows.len() as u64, NOW / DAY_MS);
        assert_eq!(total.jobs, 20_000);
        assert!(
            rows.iter()
                .all(|r| r.jobs == 20_000 && r.hours == 24.0 * 20_000.0)
        );
        // 20,000 jobs of 20,000 days each would be 4e8 passes.
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The rows by day are those of a pass over each day of each job.
        #[test]
        fn rows_by_day_are_a_pass_over_each_day(
            jobs in prop::collection::vec(
                (0..40 * DAY_MS, 0..40 * DAY_MS, 0u32..4, 0.0..1e6f64, 0.0..1e6f64),
                0..30,
            ),
            window in (0..45 * DAY_MS, 0..45 * DAY_MS),
        ) {
            let base = NOW - 42 * DAY_MS;
            let jobs: Vec<Job> = jobs
                .into_iter()
                .map(|(start, length, gpus, busy, idle)| {
                    let length = if start % 3 == 0 { length % (3 * 3_600_000) } else { length };
                    job(base + start, base + start + length, gpus, (busy + idle, busy, idle))
                })
                .collect();
            let (since, until) = (base + window.0.min(window.1), base + window.0.max(window.1));
            let (got, _) = rows(&jobs, By::Day, since, until);
            let want = by_day_one_day_at_a_time(&jobs, since, until);
            prop_assert_eq!(got.len(), want.len());
            for (row, (key, want)) in got.iter().zip(&want) {
                prop_assert_eq!(&row.key, key);
                prop_assert_eq!(row.jobs, want.jobs);
                prop_assert!(close(row.hours, want.hours), "{:?} {:?}", row, want);
                prop_assert!(close(row.gpu_hours, want.gpu_hours), "{:?} {:?}", row, want);
                prop_assert!(close(row.gpu_hours_computing, want.gpu_hours_computing));
                prop_assert!(close(row.gpu_hours_idle, want.gpu_hours_idle));
                prop_assert!(close(row.gpu_hours_sampled, want.gpu_hours_sampled));
                prop_assert!(close(row.wait_s, want.wait_s));
            }
        }
    }
}
