//! `devlock setup`: a managed scratch directory for a shared machine. Root
//! makes the directory and each declared resource's files its own, so no user
//! can rename, remove, replace or squat them; running it again changes only
//! what is not as it should be.

use std::ffi::CString;

use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::cli::SetupArgs;
use crate::exit::ExitCode;
use crate::flock::dir::ScratchDir;
use crate::gpu::device::{DeviceReport, Probe};
use crate::gpu::source::Auto;
use crate::resource::Resource;
use crate::show::{sanitize, show_path};
use crate::usage::site::{self, UsageDir};
use std::os::fd::AsFd;

use crate::walk::{self, Parent};
use records::{
    print_tmpfiles, record_usage_dir, site_idle_timeout, usage_asked, usage_managed, usage_way,
};

mod dir;
mod files;
mod leases;
mod owner;
mod records;

use dir::take_dir;
use files::declare;
use owner::owner_words;

/// How many times a step that someone races is tried again.
pub(super) const TRIES: usize = 10;

/// What to make: modes and owners.
pub(super) struct Plan {
    gid: u32,
    pub(super) group: Option<String>,
    pub(super) dir_mode: u32,
    pub(super) file_mode: u32,
    pub(super) resources: Vec<Resource>,
    slots: u16,
}

impl Plan {
    /// The files of one resource: lock, queue, and slots when asked.
    pub(super) fn files(&self, r: &Resource) -> Vec<String> {
        let lock = r.file_name();
        let queue = crate::flock::queue::queue_name(&lock);
        let mut files = vec![lock, queue];
        for s in 1..=u64::from(self.slots) {
            files.push(crate::flock::slots::slot_file(r, s));
        }
        files
    }
}

/// The plan `args` ask for: the resources named (and the GPUs with
/// `--gpus`), the group's id, the modes.
fn plan(args: &SetupArgs, probe_timeout: Duration) -> Result<Plan> {
    let mut resources = Resource::parse_all(&args.resources)?;
    crate::cli::refuse_subcommand_names(&resources)?;
    if args.gpus {
        resources.extend(gpu_resources(probe_timeout)?);
    }
    resources.sort();
    resources.dedup();
    let gid = match &args.group {
        None => 0,
        Some(name) => match nix::unistd::Group::from_name(name) {
            Ok(Some(group)) => group.gid.as_raw(),
            _ => {
                return Err(crate::error::usage(format!(
                    "no group named {:?} (see getent group)",
                    sanitize(name)
                )));
            }
        },
    };
    Ok(Plan {
        gid,
        group: args.group.clone(),
        dir_mode: if args.group.is_some() { 0o1770 } else { 0o1777 },
        file_mode: if args.group.is_some() { 0o660 } else { 0o666 },
        resources,
        slots: args.slots.unwrap_or(0),
    })
}

pub(crate) fn run(args: &SetupArgs, dir: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let plan = plan(args, probe_timeout)?;
    if args.print_tmpfiles {
        return print_tmpfiles(dir, plan, args);
    }
    if crate::sys::process::effective_uid() != 0 {
        return Err(crate::error::denied(format!(
            "devlock setup must run as root: it makes {} and its lock files root's, so that \
                 no user can rename or remove them (try: {})",
            show_path(dir),
            crate::flock::trust::fix_command(
                Some(dir),
                plan.resources.iter().map(Resource::as_str)
            )
        )));
    }
    // The whole way to --dir, and to the usage directory, is checked before
    // anything changes.
    let parent = walk::reach(dir)?;
    // Asked, named by the variable (as setup has always taken it), or as
    // recorded before.
    let usage = usage_asked(args)
        .or_else(crate::usage::named_by_env)
        .or_else(|| {
            let now = parent.open().ok()?;
            site::usage_dir(now.as_fd())
        })
        .unwrap_or_else(usage_managed);
    let usage = usage_way(usage)?;
    let mut report = Report::default();
    let scratch = ScratchDir::from_fd(
        dir,
        take_dir(dir, &parent, &plan, plan.dir_mode, None, &mut report)?,
    )?;
    take_wait_dir(&scratch, &parent, &plan, &mut report)?;
    for resource in &plan.resources {
        for name in plan.files(resource) {
            declare(&scratch, &name, &plan, &mut report)?;
        }
    }
    if !plan.resources.is_empty() {
        // The declared names: a run then refuses others unless --new.
        let mut names = crate::flock::declared::read(&scratch).unwrap_or_default();
        names.extend(plan.resources.iter().cloned());
        names.sort();
        names.dedup();
        crate::flock::declared::write(&scratch, &names)?;
    }
    if let Some(timeout) = args.idle_timeout {
        site_idle_timeout(&scratch, timeout, &mut report)?;
    }
    if let Some((path, parent)) = &usage {
        take_dir(
            path,
            parent,
            &plan,
            plan.dir_mode,
            Some("usage directory"),
            &mut report,
        )?;
    }
    let usage = match usage {
        Some((_, parent)) => UsageDir::At(parent.target()),
        None => UsageDir::Nowhere,
    };
    record_usage_dir(&scratch, &usage, &mut report)?;
    for issue in crate::flock::trust::dir_issues(&scratch) {
        println!("devlock setup: warning: {}", issue.reason);
    }
    say_managed(dir, &parent, &plan, &report);
    if report.refused > 0 {
        return Err(crate::error::in_use(format!(
            "{} of the files could not be replaced while locked; run devlock setup again once they are free",
            report.refused
        )));
    }
    Ok(ExitCode::Success)
}

