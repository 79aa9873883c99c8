//! The machine-wide scratch directory that holds every lock file.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::fcntl::OFlag;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Where locks live unless `--dir` or `DEVLOCK_DIR` say otherwise: the same
/// path for every user and every TMPDIR, so every job on the machine meets the
/// same gate.
pub const DEFAULT_DIR: &str = "/run/lock/devlock";

/// Mode of a directory devlock creates: world-writable and sticky like /tmp,
/// so every user can add lock files and nobody can remove another's.
const CREATED_DIR_MODE: u32 = 0o1777;

/// An open handle on the scratch directory; lock files are opened relative to
/// it so that no path component after it is followed again.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
    fd: OwnedFd,
    /// Where the files opened in it are logged, for a run's trust notes.
    opens: Option<OpenLog>,
    /// The registrations this process made here that are still there.
    made: crate::flock::made::Made,
}

/// The files opened in a scratch directory: path, owner and name of each.
pub(crate) type OpenLog = std::sync::Arc<std::sync::Mutex<Vec<(PathBuf, u32, String)>>>;

impl ScratchDir {
    /// Opens the directory, creating it (sticky, world-writable) when missing.
    pub fn open_or_create(path: &Path) -> Result<ScratchDir> {
        let mut created = false;
        loop {
            match ScratchDir::open(path)? {
                Some(dir) => {
                    if created {
                        // Through the descriptor opened without following
                        // links, and whatever the creator's umask was.
                        nix::sys::stat::fchmod(
                            &dir.fd,
                            nix::sys::stat::Mode::from_bits_truncate(CREATED_DIR_MODE),
                        )
                        .with_context(|| {
                            format!("setting mode of {}", crate::show::show_path(path))
                        })?;
                    }
                    return Ok(dir);
                }
                None => created = create(path)?,
            }
        }
    }

    /// Opens the directory if it exists; `Ok(None)` when it does not.
    /// Root reaches it from `/` through root's directories only (see
    /// [`root_way`]); another user by its path, as every user's own
    /// take does (the take's path pays nothing more).
    pub fn open(path: &Path) -> Result<Option<ScratchDir>> {
        let opened = if crate::sys::process::effective_uid() == 0 {
            match root_way(path)? {
                Some(parent) => parent.open(),
                None => return Ok(None),
            }
        } else {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            crate::sys::fs::open(&c_path(path)?, flags)
        };
        let fd = match opened {
            Ok(fd) => fd,
            Err(err) => {
                return match err.raw_os_error() {
                    Some(libc::ENOENT) => Ok(None),
                    Some(libc::ELOOP) | Some(libc::ENOTDIR) if is_symlink(path) => {
                        Err(crate::error::unsafe_file(format!(
                            "scratch directory {} is a symbolic link; refusing to follow it",
                            crate::show::show_path(path)
                        )))
                    }
                    Some(libc::ENOTDIR) => Err(crate::error::unsafe_file(format!(
                        "scratch directory {} is not a directory",
                        crate::show::show_path(path)
                    ))),
                    Some(libc::EACCES) => Err(crate::error::unsafe_file(format!(
                        "cannot open scratch directory {}: Permission denied (it is kept for \
                         a group this user is not in, or for its owner)",
                        crate::show::show_path(path)
                    ))),
                    _ => Err(crate::error::unsafe_file(format!(
                        "cannot open scratch directory {}: {}",
                        crate::show::show_path(path),
                        crate::proc::os_text(&err)
                    ))),
                };
            }
        };
        ScratchDir::from_fd(path, fd).map(Some)
    }

    /// The directory open as `fd` (reached and checked by its caller, e.g.
    /// `devlock setup` from `/`), known as `path` in messages.
    pub fn from_fd(path: &Path, fd: OwnedFd) -> Result<ScratchDir> {
        let dir = ScratchDir {
            path: path.to_owned(),
            fd,
            opens: None,
            made: Default::default(),
        };
        dir.refuse_network_filesystem()?;
        Ok(dir)
    }

    /// A second handle on the same directory.
    pub(crate) fn try_clone(&self) -> Result<ScratchDir> {
        Ok(ScratchDir {
            path: self.path.clone(),
            fd: self
                .fd
                .try_clone()
                .context("duplicating directory handle")?,
            opens: self.opens.clone(),
            made: self.made.clone(),
        })
    }

