//! The last day's holds of each GPU, from the usage records: what `devlock
//! serve` draws under each GPU and counts in its metrics.
//!
//! Its size is the page's, not the records': a user can write as many
//! records as their file holds, so a history keeps at most [`MAX_GPUS`]
//! GPUs and at most [`MAX_MARKS`] marks each (more holds are drawn merged,
//! a mark per quarter of an hour), with the held time and the count of
//! holds summed over them all.

use std::collections::BTreeMap;

use super::read::{Ending, Job};

/// How far back the history goes.
pub const SPAN_MS: u64 = 24 * 3_600_000;

/// Most GPUs a history keeps: the lowest indices the records name.
pub(crate) const MAX_GPUS: usize = 64;

/// Most marks a GPU's day has: one per hold up to this many, else one per
/// `SPAN_MS / MAX_MARKS` (a quarter of an hour) that holds began in.
pub const MAX_MARKS: usize = 96;

/// A mark: one hold of one GPU clipped to the history's window, or the
/// holds that began in one slot of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub start_ms: u64,
    pub end_ms: u64,
    /// How many holds it stands for (1 unless merged).
    pub holds: u64,
    /// The user and step of its (first) hold.
    pub user: String,
    pub step: String,
    /// How it ended, if it did (`None` while it runs or when unseen; for
    /// merged holds, when they did not all end alike).
    pub how: Option<&'static str>,
    pub running: bool,
    /// The share of its sampled time its GPUs computed, if sampled (merged
    /// holds: `None`).
    pub busy_share: Option<f64>,
}

/// One GPU's day.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Day {
    /// Oldest first.
    pub marks: Vec<Span>,
    /// Milliseconds of the window in which some hold held the GPU
    /// (overlapping holds, as budgets share a GPU, count once).
    pub held_ms: u64,
    /// Holds in the window.
    pub holds: u64,
    /// Where the held time reached so far, holds taken oldest first.
    reach: u64,
}

/// Each GPU's holds in `[now - SPAN_MS, now]`.
pub fn of(jobs: &[Job], now_ms: u64) -> BTreeMap<u32, Day> {
    let since = now_ms.saturating_sub(SPAN_MS);
    // The jobs in the window, clipped to it, oldest first: held time and
    // merged marks are summed in that order.
    let mut order: Vec<(u64, u64, &Job)> = jobs
        .iter()
        .filter_map(|job| {
            let (start, end) = (job.start.start_ms, job.end_ms.max(job.start.start_ms));
            (end >= since && start <= now_ms).then(|| (start.max(since), end.min(now_ms), job))
        })
        .collect();
    order.sort_by_key(|&(start, _, _)| start);
    let mut days: BTreeMap<u32, Day> = BTreeMap::new();
    for (start, end, job) in order {
        let gpus = if job.measured.gpus.is_empty() {
            &job.start.gpus
        } else {
            &job.measured.gpus
        };
        let m = &job.measured;
        let span = Span {
            start_ms: start,
            end_ms: end,
            holds: 1,
            user: crate::proc::process::user_name(job.uid),
            step: job.start.step.clone(),
            how: job.how.map(super::How::label),
            running: job.ending == Ending::Running,
            busy_share: (m.sampled_gpu_s > 0.0)
                .then(|| (m.busy_gpu_s / m.sampled_gpu_s).clamp(0.0, 1.0)),
        };
        for &gpu in gpus {
            if days.len() == MAX_GPUS && !days.contains_key(&gpu) {
                // Keep the lowest: a higher GPU never comes back.
                match days.last_key_value() {
                    Some((&highest, _)) if highest > gpu => {
                        days.pop_last();
                    }
                    _ => continue,
                }
            }
            days.entry(gpu).or_default().add(span.clone(), since);
        }
    }
    days
}

impl Day {
    /// Adds a hold, no older than those added before.
    fn add(&mut self, span: Span, since: u64) {
        let from = span.start_ms.max(self.reach);
        self.held_ms += span.end_ms.saturating_sub(from);
        self.reach = self.reach.max(span.end_ms);
        self.holds += 1;
        if self.holds as usize <= MAX_MARKS {
            self.marks.push(span);
            return;
        }
        if self.holds as usize == MAX_MARKS + 1 {
            // One too many: from now on a mark per slot.
            let marks = std::mem::take(&mut self.marks);
            for mark in marks {
                self.merge(mark, since);
            }
        }
        self.merge(span, since);
    }

