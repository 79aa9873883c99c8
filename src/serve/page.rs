//! `/`: a snapshot as one HTML page for a browser, which reloads itself
//! (`<meta http-equiv="refresh">`): no script at all, its CSS inline, no
//! font, image or anything else fetched from anywhere (the favicon is an
//! empty `data:` URL, so the browser does not ask for one either).
//!
//! The page is a legend of its colours, then a card per GPU (`gpu:N`, from
//! the probe's devices and the lock files alike), in index order: the
//! lock's state, the device's name and utilisation, a memory bar (used
//! inside the gate, used outside it, the `--mem` budgets as an outline),
//! the holders, the line, the processes outside the gate and the MIG
//! instances; then a table of every other lock held or waited for (a
//! group's rows held for a member are shown on the member's card, not
//! again); then what status warns about, the last day by user and the
//! site's policy ([`site`]). A card says FREE only when nobody holds the
//! lock and no process outside every gate is on the GPU ("in use outside
//! devlock"), and its processes are known: the badge is about the device,
//! not the lock file. Every text is status's (sanitised), escaped for HTML.
//!
//! A card's last day of use comes from the usage records, which any user
//! writes: [`Snapshot`] carries them bounded (at most 96 marks a GPU, see
//! [`crate::usage::history`]) and [`day`] draws each mark within
//! [`day::MAX_MARK_BYTES`], so the records add at most 48 KiB to a GPU's
//! card however many there are.

mod day;
mod site;

use crate::usage::history::Day;
use day::day;
use std::fmt::Write as _;
use std::time::Duration;

use crate::gpu::device::{Device, DeviceProcess, DeviceReport, MigInstance};
use crate::gpu::memory::size;
use crate::resource::Resource;
use crate::serve::snapshot::Snapshot;
use crate::serve::state_name;
use crate::show::sanitize;
use crate::text::short_duration;
use crate::view::{Holder, HolderSource, ResourceView, State, WaiterSource, WaiterView};

/// The `Content-Type` of the page.
pub(crate) const CONTENT_TYPE: &str = "text/html; charset=utf-8";

/// What the page may load: nothing but its own inline style and the empty
/// `data:` favicon; no script, no frame around it, no form.
pub(crate) const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'; \
     img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// How often the page reloads itself, in seconds.
pub(crate) const RELOAD_SECONDS: u32 = 5;

const STYLE: &str = include_str!("page.css");

/// Text for HTML: status's sanitised text, with `& < > " '` escaped.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in sanitize(text).chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn duration(ms: Option<u64>) -> String {
    ms.map_or("?".to_owned(), |ms| {
        short_duration(Duration::from_millis(ms))
    })
}

/// Where a holder's row is shown.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// On GPU N's card.
    Gpu(u32),
    /// On every GPU's card: it holds the whole group `gpu`.
    Group,
    /// Among the other locks.
    Other,
}

/// One GPU's card: its lock (when it has a lock file) and its device (when
/// the probe lists it).
struct Card<'a> {
    index: u32,
    view: Option<&'a ResourceView>,
    device: Option<&'a Device>,
}

