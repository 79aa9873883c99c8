//! `devlock report`'s figures: the jobs of a time window summed by user,
//! resource, step or day, as a table, JSON or CSV.
//!
//! A job counts for the part of it inside the window (and, by day, inside
//! each UTC day): its GPU-hours held are that part's length times its GPUs,
//! and its computing and idle GPU-hours the sampled ones scaled to that
//! part. Its wait counts where it started.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::usage::read::{Ending, Job};

pub(crate) use crate::cli::ReportBy as By;

mod days;
use days::Days;

/// One row's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct Row {
    pub key: String,
    pub jobs: u64,
    /// Wall-clock hours held.
    pub hours: f64,
    pub gpu_hours: f64,
    pub gpu_hours_computing: f64,
    pub gpu_hours_idle: f64,
    /// GPU-hours the sampler covered (computing and idle are of these).
    pub gpu_hours_sampled: f64,
    pub wait_s: f64,
    pub longest_wait_s: f64,
    /// The budgets asked (`--mem`), summed over the jobs that had one.
    pub budget_mib: u64,
    /// Those jobs' peak use, summed.
    pub peak_mib_of_budgeted: u64,
    /// The largest peak of any job.
    pub peak_mib: Option<u64>,
    pub stopped_idle: u64,
    pub stopped_over_budget: u64,
    /// Jobs whose end was observed later (devlock was killed).
    pub observed_later: u64,
    pub running: u64,
}

const HOUR_MS: f64 = 3_600_000.0;
const DAY_MS: u64 = 86_400_000;

/// Sums `jobs` into rows by `by`, over `[since, until)`, with a total.
pub(crate) fn rows(jobs: &[Job], by: By, since: u64, until: u64) -> (Vec<Row>, Row) {
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let mut total = Row {
        key: "total".into(),
        ..Row::default()
    };
    let mut days = Days::default();
    for job in jobs {
        let (start, end) = (job.start.start_ms, job.end_ms.max(job.start.start_ms));
        let (lo, hi) = (start.max(since), end.min(until));
        let overlaps = lo < hi || (start == end && (since..until).contains(&start));
        if !overlaps {
            continue;
        }
        add(&mut total, job, lo, hi, true);
        match by {
            By::Day => days.add(job, lo, hi),
            By::User => add(
                rows.entry(crate::proc::process::user_name(job.uid))
                    .or_default(),
                job,
                lo,
                hi,
                true,
            ),
            By::Step => add(
                rows.entry(job.start.step.clone()).or_default(),
                job,
                lo,
                hi,
                true,
            ),
            By::Resource => {
                let gpus = job_gpus(job).max(1) as f64;
                for resource in &job.start.resources {
                    let row = rows.entry(resource.clone()).or_default();
                    let share = resource_gpus(resource, job) as f64 / gpus;
                    add_share(row, job, lo, hi, true, share);
                }
            }
        }
    }
    if by == By::Day {
        rows = days.rows();
    }
    let rows = rows
        .into_iter()
        .map(|(key, row)| Row { key, ..row })
        .collect();
    (rows, total)
}

/// The GPUs a job held.
fn job_gpus(job: &Job) -> usize {
    if job.measured.gpus.is_empty() {
        job.start.gpus.len()
    } else {
        job.measured.gpus.len()
    }
}

/// Of a job's GPUs, those a resource stands for.
fn resource_gpus(resource: &str, job: &Job) -> usize {
    if resource == crate::gpu::gate::GPU_GROUP {
        return job_gpus(job);
    }
    let parsed = crate::resource::Resource::parse(resource.as_ref()).ok();
    let is_gpu = parsed
        .as_ref()
        .is_some_and(|r| r.gpu_index().is_some() || r.mig_parent().is_some());
    usize::from(is_gpu)
}

fn add(row: &mut Row, job: &Job, lo: u64, hi: u64, started_here: bool) {
    add_share(row, job, lo, hi, started_here, 1.0);
}

