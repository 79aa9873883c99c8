//! `devlock status`: gather the report and print it, as a table or as one
//! JSON document (whose schema is doc/status-schema.md).

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::cli::StatusArgs;
use crate::exit::ExitCode;
use crate::resource::Resource;
use crate::status::{model, table};

pub(crate) fn run(args: &StatusArgs, dir: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let wanted = Resource::parse_all(&args.resources)?;
    let mut report = model::gather(dir, &wanted, Some(probe_timeout))?;
    // Lock files stay forever (deleting one would let two holders in), so
    // after a few typos most are idle: the table shows what is in use, and
    // what was asked for by name.
    report.hide_idle = !args.all && wanted.is_empty();
    print_report(&report, args.json, table::table)
}

/// Prints a status report, as one JSON document or as `table` renders it
/// (coloured on a terminal, unless NO_COLOR). Shared with `status --etcd`.
pub(crate) fn print_report<R: serde::Serialize>(
    report: &R,
    json: bool,
    table: fn(&R, table::Render) -> String,
) -> Result<ExitCode> {
    let text = if json {
        let mut json = serde_json::to_string_pretty(report)?;
        json.push('\n');
        json
    } else {
        let terminal = std::io::stdout().is_terminal();
        let render = table::Render {
            colour: terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            width: terminal
                .then(|| crate::sys::tty::columns(std::io::stdout()))
                .flatten(),
        };
        table(report, render)
    };
    // A reader that stops early (`| head`) is not an error.
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(ExitCode::Success),
    }
}