/// The page for `snapshot`, on the machine called `host`.
pub(crate) fn render(snapshot: &Snapshot, host: &str) -> String {
    let report = &snapshot.report;
    let cards = cards(report);
    let group = report.resources.iter().find(|r| r.name == "gpu");
    let mut page = String::with_capacity(16 * 1024);
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta http-equiv=\"refresh\" content=\"{RELOAD_SECONDS}\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <meta name=\"color-scheme\" content=\"light dark\">\n\
         <link rel=\"icon\" href=\"data:,\">\n<title>devlock · {host}</title>\n\
         <style>\n{STYLE}</style>\n</head>\n<body>\n",
        host = esc(host)
    );
    let source = match (&report.device_info, report.device_source) {
        (Some(DeviceReport::Devices(_)), Some(source)) => {
            format!(" · GPUs as {} reports them", esc(source.name()))
        }
        (Some(DeviceReport::Unknown { .. }), _) => " · GPUs unknown".to_owned(),
        _ => String::new(),
    };
    let _ = write!(
        page,
        "<header>\n<h1>devlock <span class=\"host\">on {}</span></h1>\n\
         <p class=\"meta\">as of {}{source} · reloads every {RELOAD_SECONDS} s · \
         <a href=\"/metrics\">/metrics</a> · <a href=\"/status.json\">/status.json</a></p>\n\
         </header>\n",
        esc(host),
        humantime::format_rfc3339_seconds(snapshot.at)
            .to_string()
            .replace('T', " ")
            .replace('Z', " UTC"),
    );
    site::legend(&mut page);
    warnings(&mut page, snapshot);
    let gpus_unknown = matches!(report.device_info, Some(DeviceReport::Unknown { .. }));
    if !cards.is_empty() {
        page.push_str("<section class=\"gpus\">\n");
        for card in &cards {
            let history = snapshot.history.get(&card.index);
            gpu_card(
                &mut page,
                card,
                group,
                history,
                crate::usage::ms_of(snapshot.at),
                gpus_unknown,
            );
        }
        page.push_str("</section>\n");
    }
    others(&mut page, &report.resources);
    site::users(&mut page, snapshot);
    site::policy(&mut page, snapshot);
    let unused = report
        .resources
        .iter()
        .filter(|r| r.state == State::Free && r.waiters.is_empty() && r.in_use_outside.is_empty())
        .count();
    let _ = write!(
        page,
        "<footer>devlock {} · {} lock files in {}, {unused} of them unused</footer>\n</body>\n</html>\n",
        env!("CARGO_PKG_VERSION"),
        report.resources.len(),
        esc(&report.dir)
    );
    page
}

/// A card for every GPU the probe lists and every `gpu:N` lock file.
fn cards(report: &crate::view::StatusReport) -> Vec<Card<'_>> {
    let devices = report.device_info.as_ref().map_or(&[][..], |i| i.devices());
    let mut indices: Vec<u32> = devices.iter().map(|d| d.index).collect();
    indices.extend(report.resources.iter().filter_map(|r| gpu_index(&r.name)));
    indices.sort_unstable();
    indices.dedup();
    indices
        .into_iter()
        .map(|index| Card {
            index,
            view: report
                .resources
                .iter()
                .find(|r| gpu_index(&r.name) == Some(index)),
            device: devices.iter().find(|d| d.index == index),
        })
        .collect()
}

fn gpu_index(name: &str) -> Option<u32> {
    name.parse::<Resource>().ok()?.gpu_index()
}

/// Whether a resource is shown on a card rather than among the others: a
/// GPU or a MIG instance.
fn on_a_card(name: &str) -> bool {
    name.parse::<Resource>()
        .is_ok_and(|r| r.gpu_index().is_some() || r.mig_parent().is_some())
}

/// What a card's badge says: the lock's state, except that a GPU whose
/// lock nobody holds is free only when nothing runs on it outside devlock
/// and its processes are known.
fn badge(state: State, card: &Card, gpus_unknown: bool) -> (&'static str, &'static str) {
    let outside = card
        .device
        .is_some_and(|d| d.processes.iter().any(|p| !p.gated()));
    let unknown = gpus_unknown || card.device.is_some_and(|d| d.processes_unknown.is_some());
    match state {
        State::Free if outside => ("outside", "in use outside devlock"),
        State::Free if unknown => ("unknown", "lock free, use unknown"),
        state => (state_name(state), state_name(state)),
    }
}