/// Adds the part `[lo, hi)` of `job`, `share` of its GPUs.
fn add_share(row: &mut Row, job: &Job, lo: u64, hi: u64, started_here: bool, share: f64) {
    let length = job.end_ms.saturating_sub(job.start.start_ms);
    let part = hi.saturating_sub(lo);
    // The share of the job's measured figures that fall in this part.
    let fraction = if length == 0 {
        1.0
    } else {
        part as f64 / length as f64
    };
    let gpus = job_gpus(job) as f64 * share;
    row.jobs += 1;
    row.hours += part as f64 / HOUR_MS;
    row.gpu_hours += part as f64 / HOUR_MS * gpus;
    let m = &job.measured;
    let scale = fraction * share / 3600.0;
    row.gpu_hours_computing += m.busy_gpu_s * scale;
    row.gpu_hours_idle += m.idle_gpu_s * scale;
    row.gpu_hours_sampled += m.sampled_gpu_s * scale;
    if started_here {
        let wait = job.start.waited_ms as f64 / 1000.0;
        row.wait_s += wait;
        row.longest_wait_s = row.longest_wait_s.max(wait);
        if let Some(budget) = job.start.mem_mib {
            row.budget_mib = row.budget_mib.saturating_add(budget);
            row.peak_mib_of_budgeted = row
                .peak_mib_of_budgeted
                .saturating_add(m.peak_mib.unwrap_or(0));
        }
        if let Some(peak) = m.peak_mib {
            row.peak_mib = Some(row.peak_mib.unwrap_or(0).max(peak));
        }
        match job.how {
            Some(crate::usage::How::Idle) => row.stopped_idle += 1,
            Some(crate::usage::How::OverBudget) => row.stopped_over_budget += 1,
            _ => {}
        }
        match job.ending {
            Ending::ObservedLater => row.observed_later += 1,
            Ending::Running => row.running += 1,
            Ending::Recorded => {}
        }
    }
}

/// `2026-11-30`, the UTC day starting at `ms`.
pub(crate) fn day_name(ms: u64) -> String {
    crate::text::utc_seconds(ms)[..10].to_owned()
}

/// Hours as the table shows them, with the precision they need: `12.5`,
/// `2.25`, and under an hour minutes or seconds (`42m`, `30s`), never
/// `0.00`.
fn hours(h: f64) -> String {
    if h == 0.0 {
        "0".into()
    } else if h < 1.0 / 60.0 {
        format!("{}s", (h * 3600.0).round().max(1.0))
    } else if h < 1.0 {
        format!("{}m", (h * 60.0).round())
    } else if h < 10.0 {
        format!("{h:.2}")
    } else {
        format!("{h:.1}")
    }
}

fn share(part: f64, of: f64) -> String {
    if of <= 0.0 {
        "-".into()
    } else {
        format!("{:.0}%", 100.0 * part / of)
    }
}

/// `20GiB`: a size without its space, to keep the table narrow.
fn mib(m: u64) -> String {
    crate::gpu::memory::size(m).replace(' ', "")
}

/// The widest a row's name is in the table (JSON and CSV keep it whole), so
/// that the table fits a terminal.
const MAX_KEY: usize = 24;

/// `text` cut to `max` characters, the last of them `…`.
fn clip(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max - 1).collect();
    cut.push('…');
    cut
}

/// The table's header, its first column named for `by`.
pub(crate) fn header(by: By) -> [&'static str; 9] {
    let by_name = match by {
        By::User => "USER",
        By::Resource => "RESOURCE",
        By::Step => "STEP",
        By::Day => "DAY (UTC)",
    };
    [
        by_name,
        "JOBS",
        "GPU-H",
        "COMPUTE",
        "IDLE",
        "WAIT",
        "MAX",
        "BUDGET/PEAK",
        "STOPPED",
    ]
}

/// One row's cells, as the table shows them (and `devlock serve`'s page).
pub(crate) fn cells(row: &Row) -> Vec<String> {
    let budget = if row.budget_mib > 0 {
        format!("{}/{}", mib(row.budget_mib), mib(row.peak_mib_of_budgeted))
    } else {
        "-".into()
    };
    let mut stopped = Vec::new();
    if row.stopped_idle > 0 {
        stopped.push(format!("{} idle", row.stopped_idle));
    }
    if row.stopped_over_budget > 0 {
        stopped.push(format!("{} mem", row.stopped_over_budget));
    }
    if row.observed_later > 0 {
        stopped.push(format!("{} killed", row.observed_later));
    }
    vec![
        clip(&crate::show::sanitize(&row.key), MAX_KEY),
        row.jobs.to_string(),
        hours(row.gpu_hours),
        // One number: the share of the sampled GPU time that computed.
        share(row.gpu_hours_computing, row.gpu_hours_sampled),
        hours(row.gpu_hours_idle),
        crate::text::short_duration(crate::text::seconds(row.wait_s)),
        crate::text::short_duration(crate::text::seconds(row.longest_wait_s)),
        budget,
        if stopped.is_empty() {
            "-".into()
        } else {
            stopped.join(", ")
        },
    ]
}

