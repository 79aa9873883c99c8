//! devlock: machine-wide device locks over flock(2), as a library and a CLI.
//!
//! The binary is a thin layer over this crate. The library has one take,
//! [`Acquiring`], which the command line and the Python package take through
//! too: the command line's options as a [`Spec`] planned by its rules
//! (groups, members, slots, budgets, the caller's `CUDA_VISIBLE_DEVICES`),
//! a wait that another thread watches, shows and stops, and a [`Busy`] that
//! names the holder. [`Acquiring::hold`] is that take waited for on the
//! calling thread: a Rust program's `devlock NAME --`.
//!
//! The library's API is [`Acquiring`] and [`Hold`] with their options, the
//! typed [`Error`], [`Resource`] and [`status_document`].
//! `cli`, `exit` and `run` are public for the binary (and the bindings'
//! exit codes), `testing` for the integration tests: none of them is part
//! of the library's API (they are hidden from its documentation and may
//! change in any release). Everything else is private to the crate.
//!
//! ```no_run
//! # fn main() -> Result<(), devlock::Error> {
//! let options = devlock::Options {
//!     wait: devlock::Wait::Timeout(std::time::Duration::from_secs(600)),
//!     ..Default::default()
//! };
//! // gpu shared, gpu:0; released when dropped
//! let _gpu = devlock::Acquiring::start(&"gpu:0".into(), &options, &[])?.hold()?;
//! # Ok(())
//! # }
//! ```
//!
//! [`Acquiring::start`] takes a [`Spec`] (a resource's name converts into
//! one) with the locks enclosing holds of this process keep (they pass
//! through), and [`Acquiring::hold`] waits for it on the calling thread,
//! returning the [`Hold`]: the same plan as `devlock NAME --` (a member
//! `gpu:0` takes its group `gpu` shared, `--slots`, `--any`, `--mem`; a GPU
//! outside the caller's `CUDA_VISIBLE_DEVICES` is a usage error), the same
//! files, line, records and typed errors. A [`Spec`] carries `--shared`,
//! `--slots`, `--any`/`--count` (groups included) and
//! `--mem` with `mem_headroom`, `settle` and `mem_strict`: a budget's hold
//! keeps a watch thread for its life ([`Hold::on_budget_event`] hears over
//! budget and, with `mem_strict`, when to stop the work, which the caller
//! does its own way; [`Hold::budget_env`] is what the work learns).
//! [`Acquiring`] is taken at once when free, else waits on a thread of its
//! own that the caller polls (`wait`), shows in the command line's words
//! (`waiting_line`) and stops at once (`cancel`, a timeout), leaving the
//! line. A [`Hold`] that a forked child lets go of leaves its parent's hold
//! alone. [`status_document`] is `devlock status --json`. Every call
//! returns the typed [`Error`]: `Busy` and `Timeout` (a [`Busy`] worded as
//! `devlock -n` and `-w` word it, with the holder), `Usage`, `Unsafe`,
//! `DeviceUnknown`, `NotSupported`, `InUse` and `Other` (and the command
//! line's `Etcd`, `Command`, `Signal`, `Denied`), each with the command
//! line's line and `exit_code()` ([`ExitCodeOf`]).

#![warn(missing_docs)]

// The core's modules, under the paths the front ends have always named
// (`crate::flock::…`): the core is a crate of its own (core/, devlock-core),
// which cannot import what is below.
use devlock_core::{
    error, flock, gpu, hold_event, hold_watch, interrupt, job_env, plan, proc, request, resource,
    show, sys, take, units, usage, view, walk,
};

mod api;
mod cmd;
#[cfg(feature = "etcd")]
mod etcd;
mod known;
mod messages;
mod serve;
mod status;
mod supervise;
mod text;
mod tty;
mod wait_display;
mod watcher;

#[doc(hidden)]
pub mod cli;
#[doc(hidden)]
pub mod exit;
mod report;
#[doc(hidden)]
pub mod testing;

pub use api::{
    Acquiring, BudgetEvent, BudgetSink, HeldLock, Hold, IdleEvent, IdleSink, Kept, Options, Spec,
    Wait, duration_of, status_document,
};
pub use error::{Busy, CommandKind, Error, EtcdKind, Holder, Result};
pub use exit::ExitCodeOf;
pub use resource::Resource;

/// Where locks live unless `--dir` or `DEVLOCK_DIR` say otherwise: the same
/// path for every user and every TMPDIR, so every job on the machine meets
/// the same gate.
pub const DEFAULT_DIR: &str = flock::dir::DEFAULT_DIR;

/// Runs a parsed command line and returns the exit code to end with (for
/// the binary; not part of the library's API).
#[doc(hidden)]
pub fn run(cli: cli::Cli) -> Result<exit::ExitCode> {
    let result = cmd::dispatch(cli).map_err(Error::from);
    if result.as_ref().is_err_and(Error::is_busy) {
        // A stop signal that came while the busy lock's holders were
        // looked up (a look that a stranger's locks can make long) ends
        // the run as it would have, not with the busy code.
        supervise::die_of_pending_stop();
    }
    result
}
