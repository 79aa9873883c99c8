//! `devlock setup`: a managed scratch directory for a shared machine. Root
//! makes the directory and each declared resource's files its own, so no user
//! can rename, remove, replace or squat them; running it again changes only
//! what is not as it should be.

use std::ffi::CString;
use std::os::fd::OwnedFd;

use nix::fcntl::OFlag;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cli::SetupArgs;
use crate::exit::ExitCode;
use crate::flock::dir::ScratchDir;
use crate::gpu::device::{DeviceReport, Probe};
use crate::gpu::source::Auto;
use crate::proc;
use crate::proc::lock_entry::FileId;
use crate::proc::locks::LockTable;
use crate::resource::Resource;
use crate::show::kind_of;
use crate::show::{sanitize, show_path};
use crate::usage::site::{self, UsageDir};
use nix::fcntl::AtFlags;
use std::os::fd::AsFd;

use super::setup_site::{
    record_usage_dir, site_idle_timeout, tmpfiles, usage_asked, usage_managed, usage_way,
};
use crate::walk::Parent;

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

pub(crate) fn run(args: &SetupArgs, dir: &Path, probe_timeout: Duration) -> Result<ExitCode> {
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
    let mut plan = Plan {
        gid,
        group: args.group.clone(),
        dir_mode: if args.group.is_some() { 0o1770 } else { 0o1777 },
        file_mode: if args.group.is_some() { 0o660 } else { 0o666 },
        resources,
        slots: args.slots.unwrap_or(0),
    };
    if args.print_tmpfiles {
        // The boot snippet makes the directory as it is now and as asked:
        // the resources already declared there (setup merges names too) and
        // the site's idle policy, so a reboot loses neither.
        let now = ScratchDir::open(dir).ok().flatten();
        let declared = now.as_ref().and_then(crate::flock::declared::read);
        plan.resources.extend(declared.unwrap_or_default());
        plan.resources.sort();
        plan.resources.dedup();
        let idle = args
            .idle_timeout
            .or_else(|| now.as_ref().and_then(crate::usage::idle::site_default));
        // The one recorded before a caller's variable: a user's own (where
        // their records go) must not move the site's in a snippet they print.
        let usage = usage_asked(args)
            .or_else(|| now.as_ref().and_then(|now| site::usage_dir(now.fd())))
            .or_else(crate::usage::named_by_env)
            .unwrap_or_else(usage_managed);
        let usage = match usage {
            UsageDir::At(path) => UsageDir::At(std::path::absolute(&path)?),
            nowhere => nowhere,
        };
        print!("{}", tmpfiles(dir, &plan, args, idle, &usage)?);
        return Ok(ExitCode::Success);
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
    let parent = crate::walk::reach(dir)?;
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
    let owner = match &plan.group {
        Some(g) => format!("root:{}", sanitize(g)),
        None => "root:root".to_owned(),
    };
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
    if report.refused > 0 {
        return Err(crate::error::in_use(format!(
            "{} of the files could not be replaced while locked; run devlock setup again once they are free",
            report.refused
        )));
    }
    Ok(ExitCode::Success)
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

fn c_string_os(text: &std::ffi::OsStr) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(text.as_bytes()).map_err(|_| crate::error::usage("a path contains a NUL byte"))
}

pub(super) fn c_string(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| crate::error::usage("a path contains a NUL byte"))
}

