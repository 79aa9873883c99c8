//! Each subcommand's entry point: `devlock R -- CMD` ([`run`]), `devlock
//! status` ([`status`]), `devlock setup` ([`setup`]) and `devlock forget`
//! ([`forget`]), for either backend;
//! `devlock serve` is [`crate::serve`]'s, for the lock directory only.

pub(crate) mod forget;
pub(crate) mod report;
pub(crate) mod run;
pub(crate) mod setup;
pub(crate) mod status;

use anyhow::Result;

use crate::cli::{Cli, Command};
use crate::exit::ExitCode;

/// Runs a parsed command line and returns the exit code to end with.
pub(crate) fn dispatch(cli: Cli) -> Result<ExitCode> {
    if let Some(Command::Status(args)) = &cli.subcommand {
        args.refuse_command()?;
    }
    if !cli.etcd.is_empty() {
        return etcd(cli);
    }
    match cli.subcommand {
        Some(Command::Status(args)) => status::run(&args, &cli.dir, cli.probe_timeout),
        Some(Command::Setup(args)) => setup::run(&args, &cli.dir, cli.probe_timeout),
        Some(Command::Serve(args)) => crate::serve::run(&args, &cli.dir, cli.probe_timeout),
        Some(Command::Forget(args)) => forget::run(&args, &cli.dir),
        Some(Command::Report(args)) => report::run(&args, &cli.dir),
        Some(Command::Busy(args)) => report::busy(&args),
        None => run::run(crate::cli::RunPlan::from_args(
            &cli.run,
            &cli.dir,
            cli.probe_timeout,
            false,
        )?),
    }
}

#[cfg(feature = "etcd")]
fn etcd(cli: Cli) -> Result<ExitCode> {
    let tls = crate::etcd::TlsFiles {
        ca: cli.etcd_ca.clone(),
        cert: cli.etcd_cert.clone(),
        key: cli.etcd_key.clone(),
    };
    let config =
        crate::etcd::Config::new(&cli.etcd, cli.etcd_user.as_deref(), &tls, &cli.etcd_prefix)?;
    match cli.subcommand {
        Some(Command::Status(args)) => crate::etcd::status::run(&args, config),
        Some(Command::Setup(_)) => Err(crate::error::usage(
            "devlock setup prepares the scratch directory; it has nothing to do with --etcd",
        )),
        Some(Command::Serve(_)) => Err(crate::error::usage(crate::messages::serve::not_for_etcd())),
        Some(Command::Report(args)) => report::run(&args, &cli.dir),
        Some(Command::Busy(args)) => report::busy(&args),
        Some(Command::Forget(_)) => Err(crate::error::usage(
            "devlock forget removes lock files in the scratch directory; it has nothing to do with --etcd",
        )),
        None => {
            let plan = crate::cli::RunPlan::from_args(&cli.run, &cli.dir, cli.probe_timeout, true)?;
            crate::etcd::run::run(plan, config)
        }
    }
}

#[cfg(not(feature = "etcd"))]
fn etcd(_cli: Cli) -> Result<ExitCode> {
    Err(crate::error::usage(crate::messages::HOW_TO_GET_ETCD))
}
