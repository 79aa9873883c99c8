//! Registrations: one small file per waiting devlock (and per shared holder,
//! which has no lock file of its own to write into), kept flock'ed by its
//! owner, so the kernel itself says which registrations are alive.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

use crate::procfs::{FileId, LockTable};
use crate::record::{self, Record};
use crate::resource::Resource;
use crate::scratch::ScratchDir;

/// What a registration stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Wait,
    /// A shared hold: many holders, so no single record in the lock file.
    Hold,
}

impl Kind {
    fn suffix(self) -> &'static str {
        match self {
            Kind::Wait => ".wait",
            Kind::Hold => ".hold",
        }
    }
}

/// Registrations are dot files, which no resource name can be, so they never
/// collide with a lock file.
fn file_name(resource: &Resource, pid: u32, n: u32, kind: Kind) -> String {
    format!(".{resource}@{pid}.{n}{}", kind.suffix())
}

/// The resource and kind a registration file name belongs to.
pub fn resource_of(file_name: &str) -> Option<(Resource, Kind)> {
    let inner = file_name.strip_prefix('.')?;
    let (inner, kind) = match inner.strip_suffix(".wait") {
        Some(inner) => (inner, Kind::Wait),
        None => (inner.strip_suffix(".hold")?, Kind::Hold),
    };
    let (name, _) = inner.rsplit_once('@')?;
    Some((name.parse().ok()?, kind))
}

/// A live registration; dropping it removes the file.
#[derive(Debug)]
pub struct Registration {
    dir: ScratchDir,
    name: String,
    file: File,
}

impl Registration {
    /// Registers this process as waiting for (or sharing) `resource`.
    pub fn create(
        dir: &ScratchDir,
        resource: &Resource,
        record: &Record,
        kind: Kind,
    ) -> Result<Registration> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = dir.try_clone()?;
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let name = file_name(resource, std::process::id(), n, kind);
            let c_name = crate::scratch::c_path(name.as_ref())?;
            let flags = libc::O_RDWR
                | libc::O_CREAT
                | libc::O_EXCL
                | libc::O_NOFOLLOW
                | libc::O_NONBLOCK
                | libc::O_CLOEXEC;
            // SAFETY: valid directory descriptor and NUL-terminated name.
            let fd = unsafe { libc::openat(dir.fd().as_raw_fd(), c_name.as_ptr(), flags, 0o644) };
            if fd < 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EEXIST) {
                    // Left by a dead process that had our pid: try the next number.
                    continue;
                }
                return Err(err).with_context(|| {
                    format!("registering as a waiter in {}", dir.path().display())
                });
            }
            // SAFETY: fd is ours alone.
            let file = unsafe { File::from_raw_fd(fd) };
            // SAFETY: open descriptor.
            let _ = unsafe { libc::fchmod(fd, 0o644) };
            // A status reader that sweeps dead registrations may take the
            // lock on a file this young and unlink it; then start again.
            // SAFETY: open descriptor.
            if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            let meta = file.metadata()?;
            let still_there = nix::sys::stat::fstatat(
                dir.fd(),
                name.as_str(),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .is_ok_and(|st| st.st_ino == std::os::unix::fs::MetadataExt::ino(&meta));
            if !still_there {
                continue;
            }
            record.write_to(&file)?;
            return Ok(Registration { dir, name, file });
        }
    }
}

impl Registration {
    /// Replaces the label (once the command runs, its pid joins the record).
    pub fn rewrite(&self, record: &Record) -> std::io::Result<()> {
        record.write_to(&self.file)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = nix::unistd::unlinkat(
            self.dir.fd(),
            self.name.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
}

/// A registration that the kernel confirms is alive.
#[derive(Debug, Clone)]
pub struct Waiter {
    pub resource: Resource,
    pub kind: Kind,
    pub record: Record,
}

/// Live registrations in `dir`, in line order (ticket, then arrival), for
/// the resources `wanted` accepts. Registrations of dead processes are
/// removed where we may remove them.
pub fn live_waiters(
    dir: &ScratchDir,
    names: &[String],
    table: &LockTable,
    wanted: impl Fn(&Resource) -> bool,
) -> Vec<Waiter> {
    let mut waiters = Vec::new();
    for name in names {
        let Some((resource, kind)) = resource_of(name) else {
            continue;
        };
        if !wanted(&resource) {
            continue;
        }
        let Ok(file) = open_read_only(dir, name) else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        let id = FileId::from_metadata(
            std::os::unix::fs::MetadataExt::dev(&meta),
            std::os::unix::fs::MetadataExt::ino(&meta),
        );
        if !table.is_locked(id) {
            sweep_dead(dir, name, &file);
            continue;
        }
        if let Some(record) = record::read_from(&file).valid() {
            waiters.push(Waiter {
                resource,
                kind,
                record,
            });
        }
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

/// Removes a registration whose owner died. Taking its lock first proves the
/// owner is gone (a live owner holds it for as long as it waits).
fn sweep_dead(dir: &ScratchDir, name: &str, file: &File) {
    // SAFETY: open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        let _ = nix::unistd::unlinkat(dir.fd(), name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
}

/// Opens a file in the scratch directory for reading: no symlinks followed, no
/// blocking on a FIFO, and only regular files accepted.
pub fn open_read_only(dir: &ScratchDir, name: &str) -> std::io::Result<File> {
    let c_name = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    let flags =
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
    // SAFETY: valid directory descriptor and NUL-terminated name.
    let fd = unsafe { libc::openat(dir.fd().as_raw_fd(), c_name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is ours alone.
    let file = unsafe { File::from_raw_fd(fd) };
    if !file.metadata()?.file_type().is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiter_file_names_name_their_resource() {
        let gpu: Resource = "gpu:3".parse().unwrap();
        let name = file_name(&gpu, 4242, 0, Kind::Wait);
        assert_eq!(name, ".gpu:3@4242.0.wait");
        assert_eq!(resource_of(&name), Some((gpu.clone(), Kind::Wait)));
        assert_eq!(resource_of(".gpu:3@1.2.hold"), Some((gpu, Kind::Hold)));
        assert_eq!(resource_of("gpu.lock"), None);
    }
}