/// Makes the directory root's, with `mode`: created when missing, taken
/// over (through a descriptor opened without following links, then
/// checked to be still at the path) when someone else owns it, and
/// whatever else stands at the path (a symbolic link, a file) removed
/// first. Every step is relative to the descriptor of the directory above
/// it, which [`crate::walk::reach`] walked to from `/` and checked: nothing
/// here follows a path again, so a co-user who swaps the directory for a
/// link (`renameat2(RENAME_EXCHANGE)`) changes only what is opened, never
/// what is changed. `label` names it in what setup says.
fn take_dir(
    path: &Path,
    parent: &Parent,
    plan: &Plan,
    mode: u32,
    label: Option<&str>,
    report: &mut Report,
) -> Result<OwnedFd> {
    let name = parent.name.as_os_str();
    let shown = parent.target();
    let mut created = false;
    for _ in 0..TRIES {
        match nix::sys::stat::fstatat(&parent.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(nix::errno::Errno::ENOENT) => {
                match nix::sys::stat::mkdirat(
                    &parent.fd,
                    name,
                    nix::sys::stat::Mode::from_bits_truncate(0o700),
                ) {
                    Ok(()) => created = true,
                    Err(nix::errno::Errno::EEXIST) => continue,
                    Err(e) => {
                        return Err(crate::error::unsafe_file(format!(
                            "cannot create {}: {e}",
                            show_path(&shown)
                        )));
                    }
                }
            }
            Ok(st) if st.st_mode & libc::S_IFMT != libc::S_IFDIR => {
                match nix::unistd::unlinkat(
                    &parent.fd,
                    name,
                    nix::unistd::UnlinkatFlags::NoRemoveDir,
                ) {
                    Ok(()) => {}
                    // Swapped for a directory meanwhile: look again.
                    Err(nix::errno::Errno::EISDIR | nix::errno::Errno::ENOENT) => continue,
                    Err(e) => {
                        return Err(e).with_context(|| {
                            format!("removing what stands at {}", show_path(&shown))
                        });
                    }
                }
                report.changed(
                    path,
                    &format!(
                        "removed a {} owned by {} that stood there",
                        kind_of(st.st_mode),
                        owner_name(st.st_uid)
                    ),
                );
                continue;
            }
            Ok(_) => {}
            Err(e) => return Err(e).with_context(|| format!("examining {}", show_path(&shown))),
        }
        let c_name = c_string_os(name)?;
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let Ok(fd) = crate::sys::fs::openat(parent.fd.as_fd(), &c_name, flags, 0) else {
            // Replaced between the look and the open: look again.
            continue;
        };
        let st = nix::sys::stat::fstat(&fd)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            continue;
        }
        let changed = make_ours(&fd, &st, plan.gid, mode)?;
        let made = format!("({} {mode:o})", owner_words(plan));
        if created {
            report.changed(path, &format!("{} {made}", label.unwrap_or("created")));
            created = false;
        } else if let Some(what) = changed {
            match label {
                Some(label) => report.changed(path, &format!("{label} {made}: {what}")),
                None => report.changed(path, &what),
            }
        }
        // Root's now, so nobody but root can move it: if it is still at
        // the path, it stays there. A rename that passed the kernel's
        // sticky check before the fchown may still be under way, though:
        // making the name again waits for it (it takes the directory's
        // lock, which a rename holds throughout) and fails.
        let _ = nix::sys::stat::mkdirat(
            &parent.fd,
            name,
            nix::sys::stat::Mode::from_bits_truncate(0o700),
        );
        let still = nix::sys::stat::fstatat(&parent.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .is_ok_and(|now| now.st_dev == st.st_dev && now.st_ino == st.st_ino);
        if !still {
            continue;
        }
        return Ok(fd);
    }
    Err(crate::error::unsafe_file(format!(
        "{} keeps changing under devlock setup; someone is racing it",
        show_path(&shown)
    )))
}

fn owner_name(uid: u32) -> String {
    sanitize(&proc::process::user_name(uid))
}

/// Gives an open file or directory to root (and the group), with `mode`,
/// and without ACL entries a former owner may have added (a named entry
/// could lock a user out). Says what changed, if anything.
fn make_ours(fd: &OwnedFd, st: &libc::stat, gid: u32, mode: u32) -> Result<Option<String>> {
    let acls = [c"system.posix_acl_access", c"system.posix_acl_default"];
    let mut had_acl = false;
    for name in acls {
        if crate::sys::fs::remove_xattr(fd, name) {
            had_acl = true;
        }
    }
    let right_owner = st.st_uid == 0 && st.st_gid == gid;
    let right_mode = st.st_mode & 0o7777 == mode;
    if right_owner && right_mode && !had_acl {
        return Ok(None);
    }
    // chown first (it may clear mode bits), then the mode.
    crate::sys::fs::fchown(fd, 0, gid)
        .and_then(|()| crate::sys::fs::fchmod(fd, mode))
        .context("changing owner and mode")?;
    let mut what = Vec::new();
    if !right_owner {
        what.push(format!(
            "taken over from {}:{}",
            owner_name(st.st_uid),
            group_name(st.st_gid)
        ));
    }
    if !right_mode {
        what.push(format!("mode {:o} (was {:o})", mode, st.st_mode & 0o7777));
    }
    if had_acl {
        what.push("ACL removed".to_owned());
    }
    Ok(Some(what.join(", ")))
}

