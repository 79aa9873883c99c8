//! `devlock status`: gather the report and print it, as a table or as one
//! JSON document (whose schema is doc/status-schema.md).

use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::cli::StatusArgs;
use crate::exit::ExitCode;
use crate::resource::Resource;
use crate::status::print::print_report;
use crate::status::table;
use crate::view as model;

pub(crate) fn run(args: &StatusArgs, dir: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let wanted = Resource::parse_all(&args.resources)?;
    let mut report = model::gather(dir, &wanted, Some(probe_timeout))?;
    // A stop signal cut the look short: end as it asks, not with a report.
    crate::supervise::die_of_pending_stop();
    // Lock files stay forever (deleting one would let two holders in), so
    // after a few typos most are idle: the table shows what is in use, and
    // what was asked for by name.
    report.hide_idle = !args.all && wanted.is_empty();
    print_report(&report, args.json, table::table)
}
