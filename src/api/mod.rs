//! The library façade: what a Rust program (and the bindings built on it)
//! takes, over the same files, line and rules as the command line.

mod hold;
mod keep;
mod options;
mod spec;
mod take;
mod watch;

use std::path::Path;
use std::time::Duration;

pub use crate::plan::Spec;
pub use crate::take::HeldLock;
pub use hold::Hold;
pub use keep::Kept;
pub use options::{Options, Wait};
pub use spec::duration_of;
pub use take::Acquiring;
pub use watch::{BudgetEvent, BudgetSink, IdleEvent, IdleSink};

use crate::error::{Error, Result};
use crate::resource::Resource;

/// The same document as `devlock status --json [RESOURCE...]` (pretty JSON
/// with a final newline); with `probe_timeout`, the GPUs too.
pub fn status_document(
    dir: &Path,
    resources: &[String],
    probe_timeout: Option<Duration>,
) -> Result<String> {
    let document = || -> anyhow::Result<String> {
        let names: Vec<std::ffi::OsString> = resources.iter().map(Into::into).collect();
        let wanted = Resource::parse_all(&names)?;
        let report = crate::view::gather(dir, &wanted, probe_timeout)?;
        let mut json = serde_json::to_string_pretty(&report)?;
        json.push('\n');
        Ok(json)
    };
    document().map_err(Error::from)
}
