//! The page's parts about the whole machine rather than one lock: the
//! legend of its colours, the last day's use by user (`devlock report`'s
//! own rows and cells) and the site's policy in force.

use std::fmt::Write as _;

use super::esc;
use crate::gpu::memory::size;
use crate::report;
use crate::serve::snapshot::Snapshot;
use crate::view::State;

/// Every colour the page paints with, and what it means: one `key` swatch
/// each, its class the CSS variable's name (a test checks that each colour
/// the style uses is here). Grouped as the page shows them.
const LEGEND: [(&str, &[(&str, &str)]); 3] = [
    (
        "Locks",
        &[
            (
                "free",
                "free: nobody holds it, nothing runs on it outside devlock",
            ),
            ("held", "held, or waiting in its line"),
            ("shared", "held shared (--shared, --slots, --mem budgets)"),
            (
                "outside",
                "in use outside devlock: a process on the GPU holds no lock",
            ),
            ("idle", "a holder idle, stopped or over its budget"),
            ("unknown", "unknown to this server"),
        ],
    ),
    (
        "Memory",
        &[
            ("inside", "used by the jobs holding the lock"),
            ("outside", "used outside the gate"),
            ("budget", "budgets held (--mem)"),
        ],
    ),
    (
        "Last 24 h",
        &[
            ("inside", "a hold"),
            ("idle", "a hold whose GPU computed nothing"),
        ],
    ),
];

/// The legend: a swatch and its meaning for every colour on the page.
pub(super) fn legend(page: &mut String) {
    page.push_str("<section class=\"legend\" aria-label=\"legend\">\n");
    for (group, keys) in LEGEND {
        let _ = write!(page, "<p><b>{group}</b>");
        for (key, words) in keys {
            let _ = write!(
                page,
                " <span class=\"entry\"><span class=\"key {key}\"></span>{}</span>",
                esc(words)
            );
        }
        page.push_str("</p>\n");
    }
    page.push_str("</section>\n");
}

/// Most users listed; the rest are counted in a line (and in the total).
pub(super) const MAX_USERS: usize = 32;

/// The last day by user: `devlock report --by user --since 24h`'s rows,
/// each cell as the report writes it, and its total.
pub(super) fn users(page: &mut String, snapshot: &Snapshot) {
    let users = &snapshot.users;
    page.push_str("<section class=\"users\">\n<h2>Last 24 hours by user</h2>\n");
    let Some(dir) = &users.dir else {
        page.push_str(
            "<p class=\"figures\">no usage records are kept (DEVLOCK_USAGE_DIR=none)</p>\n</section>\n",
        );
        return;
    };
    let dir = esc(&crate::show::show_path(dir));
    if users.rows.is_empty() {
        let _ = writeln!(
            page,
            "<p class=\"figures\">no hold recorded in {dir} in the last 24 hours</p>\n</section>"
        );
        return;
    }
    page.push_str("<table class=\"report\">\n<tr>");
    for name in report::header(report::By::User) {
        let _ = write!(page, "<th>{name}</th>");
    }
    page.push_str("</tr>\n");
    let row = |page: &mut String, row: &report::Row, class: &str| {
        let _ = write!(page, "<tr class=\"{class}\">");
        for cell in report::cells(row) {
            let _ = write!(page, "<td>{}</td>", esc(&cell));
        }
        page.push_str("</tr>\n");
    };
    for user in users.rows.iter().take(MAX_USERS) {
        row(page, user, "user");
    }
    row(page, &users.total, "total");
    page.push_str("</table>\n");
    let more = users.rows.len().saturating_sub(MAX_USERS);
    if more > 0 {
        let _ = writeln!(
            page,
            "<p class=\"figures\">{more} more users in the total: devlock report --by user --since 24h lists them</p>"
        );
    }
    let _ = writeln!(
        page,
        "<p class=\"figures\">from the usage records in {dir}, as <code>devlock report --by user --since 24h</code> sums them \
         (GPU-H: GPU-hours held; COMPUTE: the share of the sampled GPU time that computed)</p>\n</section>"
    );
}

/// The policy in force: how the lock directory is set up, the site's idle
/// timeout, the memory budgets held, and where use is recorded.
pub(super) fn policy(page: &mut String, snapshot: &Snapshot) {
    let report = &snapshot.report;
    let dir = esc(&report.dir);
    let mut items = Vec::new();
    items.push(if report.trust.managed && report.trust.safe {
        format!("<b>Set up</b>: {dir} is root's (devlock setup): no user can rename, remove or replace another's lock files")
    } else if report.trust.managed {
        format!("<b>Set up, with a fault</b>: {dir} is root's, but another user can swap a file in it (see the warnings; <code>sudo devlock setup</code> mends it)")
    } else {
        format!("<b>Not set up</b>: another user can rename or replace the lock files in {dir}; <code>sudo devlock setup</code> makes them root's")
    });
    items.push(match snapshot.idle_ceiling {
        Some(ceiling) => format!(
            "<b>Idle timeout</b>: {}, the site's ceiling: a job whose GPUs compute nothing that long is stopped; a job may ask for a shorter one, not a longer one",
            crate::text::short_duration(ceiling)
        ),
        None => "<b>Idle timeout</b>: none for the site (a job stops when idle only if it asks, with --idle-timeout; <code>devlock setup --idle-timeout</code> sets one)".to_owned(),
    });
    let budgets: Vec<String> = report
        .resources
        .iter()
        .filter(|r| r.state != State::Unknown)
        .filter_map(|r| {
            let m = r.memory.as_ref().filter(|m| m.budgets_mib > 0)?;
            Some(format!(
                "{} {} of {}",
                esc(&r.name),
                size(m.budgets_mib),
                size(m.total_mib)
            ))
        })
        .collect();
    items.push(if budgets.is_empty() {
        "<b>Memory budgets</b>: none held (a job asks for one with --mem; without, it holds the whole GPU)".to_owned()
    } else {
        format!(
            "<b>Memory budgets</b> held: {} (a job is let in while the budgets, the use outside them and its headroom fit)",
            budgets.join(", ")
        )
    });
    items.push(match &snapshot.users.dir {
        Some(dir) => format!(
            "<b>Usage records</b>: kept in {} (devlock report)",
            esc(&crate::show::show_path(dir))
        ),
        None => "<b>Usage records</b>: not kept".to_owned(),
    });
    page.push_str("<section class=\"policy\">\n<h2>Site policy</h2>\n<ul>\n");
    for item in items {
        let _ = writeln!(page, "<li>{item}</li>");
    }
    page.push_str("</ul>\n</section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every colour variable the style paints with (all but the page's
    /// neutral ones) has its swatch in the legend.
    #[test]
    fn the_legend_names_every_colour_the_style_uses() {
        let neutral = ["bg", "card", "text", "dim", "line", "track"];
        let mut shown = String::new();
        legend(&mut shown);
        let mut used: Vec<&str> = super::super::STYLE
            .split("var(--")
            .skip(1)
            .filter_map(|rest| rest.split(')').next())
            .filter(|name| !neutral.contains(name))
            .collect();
        used.sort_unstable();
        used.dedup();
        assert!(used.len() >= 7, "{used:?}");
        for name in used {
            assert!(
                shown.contains(&format!("class=\"key {name}\"")),
                "{name} is not in the legend: {shown}"
            );
        }
    }
}