fn gpu_card(
    page: &mut String,
    card: &Card,
    group: Option<&ResourceView>,
    history: Option<&Day>,
    now_ms: u64,
    gpus_unknown: bool,
) {
    let state = card.view.map_or(State::Free, |v| v.state);
    let waiting = card.view.map_or(0, |v| v.waiters.len());
    let (class, words) = badge(state, card, gpus_unknown);
    let _ = write!(
        page,
        "<article class=\"gpu {class}\" id=\"gpu-{}\">\n<h2>gpu:{}",
        card.index, card.index
    );
    let _ = write!(page, " <span class=\"state\">{words}</span>");
    let outside = card
        .device
        .map_or(0, |d| d.processes.iter().filter(|p| !p.gated()).count());
    if outside > 0 && class != "outside" {
        let _ = write!(
            page,
            " <span class=\"also-outside\">+{outside} outside devlock</span>"
        );
    }
    if waiting > 0 {
        let _ = write!(page, " <span class=\"waiting\">{waiting} waiting</span>");
    }
    page.push_str("</h2>\n");
    if let Some(device) = card.device {
        let util = device
            .utilization_pct
            .map_or("utilisation unknown".to_owned(), |u| format!("{u}% busy"));
        let _ = writeln!(
            page,
            "<p class=\"model\">{} · {util}</p>",
            esc(&device.name)
        );
        memory(page, device, card.view);
    }
    let _ = writeln!(page, "<table class=\"people\">");
    if let Some(view) = card.view {
        for h in &view.holders {
            holder_row(page, h, Place::Gpu(card.index));
        }
    }
    if let Some(group) = group {
        for h in group.holders.iter().filter(|h| h.via.is_none()) {
            holder_row(page, h, Place::Group);
        }
    }
    if let Some(view) = card.view {
        for w in &view.waiters {
            waiter_row(page, w);
        }
    }
    if let Some(device) = card.device {
        outside_rows(page, device);
    }
    page.push_str("</table>\n");
    if let Some(device) = card.device
        && !device.mig_instances.is_empty()
    {
        instances(page, &device.mig_instances);
    }
    if let Some(history) = history {
        day(page, history, now_ms);
    }
    page.push_str("</article>\n");
}

/// The memory bar and its figures: used inside the gate (the gated
/// processes), used outside it (the rest of what the driver counts: other
/// processes, the driver, memory no process is named for), and the
/// budgets held on the device as an outline.
fn memory(page: &mut String, device: &Device, view: Option<&ResourceView>) {
    let (Some(total), Some(used)) = (device.memory_total_mib, device.memory_used_mib) else {
        page.push_str("<p class=\"figures\">memory unknown</p>\n");
        return;
    };
    let inside: u64 = device
        .processes
        .iter()
        .filter(|p| p.gated())
        .filter_map(|p| p.used_mib)
        .sum::<u64>()
        .min(used);
    let outside = used - inside;
    let budgeted = view
        .and_then(|v| v.memory.as_ref())
        .map(|m| (m.budgets_mib, m.room_mib))
        .filter(|(b, _)| *b > 0);
    let share = |mib: u64| {
        if total == 0 {
            0.0
        } else {
            (mib as f64 * 100.0 / total as f64).min(100.0)
        }
    };
    let _ = write!(
        page,
        "<div class=\"bar\" role=\"img\" aria-label=\"{used} of {total} used\">\
         <span class=\"inside\" style=\"width:{:.1}%\"></span>\
         <span class=\"outside\" style=\"left:{:.1}%;width:{:.1}%\"></span>",
        share(inside),
        share(inside),
        share(outside),
        used = size(used),
        total = size(total),
    );
    if let Some((budgets, _)) = budgeted {
        let _ = write!(
            page,
            "<span class=\"budget\" style=\"width:{:.1}%\"></span>",
            share(budgets)
        );
    }
    page.push_str("</div>\n");
    let mut figures = format!(
        "{} of {} used: <span class=\"key inside\"></span>{} in the gate, \
         <span class=\"key outside\"></span>{} outside",
        size(used),
        size(total),
        size(inside),
        size(outside)
    );
    if let Some((budgets, room)) = budgeted {
        let _ = write!(
            figures,
            " · <span class=\"key budget\"></span>{} budgeted, {} room",
            size(budgets),
            size(room)
        );
    }
    let _ = writeln!(page, "<p class=\"figures\">{figures}</p>");
}