fn group_name(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => sanitize(&g.name),
        _ => gid.to_string(),
    }
}

/// Makes one declared file root's: created when missing; root's own file
/// fixed in place; a regular file another user owns (or one with a lease
/// or several links) replaced by a new root file when nobody holds it, so
/// nothing set on the old inode carries over, and taken over in place when
/// held (the same inode, so a holder of it stays the only holder, and its
/// owner can no longer rename it); a file of the wrong type (a FIFO, a
/// symbolic link, a socket, a directory) is swapped for a new root file,
/// unless it is locked.
fn declare(dir: &ScratchDir, name: &str, plan: &Plan, report: &mut Report) -> Result<()> {
    let path = dir.path().join(name);
    for _ in 0..TRIES {
        let st =
            match nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            {
                Err(nix::errno::Errno::ENOENT) => {
                    let temp = new_file(dir, name, plan)?;
                    match rename(dir, &temp, name, false) {
                        Ok(()) => {
                            report.changed(
                                &path,
                                &format!("created ({} {:o})", owner_words(plan), plan.file_mode),
                            );
                            return Ok(());
                        }
                        Err(_) => {
                            let _ = unlink(dir, &temp);
                            continue;
                        }
                    }
                }
                Err(e) => return Err(e).with_context(|| format!("examining {}", show_path(&path))),
                Ok(st) => st,
            };
        if st.st_mode & libc::S_IFMT == libc::S_IFREG {
            let leased = !lease_holders(FileId::from_metadata(st.st_dev, st.st_ino)).is_empty();
            // Another user's, leased, or linked elsewhere too (a link to
            // a root file outside, which an in-place chmod would change):
            // a new root file in its place, unless held.
            if st.st_uid != 0 || leased || st.st_nlink > 1 {
                match replace_unless_held(dir, name, &st, plan)? {
                    Swap::Done => {
                        report.changed(
                            &path,
                            &format!(
                                "replaced a regular file owned by {}{} with a new one ({} {:o}): \
                                 nothing set on the old one, a lease or an ACL, carries over",
                                owner_name(st.st_uid),
                                if st.st_nlink > 1 {
                                    format!(" with {} links", st.st_nlink)
                                } else {
                                    String::new()
                                },
                                owner_words(plan),
                                plan.file_mode
                            ),
                        );
                        return Ok(());
                    }
                    Swap::Raced => continue,
                    Swap::Held => {}
                }
            }
            let c_name = c_string(name)?;
            let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
            let fd = match crate::sys::fs::openat(dir.fd(), &c_name, flags, 0) {
                Ok(fd) => fd,
                // A write lease: its owner is told to let go, and this
                // run cannot wait for that (the kernel's lease-break time).
                Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                    eprintln!(
                        "devlock: not taking over {}: its owner {} holds a lease on it; run \
                         devlock setup again in a minute",
                        show_path(&path),
                        owner_name(st.st_uid)
                    );
                    report.refused += 1;
                    return Ok(());
                }
                Err(_) => continue,
            };
            let st = nix::sys::stat::fstat(&fd)?;
            if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                continue;
            }
            if let Some(what) = make_ours(&fd, &st, plan.gid, plan.file_mode)? {
                report.changed(&path, &what);
            }
            // Root's now, so its former owner can take no new lease on it;
            // one taken before stays until the kernel breaks it, and makes
            // every open for writing wait or fail meanwhile.
            let leases = lease_holders(FileId::from_metadata(st.st_dev, st.st_ino));
            if !leases.is_empty() {
                eprintln!(
                    "devlock: {} is held, so it was kept (taken over in place), but the lease on \
                     it ({}) stays until the kernel breaks it; run devlock setup again once it is \
                     free, to replace it",
                    show_path(&path),
                    leases
                        .iter()
                        .map(|&p| {
                            let user = proc::process::uid_of(p)
                                .map_or("user unknown".to_owned(), owner_name);
                            format!("pid {p}, {user}")
                        })
                        .collect::<Vec<_>>()
                        .join("; ")
                );
                report.refused += 1;
            }
            return Ok(());
        }
        // The wrong type: swap a new file in, unless the thing is locked.
        let id = FileId::from_metadata(st.st_dev, st.st_ino);
        let table = LockTable::read().context("reading /proc/locks")?;
        if table.any_on(id) {
            let holders: Vec<String> = table
                .holders(id)
                .chain(table.blocked(id))
                .map(|l| {
                    let user =
                        proc::process::uid_of(l.pid).map_or("user unknown".to_owned(), owner_name);
                    format!("pid {}, {user}", l.pid)
                })
                .collect();
            let holders = if holders.is_empty() {
                "byte-range locks".to_owned()
            } else {
                holders.join("; ")
            };
            eprintln!(
                "devlock: not replacing {}: a {} owned by {}, locked by {holders}; replacing a \
                 held lock file would let a second holder in",
                show_path(&path),
                kind_of(st.st_mode),
                owner_name(st.st_uid)
            );
            report.refused += 1;
            return Ok(());
        }
        let temp = new_file(dir, name, plan)?;
        if rename(dir, &temp, name, true).is_err() {
            let _ = unlink(dir, &temp);
            continue;
        }
        // What came out must be what we looked at; else someone swapped it
        // meanwhile: put theirs back and look again.
        let out = nix::sys::stat::fstatat(
            dir.fd(),
            temp.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        );
        if !out.is_ok_and(|o| o.st_dev == st.st_dev && o.st_ino == st.st_ino) {
            let _ = rename(dir, &temp, name, true);
            continue;
        }
        let gone = if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
            nix::unistd::unlinkat(
                dir.fd(),
                temp.as_str(),
                nix::unistd::UnlinkatFlags::RemoveDir,
            )
            .is_ok()
        } else {
            unlink(dir, &temp).is_ok()
        };
        let aside = if gone {
            String::new()
        } else {
            format!("; it is now {}", show_path(&dir.path().join(&temp)))
        };
        report.changed(
            &path,
            &format!(
                "replaced a {} owned by {}{aside}",
                kind_of(st.st_mode),
                owner_name(st.st_uid)
            ),
        );
        return Ok(());
    }
    Err(crate::error::unsafe_file(format!(
        "{} keeps changing under devlock setup; someone is racing it",
        show_path(&path)
    )))
}