    /// The registrations made here that are still there (shared by every
    /// clone of this handle).
    pub fn made(&self) -> &crate::flock::made::Made {
        &self.made
    }

    /// From now on, every file opened in the directory that another user
    /// owns is logged in `log` (its owner from the fstat its opener makes
    /// anyway: free on the fast path).
    pub(crate) fn log_opens(&mut self, log: OpenLog) {
        self.opens = Some(log);
    }

    /// Logs a file opened in the directory that a user other than root and
    /// us owns, if opens are logged.
    pub(crate) fn opened(&self, path: &Path, owner: u32, name: &str) {
        if let Some(log) = &self.opens
            && owner != 0
            && owner != crate::sys::process::effective_uid()
        {
            log.lock().unwrap_or_else(|e| e.into_inner()).push((
                path.to_owned(),
                owner,
                name.to_owned(),
            ));
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether an exclusive holder's record goes into its lock file here:
    /// only in a directory made for locks, sticky as devlock and `devlock
    /// setup` make them (and /tmp is), where `NAME.lock` is the gate's, or
    /// one this user cannot write (its lock files were made for it). In a
    /// directory of this user's own (`--dir .` in a project) `NAME.lock`
    /// may be a file the command owns (cargo's `Cargo.lock`, yarn's
    /// `yarn.lock`), and one devlock made would hand the command its record
    /// as the file's content (issue #32.10): the record goes into a
    /// registration of its own, as a shared holder's does, and the lock
    /// file is never written.
    pub(crate) fn records_in_lock_files(&self) -> bool {
        nix::sys::stat::fstat(self.fd.as_fd()).is_ok_and(|st| st.st_mode & libc::S_ISVTX != 0)
            || nix::unistd::faccessat(
                self.fd.as_fd(),
                ".",
                nix::unistd::AccessFlags::W_OK,
                nix::fcntl::AtFlags::AT_EACCESS,
            )
            .is_err()
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// flock(2) is emulated with byte-range locks on NFS, turns mandatory on
    /// CIFS and varies on FUSE: a gate there is not the gate it looks like.
    fn refuse_network_filesystem(&self) -> Result<()> {
        let Ok(kind) = crate::sys::fs::filesystem_type(&self.fd) else {
            return Ok(());
        };
        if LOCAL_FILESYSTEMS.contains(&kind) {
            return Ok(());
        }
        let name = match kind {
            0x6969 => "NFS",
            0x517B => "SMB",
            0xFF53_4D42 => "CIFS",
            0xFE53_4D42 => "SMB2",
            0x6573_5546 => "FUSE",
            0x0102_1997 => "9p",
            0x5346_414F => "AFS",
            0x00C3_6400 => "Ceph",
            _ => return self.refuse_unlockable(kind),
        };
        Err(crate::error::unsafe_file(format!(
            "scratch directory {} is on {name}, where flock(2) is emulated or unreliable; \
                 use a local directory (--dir or DEVLOCK_DIR)",
            crate::show::show_path(&self.path)
        )))
    }

    /// A filesystem devlock does not know is asked whether flock(2) excludes
    /// there (Docker Desktop's file sharing has been seen to let two
    /// exclusive flocks succeed): a private file with no name, opened twice,
    /// locked through the first open; the second must be refused.
    fn refuse_unlockable(&self, kind: u64) -> Result<()> {
        match flock_excludes(self.fd()) {
            // Cannot tell (no O_TMPFILE there, a directory this user cannot
            // write): the lock files' own opens will say what fails.
            Err(_) | Ok(true) => Ok(()),
            Ok(false) => Err(crate::error::unsafe_file(format!(
                "scratch directory {} is on a filesystem (type {kind:#x}) where flock(2) does not \
                     exclude: two exclusive locks on one file both succeeded; use a local directory \
                     (--dir or DEVLOCK_DIR), bind-mounted from the host into containers",
                crate::show::show_path(&self.path)
            ))),
        }
    }

    /// Names in the directory (for status).
    /// The names in the directory with their inode numbers (getdents'
    /// `d_ino`: no file is opened or stat'ed).
    pub(crate) fn inodes(&self) -> Result<std::collections::HashMap<String, u64>> {
        let mut names = std::collections::HashMap::new();
        crate::sys::listing::each_entry(self.fd(), |name, ino| {
            names.insert(name.to_owned(), ino);
        })
        .with_context(|| format!("reading {}", self.path.display()))?;
        Ok(names)
    }

    /// Every name in the directory but `.` and `..`.
    pub fn entries(&self) -> Result<Vec<String>> {
        self.entries_starting_with("")
    }

    /// The names in the directory that begin with `prefix`, compared as
    /// bytes before any is copied: a group's members (`gpu:`) in a
    /// directory that also holds a registration per waiter, where a
    /// take after a long line would otherwise copy every waiter's name.
    pub(crate) fn entries_starting_with(&self, prefix: &str) -> Result<Vec<String>> {
        let mut names = Vec::new();
        crate::sys::listing::each_entry(self.fd(), |name, _| {
            if name.starts_with(prefix) {
                names.push(name.to_owned());
            }
        })
        .with_context(|| format!("reading {}", crate::show::show_path(&self.path)))?;
        Ok(names)
    }
}

/// The subdirectory waiters register in (issue #35: a take that lists the
/// lock directory for a group's members then reads no waiter's name). A
/// dot name with no `@` and no `.lock`, `.queue` or `.slotN` ending: never a
/// lock, queue, slot or registration name.
pub const WAIT_DIR: &str = ".waiting";

impl ScratchDir {
    /// The wait directory, when there is one to trust: a real directory
    /// (opened without following a link, then fstat'ed) that root or this
    /// directory's owner owns, shared as this directory is (see
    /// [`shared_as`]). `None` sends a waiter's registration here, as
    /// before the wait directory was.
    pub(crate) fn wait_dir(&self) -> Option<ScratchDir> {
        let here = nix::sys::stat::fstat(self.fd.as_fd()).ok()?;
        self.open_wait_dir(&here)
    }

    /// [`Self::wait_dir`], made first when missing by a waiter that may
    /// make it: this directory's owner, or root (anyone else's would be
    /// theirs, which nobody trusts), and only in a directory made for
    /// locks (sticky): in a user's own (`--dir .` in a project) a listing
    /// costs little and a directory devlock leaves there for good would be
    /// clutter. Made with no access for others, then given this
    /// directory's mode, so it is never looser on the way. One of ours
    /// still private is finished the same way: a maker killed between the
    /// two steps left it so, and nobody else could have written in it.
    pub(crate) fn wait_dir_or_make(&self) -> Option<ScratchDir> {
        let here = nix::sys::stat::fstat(self.fd.as_fd()).ok()?;
        if let Some(found) = self.open_wait_dir(&here) {
            return Some(found);
        }
        let me = crate::sys::process::effective_uid();
        if (me != 0 && me != here.st_uid) || here.st_mode & libc::S_ISVTX == 0 {
            return None;
        }
        let private = nix::sys::stat::Mode::from_bits_truncate(0o700);
        match nix::sys::stat::mkdirat(self.fd.as_fd(), WAIT_DIR, private) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(_) => return None,
        }
        let made = self.open_dir_below(WAIT_DIR)?;
        let st = nix::sys::stat::fstat(made.as_fd()).ok()?;
        if st.st_uid != me || st.st_mode & 0o077 != 0 {
            // Made meanwhile by someone else, or finished: checked as any
            // found one.
            return self.open_wait_dir(&here);
        }
        // The group first (a group-shared directory's must be its group),
        // then the mode, which a chown may have cleared bits of.
        if st.st_gid != here.st_gid {
            let _ = crate::sys::fs::fchown(&made, st.st_uid, here.st_gid);
        }
        let _ = crate::sys::fs::fchmod(&made, here.st_mode & 0o1777);
        self.open_wait_dir(&here)
    }

    fn open_wait_dir(&self, here: &libc::stat) -> Option<ScratchDir> {
        let fd = self.open_dir_below(WAIT_DIR)?;
        let st = nix::sys::stat::fstat(fd.as_fd()).ok()?;
        shared_as((&st).into(), here.into()).then(|| ScratchDir {
            path: self.path.join(WAIT_DIR),
            fd,
            opens: self.opens.clone(),
            made: self.made.clone(),
        })
    }

    fn open_dir_below(&self, name: &str) -> Option<OwnedFd> {
        let name = CString::new(name).ok()?;
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        crate::sys::fs::openat(self.fd.as_fd(), &name, flags, 0).ok()
    }
}

/// What decides who may use a directory: its type and mode, owner, group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sharing {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

impl From<&libc::stat> for Sharing {
    fn from(st: &libc::stat) -> Sharing {
        Sharing {
            mode: st.st_mode,
            uid: st.st_uid,
            gid: st.st_gid,
        }
    }
}

/// Whether the directory `sub` describes may hold the registrations of
/// the directory `top` describes: a directory owned by root or by `top`'s
/// owner (nobody else can rename or remove it, or change its mode), with
/// `top`'s mode, sticky and world-writable exactly where `top` is, and
/// `top`'s group unless its group has no more access than anyone. Never
/// looser than `top` (a registration there is as safe as one in `top`),
/// and never tighter (every user who can wait and look in `top` can
/// there).
pub(crate) fn shared_as(sub: Sharing, top: Sharing) -> bool {
    let mode = sub.mode & 0o1777;
    let group_is_anyone = (mode >> 3) & 0o7 == mode & 0o7;
    sub.mode & libc::S_IFMT == libc::S_IFDIR
        && (sub.uid == 0 || sub.uid == top.uid)
        && mode == top.mode & 0o1777
        && (sub.gid == top.gid || group_is_anyone)
}

use crate::sys::fs::LOCAL_FILESYSTEMS;

/// Whether an exclusive flock(2) on one open of a file keeps a second open
/// of it out, tried on a file of no name in `dir` (O_TMPFILE: nothing is
/// left behind and nobody else can open it).
pub(crate) fn flock_excludes(dir: std::os::fd::BorrowedFd<'_>) -> std::io::Result<bool> {
    use crate::sys::fs::{Flock, flock, openat};
    let first = openat(
        dir,
        c".",
        OFlag::O_TMPFILE | OFlag::O_RDWR | OFlag::O_CLOEXEC,
        0o600,
    )?;
    let again = crate::sys::fs::open(
        &CString::new(format!("/proc/self/fd/{}", first.as_raw_fd())).expect("no NUL in a number"),
        OFlag::O_RDWR | OFlag::O_CLOEXEC,
    )?;
    flock(&first, Flock::Exclusive, true)?;
    match flock(&again, Flock::Exclusive, true) {
        Ok(()) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(true),
        Err(e) => Err(e),
    }
}

/// The directory that holds the lock directory `path`, for root: walked
/// to from `/` (see [`crate::walk::walk`]), root's all the way
/// and writable by nobody else unless sticky, so that no user decides where
/// root makes, writes or removes a file; `None` when a directory on the way
/// is missing. Anything else refuses with exit 74, naming the real path at
/// fault and its owner.
fn root_way(path: &Path) -> Result<Option<crate::walk::Parent>> {
    use crate::walk::{Stop, Way, walk};
    let way = Way {
        verb: "use",
        ..Way::SETUP
    };
    match walk(path, way) {
        Ok(parent) => Ok(Some(parent)),
        Err(Stop::Missing(_)) => Ok(None),
        Err(Stop::Refused(e)) => Err(e),
    }
}

/// Makes the directory; `false` when someone else made it first. Root
/// makes it relative to the directory above, reached by [`root_way`].
fn create(path: &Path) -> Result<bool> {
    let made = if crate::sys::process::effective_uid() == 0 {
        match root_way(path)? {
            Some(parent) => nix::sys::stat::mkdirat(
                &parent.fd,
                parent.name.as_os_str(),
                nix::sys::stat::Mode::from_bits_truncate(0o700),
            )
            .map_err(std::io::Error::from),
            None => Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        }
    } else {
        std::fs::create_dir(path)
    };
    match made {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(crate::error::unsafe_file(format!(
            "cannot create scratch directory {}: {} (choose another with --dir or DEVLOCK_DIR)",
            crate::show::show_path(path),
            crate::proc::os_text(&e)
        ))),
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

pub(crate) fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        crate::error::usage(format!(
            "path {} contains a NUL byte",
            crate::show::show_path(path)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flock_excludes_on_a_local_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let opened = ScratchDir::open(dir.path()).unwrap().unwrap();
        assert!(flock_excludes(opened.fd()).unwrap());
        // The probe's file has no name: nothing is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // /dev/shm and /tmp are tmpfs or a disk: known, so not probed.
        let kind = crate::sys::fs::filesystem_type(opened.fd()).unwrap();
        assert!(LOCAL_FILESYSTEMS.contains(&kind), "{kind:#x}");
    }

    /// Issue #32.10: a record goes into a lock file only in a directory
    /// made for locks (sticky), or one this user cannot write.
    #[test]
    fn records_go_into_lock_files_only_in_a_directory_made_for_locks() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mode = |m| std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(m));
        let opened = ScratchDir::open(dir.path()).unwrap().unwrap();
        mode(0o755).unwrap();
        assert!(!opened.records_in_lock_files(), "a project's directory");
        mode(0o1777).unwrap();
        assert!(opened.records_in_lock_files(), "made for locks");
        if !nix::unistd::geteuid().is_root() {
            mode(0o555).unwrap();
            assert!(opened.records_in_lock_files(), "made for this user");
        }
        mode(0o700).unwrap();
    }

    /// The wait directory is trusted only as a directory of root's or the
    /// lock directory's owner, shared exactly as the lock directory is.
    #[test]
    fn a_wait_directory_is_shared_as_its_lock_directory() {
        let stat = |uid, gid, mode| Sharing { mode, uid, gid };
        let dir = libc::S_IFDIR;
        let top = stat(1000, 1000, dir | 0o1777);
        assert!(shared_as(stat(1000, 1000, dir | 0o1777), top));
        assert!(
            shared_as(stat(0, 0, dir | 0o1777), top),
            "root's, any group"
        );
        assert!(
            !shared_as(stat(1001, 1000, dir | 0o1777), top),
            "another user's"
        );
        assert!(!shared_as(stat(1000, 1000, dir | 0o777), top), "not sticky");
        assert!(!shared_as(stat(1000, 1000, dir | 0o1755), top), "tighter");
        assert!(!shared_as(stat(1000, 1000, libc::S_IFLNK | 0o1777), top));
        let group = stat(0, 50, dir | 0o1770);
        assert!(shared_as(stat(0, 50, dir | 0o3770), group), "setgid");
        assert!(
            !shared_as(stat(0, 51, dir | 0o1770), group),
            "another group"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever another user planted at the wait directory's name (any
        /// type, owner, group, mode), it is trusted only as a directory of
        /// root's or the lock directory's owner, with the lock directory's
        /// permission bits exactly: never looser, never tighter.
        #[test]
        fn a_planted_wait_directory_is_trusted_only_as_the_rule_says(
            sub in (proptest::prelude::any::<u32>(), 0u32..4, 0u32..4),
            top in (0u32..0o10000, 0u32..4, 0u32..4),
        ) {
            let (sub_mode, sub_uid, sub_gid) = sub;
            let top = Sharing { mode: libc::S_IFDIR | top.0, uid: top.1, gid: top.2 };
            let sub = Sharing { mode: sub_mode, uid: sub_uid, gid: sub_gid };
            if shared_as(sub, top) {
                proptest::prop_assert_eq!(sub.mode & libc::S_IFMT, libc::S_IFDIR);
                proptest::prop_assert!(sub.uid == 0 || sub.uid == top.uid);
                proptest::prop_assert_eq!(sub.mode & 0o1777, top.mode & 0o1777);
            }
        }
    }

    /// A group's members are found among the registrations of a long line,
    /// by their name's prefix alone; what is no member stays out.
    #[test]
    fn entries_starting_with_a_group_prefix_are_its_members_only() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "gpu:0.lock",
            "gpu:1.lock",
            "gpu.lock",
            "gpux:0.lock",
            ".gpu@7.0.wait",
            ".gpu:0@7.0.wait",
        ] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        let opened = ScratchDir::open(dir.path()).unwrap().unwrap();
        let mut names = opened.entries_starting_with("gpu:").unwrap();
        names.sort();
        assert_eq!(names, ["gpu:0.lock", "gpu:1.lock"]);
    }
}
