//! The status report rendered for people: the locks table, the warnings
//! under it, and the GPUs table (the JSON is the model itself, serialised).

use std::time::Duration;

use crate::gpu::device::format_mib;
use crate::gpu::device::{Device, DeviceProcess, DeviceReport};
use crate::show::sanitize;
use crate::text::short_duration;
use crate::view::{
    Effect, Holder, HolderSource, OutsideUse, ResourceView, State, StatusReport, WaiterSource,
    WaiterView,
};

mod devices;
use devices::*;

/// How a table is drawn: in colour or not, and fitted to a terminal's
/// width (the longest column shortened, cells cut with `…`, free text
/// wrapped) or, in a pipe, whole: one record a line, for grep.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Render {
    pub(crate) colour: bool,
    pub(crate) width: Option<usize>,
}

/// A table's row: cells aligned in columns, or a line of text of its own
/// (the budget figures under a device's holders) that widens no column.
#[derive(Debug, Clone)]
pub(crate) enum Row {
    Cells(Vec<String>),
    Line(String),
}

/// Renders the report: the locks, what another user could break, then the
/// GPUs when the driver answered.
pub(crate) fn table(report: &StatusReport, render: Render) -> String {
    let mut out = locks_table(report, render);
    out.push_str(&warnings(report));
    match &report.device_info {
        Some(DeviceReport::Unknown { reason }) => {
            out.push_str(&format!("\nGPUs: unknown ({})\n", sanitize(reason)));
        }
        Some(DeviceReport::Devices(devices)) => {
            out.push_str(&devices_table(devices, render));
            if let Some(source) = report.device_source {
                out.push_str(&format!("(GPUs as {} reports them)\n", source.name()));
            }
        }
        _ => {}
    }
    out
}

fn locks_table(report: &StatusReport, render: Render) -> String {
    let columns = Columns {
        devices: report
            .resources
            .iter()
            .any(|r| r.holders.iter().any(|h| !h.devices.is_empty())),
        budgets: report.resources.iter().any(|r| {
            r.holders.iter().any(|h| h.mem_mib.is_some())
                || r.waiters.iter().any(|w| w.mem_mib.is_some())
        }),
    };
    let mut header = vec!["RESOURCE", "STATE", "STEP", "PID", "USER", "FOR"];
    if columns.budgets {
        header.push("BUDGET");
    }
    if columns.devices {
        header.push("ON GPU");
    }
    let mut rows: Vec<Row> = vec![Row::Cells(header.iter().map(|h| h.to_string()).collect())];
    // The GPU's own figures, on lines of their own after the lock rows.
    let mut figures: Vec<Row> = Vec::new();
    let requests = crate::view::requests::waits_on_several(report);
    let hidden = if report.hide_idle {
        report.resources.iter().filter(|r| unused(r)).count()
    } else {
        0
    };
    for res in report
        .resources
        .iter()
        .filter(|res| !(report.hide_idle && unused(res)))
    {
        let state = state_cell(res);
        empty_row(res, &state, &mut rows);
        for (i, h) in res.holders.iter().enumerate() {
            rows.push(Row::Cells(holder_cells(res, h, i == 0, &state, columns)));
        }
        figures.extend(memory_line(res));
        for w in res
            .waiters
            .iter()
            .filter(|w| !requests.iter().any(|r| r.is(w)))
        {
            rows.push(Row::Cells(line_cells(w, columns)));
        }
    }
    for request in &requests {
        let w = request.waiter;
        let state = format!("waits (any){}", if w.stopped { " (stopped)" } else { "" });
        let step = w.step.as_deref().map_or("?".to_owned(), sanitize);
        let cells = waiter_cells(w, request.resources.clone(), state, step, columns.budgets);
        rows.push(Row::Cells(cells));
    }
    rows.extend(figures);
    let mut out = if rows.len() > 1 {
        // STEP, PID and ON GPU give way first.
        let last = 5 + usize::from(columns.budgets) + usize::from(columns.devices);
        align(&rows, render, &[2, 3, last], paint_lock_cell)
    } else {
        String::new()
    };
    if report.resources.is_empty() {
        out.push_str(&format!("(no locks in {})\n", report.dir));
    } else if hidden > 0 {
        let (locks, none_in_use) = match (hidden, rows.len()) {
            (1, 1) => ("lock", "no lock is held or waited for; "),
            (1, _) => ("lock", ""),
            (_, 1) => ("locks", "no lock is held or waited for; "),
            _ => ("locks", ""),
        };
        out.push_str(&format!(
            "({none_in_use}{hidden} unused {locks} not shown: devlock status --all lists them)\n"
        ));
    }
    out
}

