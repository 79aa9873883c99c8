//! `devlock report`: the usage records summed ([`crate::report`]),
//! and `devlock busy`.

use std::time::SystemTime;

use anyhow::Result;

use crate::cli::{BusyArgs, ReportArgs};
use crate::exit::ExitCode;
use crate::report;
use crate::usage::{self, ms_of, read};

pub(crate) fn run(args: &ReportArgs, lock_dir: &std::path::Path) -> Result<ExitCode> {
    let now = SystemTime::now();
    let since = when(&args.since, now, "--since")?;
    let until = match &args.until {
        Some(text) => when(text, now, "--until")?,
        None => now,
    };
    let (since, until) = (ms_of(since), ms_of(until));
    if until < since {
        return Err(crate::error::usage("--until comes before --since"));
    }
    let Some(dir) = usage::dir_at(lock_dir) else {
        return Err(crate::error::usage(
            "no usage records are kept (DEVLOCK_USAGE_DIR=none, or devlock setup --usage-dir \
             none), so there is nothing to report",
        ));
    };
    let (jobs, notes) = match read::jobs(&dir, ms_of(now)) {
        Ok(found) => found,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), Vec::new()),
        Err(e) => {
            return Err(crate::error::unsafe_file(format!(
                "{}: {}",
                dir.display(),
                crate::proc::os_text(&e)
            )));
        }
    };
    let jobs: Vec<read::Job> = jobs
        .into_iter()
        .filter(|job| chosen(job, args.user.as_deref(), args.resource.as_deref()))
        .collect();
    let (rows, total) = report::rows(&jobs, args.by, since, until);
    if args.json {
        let listed: Vec<_> = jobs
            .iter()
            .filter(|j| j.start.start_ms < until && j.end_ms.max(j.start.start_ms) >= since)
            .map(report::job_json)
            .collect();
        let at = crate::text::utc_seconds;
        let doc = serde_json::json!({
            "dir": dir,
            "since": at(since),
            "until": at(until),
            "by": format!("{:?}", args.by).to_lowercase(),
            "rows": rows,
            "total": total,
            "jobs": listed,
            "notes": notes,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::Success);
    }
    for note in &notes {
        // Whole: devlock's own words, a file's name in them cleaned.
        eprintln!("devlock: note: {}", crate::show::clean(note));
    }
    if args.jobs {
        let listed: Vec<&read::Job> = jobs
            .iter()
            .filter(|j| j.start.start_ms < until && j.end_ms.max(j.start.start_ms) >= since)
            .collect();
        print!("{}", report::jobs_table(&listed));
    } else if args.csv {
        print!("{}", report::csv(&rows, &total));
    } else {
        print!("{}", report::table(args.by, &rows, &total));
    }
    Ok(ExitCode::Success)
}

pub(crate) fn busy(args: &BusyArgs) -> Result<ExitCode> {
    usage::idle::say_busy(args.duration)?;
    Ok(ExitCode::Success)
}

/// Whether `job` passes `--user` (its records' owner, by name or uid) and
/// `--resource` (held exactly, or a member of it: `gpu` takes `gpu:0`).
fn chosen(job: &read::Job, user: Option<&str>, resource: Option<&str>) -> bool {
    let user_ok = user
        .is_none_or(|u| u == job.uid.to_string() || u == crate::proc::process::user_name(job.uid));
    let resource_ok = resource.is_none_or(|r| {
        job.start.resources.iter().any(|held| {
            held == r
                || held
                    .strip_prefix(r)
                    .is_some_and(|rest| rest.starts_with(':'))
        })
    });
    user_ok && resource_ok
}

/// `7d` (back from now), `2026-11-30` or `2026-11-30T08:00:00Z` (UTC).
fn when(text: &str, now: SystemTime, flag: &str) -> Result<SystemTime> {
    if let Ok(back) = crate::units::parse_duration(text) {
        return Ok(now.checked_sub(back).unwrap_or(SystemTime::UNIX_EPOCH));
    }
    let full = if text.len() == 10 {
        format!("{text}T00:00:00Z")
    } else {
        text.to_owned()
    };
    humantime::parse_rfc3339_weak(&full).map_err(|_| {
        crate::error::usage(format!(
            "{flag} {}: neither a duration back from now (7d, 12h) nor a UTC time \
                 (2026-11-30, 2026-11-30T08:00:00Z)",
            crate::show::sanitize(text)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn windows_are_durations_back_or_utc_times() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10 * 86400);
        assert_eq!(
            when("7d", now, "--since").unwrap(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(3 * 86400)
        );
        assert_eq!(
            when("1970-01-02", now, "--since").unwrap(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(86400)
        );
        assert_eq!(
            when("1970-01-02T01:00:00Z", now, "--since").unwrap(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(86400 + 3600)
        );
        assert!(when("yesterday", now, "--since").is_err());
    }
}