/// The table: one line per row and the total, in columns.
pub(crate) fn table(by: By, rows: &[Row], total: &Row) -> String {
    let header = header(by);
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    lines.extend(rows.iter().chain(std::iter::once(total)).map(cells));
    let columns = header.len();
    let widths = column_widths(&lines, columns);
    let mut out = String::new();
    for line in &lines {
        let mut text = String::new();
        for (c, cell) in line.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 {
                text.push_str(cell);
                text.push_str(&" ".repeat(pad));
            } else {
                text.push_str("  ");
                if c == columns - 1 {
                    text.push_str(cell);
                } else {
                    text.push_str(&" ".repeat(pad));
                    text.push_str(cell);
                }
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    }
    out
}

/// The rows as CSV (RFC 4180: a field with a comma, quote or newline is quoted).
pub(crate) fn csv(rows: &[Row], total: &Row) -> String {
    let mut out = String::from(
        "key,jobs,hours,gpu_hours,gpu_hours_computing,gpu_hours_idle,gpu_hours_sampled,wait_s,\
         longest_wait_s,budget_mib,peak_mib_of_budgeted,peak_mib,stopped_idle,\
         stopped_over_budget,observed_later,running\n",
    );
    for row in rows.iter().chain(std::iter::once(total)) {
        let key = if row.key.contains([',', '"', '\n', '\r']) {
            format!("\"{}\"", row.key.replace('"', "\"\""))
        } else {
            row.key.clone()
        };
        out.push_str(&format!(
            "{key},{},{:.4},{:.4},{:.4},{:.4},{:.4},{:.1},{:.1},{},{},{},{},{},{},{}\n",
            row.jobs,
            row.hours,
            row.gpu_hours,
            row.gpu_hours_computing,
            row.gpu_hours_idle,
            row.gpu_hours_sampled,
            row.wait_s,
            row.longest_wait_s,
            row.budget_mib,
            row.peak_mib_of_budgeted,
            row.peak_mib.map_or(String::new(), |p| p.to_string()),
            row.stopped_idle,
            row.stopped_over_budget,
            row.observed_later,
            row.running
        ));
    }
    out
}

/// One job as `--jobs` lists it in JSON.
#[derive(Debug, Serialize)]
pub(crate) struct JobJson<'a> {
    pub user: String,
    pub job: &'a str,
    pub step: &'a str,
    pub resources: &'a [String],
    pub gpus: &'a [u32],
    pub start: String,
    pub end: String,
    /// `recorded`, `running` or `observed-later`.
    pub ending: &'static str,
    pub how: Option<&'static str>,
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub waited_s: f64,
    pub mem_mib: Option<u64>,
    pub peak_mib: Option<u64>,
    pub busy_gpu_s: f64,
    pub idle_gpu_s: f64,
    pub sampled_gpu_s: f64,
    pub idle_timeout_s: Option<u64>,
    pub from: &'a str,
}

