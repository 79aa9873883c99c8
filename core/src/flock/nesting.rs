//! Inherited-lock pass-through: a take inside a job that already holds the
//! lock (through a descriptor it passed down) runs under that hold instead
//! of waiting for itself.

use std::os::fd::RawFd;

use anyhow::Result;

use crate::flock::file::LockFile;
use crate::proc;
use crate::request::Request;

/// Whether we run inside a job that holds the lock already (then the take
/// passes through); an error when that job holds it only shared and this
/// asks for it exclusively, which would wait for itself forever.
pub(crate) fn inside_holder(lock: &LockFile, request: &Request) -> Result<bool> {
    match inherited(lock, request.exclusive) {
        Inherited::Yes => Ok(true),
        Inherited::No => Ok(false),
        Inherited::OnlyShared(pid) => Err(held_only_shared(&request.name, pid)),
    }
}

// Typed refusals (exit 75 even with -q: no wait ends them); the words
// are the error's line.

/// A job that holds a lock only shared, asked for it exclusively.
fn held_only_shared(resource: &crate::resource::Resource, pid: u32) -> anyhow::Error {
    crate::error::in_use(format!(
        "{resource} is held only shared by the job this runs in (pid {pid}); taking it \
             exclusively inside that job would wait for itself"
    ))
}

/// A take inside an enclosing hold of this process (the library's nesting)
/// that holds a lock only shared, asked for it exclusively.
pub(crate) fn held_only_shared_here(resource: &crate::resource::Resource) -> anyhow::Error {
    crate::error::in_use(format!(
        "{resource} is held only shared by an enclosing hold of this process; taking it \
             exclusively inside that hold would wait for itself"
    ))
}

/// Whether the work we run inside already holds a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inherited {
    No,
    /// Held in a mode that covers the request: run under it.
    Yes,
    /// Held, but only shared while the request is exclusive: waiting would
    /// wait for ourselves.
    OnlyShared(u32),
}

/// Whether the job we run inside already holds the lock, asked of the
/// kernel rather than of an environment variable a script may have copied:
/// a descriptor we inherited (not close-on-exec, so not one of ours) on the
/// same file whose `/proc/self/fdinfo` shows a granted lock. An ancestor
/// that holds the lock without having passed the descriptor down does not
/// count: it may hold it for other work (a thread of a service), and then
/// passing through would let two holders in. The waiting line says so.
pub fn inherited(lock: &LockFile, exclusive: bool) -> Inherited {
    let mut found = Inherited::No;
    for held_exclusive in inherited_modes(lock) {
        if held_exclusive || !exclusive {
            return Inherited::Yes;
        }
        found = Inherited::OnlyShared(std::process::id());
    }
    found
}

/// The modes (true for exclusive) in which descriptors we inherited hold the
/// lock.
fn inherited_modes(lock: &LockFile) -> Vec<bool> {
    inherited_holds(lock).into_iter().map(|(_, e)| e).collect()
}

/// The descriptors we inherited that hold the lock: what a child must
/// inherit in turn to run inside the same hold.
pub fn inherited_fds(lock: &LockFile) -> Vec<RawFd> {
    let mut fds: Vec<RawFd> = inherited_holds(lock)
        .into_iter()
        .map(|(fd, _)| fd)
        .collect();
    fds.dedup();
    fds
}

/// Each inherited descriptor on the lock's file with a granted lock, and
/// the lock's mode (true for exclusive).
fn inherited_holds(lock: &LockFile) -> Vec<(RawFd, bool)> {
    let mut modes = Vec::new();
    let fds = crate::sys::fds::open_fds().unwrap_or_else(listed_fds);
    for number in fds {
        // The cheap test first: most of our descriptors are close-on-exec.
        if crate::sys::fs::close_on_exec(number) != Some(false) {
            continue;
        }
        let same = crate::sys::fs::file_id_of(number).is_some_and(|(dev, ino)| {
            proc::lock_entry::FileId::from_metadata(dev, ino) == lock.id()
        });
        if !same {
            continue;
        }
        modes.extend(
            proc::fdinfo::locks_of_fd("self", &number.to_string())
                .iter()
                .filter(|l| l.file == lock.id() && !l.blocked)
                .map(|l| (number, l.exclusive)),
        );
    }
    modes
}

/// Our descriptors as `/proc/self/fd` lists them (where the cheaper look
/// of [`open_fds`](crate::sys::fds::open_fds) does not come out).
fn listed_fds() -> Vec<RawFd> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|fd| fd.file_name().to_str()?.parse().ok())
        .collect()
}

/// Whether descriptor `fd` of this process is open on the lock's file and
/// holds a granted lock on it (asked of the kernel: a forked child that
/// closed its copy does not).
pub fn fd_holds(fd: RawFd, lock: &LockFile) -> bool {
    crate::sys::fs::file_id_of(fd)
        .is_some_and(|(dev, ino)| proc::lock_entry::FileId::from_metadata(dev, ino) == lock.id())
        && proc::fdinfo::locks_of_fd("self", &fd.to_string())
            .iter()
            .any(|l| l.file == lock.id() && !l.blocked)
}