/// The optional columns of the locks table.
#[derive(Debug, Clone, Copy)]
struct Columns {
    /// ON GPU: some holder's processes use a GPU.
    devices: bool,
    /// BUDGET: some holder or waiter asked for `--mem`.
    budgets: bool,
}

/// Unused: free as far as status can tell, and nothing in its way. A
/// lock in an unknown state, or one that another user's lock or a
/// renamed file concerns, is never counted away.
fn unused(res: &ResourceView) -> bool {
    res.state == State::Free
        && res.holders.is_empty()
        && res.waiters.is_empty()
        && res.conflicts.is_empty()
        && res.foreign_locks.iter().all(|l| l.effect == Effect::None)
        && res.unknown_name.is_none()
        && res.in_use_outside.is_empty()
}

/// A lock's STATE cell: `free`, `held`, `shared by 2 (4 slots)`.
fn state_cell(res: &ResourceView) -> String {
    let mut state = match res.state {
        // Nobody holds the lock, but its device is not free.
        State::Free if !res.in_use_outside.is_empty() => "in use".to_owned(),
        State::Free => "free".to_owned(),
        State::Held => "held".to_owned(),
        State::Shared => format!("shared by {}", res.holders.len()),
        State::Unknown => "unknown".to_owned(),
    };
    if let Some(slots) = res.slots {
        state.push_str(&format!(" ({slots} slots)"));
    }
    state
}

/// The one row of a lock nobody holds: why its name is unknown, or what
/// else is said of it (used outside the gate, a stale record).
fn empty_row(res: &ResourceView, state: &str, rows: &mut Vec<Row>) {
    if res.holders.is_empty()
        && let Some(why) = &res.unknown_name
    {
        rows.push(Row::Cells(vec![
            res.name.clone(),
            "unknown name".to_owned(),
            format!("({why})"),
        ]));
    } else if res.holders.is_empty() {
        let note = match (&res.stale_record, res.record) {
            _ if !res.in_use_outside.is_empty() => {
                format!("({})", outside_words(&res.in_use_outside))
            }
            (Some(s), _) => format!("(stale record: {} pid {})", sanitize(&s.step), s.pid),
            (None, Some(r)) => format!("({r} record)"),
            _ => String::new(),
        };
        rows.push(Row::Cells(vec![res.name.clone(), state.to_owned(), note]));
    }
}

/// A holder's STEP cell: its step, or why it has none, and what else is
/// known of it in parentheses.
fn holder_step(h: &Holder) -> String {
    let name = h.name.as_deref().map_or(String::new(), sanitize);
    let mut step = match (&h.step, h.source) {
        (Some(step), HolderSource::Inherited) => format!("{} (inherited)", sanitize(step)),
        (Some(step), _) => sanitize(step),
        (None, HolderSource::NoRecord) => format!("({name}, no record)"),
        (None, HolderSource::Inherited) => format!("({name}, inherited)"),
        // Why is in --json's note, and devlock-status(1).
        (None, _) => "(owner hidden from you)".to_owned(),
    };
    if let Some(via) = &h.via {
        step.push_str(&format!(" (via {})", sanitize(via)));
    }
    if let Some(slot) = h.slot {
        step.push_str(&format!(" (slot {slot})"));
    }
    if h.stopped {
        step.push_str(" (stopped)");
    }
    if h.watch_gone {
        step.push_str(" (watch gone)");
    }
    if let Some(idle) = h
        .idle_for_ms
        .filter(|_| h.kept_for_ms.is_none() && h.via.is_none())
    {
        let idle = crate::text::short_duration(std::time::Duration::from_millis(idle));
        step.push_str(&format!(" (idle {idle})"));
    }
    if let Some(kept) = crate::messages::busy::kept_phrase(h) {
        step.push_str(&format!(" (kept: {kept})"));
    }
    if let Some(container) = &h.container {
        step.push_str(&format!(" (in {})", sanitize(container)));
    }
    step
}