/// `report --jobs`: one row per job, the admin's questions in order (who,
/// on what, when, how long, how much of it computed, how it ended).
pub(crate) fn jobs_table(jobs: &[&Job]) -> String {
    let mut lines: Vec<[String; 7]> = vec![
        [
            "USER",
            "STEP",
            "RESOURCES",
            "START (UTC)",
            "HELD",
            "COMPUTE",
            "ENDED",
        ]
        .map(str::to_owned),
    ];
    for job in jobs {
        let j = job_json(job);
        let held_ms = job.end_ms.saturating_sub(job.start.start_ms);
        lines.push([
            clip(&crate::show::sanitize(&j.user), MAX_KEY),
            clip(&crate::show::sanitize(j.step), MAX_KEY),
            clip(&crate::show::sanitize(&j.resources.join(",")), MAX_KEY),
            j.start.get(..16).unwrap_or(&j.start).replace('T', " "),
            crate::text::short_duration(std::time::Duration::from_millis(held_ms)),
            share(j.busy_gpu_s, j.sampled_gpu_s),
            match (j.how, j.code, j.signal) {
                (Some(how), Some(code), _) => format!("{how} {code}"),
                (Some(how), None, Some(signal)) => format!("{how} (signal {signal})"),
                (how, _, _) => how.unwrap_or(j.ending).to_owned(),
            },
        ]);
    }
    let widths = column_widths(&lines, 7);
    let mut out = String::new();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                let pad = " ".repeat(widths[c] - cell.chars().count());
                match c {
                    4 | 5 => format!("{pad}{cell}"),
                    6 => cell.clone(),
                    _ => format!("{cell}{pad}"),
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

pub(crate) fn job_json(job: &Job) -> JobJson<'_> {
    let at = crate::text::utc_millis;
    JobJson {
        user: crate::proc::process::user_name(job.uid),
        job: &job.start.job,
        step: &job.start.step,
        resources: &job.start.resources,
        gpus: if job.measured.gpus.is_empty() {
            &job.start.gpus
        } else {
            &job.measured.gpus
        },
        start: at(job.start.start_ms),
        end: at(job.end_ms),
        ending: match job.ending {
            Ending::Recorded => "recorded",
            Ending::Running => "running",
            Ending::ObservedLater => "observed-later",
        },
        how: job.how.map(crate::usage::How::label),
        code: job.code,
        signal: job.signal,
        waited_s: job.start.waited_ms as f64 / 1000.0,
        mem_mib: job.start.mem_mib,
        peak_mib: job.measured.peak_mib,
        busy_gpu_s: job.measured.busy_gpu_s,
        idle_gpu_s: job.measured.idle_gpu_s,
        sampled_gpu_s: job.measured.sampled_gpu_s,
        idle_timeout_s: job.start.idle_timeout_s,
        from: &job.start.from,
    }
}

/// The widest cell of each of the first `columns` columns, in characters.
fn column_widths<L: AsRef<[String]>>(lines: &[L], columns: usize) -> Vec<usize> {
    (0..columns)
        .map(|c| {
            lines
                .iter()
                .map(|l| l.as_ref()[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// 2026-12-01T00:00:00Z.
    const NOW: u64 = 1_796_083_200_000;

    /// A job of `gpus` GPUs with its sampled, busy and idle GPU-seconds
    /// (also the by-day sum's tests).
    pub(super) fn job(start: u64, end: u64, gpus: u32, figures: (f64, f64, f64)) -> Job {
        let mut job = Job::for_test(0, start, end, (0..gpus).collect(), "s");
        job.measured.sampled_gpu_s = figures.0;
        job.measured.busy_gpu_s = figures.1;
        job.measured.idle_gpu_s = figures.2;
        job
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever a job says (past what a line may: the sums are safe on
        /// their own), every view of the report is made without a panic, a
        /// line per row.
        #[test]
        fn every_view_of_any_jobs_is_made(
            jobs in prop::collection::vec(
                (
                    (0..NOW + DAY_MS, 0..NOW + DAY_MS, any::<u64>()),
                    (prop::option::of(any::<u64>()), prop::option::of(any::<u64>())),
                    (any::<f64>(), any::<f64>(), any::<f64>()),
                    (prop::collection::vec("[a-z:0-9]{0,8}|\\PC{0,20}", 0..4), "\\PC{0,300}"),
                ),
                0..12,
            ),
            since in NOW - 60 * DAY_MS..NOW,
            far in (any::<u64>(), prop_oneof![Just(u64::MAX), any::<u64>()]),
        ) {
            let jobs: Vec<Job> = jobs
                .into_iter()
                .map(|((start, end, waited), (mem, peak), figures, (resources, step))| {
                    let mut job = job(start, end, 2, figures);
                    job.start.waited_ms = waited;
                    job.start.mem_mib = mem;
                    job.measured.peak_mib = peak;
                    job.start.resources = resources;
                    job.start.step = step;
                    job
                })
                .collect();
            for by in [By::User, By::Resource, By::Step, By::Day] {
                let (rows, total) = rows(&jobs, by, since, NOW + DAY_MS);
                prop_assert_eq!(table(by, &rows, &total).lines().count(), rows.len() + 2);
                let csv = csv(&rows, &total);
                prop_assert!(csv.lines().count() >= rows.len() + 2);
                for line in table(by, &rows, &total).lines() {
                    prop_assert!(!line.chars().any(crate::show::is_unsafe_char));
                }
            }
            for mut job in jobs {
                prop_assert!(serde_json::to_string(&job_json(&job)).is_ok());
                // Far dates, as a line may not say them: still written.
                (job.start.start_ms, job.end_ms) = (far.0, far.1);
                let json = serde_json::to_value(job_json(&job)).unwrap();
                prop_assert!(json["end"].as_str().unwrap().len() <= 24, "{}", json);
            }
        }
    }

    #[test]
    fn small_values_keep_their_precision_and_a_column_holds_one_number() {
        assert_eq!(hours(0.0), "0");
        assert_eq!(hours(30.0 / 3600.0), "30s");
        assert_eq!(hours(0.1 / 3600.0), "1s");
        assert_eq!(hours(0.7), "42m");
        assert_eq!(hours(2.25), "2.25");
        assert_eq!(hours(96.04), "96.0");
        assert_eq!(share(0.7, 1.0), "70%");
    }
}
