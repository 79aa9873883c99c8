//! The common command line, read without clap.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use super::{Cli, RunArgs, SUBCOMMANDS};

/// The command line most runs have, `devlock [-n] [-q] [-s] [--step NAME]
/// [--dir DIR] RESOURCE... -- COMMAND...`, read without clap: building
/// clap's tree of every flag and its help costs about a fifth of an
/// uncontended run's instructions. Anything else (another flag, a repeated
/// one, `--flag=value`, a value that looks like a flag, no `--`, a
/// subcommand's name, text that is not UTF-8 where clap wants a string, an
/// etcd variable in the environment) is `None`, for clap to parse, and
/// what this returns is what clap returns (a unit test holds them
/// together).
pub(super) fn common_run(args: &[OsString]) -> Option<Cli> {
    if std::env::vars_os().any(|(name, _)| name.as_encoded_bytes().starts_with(b"DEVLOCK_ETCD")) {
        return None;
    }
    let dash = args.iter().position(|a| a == "--")?;
    let (before, command) = (args.get(1..dash)?, &args[dash + 1..]);
    if command.is_empty() {
        return None;
    }
    let (mut no_wait, mut quiet, mut shared) = (false, false, false);
    let (mut step, mut dir): (Option<String>, Option<PathBuf>) = (None, None);
    let mut resources = Vec::new();
    let mut words = before.iter();
    while let Some(word) = words.next() {
        let set = |flag: &mut bool| (!std::mem::replace(flag, true)).then_some(());
        match word.to_str() {
            Some("-n" | "--no-wait") => set(&mut no_wait)?,
            Some("-q" | "--quiet") => set(&mut quiet)?,
            Some("-s" | "--shared") => set(&mut shared)?,
            Some(flag @ ("--step" | "--dir")) => {
                let value = words.next()?;
                let text = value.to_str()?;
                if text.is_empty() || text.starts_with('-') {
                    return None;
                }
                if flag == "--step" && step.replace(text.to_owned()).is_some()
                    || flag == "--dir" && dir.replace(PathBuf::from(value)).is_some()
                {
                    return None;
                }
            }
            Some(word)
                if word.is_empty() || word.starts_with('-') || SUBCOMMANDS.contains(&word) =>
            {
                return None;
            }
            _ if word.as_encoded_bytes().starts_with(b"-") => return None,
            _ => resources.push(word.clone()),
        }
    }
    if resources.is_empty() {
        return None;
    }
    let dir = dir.unwrap_or_else(|| {
        std::env::var_os("DEVLOCK_DIR")
            .filter(|d| !d.is_empty())
            .map_or_else(
                || PathBuf::from(crate::flock::dir::DEFAULT_DIR),
                PathBuf::from,
            )
    });
    Some(Cli {
        subcommand: None,
        run: RunArgs {
            resources,
            command: command.to_vec(),
            no_wait,
            timeout: None,
            conflict_exit_code: 75,
            new: false,
            step,
            quiet,
            no_setup_warning: false,
            any: false,
            count: None,
            shared,
            exclusive: false,
            slots: None,
            require_idle: false,
            idle_threshold: None,
            mem: None,
            mem_headroom: None,
            settle: None,
            mem_strict: false,
            idle_timeout: None,
            report_every: Duration::from_secs(60),
            ttl: None,
            kill_after: None,
        },
        dir,
        probe_timeout: Duration::from_secs(5),
        etcd: Vec::new(),
        etcd_user: None,
        etcd_ca: None,
        etcd_cert: None,
        etcd_key: None,
        etcd_prefix: "/devlock/".to_owned(),
    })
}