/// Makes the lock directory's wait directory root's, with the lock
/// directory's mode and group, as a root-owned one is trusted (see
/// `ScratchDir::wait_dir`): waiters register there, not among the lock
/// files. Whatever stood at its name (another user's directory, a link, a
/// file) is taken over or removed, as the lock directory's would be.
fn take_wait_dir(
    scratch: &ScratchDir,
    parent: &Parent,
    plan: &Plan,
    report: &mut Report,
) -> Result<()> {
    let here = Parent {
        fd: scratch
            .fd()
            .try_clone_to_owned()
            .map_err(anyhow::Error::from)?,
        real: parent.target(),
        name: crate::flock::dir::WAIT_DIR.into(),
    };
    let path = scratch.path().join(crate::flock::dir::WAIT_DIR);
    take_dir(
        &path,
        &here,
        plan,
        plan.dir_mode,
        Some("wait directory"),
        report,
    )?;
    Ok(())
}

/// Says what `dir` is now: its owner and mode, the resources declared, and
/// whether anything changed.
fn say_managed(dir: &Path, parent: &Parent, plan: &Plan, report: &Report) {
    let owner = owner_words(plan);
    let names: Vec<&str> = plan.resources.iter().map(Resource::as_str).collect();
    let real = parent.target();
    let absolute = std::env::current_dir().map(|cwd| cwd.join(dir));
    let shown = if absolute.as_deref().is_ok_and(|a| a == real) {
        show_path(dir)
    } else {
        format!("{} (that is {})", show_path(dir), show_path(&real))
    };
    println!(
        "devlock setup: {shown} is managed ({owner} {:o}); {} declared{}{}",
        plan.dir_mode,
        match names.len() {
            0 => "no resources".to_owned(),
            1 => "1 resource".to_owned(),
            n => format!("{n} resources"),
        },
        if names.is_empty() {
            String::new()
        } else {
            format!(": {}", names.join(" "))
        },
        if report.changes == 0 {
            ", nothing changed"
        } else {
            ""
        }
    );
}

#[derive(Default)]
pub(super) struct Report {
    changes: usize,
    refused: usize,
}

impl Report {
    pub(super) fn changed(&mut self, path: &Path, what: &str) {
        self.changes += 1;
        println!("devlock setup: {}: {what}", show_path(path));
    }
}

/// `gpu`, `gpu:N` for the GPUs the probe lists, and their MIG instances.
fn gpu_resources(timeout: Duration) -> Result<Vec<Resource>> {
    let devices = match Auto.probe(timeout) {
        DeviceReport::Devices(devices) => devices,
        DeviceReport::NoInfo => {
            return Err(crate::error::device(
                "--gpus: no NVML library and no nvidia-smi found (set DEVLOCK_NVML or DEVLOCK_NVIDIA_SMI, or name the resources)",
            ));
        }
        DeviceReport::Unknown { reason } => {
            return Err(crate::error::device(format!(
                "--gpus: cannot list the GPUs: {}",
                sanitize(&reason)
            )));
        }
    };
    let mut names = vec!["gpu".to_owned()];
    for d in &devices {
        names.push(format!("gpu:{}", d.index));
        // MIG instances are devices too (NVML lists them; one whose profile
        // has no resource name cannot be locked, so has no file).
        names.extend(d.mig_instances.iter().filter_map(|i| i.name.clone()));
    }
    names
        .iter()
        .map(|n| {
            n.parse()
                .map_err(|e: String| crate::error::device(format!("--gpus: {e}")))
        })
        .collect()
}

pub(super) fn c_string(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| crate::error::usage("a path contains a NUL byte"))
}

pub(super) fn unlink(dir: &ScratchDir, name: &str) -> nix::Result<()> {
    nix::unistd::unlinkat(dir.fd(), name, nix::unistd::UnlinkatFlags::NoRemoveDir)
}
