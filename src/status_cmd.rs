//! `devlock status`: the report as an aligned table or one JSON document.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::cli::StatusArgs;
use crate::exit::{ExitCode, coded};
use crate::resource::Resource;
use crate::status::{self, StatusReport};
use crate::text::{sanitize, short_duration};

pub fn run(args: &StatusArgs, dir: &Path) -> Result<ExitCode> {
    let wanted = args
        .resources
        .iter()
        .map(|r| Resource::parse(r).map_err(|e| coded(ExitCode::Usage, e)))
        .collect::<Result<Vec<_>>>()?;
    let report = status::gather(dir, &wanted)?;
    let text = if args.json {
        let mut json = serde_json::to_string_pretty(&report)?;
        json.push('\n');
        json
    } else {
        let colour = std::io::stdout().is_terminal()
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        table(&report, colour)
    };
    // A reader that stops early (`| head`) is not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::Success),
    }
}

const HEADER: [&str; 6] = ["RESOURCE", "STATE", "STEP", "PID", "USER", "FOR"];

/// Renders the report as aligned columns, one row per holder and per waiter.
pub fn table(report: &StatusReport, colour: bool) -> String {
    let mut rows: Vec<[String; 6]> = vec![HEADER.map(str::to_owned)];
    for res in &report.resources {
        let state = match (res.state, res.holders.len()) {
            ("shared", n) => format!("shared by {n}"),
            (state, _) => state.to_owned(),
        };
        if res.holders.is_empty() {
            let note = match (&res.stale_record, res.record) {
                (Some(s), _) => format!("(stale record: {} pid {})", sanitize(&s.step), s.pid),
                (None, Some(r)) => format!("({r} record)"),
                _ => String::new(),
            };
            rows.push([
                res.name.clone(),
                state.clone(),
                note,
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
        for (i, h) in res.holders.iter().enumerate() {
            let step = match (&h.step, h.source) {
                (Some(step), "inherited") => format!("{} (inherited)", sanitize(step)),
                (Some(step), _) => sanitize(step),
                (None, "no-record") => format!(
                    "({}, no record)",
                    h.command
                        .as_ref()
                        .map_or(String::new(), |c| sanitize(&c.join(" ")))
                ),
                (None, _) => "(unknown)".to_owned(),
            };
            let pids = if h.pids.is_empty() {
                "?".to_owned()
            } else {
                h.pids
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let name = if i == 0 {
                res.name.clone()
            } else {
                String::new()
            };
            rows.push([
                name,
                if i == 0 { state.clone() } else { String::new() },
                step,
                pids,
                h.user.as_deref().map_or("?".to_owned(), sanitize),
                duration_cell(h.held_for_ms),
            ]);
        }
        for w in &res.waiters {
            rows.push([
                String::new(),
                format!("waits #{}", w.position),
                w.step.as_deref().map_or("(no record)".to_owned(), sanitize),
                w.pid.to_string(),
                w.user.as_deref().map_or("?".to_owned(), sanitize),
                duration_cell(w.waiting_for_ms),
            ]);
        }
    }
    let mut widths = [0usize; 6];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for (n, row) in rows.iter().enumerate() {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            let padded = if i + 1 == row.len() {
                cell.clone()
            } else {
                format!("{cell:<width$}  ", width = widths[i])
            };
            line.push_str(&paint(&padded, n, i, cell, colour));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    if report.resources.is_empty() {
        out.push_str(&format!("(no locks in {})\n", report.dir));
    }
    out
}

fn paint(padded: &str, row: usize, column: usize, cell: &str, colour: bool) -> String {
    if !colour {
        return padded.to_owned();
    }
    let code = match (row, column, cell) {
        (0, _, _) => "1",
        (_, 1, "free") => "32",
        (_, 1, c) if c.starts_with("held") || c.starts_with("shared") => "33",
        _ => return padded.to_owned(),
    };
    format!("\x1b[{code}m{padded}\x1b[0m")
}

fn duration_cell(ms: Option<u64>) -> String {
    ms.map_or("-".to_owned(), |ms| {
        short_duration(Duration::from_millis(ms))
    })
}
