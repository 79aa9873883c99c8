//! Printing a status report: one JSON document, or a table coloured on a
//! terminal (unless NO_COLOR); for either backend's status.

use std::io::{IsTerminal, Write};

use anyhow::Result;

use crate::exit::ExitCode;

/// Prints a status report, as one JSON document or as `table` renders it
/// (coloured on a terminal unless NO_COLOR, and fitted to its width).
pub(crate) fn print_report<R: serde::Serialize>(
    report: &R,
    json: bool,
    table: fn(&R, crate::status::table::Render) -> String,
) -> Result<ExitCode> {
    let text = if json {
        let mut json = serde_json::to_string_pretty(report)?;
        json.push('\n');
        json
    } else {
        let terminal = std::io::stdout().is_terminal();
        let render = crate::status::table::Render {
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
