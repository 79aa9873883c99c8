//! Registrations: one small file per waiting devlock (and per shared holder,
//! which has no lock file of its own to write into, and per holder whose
//! lock file was renamed or removed under it), kept flock'ed by its owner, so
//! the kernel itself says which registrations are alive, and whose.
//! Waiters register in the lock directory's wait directory where there is
//! one to trust (see `ScratchDir::wait_dir`); readers look in both.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

use crate::flock::dir::{ScratchDir, WAIT_DIR};
use crate::flock::file::open_checked;
use crate::flock::record::{self, Record};
use crate::proc::lock_entry::FileId;
use crate::proc::locks::LockTable;
use crate::resource::Resource;
use crate::sys::fs::{Flock, flock};
use nix::fcntl::OFlag;

/// What a registration stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Wait,
    /// A shared hold: many holders, so no single record in the lock file.
    Hold,
    /// A holder whose path no longer names the file it holds: someone renamed
    /// or removed it, and a second holder may be in beside it.
    Lost,
}

impl Kind {
    fn suffix(self) -> &'static str {
        match self {
            Kind::Wait => ".wait",
            Kind::Hold => ".hold",
            Kind::Lost => ".lost",
        }
    }
}

/// How many taken names a registration tries before it gives up (only
/// files planted under our pid's names can take them).
const MAX_NAME_TRIES: u32 = 1000;

/// Registrations are dot files, which no resource name can be, so they never
/// collide with a lock file.
fn file_name(resource: &Resource, pid: u32, n: u32, kind: Kind) -> String {
    format!(".{resource}@{pid}.{n}{}", kind.suffix())
}

/// The resource, kind and pid a registration file name belongs to.
pub(crate) fn parse_name(file_name: &str) -> Option<(Resource, Kind, u32)> {
    let inner = file_name.strip_prefix('.')?;
    let (inner, kind) = [Kind::Wait, Kind::Hold, Kind::Lost]
        .into_iter()
        .find_map(|k| Some((inner.strip_suffix(k.suffix())?, k)))?;
    let (name, id) = inner.rsplit_once('@')?;
    let (pid, n) = id.split_once('.')?;
    n.parse::<u32>().ok()?;
    Some((name.parse().ok()?, kind, pid.parse().ok()?))
}

/// The resource and kind a registration file name belongs to.
#[cfg(test)]
pub(crate) fn resource_of(file_name: &str) -> Option<(Resource, Kind)> {
    parse_name(file_name).map(|(r, k, _)| (r, k))
}

/// A live registration; dropping it removes the file.
#[derive(Debug)]
pub struct Registration {
    dir: ScratchDir,
    name: String,
    file: File,
    kind: Kind,
    /// The file's length: what the last record written left.
    len: std::cell::Cell<u64>,
    /// A copy in a forked child, closed without touching the file.
    detached: bool,
}

impl Registration {
    /// Registers this process as waiting for (or sharing) `resource`. A
    /// waiter registers in the wait directory when there is one to trust
    /// (so that a listing of `dir` does not grow with the line), else, as
    /// a holder does, in `dir`: a fallback, never an error.
    pub fn create(
        dir: &ScratchDir,
        resource: &Resource,
        record: &Record,
        kind: Kind,
    ) -> Result<Registration> {
        if kind == Kind::Wait
            && let Some(waits) = dir.wait_dir_or_make()
            && let Ok(made) = Registration::create_in(waits, resource, record, kind)
        {
            return Ok(made);
        }
        Registration::create_in(dir.try_clone()?, resource, record, kind)
    }