/// A holder: its label (step, or what stands for it), user, for how long,
/// and on a GPU what its processes use there.
fn holder_row(page: &mut String, h: &Holder, place: Place) {
    let pid = h.pid.map(|p| format!("pid {p}")).unwrap_or_default();
    let name = h.name.as_deref().map(esc).unwrap_or_else(|| "?".to_owned());
    let label = match (&h.step, h.source) {
        (Some(step), _) => format!("<b>{}</b>", esc(step)),
        (None, HolderSource::NoRecord) => format!("{name} <i>(no record)</i>"),
        (None, HolderSource::Inherited) => format!("{name} <i>(inherited)</i>"),
        (None, _) => match &h.note {
            Some(note) => format!("<i>unknown: {}</i>", esc(note)),
            None => "<i>unknown</i>".to_owned(),
        },
    };
    let mut notes = Vec::new();
    if place == Place::Group {
        notes.push("holds the whole group gpu".to_owned());
    }
    if let Some(via) = &h.via {
        notes.push(format!("for {}", esc(via)));
    }
    if h.source == HolderSource::Inherited && h.step.is_some() {
        notes.push("inherited: its devlock is gone".to_owned());
    }
    if let Some(mem) = h.mem_mib {
        notes.push(format!(
            "budget {}",
            esc(&crate::status::table::budget_cell(h, mem))
        ));
    }
    if let Place::Gpu(index) = place
        && let Some(used) = h
            .devices
            .iter()
            .find(|d| d.index == index)
            .and_then(|d| d.used_mib)
    {
        notes.push(format!("uses {}", size(used)));
    }
    if let Some(slot) = h.slot {
        notes.push(format!("slot {slot}"));
    }
    if h.stopped {
        notes.push("stopped".to_owned());
    }
    if let Some(idle) = h.idle_for_ms {
        notes.push(format!(
            "idle {}",
            crate::text::short_duration(std::time::Duration::from_millis(idle))
        ));
    }
    if let Some(kept) = crate::messages::busy::kept_phrase(h) {
        notes.push(format!("kept: {}", esc(&kept)));
    }
    if let Some(container) = &h.container {
        notes.push(format!("in {}", esc(container)));
    }
    let class = if h.over_budget == Some(true) || h.stopped || h.idle_for_ms.is_some() {
        "holds warn"
    } else {
        "holds"
    };
    let _ = writeln!(
        page,
        "<tr class=\"{class}\"><th>holds</th><td>{label}</td><td>{}</td><td>held {}</td>\
         <td class=\"notes\">{} <span class=\"pid\">{pid}</span></td></tr>",
        h.user.as_deref().map(esc).unwrap_or_else(|| "?".to_owned()),
        duration(h.held_for_ms),
        notes.join(" · "),
    );
}

/// A waiter: its place, label, user and wait.
fn waiter_row(page: &mut String, w: &WaiterView) {
    let label = match (&w.step, w.source) {
        (Some(step), _) => format!("<b>{}</b>", esc(step)),
        (None, WaiterSource::Unregistered) => "<i>a place in line, no registration</i>".to_owned(),
        (None, _) => "<i>(no record)</i>".to_owned(),
    };
    let mut notes = Vec::new();
    if let Some(mem) = w.mem_mib {
        notes.push(format!("asks {}", size(mem)));
    }
    if w.stopped {
        notes.push("stopped".to_owned());
    }
    let pid = w.pid.map(|p| format!("pid {p}")).unwrap_or_default();
    let _ = writeln!(
        page,
        "<tr class=\"waits\"><th>waits #{}</th><td>{label}</td><td>{}</td><td>waiting {}</td>\
         <td class=\"notes\">{} <span class=\"pid\">{pid}</span></td></tr>",
        w.position,
        w.user.as_deref().map(esc).unwrap_or_else(|| "?".to_owned()),
        duration(w.waiting_for_ms),
        notes.join(" · "),
    );
}

/// The device's processes outside every gate (status's NOT GATED), or that
/// its processes are unknown.
fn outside_rows(page: &mut String, device: &Device) {
    if let Some(why) = &device.processes_unknown {
        let _ = writeln!(
            page,
            "<tr class=\"outside\"><th>processes</th><td colspan=\"4\">unknown: {}</td></tr>",
            esc(why)
        );
        return;
    }
    for p in device.processes.iter().filter(|p| !p.gated()) {
        process_row(page, p);
    }
}

