//! How `devlock setup` reaches its `--dir`: from `/`, one component at a
//! time, each opened relative to the one before without following links
//! (`openat(O_NOFOLLOW|O_DIRECTORY)`) and checked through its descriptor
//! (`fstat`), so that nothing a user owns decides where setup acts. What
//! setup does afterwards is relative to the descriptor of the last
//! directory above `--dir`, never by path again.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use anyhow::Result;
use nix::fcntl::{AtFlags, OFlag};

use crate::exit::{ExitCode, coded};
use crate::flock::file::kind_of;
use crate::text::show_path;

/// As many symbolic links as the kernel follows in one path (`MAXSYMLINKS`).
const MAX_LINKS: usize = 40;

/// The directory that holds `--dir`, open and trusted: root's, and
/// writable by nobody else unless sticky, as is every directory above it.
pub(crate) struct Parent {
    /// The descriptor everything below is made and opened through.
    pub fd: OwnedFd,
    /// Its real path (symbolic links resolved), for messages.
    pub real: PathBuf,
    /// The last component of `--dir`: the directory setup makes its own.
    pub name: OsString,
}

impl Parent {
    /// The real path of `--dir` itself.
    pub(crate) fn target(&self) -> PathBuf {
        self.real.join(&self.name)
    }
}

/// Walks to the directory that holds `dir` (made absolute against the
/// working directory). Root's symbolic links are followed (only root can
/// change them, in directories only root may write or that are sticky);
/// anything else refuses with exit 74 before setup has changed anything:
/// a directory or link above `dir` that another user owns, one that group
/// or others may write without the sticky bit, a component that is missing
/// or not a directory.
pub(crate) fn reach(dir: &Path) -> Result<Parent> {
    let absolute = if dir.is_absolute() {
        dir.to_owned()
    } else {
        std::env::current_dir()
            .map_err(|e| {
                coded(
                    ExitCode::IoError,
                    format!("cannot find the working directory: {e}"),
                )
            })?
            .join(dir)
    };
    let mut parts: VecDeque<Component<'_>> = absolute.components().collect();
    let name = match parts.pop_back() {
        Some(Component::Normal(name)) => name.to_owned(),
        _ => {
            return Err(coded(
                ExitCode::Usage,
                format!(
                    "devlock setup --dir {}: name the directory to make by its last component \
                     (not /, . or ..)",
                    show_path(dir)
                ),
            ));
        }
    };
    let root = open_dir(nix::fcntl::AT_FDCWD, OsStr::new("/")).map_err(|e| {
        coded(
            ExitCode::IoError,
            format!("cannot open /: {}", crate::proc::os_text(&e)),
        )
    })?;
    let mut real = PathBuf::from("/");
    check_dir(&root, &real, dir)?;
    let mut cur = root;
    let mut links = 0;
    let mut todo: VecDeque<OsString> = parts
        .into_iter()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_owned()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    while let Some(part) = todo.pop_front() {
        let here = real.join(&part);
        let refuse = |why: String| refusal(dir, &here, why);
        if part == ".." {
            cur = open_dir(cur.as_fd(), &part).map_err(|e| {
                refuse(format!("it cannot be opened: {}", crate::proc::os_text(&e)))
            })?;
            real.pop();
            check_dir(&cur, &real, dir)?;
            continue;
        }
        let st = match nix::sys::stat::fstatat(&cur, part.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
        {
            Ok(st) => st,
            Err(nix::errno::Errno::ENOENT) => {
                return Err(coded(
                    ExitCode::IoError,
                    format!(
                        "refusing to set up {}: {} does not exist (setup makes only the last \
                         directory of --dir: make those above it first, root's); nothing was changed",
                        show_path(dir),
                        show_path(&here)
                    ),
                ));
            }
            Err(e) => return Err(refuse(format!("it cannot be examined: {}", e.desc()))),
        };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFLNK => {
                let target = nix::fcntl::readlinkat(&cur, part.as_os_str())
                    .map_err(|e| refuse(format!("its link cannot be read: {}", e.desc())))?;
                if st.st_uid != 0 {
                    return Err(refuse(format!(
                        "it is a symbolic link (to {}) owned by {}, who can point it anywhere",
                        show_path(Path::new(&target)),
                        user(st.st_uid)
                    )));
                }
                links += 1;
                if links > MAX_LINKS {
                    return Err(refuse("too many levels of symbolic links".to_owned()));
                }
                let target = PathBuf::from(target);
                if target.is_absolute() {
                    cur = open_dir(nix::fcntl::AT_FDCWD, OsStr::new("/")).map_err(|e| {
                        refuse(format!("it cannot be opened: {}", crate::proc::os_text(&e)))
                    })?;
                    real = PathBuf::from("/");
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(n) => todo.push_front(n.to_owned()),
                        Component::ParentDir => todo.push_front(OsString::from("..")),
                        _ => {}
                    }
                }
            }
            libc::S_IFDIR => {
                let fd = open_dir(cur.as_fd(), &part).map_err(|e| {
                    refuse(format!("it cannot be opened: {}", crate::proc::os_text(&e)))
                })?;
                real = here.clone();
                check_dir(&fd, &real, dir)?;
                cur = fd;
            }
            other => {
                return Err(refuse(format!(
                    "it is a {}, not a directory",
                    kind_of(other)
                )));
            }
        }
    }
    Ok(Parent {
        fd: cur,
        real,
        name,
    })
}

/// One directory on the way, opened without following a link.
fn open_dir(at: impl AsFd, name: &OsStr) -> std::io::Result<OwnedFd> {
    let c_name = std::ffi::CString::new(name.as_bytes()).map_err(std::io::Error::other)?;
    crate::sys::fs::openat(
        at.as_fd(),
        &c_name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        0,
    )
}

/// A directory above `--dir` must be root's, and writable by group or
/// others only with the sticky bit (like `/tmp`: there nobody but root can
/// rename or remove an entry root owns, and every entry on the way is
/// checked to be root's in turn).
fn check_dir(fd: &OwnedFd, real: &Path, dir: &Path) -> Result<()> {
    let st = nix::sys::stat::fstat(fd).map_err(|e| refusal(dir, real, e.desc().to_owned()))?;
    if st.st_uid != 0 {
        return Err(refusal(
            dir,
            real,
            format!(
                "it is owned by {}, who can replace what is below it",
                user(st.st_uid)
            ),
        ));
    }
    let sticky = st.st_mode & libc::S_ISVTX != 0;
    if st.st_mode & 0o022 != 0 && !sticky {
        let who = if st.st_mode & 0o002 != 0 {
            "everyone".to_owned()
        } else {
            format!("group {}", group(st.st_gid))
        };
        return Err(refusal(
            dir,
            real,
            format!(
                "it is writable by {who} and not sticky ({:o}), so they can replace what is below it",
                st.st_mode & 0o7777
            ),
        ));
    }
    Ok(())
}

/// The one-line refusal (exit 74), naming the real path of the component
/// at fault and the `--dir` it is on the way to.
fn refusal(dir: &Path, real: &Path, why: String) -> anyhow::Error {
    coded(
        ExitCode::IoError,
        format!(
            "refusing to set up {}: {} is on the way, and {why}; every directory above --dir \
             must be root's and writable only by root (or sticky, like /tmp); nothing was changed",
            show_path(dir),
            show_path(real)
        ),
    )
}

fn user(uid: u32) -> String {
    crate::text::sanitize(&crate::proc::process::user_name(uid))
}

fn group(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => crate::text::sanitize(&g.name),
        _ => gid.to_string(),
    }
}
