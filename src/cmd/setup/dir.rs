//! How `devlock setup` makes a directory root's (the lock directory, the
//! usage directory): made when missing, taken over when another user's,
//! whatever else stands at its name removed, every step relative to the
//! directory above it.

use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use anyhow::{Context, Result};
use nix::fcntl::{AtFlags, OFlag};

use super::owner::{make_ours, owner_name, owner_words};
use super::{Plan, Report, TRIES};
use crate::show::kind_of;
use crate::show::show_path;
use crate::walk::Parent;

fn c_string_os(text: &std::ffi::OsStr) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(text.as_bytes()).map_err(|_| crate::error::usage("a path contains a NUL byte"))
}

/// Makes the directory root's, with `mode`: created when missing, taken
/// over (through a descriptor opened without following links, then
/// checked to be still at the path) when someone else owns it, and
/// whatever else stands at the path (a symbolic link, a file) removed
/// first. Every step is relative to the descriptor of the directory above
/// it, which [`walk::reach`] walked to from `/` and checked: nothing
/// here follows a path again, so a co-user who swaps the directory for a
/// link (`renameat2(RENAME_EXCHANGE)`) changes only what is opened, never
/// what is changed. `label` names it in what setup says.
///
/// [`walk::reach`]: crate::walk::reach
pub(super) fn take_dir(
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
        if !still_at(parent, &st) {
            continue;
        }
        return Ok(fd);
    }
    Err(crate::error::unsafe_file(format!(
        "{} keeps changing under devlock setup; someone is racing it",
        show_path(&shown)
    )))
}

/// Whether the directory `st` describes is still at `parent`'s name.
fn still_at(parent: &Parent, st: &libc::stat) -> bool {
    let name = parent.name.as_os_str();
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
    nix::sys::stat::fstatat(&parent.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|now| now.st_dev == st.st_dev && now.st_ino == st.st_ino)
}