    /// Adds `span` to the mark of its slot (the last mark, or a new one).
    fn merge(&mut self, span: Span, since: u64) {
        let last = MAX_MARKS as u64 - 1;
        let slot = |ms: u64| (ms.saturating_sub(since) / (SPAN_MS / MAX_MARKS as u64)).min(last);
        match self.marks.last_mut() {
            Some(mark) if slot(mark.start_ms) == slot(span.start_ms) => {
                mark.holds += span.holds;
                mark.end_ms = mark.end_ms.max(span.end_ms);
                mark.running |= span.running;
                if mark.how != span.how {
                    mark.how = None;
                }
                mark.busy_share = None;
            }
            _ => self.marks.push(span),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::read::Job;
    use proptest::prelude::*;

    const NOW: u64 = 1_796_083_200_000;
    const H: u64 = 3_600_000;

    fn job(start_ms: u64, end_ms: u64, gpus: Vec<u32>) -> Job {
        Job::for_test(0, start_ms, end_ms, gpus, "s")
    }

    #[test]
    fn overlapping_holds_count_once() {
        let jobs = [
            job(NOW - 10 * H, NOW - 8 * H, vec![0]),
            job(NOW - 9 * H, NOW - 6 * H, vec![0, 1]),
            job(NOW - 5 * H, NOW - 4 * H, vec![0]),
            job(NOW - 30 * H, NOW - 23 * H, vec![1]),
        ];
        let days = of(&jobs, NOW);
        assert_eq!(days[&0].held_ms, 5 * H);
        assert_eq!(days[&0].holds, 3);
        // The hold begun before the window counts from its start.
        assert_eq!(days[&1].held_ms, 3 * H + H);
        assert_eq!(days[&1].marks[0].start_ms, NOW - 24 * H);
    }

    #[test]
    fn many_holds_are_drawn_merged_per_slot_and_counted_whole() {
        // A hold a minute, all day: 1,440 holds, 96 marks of 15 each.
        let jobs: Vec<Job> = (0..1440)
            .map(|i| {
                job(
                    NOW - 24 * H + i * 60_000,
                    NOW - 24 * H + i * 60_000 + 30_000,
                    vec![0],
                )
            })
            .collect();
        let day = &of(&jobs, NOW)[&0];
        assert_eq!(day.holds, 1440);
        assert_eq!(day.held_ms, 1440 * 30_000);
        assert_eq!(day.marks.len(), MAX_MARKS);
        assert!(
            day.marks.iter().all(|m| m.holds == 15),
            "{:?}",
            day.marks[0]
        );
        assert_eq!(day.marks[0].how, Some("exit"));
    }

    #[test]
    fn the_lowest_gpus_are_kept() {
        let jobs = [
            job(NOW - H, NOW, (100..164).collect()),
            job(NOW - H, NOW, vec![3]),
        ];
        let days = of(&jobs, NOW);
        assert_eq!(days.len(), MAX_GPUS);
        assert_eq!(days.keys().next(), Some(&3));
        assert!(!days.contains_key(&163));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the jobs, a history holds at most 64 GPUs of at most
        /// 96 marks, inside the window, oldest first, and counts them all.
        #[test]
        fn a_history_is_bounded_whatever_the_jobs(
            jobs in prop::collection::vec(
                (0..NOW + 2 * H, 0..NOW + 2 * H, prop::collection::vec(0u32..200, 0..8)),
                0..400,
            )
        ) {
            let jobs: Vec<Job> = jobs
                .into_iter()
                .map(|(start, end, mut gpus)| {
                    gpus.sort_unstable();
                    gpus.dedup();
                    // Mostly inside the window, some anywhere.
                    let start = if start % 4 == 0 { start } else { NOW - start % (26 * H) };
                    job(start, end, gpus)
                })
                .collect();
            let days = of(&jobs, NOW);
            prop_assert!(days.len() <= MAX_GPUS);
            for day in days.values() {
                prop_assert!(day.marks.len() <= MAX_MARKS);
                prop_assert!(day.held_ms <= SPAN_MS);
                prop_assert_eq!(day.marks.iter().map(|m| m.holds).sum::<u64>(), day.holds);
                prop_assert!(day.marks.windows(2).all(|w| w[0].start_ms <= w[1].start_ms));
                for m in &day.marks {
                    prop_assert!(NOW - SPAN_MS <= m.start_ms && m.start_ms <= m.end_ms);
                    prop_assert!(m.end_ms <= NOW);
                }
            }
        }
    }
}
