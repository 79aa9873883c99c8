//! A GPU card's last 24 hours on the page, from the usage records: bounded
//! by what it draws, not by what any user wrote.

use std::fmt::Write as _;

use super::esc;
use crate::usage::history::Day;

/// The most a mark of [`day`] takes, in bytes: a GPU's day is at most
/// [`MAX_MARKS`](crate::usage::history::MAX_MARKS) of these and a line.
pub(super) const MAX_MARK_BYTES: usize = 512;

/// The GPU's holds of the last 24 hours, from the usage records: a strip
/// with one mark per hold, or per quarter of an hour's holds when there are
/// more than the strip has marks (its user, step, times and end in its
/// title), and how long it was held in all. The user is cut to 16
/// characters and the step to 24, so that a mark stays within
/// [`MAX_MARK_BYTES`] whatever they hold.
pub(super) fn day(page: &mut String, day: &Day, now_ms: u64) {
    use crate::usage::history::SPAN_MS;
    if day.marks.is_empty() {
        return;
    }
    let since = now_ms.saturating_sub(SPAN_MS);
    let at = |ms: u64| crate::text::utc_seconds(ms)[11..16].to_owned();
    page.push_str("<div class=\"day\" title=\"holds of the last 24 hours\">");
    for s in &day.marks {
        let left = (s.start_ms.saturating_sub(since)) as f64 * 100.0 / SPAN_MS as f64;
        let left = left.min(100.0);
        let width = (s.end_ms.saturating_sub(s.start_ms) as f64 * 100.0 / SPAN_MS as f64)
            .max(0.3)
            .min(100.0 - left);
        let times = format!(
            "{}–{} UTC",
            at(s.start_ms),
            if s.running {
                "now".to_owned()
            } else {
                at(s.end_ms)
            }
        );
        let who = format!("{} · {}", esc_cut(&s.user, 16), esc_cut(&s.step, 24));
        let mut title = if s.holds > 1 {
            format!("{} holds, {times}, the first {who}", s.holds)
        } else {
            format!("{who} · {times}")
        };
        if let Some(share) = s.busy_share {
            title.push_str(&format!(" · computing {:.0}%", share * 100.0));
        }
        if let Some(how) = s.how {
            title.push_str(&format!(" · {}", esc(how)));
        }
        let class = match s.how {
            Some("stopped: idle") => "hold idle",
            _ if s.busy_share.is_some_and(|b| b == 0.0) => "hold idle",
            _ => "hold",
        };
        let before = page.len();
        let _ = write!(
            page,
            "<span class=\"{class}\" style=\"left:{left:.2}%;width:{width:.2}%\" title=\"{title}\"></span>"
        );
        debug_assert!(page.len() - before <= MAX_MARK_BYTES, "{}", &page[before..]);
    }
    page.push_str("</div>\n");
    ticks(page, since);
    let held = std::time::Duration::from_millis(day.held_ms);
    let _ = writeln!(
        page,
        "<p class=\"figures\">last 24 h: held {} by {} {}</p>",
        crate::text::short_duration(held),
        day.holds,
        if day.holds == 1 { "hold" } else { "holds" }
    );
}

/// The strip's labels: its start, every six hours after it (UTC, said
/// once at the start), and now at its end.
fn ticks(page: &mut String, since: u64) {
    use crate::usage::history::SPAN_MS;
    page.push_str("<div class=\"ticks\">");
    for quarter in 0..4u64 {
        let at = since + quarter * SPAN_MS / 4;
        let _ = write!(
            page,
            "<span style=\"left:{}%\">{}{}</span>",
            quarter * 25,
            &crate::text::utc_seconds(at)[11..16],
            if quarter == 0 { " UTC" } else { "" }
        );
    }
    page.push_str("<span style=\"left:100%\">now</span></div>\n");
}

/// [`esc`] of at most `max` characters of `text`, `…` when cut.
fn esc_cut(text: &str, max: usize) -> String {
    let mut out = esc(&text.chars().take(max).collect::<String>());
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::usage::history::{MAX_MARKS, SPAN_MS};
    use crate::usage::read::Job;
    use proptest::prelude::*;

    const NOW: u64 = 1_796_083_200_000;

    /// Steps at their worst for the page: long, every character escaped
    /// or wide, controls and bidi overrides; and short ones.
    fn step() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\"".repeat(300)),
            Just("<&>'".repeat(80)),
            Just("\u{1F600}\u{202E}\u{1b}".repeat(90)),
            "[a-z\"<]{0,30}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the jobs and however many, a GPU's day on the page is
        /// at most 96 marks of at most MAX_MARK_BYTES, every text escaped.
        #[test]
        fn a_gpus_day_is_bounded_whatever_the_jobs(
            jobs in prop::collection::vec(
                (0..SPAN_MS + 3_600_000, 0..SPAN_MS, prop::sample::select(vec![0u32, 65534, 4242]), step()),
                1..300,
            ),
            running in any::<bool>(),
        ) {
            let jobs: Vec<Job> = jobs
                .into_iter()
                .map(|(back, length, uid, step)| {
                    let start = NOW - back;
                    let mut job = Job::for_test(uid, start, start + length, vec![0], &step);
                    if running {
                        job.ending = crate::usage::read::Ending::Running;
                        job.how = None;
                    }
                    job.measured.sampled_gpu_s = 10.0;
                    job
                })
                .collect();
            let history = crate::usage::history::of(&jobs, NOW);
            let Some(gpu) = history.get(&0) else {
                return Ok(());
            };
            let mut page = String::new();
            day(&mut page, gpu, NOW);
            prop_assert!(page.len() <= MAX_MARKS * MAX_MARK_BYTES + 512, "{}", page.len());
            prop_assert!(page.matches("<span class=\"hold").count() <= MAX_MARKS);
            let titles = page.split("title=\"").skip(2);
            for title in titles {
                let title = title.split('"').next().unwrap();
                prop_assert!(!title.contains(['<', '>', '\'']), "{}", title);
                prop_assert!(!title.chars().any(crate::show::is_unsafe_char), "{}", title);
            }
        }
    }
}
