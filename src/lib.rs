//! devlock: machine-wide device locks over flock(2), as a library and a CLI.
//!
//! The binary is a thin layer over this crate; a Rust program can take the
//! same locks with [`Lock::acquire`], which waits in the same fair line as the
//! `devlock` command and passes through a lock this process already holds.
//!
//! The modules below the line are public for the binary and the tests; they
//! are documented for their maintainers, not a stable API.

#![warn(missing_docs)]

#[cfg(feature = "etcd")]
mod etcd;
mod lock;
mod run;
mod setup;
mod status_cmd;
mod wait;

pub mod cli;
pub mod exit;
pub mod resource;

#[doc(hidden)]
pub mod acquire;
#[doc(hidden)]
pub mod cuda;
#[doc(hidden)]
pub mod devices;
#[doc(hidden)]
pub mod interrupt;
#[doc(hidden)]
pub mod lockfile;
#[doc(hidden)]
pub mod probe;
#[doc(hidden)]
pub mod procfs;
#[doc(hidden)]
pub mod queue;
#[doc(hidden)]
pub mod record;
#[doc(hidden)]
pub mod scratch;
#[doc(hidden)]
pub mod status;
#[doc(hidden)]
pub mod supervise;
#[doc(hidden)]
pub mod text;
#[doc(hidden)]
pub mod trust;
#[doc(hidden)]
pub mod tty;
#[doc(hidden)]
pub mod waiters;

pub use lock::{Guard, Lock, Options, Wait};
pub use resource::Resource;

use anyhow::Result;

/// Runs a parsed command line and returns the exit code to end with.
pub fn run(cli: cli::Cli) -> Result<exit::ExitCode> {
    if let Some(cli::Command::Status(args)) = &cli.subcommand {
        args.refuse_command()?;
    }
    if !cli.etcd.is_empty() {
        return run_etcd(cli);
    }
    match cli.subcommand {
        Some(cli::Command::Status(args)) => status_cmd::run(&args, &cli.dir, cli.probe_timeout),
        Some(cli::Command::Setup(args)) => setup::run(&args, &cli.dir, cli.probe_timeout),
        None => run::run(&cli.run, &cli.dir, cli.probe_timeout),
    }
}

#[cfg(feature = "etcd")]
fn run_etcd(cli: cli::Cli) -> Result<exit::ExitCode> {
    let config = etcd::Config::new(&cli.etcd, cli.etcd_user.as_deref())?;
    match cli.subcommand {
        Some(cli::Command::Status(args)) => etcd::status::run(&args, config),
        Some(cli::Command::Setup(_)) => Err(exit::coded(
            exit::ExitCode::Usage,
            "devlock setup prepares the scratch directory; it has nothing to do with --etcd",
        )),
        None => etcd::run::run(&cli.run, config),
    }
}

#[cfg(not(feature = "etcd"))]
fn run_etcd(_cli: cli::Cli) -> Result<exit::ExitCode> {
    Err(exit::coded(
        exit::ExitCode::Usage,
        "this devlock was built without etcd support (--etcd, DEVLOCK_ETCD); \
         build it with `cargo install devlock --features etcd`",
    ))
}
