//! How root reaches a directory it acts in (setup's `--dir` and usage
//! directory, a root take's, forget's, status's and serve's lock directory,
//! the usage directory of a root run or report), and a user the usage
//! directory: from `/`, each directory on the way checked before anything
//! goes through it, so that nothing another user owns decides where it
//! acts. What is done afterwards is relative to the descriptor of the last
//! directory above, never by path again.
//!
//! A plain way (real directories only, every one trusted) costs one
//! `lstat` a component and one `open` ([`plain_way`]); anything else (a
//! link, `..`, a missing or refused component) is walked one component at
//! a time, each opened relative to the one before without following links
//! (`openat(O_NOFOLLOW|O_DIRECTORY)`) and checked through its descriptor,
//! which decides and says why.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::show::kind_of;
use crate::show::show_path;
use anyhow::Result;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::FileStat;

/// As many symbolic links as the kernel follows in one path (`MAXSYMLINKS`).
const MAX_LINKS: usize = 40;

/// The directory that holds the one walked to, open and trusted: root's
/// (or the trusted user's), and writable by nobody else unless sticky, as
/// is every directory above it.
#[derive(Debug)]
pub struct Parent {
    /// The descriptor everything below is made and opened through.
    pub fd: OwnedFd,
    /// Its real path (symbolic links resolved), for messages.
    pub real: PathBuf,
    /// The last component: the directory itself (setup makes it its own).
    pub name: OsString,
}

impl Parent {
    /// The real path of the directory itself.
    pub fn target(&self) -> PathBuf {
        self.real.join(&self.name)
    }
}

/// How a walk is judged and what its refusal says.
#[derive(Debug, Clone, Copy)]
pub struct Way<'a> {
    /// What was to be done, in a refusal: "set up", "use".
    pub verb: &'a str,
    /// What the directory is, in a refusal: "--dir", "the usage directory".
    pub what: &'a str,
    /// A user trusted besides root (the caller, when not root): a record
    /// writer may go through its own directories; root never through
    /// anyone's but root's.
    pub also: Option<u32>,
    /// Make a missing directory on the way (this process's, 0755) instead
    /// of refusing: below a directory only root (or the caller) can write,
    /// nobody else can have put anything.
    pub make_missing: bool,
}

impl Way<'_> {
    /// Setup's way to `--dir`: root's only, nothing made on the way.
    pub const SETUP: Way<'static> = Way {
        verb: "set up",
        what: "--dir",
        also: None,
        make_missing: false,
    };

    fn trusts(&self, uid: u32) -> bool {
        uid == 0 || self.also == Some(uid)
    }

    fn owners(&self) -> String {
        match self.also {
            Some(uid) => format!("root's or {}'s", user(uid)),
            None => "root's".to_owned(),
        }
    }
}

/// Why a walk stopped.
#[derive(Debug)]
pub(crate) enum Stop {
    /// A directory on the way does not exist (its real path).
    Missing(PathBuf),
    /// Anything else: the one-line refusal (exit 74, or 2 for a `dir`
    /// that names no directory to make).
    Refused(anyhow::Error),
}

/// Setup's walk to the directory that holds `--dir` (see [`walk`]): a
/// missing directory on the way is refused too.
pub fn reach(dir: &Path) -> Result<Parent> {
    reach_by(dir, Way::SETUP)
}

/// [`walk`], a missing directory on the way refused as setup refuses it.
pub fn reach_by(dir: &Path, way: Way<'_>) -> Result<Parent> {
    walk(dir, way).map_err(|stop| match stop {
        Stop::Missing(here) => crate::error::unsafe_file(format!(
            "refusing to {} {}: {} does not exist (setup makes only the last \
                 directory of {}: make those above it first, root's); nothing was changed",
            way.verb,
            show_path(dir),
            show_path(&here),
            way.what
        )),
        Stop::Refused(e) => e,
    })
}