/// A holder's row: the lock's name and state on its first.
fn holder_cells(
    res: &ResourceView,
    h: &Holder,
    first: bool,
    state: &str,
    columns: Columns,
) -> Vec<String> {
    let step = holder_step(h);
    // The process the kernel names (the devlock): its command and
    // whatever else holds the lock are in --json's pids.
    let pid = h.pids.first().map_or("?".to_owned(), u32::to_string);
    let mut row = vec![
        if first {
            res.name.clone()
        } else {
            String::new()
        },
        if first {
            state.to_owned()
        } else {
            String::new()
        },
        step,
        pid,
        h.user.as_deref().map_or("?".to_owned(), sanitize),
        duration_cell(h.held_for_ms),
    ];
    if columns.budgets {
        row.push(h.mem_mib.map_or(String::new(), |mem| budget_cell(h, mem)));
    }
    if columns.devices {
        row.push(
            h.devices
                .iter()
                .map(|d| {
                    format!(
                        "{}: {}, {}",
                        d.index,
                        d.used_mib.map_or("?".to_owned(), format_mib),
                        d.utilization_pct
                            .map_or("?%".to_owned(), |u| format!("{u}%"))
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        );
    }
    row
}

/// The memory figures of a lock held with budgets, as a line of its own.
fn memory_line(res: &ResourceView) -> Option<Row> {
    if let Some(m) = &res.memory
        && res.holders.iter().any(|h| h.mem_mib.is_some())
    {
        use crate::gpu::memory::size;
        return Some(Row::Line(format!(
            "{} memory: {} of {} budgeted, {} used by them, {} outside the gate, {} room",
            res.name,
            size(m.budgets_mib),
            size(m.total_mib),
            size(m.used_inside_mib),
            size(m.used_outside_mib),
            size(m.room_mib)
        )));
    }
    None
}

/// A waiter's row in a lock's line.
fn line_cells(w: &WaiterView, columns: Columns) -> Vec<String> {
    let stopped = if w.stopped { " (stopped)" } else { "" };
    let step = match (w.step.as_deref(), w.source) {
        (Some(step), _) => sanitize(step),
        (None, WaiterSource::Unregistered) => "(a place in line, no registration)".to_owned(),
        (None, _) => "(no record)".to_owned(),
    };
    let state = format!("waits #{}{stopped}", w.position);
    waiter_cells(w, String::new(), state, step, columns.budgets)
}

/// `20 GiB, starting`, `20 GiB, over budget: 27 GiB of 20 GiB`
/// A waiter's row: its first cells as the caller words them, then its pid,
/// user, wait and (in a table with budgets) what it asks.
fn waiter_cells(
    w: &WaiterView,
    resource: String,
    state: String,
    step: String,
    with_budgets: bool,
) -> Vec<String> {
    let mut row = vec![
        resource,
        state,
        step,
        w.pid.map_or("?".to_owned(), |p| p.to_string()),
        w.user.as_deref().map_or("?".to_owned(), sanitize),
        duration_cell(w.waiting_for_ms),
    ];
    if with_budgets {
        row.push(w.mem_mib.map_or(String::new(), |mem| {
            format!("asks {}", crate::gpu::memory::size(mem))
        }));
    }
    row
}

pub(crate) fn budget_cell(h: &Holder, mem: u64) -> String {
    use crate::gpu::memory::size;
    let mut words = vec![size(mem)];
    if h.starting == Some(true) {
        words.push("starting".to_owned());
    }
    if h.over_budget == Some(true) {
        let used = h
            .used_mib
            .filter(|&u| u > mem)
            .or(h.over_mib)
            .unwrap_or(mem);
        words.push(format!("over budget: {} of {}", size(used), size(mem)));
    }
    words.join(", ")
}

/// One line for each thing another user could break, each lock devlock did
/// not take, and each holder whose lock file was renamed or removed.
pub(crate) fn warnings(report: &StatusReport) -> String {
    let mut out = String::new();
    let mut issues: Vec<&str> = report
        .trust
        .issues
        .iter()
        .map(|i| i.reason.as_str())
        .collect();
    let mut unsafe_names = Vec::new();
    for res in &report.resources {
        if !res.trust.issues.is_empty() {
            unsafe_names.push(res.name.as_str());
        }
        issues.extend(res.trust.issues.iter().map(|i| i.reason.as_str()));
    }
    if !issues.is_empty() {
        let fix = crate::flock::trust::fix_command(
            Some(std::path::Path::new(&report.dir)),
            unsafe_names.into_iter(),
        );
        out.push_str(&format!(
            "warning: {}; to make them root's: {fix}\n",
            issues.join("; ")
        ));
    }
    for res in &report.resources {
        for l in &res.foreign_locks {
            let who = match (l.pid, &l.user) {
                (Some(pid), Some(user)) => format!("pid {pid}, {}", sanitize(user)),
                (Some(pid), None) => format!("pid {pid}"),
                _ => "owner not visible to this user".to_owned(),
            };
            let effect = match l.effect {
                Effect::None => "no effect on devlock",
                other => other.words(),
            };
            out.push_str(&format!(
                "warning: {}: a {} lock that is not devlock's on bytes {} of {} ({who}): {effect}\n",
                res.name,
                if l.exclusive { "write" } else { "read" },
                l.range,
                l.path
            ));
        }
        for c in &res.conflicts {
            out.push_str(&format!(
                "warning: {}: {} (pid {}, {}) still holds a lock file that was renamed or removed \
                 since {}: another holder may be in beside it\n",
                res.name,
                sanitize(&c.step),
                c.pid,
                c.user.as_deref().map_or("?".to_owned(), sanitize),
                c.since
            ));
        }
    }
    out
}

/// Pads every column to its widest cell; the last column is not padded.
/// Lays `rows` out in columns. To fit a terminal, the columns in `flex`
/// (free text: steps, pid lists, names) are shortened first, the rest
/// only if that is not enough.
pub(crate) fn align(
    rows: &[Row],
    render: Render,
    flex: &[usize],
    paint: fn(usize, &str) -> Option<&'static str>,
) -> String {
    let cells = || {
        rows.iter().filter_map(|r| match r {
            Row::Cells(cells) => Some(cells),
            Row::Line(_) => None,
        })
    };
    let columns = cells().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0usize; columns];
    for row in cells() {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    if let Some(width) = render.width {
        let header = cells().next().map_or(&[][..], |h| h.as_slice());
        fit(&mut widths, header, width, Some(flex));
        fit(&mut widths, header, width, None);
    }
    let mut out = String::new();
    for (n, row) in rows.iter().enumerate() {
        let row = match row {
            Row::Cells(row) => row,
            Row::Line(text) => {
                for line in wrap(text, render.width) {
                    out.push_str(&line);
                    out.push('\n');
                }
                continue;
            }
        };
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            let cell = cut(cell, widths[i]);
            let code = if n == 0 { Some("1") } else { paint(i, &cell) };
            let padded = if i + 1 == row.len() {
                cell
            } else {
                format!("{cell:<width$}  ", width = widths[i])
            };
            match code {
                Some(code) if render.colour => {
                    line.push_str(&format!("\x1b[{code}m{padded}\x1b[0m"))
                }
                _ => line.push_str(&padded),
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Shortens the widest of the columns `among` (all with `None`) until a
/// row fits `width`, none below its header (or 8 characters, whichever is
/// more).
fn fit(widths: &mut [usize], header: &[String], width: usize, among: Option<&[usize]>) {
    let total = |w: &[usize]| w.iter().sum::<usize>() + 2 * w.len().saturating_sub(1);
    let floor = |i: usize| header.get(i).map_or(0, |h| h.chars().count()).max(8);
    let candidate = |i: usize| among.is_none_or(|a| a.contains(&i));
    while total(widths) > width {
        let Some(widest) = (0..widths.len())
            .filter(|&i| candidate(i) && widths[i] > floor(i))
            .max_by_key(|&i| widths[i])
        else {
            return;
        };
        let excess = total(widths) - width;
        let next = (0..widths.len())
            .filter(|&i| i != widest && candidate(i))
            .map(|i| widths[i])
            .max()
            .unwrap_or(0);
        // Down to the next widest (then both shrink in turn), or by the
        // whole excess, never below the floor.
        let step = excess.min(widths[widest] - next.max(floor(widest))).max(1);
        widths[widest] = widths[widest].saturating_sub(step).max(floor(widest));
    }
}

/// `cell` cut to `width` characters, its end replaced by `…`.
fn cut(cell: &str, width: usize) -> String {
    if cell.chars().count() <= width {
        return cell.to_owned();
    }
    let mut short: String = cell.chars().take(width.saturating_sub(1)).collect();
    short.push('…');
    short
}

/// A line of text as it is printed: whole in a pipe; on a terminal wrapped
/// at spaces to its width, continued under its second word.
fn wrap(text: &str, width: Option<usize>) -> Vec<String> {
    let Some(width) = width.filter(|&w| w > 20 && text.chars().count() > w) else {
        return vec![text.to_owned()];
    };
    let indent = text.find(' ').map_or(2, |i| i + 1).min(width / 2);
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        let len = line.chars().count();
        if len > 0 && len + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
            line = " ".repeat(indent);
        } else if len > 0 {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

pub(crate) fn paint_lock_cell(column: usize, cell: &str) -> Option<&'static str> {
    match (column, cell) {
        (1, "free") => Some("32"),
        (1, "in use") => Some("31"),
        (1, c) if c.starts_with("held") || c.starts_with("shared") => Some("33"),
        (1, "unknown" | "unknown name") => Some("35"),
        _ => None,
    }
}

fn paint_device_cell(column: usize, cell: &str) -> Option<&'static str> {
    (column == 8 && cell == "NOT GATED").then_some("1;31")
}

pub(crate) fn duration_cell(ms: Option<u64>) -> String {
    ms.map_or("-".to_owned(), |ms| {
        short_duration(Duration::from_millis(ms))
    })
}