/// A process outside every gate: what this server can know of it. Its
/// user is unknown where `/proc` hides it (another user's process under
/// `hidepid`), and its pid where it runs outside this PID namespace.
fn process_row(page: &mut String, p: &DeviceProcess) {
    let container = p
        .container
        .as_deref()
        .map(|c| format!(" · in {}", esc(c)))
        .unwrap_or_default();
    let user = p.user().map(esc).unwrap_or_else(|| {
        "<i title=\"its owner is hidden from this server (/proc)\">user hidden</i>".to_owned()
    });
    let pid = match p.pid {
        0 => "pid outside this namespace".to_owned(),
        pid => format!("pid {pid}"),
    };
    let _ = writeln!(
        page,
        "<tr class=\"outside\"><th>NOT GATED</th><td>{}</td><td>{user}</td><td>{}</td>\
         <td class=\"notes\">in use outside devlock{container} <span class=\"pid\">{pid}</span></td></tr>",
        esc(&p.name),
        p.used_mib.map_or("memory unknown".to_owned(), size),
    );
}

fn instances(page: &mut String, instances: &[MigInstance]) {
    page.push_str(
        "<table class=\"mig\"><tr><th>MIG instance</th><th>memory</th><th>processes</th></tr>\n",
    );
    for i in instances {
        let name =
            i.name.as_deref().map(esc).unwrap_or_else(|| {
                format!("?:gi{}.ci{}", i.gpu_instance_id, i.compute_instance_id)
            });
        let memory = match (i.memory_used_mib, i.memory_total_mib) {
            (Some(u), Some(t)) => format!("{} of {}", size(u), size(t)),
            _ => "?".to_owned(),
        };
        let processes = match &i.processes_unknown {
            Some(_) => "?".to_owned(),
            None => {
                let outside = i.processes.iter().filter(|p| !p.gated()).count();
                match outside {
                    0 => i.processes.len().to_string(),
                    n => format!("{} ({n} NOT GATED)", i.processes.len()),
                }
            }
        };
        let _ = writeln!(
            page,
            "<tr><td>{name}</td><td>{memory}</td><td>{processes}</td></tr>"
        );
    }
    page.push_str("</table>\n");
}

/// Every other lock held or waited for: not GPUs, not MIG instances, and
/// without the rows a group holds for its members.
fn others(page: &mut String, resources: &[ResourceView]) {
    let shown: Vec<(&ResourceView, Vec<&Holder>)> = resources
        .iter()
        .filter(|r| !on_a_card(&r.name))
        .map(|r| (r, r.holders.iter().filter(|h| h.via.is_none()).collect()))
        .filter(|(r, holders): &(&ResourceView, Vec<&Holder>)| {
            !holders.is_empty() || !r.waiters.is_empty() || r.state == State::Unknown
        })
        .collect();
    if shown.is_empty() {
        return;
    }
    page.push_str(
        "<section class=\"others\">\n<h2>Other locks in use</h2>\n<table class=\"people\">\n",
    );
    for (view, holders) in shown {
        let _ = writeln!(
            page,
            "<tr class=\"resource {}\"><td colspan=\"5\"><b>{}</b> <span class=\"state\">{}</span></td></tr>",
            state_name(view.state),
            esc(&view.name),
            state_name(view.state)
        );
        for h in holders {
            holder_row(page, h, Place::Other);
        }
        for w in &view.waiters {
            waiter_row(page, w);
        }
    }
    page.push_str("</table>\n</section>\n");
}

/// What status warns about, and a GPU source that could not answer.
fn warnings(page: &mut String, snapshot: &Snapshot) {
    let mut lines: Vec<String> = crate::status::table::warnings(&snapshot.report)
        .lines()
        .map(|l| l.strip_prefix("warning: ").unwrap_or(l).to_owned())
        .collect();
    if let Some(DeviceReport::Unknown { reason }) = &snapshot.report.device_info {
        lines.insert(0, format!("GPUs unknown: {reason}"));
    }
    if lines.is_empty() {
        return;
    }
    page.push_str("<section class=\"warnings\">\n<ul>\n");
    for line in lines {
        let _ = writeln!(page, "<li>{}</li>", esc(&line));
    }
    page.push_str("</ul>\n</section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_html() {
        assert_eq!(
            esc("<script>alert('x')</script> & \"q\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;q&quot;"
        );
        assert_eq!(esc("a\u{202e}b\x1b[31m"), "a?b?[31m");
    }
}
