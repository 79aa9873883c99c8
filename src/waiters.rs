//! Waiter registrations: one small file per waiting devlock, kept flock'ed by
//! its owner, so the kernel itself says which registrations are alive.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

use crate::procfs::{FileId, LockTable};
use crate::record::{self, Record};
use crate::resource::Resource;
use crate::scratch::ScratchDir;

/// Waiter files are dot files, which no resource name can be, so they never
/// collide with a lock file.
fn file_name(resource: &Resource, pid: u32, n: u32) -> String {
    format!(".{resource}@{pid}.{n}.wait")
}

/// The resource a waiter file name belongs to.
pub fn resource_of(file_name: &str) -> Option<Resource> {
    let inner = file_name.strip_prefix('.')?.strip_suffix(".wait")?;
    let (name, _) = inner.rsplit_once('@')?;
    name.parse().ok()
}

/// A live registration; dropping it removes the file.
#[derive(Debug)]
pub struct Registration {
    dir: ScratchDir,
    name: String,
    _file: File,
}

impl Registration {
    /// Registers this process as waiting for `resource`.
    pub fn create(dir: &ScratchDir, resource: &Resource, record: &Record) -> Result<Registration> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = ScratchDir::open(dir.path())?.context("scratch directory vanished")?;
        loop {
            let name = file_name(
                resource,
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed),
            );
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
            return Ok(Registration {
                dir,
                name,
                _file: file,
            });
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = nix::unistd::unlinkat(
            &self.dir.fd(),
            self.name.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
}

/// A registered waiter that the kernel confirms is alive.
#[derive(Debug, Clone)]
pub struct Waiter {
    pub resource: Resource,
    pub record: Record,
}

/// Live registered waiters in `dir`, oldest first, for the resources `wanted`
/// accepts. Registrations of dead waiters are removed where we may remove them.
pub fn live_waiters(
    dir: &ScratchDir,
    names: &[String],
    table: &LockTable,
    wanted: impl Fn(&Resource) -> bool,
) -> Vec<Waiter> {
    let mut waiters = Vec::new();
    for name in names {
        let Some(resource) = resource_of(name) else {
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
            waiters.push(Waiter { resource, record });
        }
    }
    waiters.sort_by_key(|w| (w.record.since_ms, w.record.pid));
    waiters
}

/// Removes a registration whose owner died. Taking its lock first proves the
/// owner is gone (a live owner holds it for as long as it waits).
fn sweep_dead(dir: &ScratchDir, name: &str, file: &File) {
    // SAFETY: open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        let _ = nix::unistd::unlinkat(&dir.fd(), name, nix::unistd::UnlinkatFlags::NoRemoveDir);
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
        let name = file_name(&gpu, 4242, 0);
        assert_eq!(name, ".gpu:3@4242.0.wait");
        assert_eq!(resource_of(&name), Some(gpu));
        assert_eq!(resource_of("gpu.lock"), None);
    }
}