/// Walks to the directory that holds `dir` (made absolute against the
/// working directory). Symbolic links that `way` trusts the owner of are
/// followed (only root can change root's, in directories only root may
/// write or that are sticky); anything else stops the walk with a refusal
/// (exit 74) before anything has been changed: a directory or link above
/// `dir` that another user owns, one that group or others may write
/// without the sticky bit, a component that is not a directory; a missing
/// one stops it as [`Stop::Missing`] unless `way.make_missing`.
pub(crate) fn walk(dir: &Path, way: Way<'_>) -> Result<Parent, Stop> {
    let absolute = absolute_of(dir)?;
    let (parts, name) = split_last(&absolute, dir, way)?;
    if let Some(parent) = plain_way(&parts, &name, way) {
        return Ok(parent);
    }
    let root = open_dir(nix::fcntl::AT_FDCWD, OsStr::new("/")).map_err(|e| {
        Stop::Refused(crate::error::unsafe_file(format!(
            "cannot open /: {}",
            crate::proc::os_text(&e)
        )))
    })?;
    let real = PathBuf::from("/");
    check_dir(&root, &real, dir, way)?;
    let todo: VecDeque<OsString> = parts
        .into_iter()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_owned()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    let mut walking = Walking {
        dir,
        way,
        cur: root,
        real,
        links: 0,
        made: None,
        todo,
    };
    while let Some(part) = walking.todo.pop_front() {
        walking.step(part)?;
    }
    Ok(Parent {
        fd: walking.cur,
        real: walking.real,
        name,
    })
}

/// `dir` made absolute against the working directory.
fn absolute_of(dir: &Path) -> Result<PathBuf, Stop> {
    if dir.is_absolute() {
        return Ok(dir.to_owned());
    }
    Ok(std::env::current_dir()
        .map_err(|e| {
            Stop::Refused(crate::error::unsafe_file(format!(
                "cannot find the working directory: {e}"
            )))
        })?
        .join(dir))
}

/// The components of `absolute` above its last, and the last, which must
/// be a name (`dir` as given, for the refusal).
fn split_last<'p>(
    absolute: &'p Path,
    dir: &Path,
    way: Way<'_>,
) -> Result<(VecDeque<Component<'p>>, OsString), Stop> {
    let mut parts: VecDeque<Component<'p>> = absolute.components().collect();
    match parts.pop_back() {
        Some(Component::Normal(name)) => Ok((parts, name.to_owned())),
        _ => Err(Stop::Refused(crate::error::usage(format!(
            "cannot {} {}: name the directory by its last component (not /, . or ..)",
            way.verb,
            show_path(dir)
        )))),
    }
}

/// A walk one component at a time, under way: the directory it is in
/// (open, checked) and what is left to walk.
struct Walking<'a, 'w> {
    /// The directory asked for, as given (for refusals).
    dir: &'a Path,
    way: Way<'w>,
    cur: OwnedFd,
    /// `cur`'s real path.
    real: PathBuf,
    /// The symbolic links followed so far.
    links: usize,
    /// The directory this walk has just made, to be given its mode.
    made: Option<OsString>,
    todo: VecDeque<OsString>,
}

