//! `devlock RESOURCE... -- COMMAND`: take every lock, run the command, pass on
//! how it ended.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cli::RunArgs;
use crate::devices;
use crate::exit::{ExitCode, coded};
use crate::lockfile::{LockFile, TryLock};
use crate::procfs;
use crate::record::Record;
use crate::resource::Resource;
use crate::scratch::ScratchDir;
use crate::status;
use crate::supervise::{self, Received};
use crate::wait::{self, WaitPlan};
use crate::waiters::Registration;

/// What taking one resource came to.
enum Taken {
    /// We hold it through this file.
    Held(LockFile),
    /// An inherited descriptor already holds it: we run inside its holder.
    /// The file is open (not locked by us) only to name the lock.
    Inherited(LockFile),
}

pub fn run(args: &RunArgs, dir_path: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let resources = validate(args)?;
    let command_line: Vec<String> = args
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let step = args
        .step
        .clone()
        .unwrap_or_else(|| basename(&args.command[0]));
    supervise::block_handled_signals();
    let dir = ScratchDir::open_or_create(dir_path)?;
    let plan = WaitPlan {
        deadline: args.timeout.map(|t| Instant::now() + t),
        timeout: args.timeout,
        quiet: args.quiet,
        live: std::io::stderr().is_terminal(),
        report_every: args.report_every,
        conflict_code: ExitCode::Command(i32::from(args.conflict_exit_code)),
    };
    let mut taken: Vec<(Resource, Taken)> = Vec::new();
    let mut pending: Option<Received> = None;
    // One canonical order (sorted names) whatever order the user wrote, so
    // two jobs naming the same resources can never each hold what the other
    // waits for.
    for resource in &resources {
        let (took, signal) = take(&dir, resource, args, &step, &command_line, &plan)?;
        pending = pending.or(signal);
        taken.push((resource.clone(), took));
    }
    if args.require_idle {
        require_idle(&taken, args.idle_threshold, probe_timeout)?;
    }
    let held: Vec<LockFile> = taken
        .into_iter()
        .filter_map(|(_, took)| match took {
            Taken::Held(lock) => Some(lock),
            Taken::Inherited(_) => None,
        })
        .collect();
    let env = child_env(&resources, &dir, &step);
    if held.is_empty() {
        return Ok(pass_through(&args.command, &env));
    }
    let fds: Vec<_> = held.iter().map(|l| l.file().as_raw_fd()).collect();
    let child = supervise::spawn(&args.command, &fds, &env)?;
    let mut record = Record::for_this_process(&step, &command_line);
    record.child = Some(child.id());
    record.child_start = procfs::start_time(child.id());
    for lock in held.iter().filter(|l| l.is_writable()) {
        // A label only: a failure to write it must not stop the work.
        let _ = record.write_to(lock.file());
    }
    let code = supervise::supervise(child, pending);
    drop(held);
    Ok(code)
}

fn validate(args: &RunArgs) -> Result<Vec<Resource>> {
    if args.resources.is_empty() {
        return Err(coded(
            ExitCode::Usage,
            "missing RESOURCE: usage: devlock [OPTIONS] RESOURCE... -- COMMAND...",
        ));
    }
    if args.command.is_empty() {
        return Err(coded(
            ExitCode::Usage,
            "missing `-- COMMAND`: put the command after `--`, as in `devlock gpu -- python train.py`",
        ));
    }
    let mut resources = args
        .resources
        .iter()
        .map(|r| Resource::parse(r).map_err(|e| coded(ExitCode::Usage, e)))
        .collect::<Result<Vec<_>>>()?;
    resources.sort();
    resources.dedup();
    if args.require_idle
        && !resources
            .iter()
            .any(|r| devices::gpu_indices(r, &[]).is_some())
    {
        return Err(coded(
            ExitCode::Usage,
            "--require-idle needs a GPU resource (gpu or gpu:N) to check",
        ));
    }
    Ok(resources)
}

