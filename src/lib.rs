//! devlock: machine-wide device locks over flock(2), as a library and a CLI.
//!
//! The binary is a thin layer over this crate; a Rust program can take the
//! same locks with [`Lock::acquire`].

pub mod acquire;
pub mod cli;
pub mod devices;
pub mod exit;
pub mod interrupt;
mod lock;
pub mod lockfile;
pub mod probe;
pub mod procfs;
pub mod queue;
pub mod record;
pub mod resource;
mod run;
pub mod scratch;
pub mod status;
pub mod supervise;
pub mod text;
mod wait;
pub mod waiters;

pub use lock::{Guard, Lock, Options, Wait};
pub use resource::Resource;

use anyhow::Result;

/// Runs a parsed command line and returns the exit code to end with.
pub fn run(cli: cli::Cli) -> Result<exit::ExitCode> {
    match cli.subcommand {
        Some(cli::Command::Status(args)) => status_cmd::run(&args, &cli.dir, cli.probe_timeout),
        None => run::run(&cli.run, &cli.dir, cli.probe_timeout),
    }
}

mod status_cmd;