/// What came of replacing another user's regular file.
enum Swap {
    /// A new root file is at the name; the old one is gone.
    Done,
    /// Something changed meanwhile: look again.
    Raced,
    /// Somebody holds it (a flock, or byte-range locks: a place in line):
    /// replacing it would let a second holder in.
    Held,
}

/// Swaps a new root file in for another user's regular file `name`, unless
/// it is held. The old file's flock is held (without waiting) across the
/// swap, so nobody takes it between the look and the swap; a devlock that
/// was about to takes it afterwards, finds the path names another file,
/// and takes that one. Whatever the owner set on the old inode (a lease,
/// an open descriptor) stays with the old inode, which is unlinked.
fn replace_unless_held(dir: &ScratchDir, name: &str, st: &libc::stat, plan: &Plan) -> Result<Swap> {
    let id = FileId::from_metadata(st.st_dev, st.st_ino);
    let c_name = c_string(name)?;
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    // Kept open (and locked) until the swap is done; dropped after.
    let probe = match crate::sys::fs::openat(dir.fd(), &c_name, flags, 0) {
        Ok(fd) => {
            if !nix::sys::stat::fstat(&fd).is_ok_and(|now| same(&now, st)) {
                return Ok(Swap::Raced);
            }
            match crate::sys::fs::flock(&fd, crate::sys::fs::Flock::Exclusive, true) {
                Ok(()) => Some(fd),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(Swap::Held),
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("locking {}", show_path(&dir.path().join(name))));
                }
            }
        }
        // A write lease: nobody else had it open when it was taken. The
        // lock table says whether anyone holds it now.
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => None,
        Err(_) => return Ok(Swap::Raced),
    };
    let table = LockTable::read().context("reading /proc/locks")?;
    if !table.ranges(id).is_empty() || (probe.is_none() && table.is_locked(id)) {
        return Ok(Swap::Held);
    }
    let temp = new_file(dir, name, plan)?;
    if rename(dir, &temp, name, true).is_err() {
        let _ = unlink(dir, &temp);
        return Ok(Swap::Raced);
    }
    let out = nix::sys::stat::fstatat(dir.fd(), temp.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW);
    if !out.is_ok_and(|o| same(&o, st)) {
        let _ = rename(dir, &temp, name, true);
        return Ok(Swap::Raced);
    }
    unlink(dir, &temp).with_context(|| {
        format!(
            "removing the replaced file, now {}",
            show_path(&dir.path().join(&temp))
        )
    })?;
    drop(probe);
    Ok(Swap::Done)
}