/// Fails fast, with the lock released, when a GPU the resources map to runs
/// work outside the gate or cannot be checked. Never waits and retries: a
/// person decides what to do about the intruder.
fn require_idle(
    taken: &[(Resource, Taken)],
    threshold_mib: u64,
    probe_timeout: Duration,
) -> Result<()> {
    let table = procfs::LockTable::read().unwrap_or_default();
    let me = std::process::id();
    let gates: Vec<devices::Gate> = taken
        .iter()
        .map(|(resource, took)| {
            let (Taken::Held(lock) | Taken::Inherited(lock)) = took;
            devices::Gate {
                resource: resource.clone(),
                lock: lock.id(),
                holder_pids: table
                    .holders(lock.id())
                    .map(|l| l.pid)
                    .chain([me])
                    .collect(),
            }
        })
        .collect();
    let info = devices::probe(probe_timeout, &gates);
    for (resource, _) in taken {
        if let Some(reason) = devices::not_idle_reason(&info, resource, threshold_mib) {
            return Err(coded(ExitCode::NotIdle, reason));
        }
    }
    Ok(())
}

fn take(
    dir: &ScratchDir,
    resource: &Resource,
    args: &RunArgs,
    step: &str,
    command_line: &[String],
    plan: &WaitPlan,
) -> Result<(Taken, Option<Received>)> {
    let name = resource.file_name();
    let lock = loop {
        let lock = LockFile::open(dir, &name)?;
        match lock.try_lock(true) {
            Ok(TryLock::Taken) if lock.still_at_path(dir) => return Ok((Taken::Held(lock), None)),
            Ok(TryLock::Taken) => continue,
            Ok(TryLock::Busy) => break lock,
            Err(e) => {
                return Err(coded(
                    ExitCode::IoError,
                    format!("cannot lock {}: {e}", lock.path().display()),
                ));
            }
        }
    };
    if held_by_inheritance(&lock) {
        return Ok((Taken::Inherited(lock), None));
    }
    if args.no_wait {
        let view = status::describe(&lock, dir, resource);
        return Err(coded(
            plan.conflict_code,
            format!("{resource} is busy{}", wait::holder_phrase(&view)),
        ));
    }
    let registration =
        Registration::create(dir, resource, &Record::for_this_process(step, command_line)).ok();
    let (lock, signal) = wait::wait_for(dir, resource, lock, true, registration, plan)?;
    Ok((Taken::Held(lock), signal))
}

/// Whether this process already holds the lock through a descriptor it
/// inherited (we run inside a command that devlock or flock started). Asked
/// of the kernel, not of an environment variable a script may have copied.
pub(crate) fn held_by_inheritance(lock: &LockFile) -> bool {
    procfs::fd_locks("self")
        .unwrap_or_default()
        .iter()
        .any(|(_, held)| held.file == lock.id() && !held.blocked)
}

/// Replaces devlock with the command: the inherited lock already covers it.
fn pass_through(command: &[OsString], env: &[(String, String)]) -> ExitCode {
    // SAFETY: an empty set unblocks what block_handled_signals blocked.
    unsafe {
        let empty = std::mem::zeroed::<libc::sigset_t>();
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
    let err = std::process::Command::new(&command[0])
        .args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .exec();
    let shown = command[0].to_string_lossy();
    let (code, why) = match err.kind() {
        std::io::ErrorKind::NotFound => (ExitCode::NotFound, "command not found".to_owned()),
        _ => (ExitCode::CannotExecute, format!("cannot execute: {err}")),
    };
    eprintln!("devlock: {shown}: {why}");
    code
}

/// What the command learns about its locks.
fn child_env(resources: &[Resource], dir: &ScratchDir, step: &str) -> Vec<(String, String)> {
    let names: Vec<&str> = resources.iter().map(Resource::as_str).collect();
    let mut env = vec![
        ("DEVLOCK_RESOURCES".to_owned(), names.join(" ")),
        ("DEVLOCK_DIR".to_owned(), dir.path().display().to_string()),
        ("DEVLOCK_STEP".to_owned(), step.to_owned()),
    ];
    let gpus: Vec<&str> = names
        .iter()
        .filter_map(|n| n.strip_prefix("gpu:"))
        .collect();
    if !gpus.is_empty() && gpus.iter().all(|g| g.parse::<u32>().is_ok()) {
        env.push(("CUDA_VISIBLE_DEVICES".to_owned(), gpus.join(",")));
        // Without this CUDA numbers devices fastest-first, and the numbers
        // would not match nvidia-smi's.
        env.push(("CUDA_DEVICE_ORDER".to_owned(), "PCI_BUS_ID".to_owned()));
    }
    env
}

fn basename(program: &OsString) -> String {
    Path::new(program)
        .file_name()
        .map_or_else(|| program.to_string_lossy(), |n| n.to_string_lossy())
        .into_owned()
}