impl Walking<'_, '_> {
    /// Goes through `part` from `cur`: up, into a directory, or along a
    /// link (its target's components put first in what is left).
    fn step(&mut self, part: OsString) -> Result<(), Stop> {
        let (dir, way) = (self.dir, self.way);
        let here = self.real.join(&part);
        let refuse = |why: String| Stop::Refused(refusal(dir, &here, why, way));
        if part == ".." {
            self.cur = open_dir(self.cur.as_fd(), &part).map_err(|e| {
                refuse(format!("it cannot be opened: {}", crate::proc::os_text(&e)))
            })?;
            self.real.pop();
            return check_dir(&self.cur, &self.real, dir, way);
        }
        let Some(st) = self.look(&part, &here)? else {
            return Ok(());
        };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFLNK => self.follow_link(&part, &st, &refuse),
            libc::S_IFDIR => {
                let fd = open_dir(self.cur.as_fd(), &part).map_err(|e| {
                    refuse(format!("it cannot be opened: {}", crate::proc::os_text(&e)))
                })?;
                if self.made.take().is_some_and(|m| m == part) {
                    // 0755 whatever the umask, through the descriptor.
                    crate::sys::fs::fchmod(&fd, 0o755).map_err(|e| {
                        refuse(format!(
                            "its mode cannot be set: {}",
                            crate::proc::os_text(&e)
                        ))
                    })?;
                }
                self.real = here.clone();
                check_dir(&fd, &self.real, dir, way)?;
                self.cur = fd;
                Ok(())
            }
            other => Err(refuse(format!(
                "it is a {}, not a directory",
                kind_of(other)
            ))),
        }
    }

    /// `part`'s status, not following a link; `None` when it was missing
    /// and `way.make_missing` made it (or someone else did meanwhile): it
    /// is put back to be looked at again.
    fn look(&mut self, part: &OsStr, here: &Path) -> Result<Option<FileStat>, Stop> {
        let refuse = |why: String| Stop::Refused(refusal(self.dir, here, why, self.way));
        match nix::sys::stat::fstatat(&self.cur, part, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(nix::errno::Errno::ENOENT) if self.way.make_missing => {
                match nix::sys::stat::mkdirat(
                    &self.cur,
                    part,
                    nix::sys::stat::Mode::from_bits_truncate(0o755),
                ) {
                    // Made, or made by someone else meanwhile: looked at
                    // again either way.
                    Ok(()) => {
                        self.made = Some(part.to_owned());
                        self.todo.push_front(part.to_owned());
                        Ok(None)
                    }
                    Err(nix::errno::Errno::EEXIST) => {
                        self.todo.push_front(part.to_owned());
                        Ok(None)
                    }
                    Err(e) => Err(refuse(format!("it cannot be made: {}", e.desc()))),
                }
            }
            Err(nix::errno::Errno::ENOENT) => Err(Stop::Missing(here.to_owned())),
            Err(e) => Err(refuse(format!("it cannot be examined: {}", e.desc()))),
        }
    }

    /// Follows the link `part` (status `st`) if `way` trusts its owner:
    /// its target's components go first in what is left, from `/` for an
    /// absolute one.
    fn follow_link(
        &mut self,
        part: &OsStr,
        st: &FileStat,
        refuse: &dyn Fn(String) -> Stop,
    ) -> Result<(), Stop> {
        let target = nix::fcntl::readlinkat(&self.cur, part)
            .map_err(|e| refuse(format!("its link cannot be read: {}", e.desc())))?;
        if !self.way.trusts(st.st_uid) {
            return Err(refuse(format!(
                "it is a symbolic link (to {}) owned by {}, who can point it anywhere",
                show_path(Path::new(&target)),
                user(st.st_uid)
            )));
        }
        self.links += 1;
        if self.links > MAX_LINKS {
            return Err(refuse("too many levels of symbolic links".to_owned()));
        }
        let target = PathBuf::from(target);
        if target.is_absolute() {
            self.cur = open_dir(nix::fcntl::AT_FDCWD, OsStr::new("/")).map_err(|e| {
                refuse(format!("it cannot be opened: {}", crate::proc::os_text(&e)))
            })?;
            self.real = PathBuf::from("/");
        }
        for c in target.components().rev() {
            match c {
                Component::Normal(n) => self.todo.push_front(n.to_owned()),
                Component::ParentDir => self.todo.push_front(OsString::from("..")),
                _ => {}
            }
        }
        Ok(())
    }
}

/// The way to the directory above `name` when it is plain: `parts` (from
/// `/`) are real directories, no link and no `..`, each one `way` trusts as
/// [`check_dir`] does. Each is looked at by path without following a link
/// (`lstat`), top down and only once the one above it was found trusted, so
/// that nobody but a trusted owner can change what a later look, or the
/// `open` of the last at the end, goes through (an entry that root owns in
/// a directory only root may write, or that is sticky, stays what it is).
/// `None` for anything else, which the walk one component at a time then
/// decides and says.
fn plain_way(parts: &VecDeque<Component<'_>>, name: &OsStr, way: Way<'_>) -> Option<Parent> {
    let mut real = PathBuf::new();
    for part in parts {
        match part {
            Component::RootDir => real.push("/"),
            Component::Normal(part) => real.push(part),
            _ => return None,
        }
        let st = nix::sys::stat::lstat(&real).ok()?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR || fault(&st, way).is_some() {
            return None;
        }
    }
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let c_real = std::ffi::CString::new(real.as_os_str().as_bytes()).ok()?;
    let fd = crate::sys::fs::open(&c_real, flags).ok()?;
    Some(Parent {
        fd,
        real,
        name: name.to_owned(),
    })
}