    fn create_in(
        dir: ScratchDir,
        resource: &Resource,
        record: &Record,
        kind: Kind,
    ) -> Result<Registration> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        for _ in 0..MAX_NAME_TRIES {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let name = file_name(resource, std::process::id(), n, kind);
            let c_name = crate::flock::dir::c_path(name.as_ref())?;
            let flags = OFlag::O_RDWR
                | OFlag::O_CREAT
                | OFlag::O_EXCL
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_CLOEXEC;
            let file = match crate::sys::fs::openat(dir.fd(), &c_name, flags, 0o644) {
                Ok(fd) => File::from(fd),
                // Left by a dead process that had our pid, or planted:
                // never opened, so whatever it is does no harm.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("creating registration {}", dir.path().join(&name).display())
                    });
                }
            };
            // A status reader that sweeps dead registrations may take the
            // lock on a file this young and unlink it; then start again.
            if flock(&file, Flock::Exclusive, true).is_err() {
                continue;
            }
            // Its pid in the kernel's table, for users who cannot read our
            // descriptors (see `proc::locks::holds_now`).
            crate::proc::locks::tag(&file);
            let path = dir.path().join(&name);
            let meta = file
                .metadata()
                .with_context(|| format!("examining registration {}", path.display()))?;
            // Whatever the umask: readable by status for every user (only
            // when the umask took something: a mode change is journalled).
            if meta.mode() & 0o777 != 0o644 {
                let _ = crate::sys::fs::fchmod(&file, 0o644);
            }
            let still_there = nix::sys::stat::fstatat(
                dir.fd(),
                name.as_str(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .is_ok_and(|st| st.st_ino == meta.ino());
            if !still_there {
                continue;
            }
            let len = record
                .write_over(&file, meta.len())
                .with_context(|| format!("writing registration {}", path.display()))?;
            dir.made().note(
                std::os::fd::AsRawFd::as_raw_fd(&dir.fd()),
                &name,
                (kind == Kind::Hold).then(|| std::os::fd::AsRawFd::as_raw_fd(&file)),
            );
            return Ok(Registration {
                dir,
                name,
                file,
                kind,
                len: std::cell::Cell::new(len),
                detached: false,
            });
        }
        Err(anyhow::anyhow!(
            "every registration name for pid {} in {} is taken",
            std::process::id(),
            dir.path().display()
        ))
    }

    /// Replaces the label (once the command runs, its pid joins the record).
    pub(crate) fn rewrite(&self, record: &Record) -> std::io::Result<()> {
        self.len.set(record.write_over(&self.file, self.len.get())?);
        Ok(())
    }

    /// The descriptor that holds the registration's lock: a shared holder's
    /// command inherits it, so the label stays alive as long as the hold.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.file)
    }

    /// In a forked child: closes this process's copy of the descriptor and
    /// leaves the file, and the label in it, to the process that made it.
    pub(crate) fn close_copy(mut self) {
        self.detached = true;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // A shared hold's label goes first, so that a child still holding
        // this file through an inherited descriptor carries no stale step
        // (no other registration is ever passed on).
        let hold = (self.kind == Kind::Hold).then(|| std::os::fd::AsRawFd::as_raw_fd(&self.file));
        self.dir.made().remove(
            std::os::fd::AsRawFd::as_raw_fd(&self.dir.fd()),
            &self.name,
            hold,
            self.detached,
        );
    }
}

/// A registration that the kernel confirms is alive and its own.
#[derive(Debug, Clone)]
pub(crate) struct Waiter {
    pub resource: Resource,
    pub kind: Kind,
    pub record: Record,
    /// False only for a shared hold's registration that the kernel shows
    /// locked by the pid it names while that pid is now another process:
    /// no label, but proof that the pid was reused (see status.rs).
    pub believed: bool,
}

/// Live registrations among `names` (a listing of `dir`), in line order
/// (ticket, then arrival), for the resources `wanted` accepts; when the
/// listing names the wait directory, the waiters registered there too. A
/// registration is believed only when the process holding its flock (per
/// the kernel) is the very process it names, pid and start time, so a
/// planted or copied file names nobody. Registrations of dead processes
/// are removed where we may remove them.
pub(crate) fn live_waiters(
    dir: &ScratchDir,
    names: &[String],
    table: &LockTable,
    wanted: impl Fn(&Resource) -> bool,
) -> Vec<Waiter> {
    live_registrations(dir, names, table, |r, _| wanted(r))
}

/// [`live_waiters`] for the resources and pids `wanted` accepts (as
/// their names say, before any file is opened).
pub(crate) fn live_registrations(
    dir: &ScratchDir,
    names: &[String],
    table: &LockTable,
    wanted: impl Fn(&Resource, u32) -> bool,
) -> Vec<Waiter> {
    let mut waiters = Vec::new();
    live_in(dir, names, table, |r, _, p| wanted(r, p), &mut waiters);
    // Only waiters register there: whatever else is found there was not
    // made by devlock, and is left unread.
    if names.iter().any(|n| n == WAIT_DIR)
        && let Some(waits) = dir.wait_dir()
    {
        let names = waits.entries().unwrap_or_default();
        let wanted = |r: &Resource, k, p| k == Kind::Wait && wanted(r, p);
        live_in(&waits, &names, table, wanted, &mut waiters);
    }
    waiters.sort_by_key(|w| {
        (
            w.record.ticket.unwrap_or(u64::MAX),
            w.record.since_ms,
            w.record.pid,
        )
    });
    waiters
}

