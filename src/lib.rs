//! devlock: machine-wide device locks over flock(2), as a library and a CLI.
//!
//! The binary is a thin layer over this crate. The library has one take,
//! [`Acquiring`], which the command line and the Python package take through
//! too: the command line's options as a [`Spec`] planned by its rules
//! (groups, members, slots, budgets, the caller's `CUDA_VISIBLE_DEVICES`),
//! a wait that another thread watches, shows and stops, and a [`Busy`] that
//! names the holder. [`Lock::acquire`] is that take waited for on the
//! calling thread: a Rust program's `devlock NAME --`.
//!
//! The library's API is [`Lock`], [`Acquiring`] and [`Hold`] with their
//! options, the typed [`Error`], [`Resource`] and [`status_document`].
//! `cli`, `exit` and `run` are public for the binary (and the bindings'
//! exit codes), `testing` for the integration tests: none of them is part
//! of the library's API (they are hidden from its documentation and may
//! change in any release). Everything else is private to the crate.

#![warn(missing_docs)]

mod api;
mod cmd;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod flock;
mod gpu;
mod interrupt;
mod known;
mod messages;
mod names;
mod plan;
mod proc;
mod request;
mod serve;
mod status;
mod supervise;
mod sys;
mod take;
mod text;
mod tty;
mod usage;
mod wait_display;
mod watcher;

#[doc(hidden)]
pub mod cli;
#[doc(hidden)]
pub mod exit;
mod resource;
#[doc(hidden)]
pub mod testing;

pub use api::{
    Acquiring, BudgetEvent, BudgetSink, HeldLock, Hold, IdleEvent, IdleSink, Kept, Lock, Options,
    Spec, Wait, duration_of, status_document,
};
pub use error::{Busy, Error, Holder, NotSupported, Result};
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
