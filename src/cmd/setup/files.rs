//! How `devlock setup` makes each declared resource's files root's: made
//! when missing, taken over in place when held, swapped for a new root file
//! (under a temporary name, then `renameat2`) when another user's or of the
//! wrong type and nobody holds it.

use std::ops::ControlFlow;
use std::path::Path;

use anyhow::{Context, Result};
use nix::fcntl::{AtFlags, OFlag};

use super::leases::lease_holders;
use super::owner::{make_ours, owner_name, owner_words};
use super::{Plan, Report, TRIES, c_string, unlink};
use crate::flock::dir::ScratchDir;
use crate::proc;
use crate::proc::lock_entry::FileId;
use crate::proc::locks::LockTable;
use crate::show::kind_of;
use crate::show::show_path;

/// Makes one declared file root's: created when missing; root's own file
/// fixed in place; a regular file another user owns (or one with a lease
/// or several links) replaced by a new root file when nobody holds it, so
/// nothing set on the old inode carries over, and taken over in place when
/// held (the same inode, so a holder of it stays the only holder, and its
/// owner can no longer rename it); a file of the wrong type (a FIFO, a
/// symbolic link, a socket, a directory) is swapped for a new root file,
/// unless it is locked.
pub(super) fn declare(
    dir: &ScratchDir,
    name: &str,
    plan: &Plan,
    report: &mut Report,
) -> Result<()> {
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
        let settled = if st.st_mode & libc::S_IFMT == libc::S_IFREG {
            declare_regular(dir, name, &path, &st, plan, report)?
        } else {
            swap_wrong_type(dir, name, &path, &st, plan, report)?
        };
        if settled.is_break() {
            return Ok(());
        }
    }
    Err(crate::error::unsafe_file(format!(
        "{} keeps changing under devlock setup; someone is racing it",
        show_path(&path)
    )))
}

/// [`declare`]'s regular file at the name: replaced when another user's
/// (or leased, or linked elsewhere) and nobody holds it, else taken over in
/// place. `Break` once settled (or refused), `Continue` to look again.
fn declare_regular(
    dir: &ScratchDir,
    name: &str,
    path: &Path,
    st: &libc::stat,
    plan: &Plan,
    report: &mut Report,
) -> Result<ControlFlow<()>> {
    let leased = !lease_holders(FileId::from_metadata(st.st_dev, st.st_ino)).is_empty();
    // Another user's, leased, or linked elsewhere too (a link to
    // a root file outside, which an in-place chmod would change):
    // a new root file in its place, unless held.
    if st.st_uid != 0 || leased || st.st_nlink > 1 {
        match replace_unless_held(dir, name, st, plan)? {
            Swap::Done => {
                report.changed(
                    path,
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
                return Ok(ControlFlow::Break(()));
            }
            Swap::Raced => return Ok(ControlFlow::Continue(())),
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
                show_path(path),
                owner_name(st.st_uid)
            );
            report.refused += 1;
            return Ok(ControlFlow::Break(()));
        }
        Err(_) => return Ok(ControlFlow::Continue(())),
    };
    let st = nix::sys::stat::fstat(&fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Ok(ControlFlow::Continue(()));
    }
    if let Some(what) = make_ours(&fd, &st, plan.gid, plan.file_mode)? {
        report.changed(path, &what);
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
            show_path(path),
            leases
                .iter()
                .map(|&p| {
                    let user =
                        proc::process::uid_of(p).map_or("user unknown".to_owned(), owner_name);
                    format!("pid {p}, {user}")
                })
                .collect::<Vec<_>>()
                .join("; ")
        );
        report.refused += 1;
    }
    Ok(ControlFlow::Break(()))
}

/// [`declare`]'s file of the wrong type at the name (a FIFO, a symbolic
/// link, a socket, a directory): swapped for a new root file unless it is
/// locked. `Break` once settled (or refused), `Continue` to look again.
fn swap_wrong_type(
    dir: &ScratchDir,
    name: &str,
    path: &Path,
    st: &libc::stat,
    plan: &Plan,
    report: &mut Report,
) -> Result<ControlFlow<()>> {
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
            show_path(path),
            kind_of(st.st_mode),
            owner_name(st.st_uid)
        );
        report.refused += 1;
        return Ok(ControlFlow::Break(()));
    }
    let temp = new_file(dir, name, plan)?;
    if rename(dir, &temp, name, true).is_err() {
        let _ = unlink(dir, &temp);
        return Ok(ControlFlow::Continue(()));
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
        return Ok(ControlFlow::Continue(()));
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
        path,
        &format!(
            "replaced a {} owned by {}{aside}",
            kind_of(st.st_mode),
            owner_name(st.st_uid)
        ),
    );
    Ok(ControlFlow::Break(()))
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