impl Parent {
    /// Opens the directory itself, without following a link.
    pub fn open(&self) -> std::io::Result<OwnedFd> {
        open_dir(self.fd.as_fd(), &self.name)
    }
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
fn check_dir(fd: &OwnedFd, real: &Path, dir: &Path, way: Way<'_>) -> Result<(), Stop> {
    let refused = |why: String| Stop::Refused(refusal(dir, real, why, way));
    let st = nix::sys::stat::fstat(fd).map_err(|e| refused(e.desc().to_owned()))?;
    match fault(&st, way) {
        Some(why) => Err(refused(why)),
        None => Ok(()),
    }
}

/// Why a directory on the way (its stat `st`) cannot be gone through, if
/// it cannot: its owner is not trusted, or group or others may write it
/// without the sticky bit.
fn fault(st: &libc::stat, way: Way<'_>) -> Option<String> {
    if !way.trusts(st.st_uid) {
        return Some(format!(
            "it is owned by {}, who can replace what is below it",
            user(st.st_uid)
        ));
    }
    let sticky = st.st_mode & libc::S_ISVTX != 0;
    (st.st_mode & 0o022 != 0 && !sticky).then(|| {
        let who = if st.st_mode & 0o002 != 0 {
            "everyone".to_owned()
        } else {
            format!("group {}", group(st.st_gid))
        };
        format!(
            "it is writable by {who} and not sticky ({:o}), so they can replace what is below it",
            st.st_mode & 0o7777
        )
    })
}

/// The one-line refusal (exit 74), naming the real path of the component
/// at fault and the directory it is on the way to.
fn refusal(dir: &Path, real: &Path, why: String, way: Way<'_>) -> anyhow::Error {
    crate::error::unsafe_file(format!(
        "refusing to {} {}: {} is on the way, and {why}; every directory above {} \
             must be {} and writable only by {} (or sticky, like /tmp); nothing was changed",
        way.verb,
        show_path(dir),
        show_path(real),
        way.what,
        way.owners(),
        if way.also.is_some() {
            "its owner"
        } else {
            "root"
        }
    ))
}

pub(crate) fn user(uid: u32) -> String {
    crate::show::sanitize(&crate::proc::process::user_name(uid))
}

fn group(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => crate::show::sanitize(&g.name),
        _ => gid.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(path: &Path) -> VecDeque<Component<'_>> {
        let mut parts: VecDeque<Component<'_>> = path.components().collect();
        parts.pop_back();
        parts
    }

    const USE: Way<'static> = Way {
        verb: "use",
        ..Way::SETUP
    };

    /// The plain way is taken only where the walk one component at a time
    /// would go through the same directories without a word: real
    /// directories, each trusted; a link, `..` or a directory of another
    /// user's is left to the walk, which decides and says why.
    #[test]
    fn only_a_plain_trusted_way_is_taken_by_path() {
        let base = tempfile::tempdir().unwrap();
        let base = base.path();
        std::fs::create_dir_all(base.join("a/b")).unwrap();
        let plain = base.join("a/b/locks");
        let me = crate::sys::process::effective_uid();
        let way = Way {
            also: (me != 0).then_some(me),
            ..USE
        };
        let name = OsStr::new("locks");
        let found = plain_way(&parts(&plain), name, way).expect("a plain way");
        assert_eq!(found.target(), plain);
        std::os::unix::fs::symlink(base.join("a/b"), base.join("link")).unwrap();
        for other in [base.join("link/locks"), base.join("a/../a/b/locks")] {
            assert!(plain_way(&parts(&other), name, way).is_none(), "{other:?}");
        }
        // A directory on the way that everyone may write, not sticky.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(base.join("a"), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(plain_way(&parts(&plain), name, way).is_none());
        std::fs::set_permissions(base.join("a"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(plain_way(&parts(&plain), name, way).is_some(), "sticky");
        if me == 0 {
            // Another user's directory on root's way.
            std::os::unix::fs::lchown(base.join("a/b"), Some(65534), None).unwrap();
            assert!(plain_way(&parts(&plain), name, USE).is_none());
            assert!(walk(&plain, USE).is_err(), "the walk refuses it too");
        }
    }
}