fn same(a: &libc::stat, b: &libc::stat) -> bool {
    a.st_dev == b.st_dev && a.st_ino == b.st_ino
}

/// The pids holding a lease on the file (`LEASE` lines of `/proc/locks`,
/// which [`LockTable`] leaves out: a lease is no lock, but it makes every
/// open for writing wait for the kernel's lease-break time).
fn lease_holders(id: FileId) -> Vec<u32> {
    match std::fs::read_to_string("/proc/locks") {
        Ok(text) => leases_in(&text, id),
        Err(_) => Vec::new(),
    }
}

/// [`lease_holders`] in the text of `/proc/locks`: `2: LEASE  ACTIVE
/// READ 10064 fe:00:10035432 0 EOF` (`BREAKING` or `BREAKER` while one is
/// broken; `->` before a request that waits).
fn leases_in(text: &str, id: FileId) -> Vec<u32> {
    text.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = usize::from(words.get(1) == Some(&"->"));
            if words.get(1 + at) != Some(&"LEASE") {
                return None;
            }
            let pid: u32 = words.get(4 + at)?.parse().ok()?;
            let mut dev = words.get(5 + at)?.split(':');
            let major = u32::from_str_radix(dev.next()?, 16).ok()?;
            let minor = u32::from_str_radix(dev.next()?, 16).ok()?;
            let ino: u64 = dev.next()?.parse().ok()?;
            (FileId { major, minor, ino } == id).then_some(pid)
        })
        .collect()
}

fn owner_words(plan: &Plan) -> String {
    match &plan.group {
        Some(g) => format!("root:{}", sanitize(g)),
        None => "root:root".to_owned(),
    }
}

/// A new root file with the plan's group and mode, under a temporary name
/// in the directory.
fn new_file(dir: &ScratchDir, name: &str, plan: &Plan) -> Result<String> {
    for n in 0..TRIES {
        let temp = format!(".{name}.setup-{}-{n}", std::process::id());
        let c_temp = c_string(&temp)?;
        let flags =
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let Ok(fd) = crate::sys::fs::openat(dir.fd(), &c_temp, flags, 0o600) else {
            continue;
        };
        let owned = crate::sys::fs::fchown(&fd, 0, plan.gid)
            .and_then(|()| crate::sys::fs::fchmod(&fd, plan.file_mode));
        if let Err(err) = owned {
            let _ = unlink(dir, &temp);
            return Err(err).with_context(|| {
                format!(
                    "setting owner and mode of {}",
                    show_path(&dir.path().join(&temp))
                )
            });
        }
        return Ok(temp);
    }
    Err(crate::error::unsafe_file(format!(
        "cannot make a temporary file in {}",
        show_path(dir.path())
    )))
}

/// `renameat2` in the directory: `exchange` swaps, else it never replaces.
fn rename(dir: &ScratchDir, from: &str, to: &str, exchange: bool) -> std::io::Result<()> {
    crate::sys::fs::rename_in(dir.fd(), from, to, exchange)
}

pub(super) fn unlink(dir: &ScratchDir, name: &str) -> nix::Result<()> {
    nix::unistd::unlinkat(dir.fd(), name, nix::unistd::UnlinkatFlags::NoRemoveDir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_found_by_file_and_locks_are_not_leases() {
        let text = "1: FLOCK  ADVISORY  WRITE 5026 fe:00:10027111 0 EOF\n\
                    2: LEASE  ACTIVE    READ 10064 fe:00:10035432 0 EOF\n\
                    3: LEASE  BREAKING  READ 10065 fe:00:10035432 0 EOF\n\
                    4: LEASE  ACTIVE    READ 10066 fe:01:10035432 0 EOF\n";
        let id = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10_035_432,
        };
        assert_eq!(leases_in(text, id), [10064, 10065]);
        let flocked = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10_027_111,
        };
        assert!(leases_in(text, flocked).is_empty());
    }
}