/// The live registrations among `names`, in `dir` itself, that `wanted`
/// accepts, added to `waiters`. At most [`SWEEP_PER_LOOK`] files nobody
/// holds are opened, however many there are.
fn live_in(
    dir: &ScratchDir,
    names: &[String],
    table: &LockTable,
    wanted: impl Fn(&Resource, Kind, u32) -> bool,
    waiters: &mut Vec<Waiter>,
) {
    // Only a file the kernel shows flocked can be a live registration: the
    // others (a dead owner's, or thousands planted) are skipped by their
    // inode number, never opened, and only a few are swept per look.
    let dev = nix::sys::stat::fstat(dir.fd()).ok().map(|st| st.st_dev);
    let flocked: std::collections::HashSet<u64> = dev
        .map(|dev| {
            let id = FileId::from_metadata(dev, 0);
            table
                .flocked_files()
                .filter(|f| f.major == id.major && f.minor == id.minor)
                .map(|f| f.ino)
                .collect()
        })
        .unwrap_or_default();
    let mut candidates: Vec<(&String, Resource, Kind, u32)> = names
        .iter()
        .filter_map(|name| {
            let (resource, kind, pid) = parse_name(name)?;
            wanted(&resource, kind, pid).then_some((name, resource, kind, pid))
        })
        .collect();
    if candidates.len() > SWEEP_PER_LOOK {
        let inodes = dir.inodes().unwrap_or_default();
        let mut swept = 0;
        candidates.retain(|(name, ..)| {
            let alive = inodes.get(*name).is_none_or(|ino| flocked.contains(ino));
            swept += usize::from(!alive);
            alive || swept <= SWEEP_PER_LOOK
        });
    }
    for (name, resource, kind, named_pid) in candidates {
        if named_pid == std::process::id() {
            // Our own: opening it here and closing it again would drop
            // its tag (a POSIX lock ends at any close in the process), so
            // it is read through the descriptor this process holds it by.
            if let Some(record) = own_record(dir, name) {
                waiters.push(Waiter {
                    resource,
                    kind,
                    record,
                    believed: true,
                });
            }
            continue;
        }
        waiters.extend(someone_elses(dir, table, name, resource, kind, named_pid));
    }
}

/// Another process's registration `name` (for `named_pid`), as
/// [`live_waiters`] shows it: none when it is no live registration (a dead
/// one's is swept), or not believed and no shared hold's label.
fn someone_elses(
    dir: &ScratchDir,
    table: &LockTable,
    name: &str,
    resource: Resource,
    kind: Kind,
    named_pid: u32,
) -> Option<Waiter> {
    let Ok((file, meta)) = open_checked(dir, name) else {
        return None;
    };
    if meta.nlink() != 1 {
        // Never made by devlock (a registration is never linked):
        // perhaps a lock file linked here, which must not be touched.
        return None;
    }
    let id = FileId::from_metadata(meta.dev(), meta.ino());
    let holders: Vec<u32> = table.holders(id).map(|l| l.pid).collect();
    if holders.is_empty() {
        sweep_dead(dir, name, &file);
        return None;
    }
    let record = record::read_from(&file).valid()?;
    let own = record.pid == named_pid && holders.contains(&record.pid);
    // The kernel's table names the pid that took the flock, which may
    // have gone to another process since (its start time can be the
    // same, in the same clock tick): believed only where its descriptors
    // or its tag show that very process holding this file now.
    let alive_in_kernel = own
        && record.names(record.pid)
        && crate::proc::locks::holds_now(table, record.pid, id) == Some(true);
    // After kill -9, a shared holder's command keeps its registration
    // locked: believed when the command is the recorded child, which the
    // kernel shows holding this very file.
    let inherited = own
        && !alive_in_kernel
        && record
            .child
            .is_some_and(|c| record.names_child(c) && table.holds_flock(c, id) == Some(true));
    // A lost lock's registration is made by the hold's watcher (the
    // command, chain-loaded, makes none): believed while the watcher the
    // record names by pid and start time holds it, beside a command that
    // is alive.
    let watched = kind == Kind::Lost
        && record.watcher == Some(named_pid)
        && holders.contains(&named_pid)
        && !record.watcher_gone()
        && record.names(record.pid);
    (alive_in_kernel || inherited || watched || (own && kind == Kind::Hold)).then_some(Waiter {
        resource,
        kind,
        record,
        believed: alive_in_kernel || inherited || watched,
    })
}

/// The record in our own registration `name`, read through a descriptor
/// of this process that has it open (none: it is not ours to show).
fn own_record(dir: &ScratchDir, name: &str) -> Option<Record> {
    let st =
        nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).ok()?;
    let fds = std::fs::read_dir("/proc/self/fd").ok()?;
    let fd = fds
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<std::os::fd::RawFd>().ok())
        .find(|&fd| crate::sys::fs::file_id_of(fd) == Some((st.st_dev, st.st_ino)))?;
    let mut buf = vec![0u8; record::MAX_RECORD_BYTES + 1];
    let len = crate::sys::fs::pread_raw(fd, &mut buf, 0).ok()?;
    let record = record::parse(&buf[..len])?;
    (record.pid == std::process::id()).then_some(record)
}

/// How many registrations nobody holds a look opens (to sweep them): the
/// rest wait for later looks, however many were planted. Enough for every
/// waiter of a busy machine's kill storm (a CI cancel of a make -j32) in
/// one look, about 3 ms at most.
const SWEEP_PER_LOOK: usize = 256;

/// Removes a registration whose owner died. Taking its lock first proves the
/// owner is gone (a live owner holds it for as long as it waits).
fn sweep_dead(dir: &ScratchDir, name: &str, file: &File) {
    if flock(file, Flock::Exclusive, true).is_ok() {
        let _ = nix::unistd::unlinkat(dir.fd(), name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
}

#[cfg(test)]
mod tests;
