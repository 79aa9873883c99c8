//! One lock file in the scratch directory, opened safely, and the flock(2) on it.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;

use nix::fcntl::OFlag;
use std::path::PathBuf;

use crate::flock::dir::ScratchDir;
use crate::proc::lock_entry::FileId;
use crate::sys::fs::{Flock, flock};
use anyhow::{Context, Result};

/// Mode every lock file gets, whatever the creator's umask: any user who can
/// reach the directory must be able to open it and join the gate.
const LOCK_FILE_MODE: u32 = 0o666;

/// An open lock file. The flock belongs to this open file description, so it
/// is held until the last descriptor to it closes: ours, or a child's that
/// inherited it.
#[derive(Debug)]
pub struct LockFile {
    file: File,
    path: PathBuf,
    id: FileId,
    writable: bool,
    /// Owner, mode bits and link count as opened: who could rename it, and
    /// whether a record may be written into it.
    owner: u32,
    mode: u32,
    nlink: u64,
}

/// Whether a lock was taken, or who is in the way.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TryLock {
    Taken,
    Busy,
}

impl LockFile {
    /// Opens `name` in `dir`, creating it when missing. Refuses symlinks,
    /// FIFOs, sockets, devices and directories (exit 74, naming the path),
    /// and never truncates or writes before holding the lock. A file with
    /// several hard links is used: anyone can link a file they can write,
    /// so refusing it would hand every user a way to disable a resource
    /// (a record is then written only where that gives nobody anything, see
    /// [`LockFile::may_hold_record`]).
    pub fn open(dir: &ScratchDir, name: &str) -> Result<LockFile> {
        let path = dir.path().join(name);
        let c_name = crate::flock::dir::c_path(name.as_ref())?;
        loop {
            refuse_odd_file_before_opening(dir, &c_name, &path)?;
            // Open without O_CREAT first: fs.protected_regular refuses
            // O_CREAT on another user's file in a sticky directory, even when
            // the file exists and is ours to open.
            let fd = match open_at(dir, &c_name, OFlag::O_RDWR) {
                Ok(fd) => Some((fd, true)),
                Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
                    // A file someone made unwritable still serves as a gate;
                    // we just cannot leave a record in it.
                    Some((
                        open_at(dir, &c_name, OFlag::O_RDONLY).map_err(|e| open_error(&path, e))?,
                        false,
                    ))
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
                Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
                    return Err(anyhow::Error::new(Leased::of(dir, name, &path)));
                }
                Err(e) => return Err(open_error(&path, e)),
            };
            let (fd, writable) = match fd {
                Some(opened) => opened,
                None => match open_at(dir, &c_name, OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL)
                {
                    Ok(fd) => {
                        // Whatever the creator's umask (an error closes it).
                        crate::sys::fs::fchmod(&fd, LOCK_FILE_MODE)
                            .map_err(|e| open_error(&path, e))?;
                        (fd, true)
                    }
                    // Someone created it between our two opens: open theirs.
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                    Err(e) => return Err(open_error(&path, e)),
                },
            };
            let file = File::from(fd);
            let meta = file.metadata().map_err(|e| open_error(&path, e))?;
            check_plain_file(std::os::unix::fs::MetadataExt::mode(&meta), &path)?;
            let id = FileId::from_metadata(meta_dev(&meta), meta_ino(&meta));
            dir.opened(&path, std::os::unix::fs::MetadataExt::uid(&meta), name);
            return Ok(LockFile {
                file,
                path,
                id,
                writable,
                owner: std::os::unix::fs::MetadataExt::uid(&meta),
                mode: std::os::unix::fs::MetadataExt::mode(&meta),
                nlink: meta_nlink(&meta),
            });
        }
    }

    /// The file opened for reading only, to look at (a waiting line's
    /// handle while a file lease keeps it from being opened for writing);
    /// never created, never locked through.
    pub(crate) fn open_to_look(dir: &ScratchDir, name: &str) -> Result<LockFile> {
        let path = dir.path().join(name);
        let (file, meta) = open_checked(dir, name).map_err(|e| open_error(&path, e))?;
        Ok(LockFile {
            file,
            id: FileId::from_metadata(meta_dev(&meta), meta_ino(&meta)),
            path,
            writable: false,
            owner: std::os::unix::fs::MetadataExt::uid(&meta),
            mode: std::os::unix::fs::MetadataExt::mode(&meta),
            nlink: meta_nlink(&meta),
        })
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn id(&self) -> FileId {
        self.id
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// A second handle on the same open file (and so the same lock).
    pub(crate) fn try_clone(&self) -> io::Result<LockFile> {
        Ok(LockFile {
            file: self.file.try_clone()?,
            path: self.path.clone(),
            id: self.id,
            writable: self.writable,
            owner: self.owner,
            mode: self.mode,
            nlink: self.nlink,
        })
    }

    /// Whether a record may go into this file, and if not, why (one line
    /// for a warning); when it may, what the file holds now (nothing, or a
    /// devlock record), for [`LockFile::holds_exactly`] before each write.
    /// Only a file that is empty or already holds a devlock record is
    /// written: anything else is somebody's data (`--dir .` with a
    /// `Cargo.lock`). A file linked elsewhere too is written only when
    /// everyone may write it anyway, so a link cannot make devlock write
    /// where its linker could not.
    pub(crate) fn may_hold_record(&self) -> std::result::Result<Vec<u8>, String> {
        if !self.writable {
            return Err(format!(
                "{} is not writable for this user; holding it without a record",
                crate::show::show_path(&self.path)
            ));
        }
        if self.nlink > 1 && self.mode & 0o002 == 0 {
            return Err(format!(
                "{} has {} hard links; holding it without writing a record into it",
                crate::show::show_path(&self.path),
                self.nlink
            ));
        }
        match self.contents() {
            Some(now) if crate::flock::record::is_ours_to_write(&now) => Ok(now),
            _ => Err(format!(
                "{} holds data devlock did not write; holding it without a record (status shows no step)",
                crate::show::show_path(&self.path)
            )),
        }
    }

    /// The whole file, when it is no longer than a record may be: its size
    /// asked first, then one read (a second only if it grew meanwhile).
    fn contents(&self) -> Option<Vec<u8>> {
        let size = self.file.metadata().ok()?.len();
        self.contents_of_size(size)
    }

    /// The file's bytes, expected to be `size` long; `None` when it is
    /// longer than a record may be or cannot be read.
    fn contents_of_size(&self, size: u64) -> Option<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let max = crate::flock::record::MAX_RECORD_BYTES;
        if size > max as u64 {
            return None;
        }
        // One byte more than expected: a file that grew shows it.
        let mut buf = vec![0u8; size as usize + 1];
        let mut len = 0;
        loop {
            let want = buf.len() - len;
            match self.file.read_at(&mut buf[len..], len as u64) {
                Ok(n) => {
                    len += n;
                    // A short read of a regular file is its end.
                    if n < want {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return None,
            }
            // Longer than its size said: read on, within bounds.
            if buf.len() > max {
                return None;
            }
            buf.resize((buf.len() * 2).min(max + 1), 0);
        }
        buf.truncate(len);
        Some(buf)
    }

    /// Whether the file holds exactly `bytes`, no more and no less: checked
    /// before every write and before the cut on release, so that what
    /// anyone else wrote into it meanwhile (the command itself, with
    /// `--dir .`) is never overwritten or cut.
    pub(crate) fn holds_exactly(&self, bytes: &[u8]) -> bool {
        use std::os::unix::fs::FileExt;
        // One read of a byte more than expected: equal only when exactly
        // these bytes come back, and then the end.
        let mut buf = vec![0u8; bytes.len() + 1];
        let mut len = 0;
        loop {
            match self.file.read_at(&mut buf[len..], len as u64) {
                Ok(0) => break,
                Ok(n) => len += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
            if len >= bytes.len() {
                // A short read of a regular file is its end; a full one
                // means it is longer.
                break;
            }
        }
        len == bytes.len() && buf[..len] == *bytes
    }

    /// The open file, for uses other than flock (the queue's byte locks).
    pub(crate) fn into_file(self) -> File {
        self.file
    }

    /// Takes the lock if nobody holds it, without waiting.
    pub(crate) fn try_lock(&self, exclusive: bool) -> Result<TryLock> {
        match flock(&self.file, lock_op(exclusive), true) {
            Ok(()) => Ok(TryLock::Taken),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(TryLock::Busy),
            Err(e) => Err(e).with_context(|| {
                format!("taking the lock on {}", crate::show::show_path(&self.path))
            }),
        }
    }

    /// Sleeps in the kernel until the lock is ours (the kernel wakes us when
    /// the holder's last descriptor closes). An interrupting signal ends the
    /// wait with `Interrupted` when `keep_waiting` says so.
    pub(crate) fn lock(&self, exclusive: bool, keep_waiting: &dyn Fn() -> bool) -> Result<()> {
        self.sleep_for_lock(exclusive, keep_waiting)
            .with_context(|| {
                format!(
                    "waiting for the lock on {}",
                    crate::show::show_path(&self.path)
                )
            })
    }

    fn sleep_for_lock(&self, exclusive: bool, keep_waiting: &dyn Fn() -> bool) -> io::Result<()> {
        loop {
            if !keep_waiting() {
                return Err(io::ErrorKind::Interrupted.into());
            }
            match flock(&self.file, lock_op(exclusive), false) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted && keep_waiting() => continue,
                other => return other,
            }
        }
    }

    /// [`LockFile::try_lock`] on the file the path names now: a lock taken
    /// on a file someone replaced is let go, and the new file tried.
    pub fn try_lock_at_path(&mut self, dir: &ScratchDir, exclusive: bool) -> Result<bool> {
        loop {
            match self.try_lock(exclusive)? {
                TryLock::Busy => return Ok(false),
                TryLock::Taken if self.still_at_path(dir) => return Ok(true),
                TryLock::Taken => *self = self.reopen(dir)?,
            }
        }
    }

    /// [`LockFile::lock`] on the file the path names now, likewise.
    pub(crate) fn lock_at_path(
        &mut self,
        dir: &ScratchDir,
        exclusive: bool,
        keep_waiting: &dyn Fn() -> bool,
    ) -> Result<()> {
        loop {
            self.lock(exclusive, keep_waiting)?;
            if self.still_at_path(dir) {
                return Ok(());
            }
            *self = self.reopen(dir)?;
        }
    }

    fn reopen(&self, dir: &ScratchDir) -> Result<LockFile> {
        let name = self.path.file_name().expect("lock path has a name");
        LockFile::open(dir, &name.to_string_lossy())
    }

    /// Whether the path still names the inode we hold. Nobody should unlink or
    /// replace a lock file, but if someone did, a holder of the old inode and
    /// one of the new would both believe they hold the lock.
    pub fn still_at_path(&self, dir: &ScratchDir) -> bool {
        let name = self.path.file_name().expect("lock path has a name");
        match nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => FileId::from_metadata(st.st_dev, st.st_ino) == self.id,
            Err(_) => false,
        }
    }
}

fn lock_op(exclusive: bool) -> Flock {
    if exclusive {
        Flock::Exclusive
    } else {
        Flock::Shared
    }
}

/// Opens a name in the scratch directory without following a symlink, without
/// blocking on a FIFO and without becoming anybody's controlling terminal.
fn open_at(dir: &ScratchDir, name: &std::ffi::CStr, flags: OFlag) -> io::Result<OwnedFd> {
    let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
    crate::sys::fs::openat(dir.fd(), name, flags, LOCK_FILE_MODE)
}

/// A file lease (fcntl `F_SETLEASE`, which only a file's owner can take)
/// makes every open for writing wait for its holder to let go, at most the
/// kernel's `lease-break-time`: devlock's files are opened without waiting,
/// so such an open fails at once. The lease stands for the resource in use,
/// as a holder does: busy for `-n`, waited out ([`Leased::break_it`]) for
/// anyone else.
#[derive(Debug)]
pub struct Leased {
    /// The file's name in the directory.
    pub name: String,
    /// `a file lease on PATH (pid N, user), not devlock's`.
    pub words: String,
    /// The lease's holder, where the kernel's table names one.
    pid: Option<u32>,
}

impl Leased {
    fn of(dir: &ScratchDir, name: &str, path: &std::path::Path) -> Leased {
        let pid = nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .ok()
            .and_then(|st| {
                let id = FileId::from_metadata(st.st_dev, st.st_ino);
                let table = crate::proc::locks::LockTable::read().ok()?;
                Some(table.leases(id).iter().find(|l| !l.blocked)?.pid)
            });
        // `pid 77, bob` as the queue's stranger's lock names its owner.
        let user = pid.and_then(crate::proc::process::uid_of);
        let owner = match (pid, user.map(crate::proc::process::user_name)) {
            (Some(pid), Some(user)) => format!("pid {pid}, {}", crate::show::sanitize(&user)),
            (Some(pid), None) => format!("pid {pid}"),
            (None, _) => crate::proc::fdinfo::unseen_owner().to_owned(),
        };
        Leased {
            name: name.to_owned(),
            words: format!(
                "a file lease on {} ({owner}), not devlock's: every open of it for writing waits for its holder",
                path.display()
            ),
            pid,
        }
    }

    /// The error a request that may not wait ends with: the same typed
    /// busy as a holder's (`-q`, `--conflict-exit-code`, `devlock.Busy`).
    pub fn into_busy(self, resource: &str) -> anyhow::Error {
        crate::error::Busy::stranger(
            resource,
            self.pid,
            format!("{resource} is busy: {}", self.words),
        )
    }

    /// Opens the file for writing, waiting (the kernel tells the lease's
    /// holder to let go, and takes it from them after `lease-break-time`),
    /// and returns it: kept open, it keeps a read lease from being taken
    /// again. A signal that `keep_waiting` says ends the wait interrupts it.
    pub(crate) fn break_it(
        &self,
        dir: &ScratchDir,
        keep_waiting: &dyn Fn() -> bool,
    ) -> io::Result<Option<OwnedFd>> {
        let c_name = std::ffi::CString::new(self.name.as_str()).map_err(io::Error::other)?;
        let flags = OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        loop {
            match crate::sys::fs::openat(dir.fd(), &c_name, flags, LOCK_FILE_MODE) {
                Ok(fd) => return Ok(Some(fd)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted && keep_waiting() => {}
                // Gone, or not ours to open for writing (then no read
                // lease of a reader can be in our way either).
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::EACCES)) => {
                    return Ok(None);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl std::fmt::Display for Leased {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.words)
    }
}

impl std::error::Error for Leased {}

/// Opening a device node can have effects of its own (a tape rewinds), so look
/// before opening too; the check after opening is the one that counts.
fn refuse_odd_file_before_opening(
    dir: &ScratchDir,
    name: &std::ffi::CStr,
    path: &std::path::Path,
) -> Result<()> {
    match nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => check_plain_file(st.st_mode, path),
        Err(_) => Ok(()),
    }
}

/// Opens a file in the scratch directory for reading: no symlinks followed, no
/// blocking on a FIFO, and only regular files accepted.
pub(crate) fn open_read_only(dir: &ScratchDir, name: &str) -> std::io::Result<File> {
    open_checked(dir, name).map(|(file, _)| file)
}

/// [`open_read_only`], with the file's metadata. A file of the wrong type is
/// refused with [`wrong_type_error`], before opening it when
/// it can be seen (opening a device can have effects of its own).
pub(crate) fn open_checked(
    dir: &ScratchDir,
    name: &str,
) -> std::io::Result<(File, std::fs::Metadata)> {
    let c_name = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    if let Ok(st) =
        nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        && st.st_mode & libc::S_IFMT != libc::S_IFREG
    {
        return Err(wrong_type_error(st.st_mode));
    }
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_CLOEXEC
        | OFlag::O_NOCTTY;
    let file = File::from(crate::sys::fs::openat(dir.fd(), &c_name, flags, 0)?);
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(wrong_type_error(std::os::unix::fs::MetadataExt::mode(
            &meta,
        )));
    }
    Ok((file, meta))
}

use crate::show::kind_of;

fn check_plain_file(mode: u32, path: &std::path::Path) -> Result<()> {
    if mode & libc::S_IFMT == libc::S_IFREG {
        return Ok(());
    }
    Err(wrong_type(path, mode))
}

/// The one-line error (exit 74) for a file of the wrong type at one of
/// devlock's paths.
pub(crate) fn wrong_type(path: &std::path::Path, mode: u32) -> anyhow::Error {
    crate::error::unsafe_file(format!(
        "{} is a {}, not a regular file; refusing to use it (remove it, or have root run devlock setup)",
        crate::show::show_path(path),
        kind_of(mode)
    ))
}

fn open_error(path: &std::path::Path, err: io::Error) -> anyhow::Error {
    let message = match err.raw_os_error() {
        Some(libc::ELOOP) => format!(
            "{} is a symbolic link; refusing to follow it in a shared directory",
            crate::show::show_path(path)
        ),
        Some(libc::EISDIR) => format!(
            "{} is a directory, not a regular file; refusing to use it",
            crate::show::show_path(path)
        ),
        Some(libc::ENXIO) => format!(
            "{} is a socket or device, not a regular file; refusing to use it",
            crate::show::show_path(path)
        ),
        Some(libc::EACCES) => format!(
            "cannot open lock file {}: permission denied (its owner made it private; \
             ask them, or have root run devlock setup)",
            crate::show::show_path(path)
        ),
        _ => format!(
            "cannot open lock file {}: {}",
            crate::show::show_path(path),
            crate::proc::os_text(&err)
        ),
    };
    crate::error::unsafe_file(message)
}

/// An error opening one of devlock's files (queue, registration) for
/// reading, as the one-line exit-74 error naming the path.
pub(crate) fn unusable(path: &std::path::Path, err: io::Error) -> anyhow::Error {
    if let Some(mode) = wrong_type_mode(&err) {
        return wrong_type(path, mode);
    }
    open_error(path, err)
}

/// The error [`crate::flock::file::open_read_only`] gives for a file of the
/// wrong type, carrying its mode.
pub(crate) fn wrong_type_error(mode: u32) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, WrongType(mode))
}

fn wrong_type_mode(err: &io::Error) -> Option<u32> {
    err.get_ref()?.downcast_ref::<WrongType>().map(|w| w.0)
}

#[derive(Debug)]
struct WrongType(u32);

impl std::fmt::Display for WrongType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a {}, not a regular file", kind_of(self.0))
    }
}

impl std::error::Error for WrongType {}

fn meta_dev(meta: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::dev(meta)
}

fn meta_ino(meta: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::ino(meta)
}

fn meta_nlink(meta: &std::fs::Metadata) -> u64 {
    std::os::unix::fs::MetadataExt::nlink(meta)
}
