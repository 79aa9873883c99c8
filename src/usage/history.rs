//! The last day's holds of each GPU, from the usage records: what `devlock
//! serve` draws under each GPU and counts in its metrics.

use std::collections::BTreeMap;

use super::read::{Ending, Job};

/// How far back the history goes.
pub(crate) const SPAN_MS: u64 = 24 * 3_600_000;

/// One hold of one GPU, clipped to the history's window.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Span {
    pub start_ms: u64,
    pub end_ms: u64,
    pub user: String,
    pub step: String,
    /// How it ended, if it did (`None` while it runs or when unseen).
    pub how: Option<&'static str>,
    pub running: bool,
    /// The share of its sampled time its GPUs computed, if sampled.
    pub busy_share: Option<f64>,
}

/// Each GPU's holds in `[now - SPAN_MS, now]`, oldest first.
pub(crate) fn of(jobs: &[Job], now_ms: u64) -> BTreeMap<u32, Vec<Span>> {
    let since = now_ms.saturating_sub(SPAN_MS);
    let mut by_gpu: BTreeMap<u32, Vec<Span>> = BTreeMap::new();
    for job in jobs {
        let (start, end) = (job.start.start_ms, job.end_ms.max(job.start.start_ms));
        if end < since || start > now_ms {
            continue;
        }
        let gpus = if job.measured.gpus.is_empty() {
            &job.start.gpus
        } else {
            &job.measured.gpus
        };
        let m = &job.measured;
        let busy_share = (m.sampled_gpu_s > 0.0).then(|| m.busy_gpu_s / m.sampled_gpu_s);
        for gpu in gpus {
            by_gpu.entry(*gpu).or_default().push(Span {
                start_ms: start.max(since),
                end_ms: end.min(now_ms),
                user: crate::proc::process::user_name(job.uid),
                step: job.start.step.clone(),
                how: job.how.map(super::How::label),
                running: job.ending == Ending::Running,
                busy_share,
            });
        }
    }
    for spans in by_gpu.values_mut() {
        spans.sort_by_key(|s| s.start_ms);
    }
    by_gpu
}

/// Milliseconds of the window in which some hold held the GPU (overlapping
/// holds, as budgets share a GPU, count once).
pub(crate) fn held_ms(spans: &[Span]) -> u64 {
    let mut total = 0;
    let mut reach = 0;
    for s in spans {
        let start = s.start_ms.max(reach);
        if s.end_ms > start {
            total += s.end_ms - start;
        }
        reach = reach.max(s.end_ms);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start_ms: u64, end_ms: u64) -> Span {
        Span {
            start_ms,
            end_ms,
            user: "u".into(),
            step: "s".into(),
            how: None,
            running: false,
            busy_share: None,
        }
    }

    #[test]
    fn overlapping_holds_count_once() {
        assert_eq!(held_ms(&[span(0, 10), span(5, 20), span(30, 40)]), 30);
        assert_eq!(held_ms(&[span(0, 40), span(5, 20)]), 40);
    }
}
