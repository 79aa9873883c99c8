//! Usage records: one JSON line when a hold's command has started, one every
//! [`PROGRESS_EVERY`] while it runs and one when it has ended, appended to
//! the holder's own file in the usage directory (`UID.jsonl`, or
//! `UID.TAG.jsonl` where a co-user made that name first), kept across
//! reboots; and where that directory is, and whether it can be trusted.
//!
//! Who a record is for comes from the kernel, never from the line: a file
//! counts for the user who owns it (fstat), and only a regular file with one
//! link does. A user can therefore write false lines only into a file of
//! their own, counted as their own jobs; and nobody else can remove one in
//! a sticky directory that root or its user owns, the only kind written to.
//! Nothing here runs before the command has started: the take pays nothing.

pub mod history;
pub mod idle;
pub(crate) mod line;
pub mod read;
pub(crate) mod sample;
pub mod site;
pub mod track;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};

/// The managed usage directory, made by `devlock setup` (root's, 1777).
pub const MANAGED_DIR: &str = "/var/lib/devlock/usage";

/// The usage directory of an open machine, made sticky and world-writable
/// by the first devlock that needs it (under /var/tmp: kept across reboots).
pub(crate) const OPEN_DIR: &str = "/var/tmp/devlock-usage";

/// The variable that names another usage directory (`none`: no records).
pub(crate) const ENV: &str = "DEVLOCK_USAGE_DIR";

/// How often a running hold appends a progress line: what a hold whose
/// devlock was killed is known to have lasted at least.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(600);

/// A usage file longer than this is renamed `UID.jsonl.old` (replacing the
/// one before) when its user's next hold starts.
pub(crate) const ROTATE_AT: u64 = 16 * 1024 * 1024;

/// The format version of every line.
pub(crate) const VERSION: u32 = 1;

/// Longest line a reader accepts.
pub(crate) const MAX_LINE: usize = 16 * 1024;

/// Where records of holds in the lock directory `lock` go:
/// `DEVLOCK_USAGE_DIR` (`none` or `off`: nowhere), else where `devlock
/// setup` recorded it in `lock` ([`site::USAGE_FILE`], believed only as
/// root wrote it), else the managed directory where it exists, else
/// [`OPEN_DIR`]. `None`: no records.
pub fn dir_for(lock: Option<&crate::flock::dir::ScratchDir>) -> Option<PathBuf> {
    match named_by_env().or_else(|| lock.and_then(|lock| site::usage_dir(lock.fd()))) {
        Some(usage) => usage.path(),
        None if Path::new(MANAGED_DIR).is_dir() => Some(PathBuf::from(MANAGED_DIR)),
        None => Some(PathBuf::from(OPEN_DIR)),
    }
}

/// [`dir_for`] the lock directory at `lock`, opened (never made) as a take
/// opens it: for a reader of records (`report`, `serve`) that has not
/// opened it already. Not opened where the variable names the directory.
pub fn dir_at(lock: &Path) -> Option<PathBuf> {
    let opened = match named_by_env() {
        Some(_) => None,
        None => crate::flock::dir::ScratchDir::open(lock).ok().flatten(),
    };
    dir_for(opened.as_ref())
}

/// What `DEVLOCK_USAGE_DIR` says, if it is set (not empty): nowhere, or
/// there ([`site::UsageDir::named`]).
pub fn named_by_env() -> Option<site::UsageDir> {
    std::env::var_os(ENV)
        .filter(|v| !v.is_empty())
        .map(|v| site::UsageDir::named(&v))
}

/// How a hold ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum How {
    /// The command exited (with `code`).
    Exit,
    /// A signal ended the command (`signal`).
    Signal,
    /// devlock stopped it: its GPUs computed nothing for the idle timeout.
    Idle,
    /// devlock stopped it: over its memory budget (`--mem-strict`).
    OverBudget,
    /// A library hold was let go.
    Released,
    /// devlock could not wait for the command.
    Error,
}

impl How {
    /// As the report writes it.
    pub fn label(self) -> &'static str {
        match self {
            How::Exit => "exit",
            How::Signal => "signal",
            How::Idle => "stopped: idle",
            How::OverBudget => "stopped: over budget",
            How::Released => "released",
            How::Error => "error",
        }
    }
}

/// What the sampler measured, so far or in all.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// The GPUs the sampler found the resources on (for `gpu`, every GPU).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    /// Samples taken.
    #[serde(default)]
    pub samples: u64,
    /// Largest memory the job's processes used on its GPUs at once, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_mib: Option<u64>,
    /// GPU-seconds covered by samples (each sample's period times the GPUs).
    #[serde(default)]
    pub sampled_gpu_s: f64,
    /// GPU-seconds computing: each sample's period times its utilization.
    #[serde(default)]
    pub busy_gpu_s: f64,
    /// GPU-seconds idle: periods where a GPU computed nothing, or the job
    /// had no process on it.
    #[serde(default)]
    pub idle_gpu_s: f64,
}

/// One line of a usage file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub(crate) enum Line {
    /// The command has started under the lock.
    Start(Start),
    /// Still running, as of `at_ms`.
    Progress {
        v: u32,
        job: String,
        at_ms: u64,
        #[serde(flatten)]
        measured: Measured,
    },
    /// It ended.
    End {
        v: u32,
        job: String,
        end_ms: u64,
        how: How,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<i32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<i32>,
        /// A library hold kept past its block's end while its process still
        /// used the device: when the block ended (the hold went on to
        /// `end_ms`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block_end_ms: Option<u64>,
        #[serde(flatten)]
        measured: Measured,
    },
}

/// The start line: what was held, by which process, since when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Start {
    pub v: u32,
    /// `BOOT-PID-START`: one hold's lines share it.
    pub job: String,
    pub resources: Vec<String>,
    /// The GPUs the resources map to (what GPU-hours count).
    #[serde(default)]
    pub gpus: Vec<u32>,
    pub step: String,
    /// The holder: devlock, or the library's process.
    pub pid: u32,
    pub pid_start: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// When the lock was taken.
    pub start_ms: u64,
    /// How long it waited for it.
    pub waited_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// `cli` or `python` (the library).
    pub from: String,
}

/// Whether any of `resources` maps to GPUs (what a hold's usage samples and
/// its idle policy acts on).
pub(crate) fn any_gpus(resources: &[crate::resource::Resource]) -> bool {
    resources.iter().any(|r| {
        crate::gpu::gate::gpu_indices(r, &[]).is_some_and(|ix| !ix.is_empty())
            || r.as_str() == "gpu"
    })
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    ms_of(SystemTime::now())
}

pub fn ms_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A hold's usage file, open for appending; every write is one line in one
/// `write(2)` (O_APPEND: lines of this user's concurrent holds never mix).
#[derive(Debug)]
pub(crate) struct Log {
    file: std::fs::File,
    pub job: String,
}

impl Log {
    /// Opens (or makes) this user's file in the usage directory `dir` and
    /// writes `start`; `Ok(None)` when records are kept nowhere, `Err` with
    /// why when they cannot be kept (the hold goes on; the front end says so).
    pub(crate) fn start(start: &Start, dir: Option<&Path>) -> Result<Option<Log>, String> {
        Log::start_in(start, Opened::open(dir.map(Path::to_path_buf)))
    }

    /// [`Log::start`] in a file [`Opened`] ahead: anew if it was removed
    /// meanwhile (renamed `.old` by a co-holder's rotation, then that
    /// `.old` replaced by the next), so that no line is written where
    /// nobody reads it.
    pub(crate) fn start_in(start: &Start, opened: Opened) -> Result<Option<Log>, String> {
        let Some((dir, file)) = opened.at else {
            return Ok(None);
        };
        let file = file?;
        let gone = nix::sys::stat::fstat(file.as_fd()).is_ok_and(|st| st.st_nlink == 0);
        let log = Log {
            file: if gone { open_own(&dir)? } else { file },
            job: start.job.clone(),
        };
        log.write(&Line::Start(start.clone()));
        Ok(Some(log))
    }

    pub(crate) fn progress(&self, measured: Measured) {
        self.write(&Line::Progress {
            v: VERSION,
            job: self.job.clone(),
            at_ms: now_ms(),
            measured,
        });
    }

    pub(crate) fn end(
        &self,
        how: How,
        code: Option<i32>,
        signal: Option<i32>,
        block_end_ms: Option<u64>,
        measured: Measured,
    ) {
        self.write(&Line::End {
            v: VERSION,
            job: self.job.clone(),
            end_ms: now_ms(),
            how,
            code,
            signal,
            block_end_ms,
            measured,
        });
    }

    fn write(&self, line: &Line) {
        use std::io::Write;
        let mut bytes = serde_json::to_vec(line).expect("a usage line always serialises");
        bytes.push(b'\n');
        // One write: with O_APPEND the kernel puts it at the end whole.
        let _ = (&self.file).write(&bytes);
    }
}

/// This user's usage file in a usage directory, opened before a take
/// that may wait: a take that waited then writes its start line in one
/// write(2) after the grant, instead of walking to the directory and
/// opening the file while the next in line waits for its command to start
/// (bench/run's hand-off and drain). A take that does not wait does what
/// it did, before its grant instead of after.
#[derive(Debug)]
pub struct Opened {
    /// The usage directory and the file in it, or `Err` with why records
    /// cannot be kept there (said once the locks are taken, as before);
    /// `None` where records are kept nowhere.
    at: Option<(PathBuf, Result<std::fs::File, String>)>,
}

impl Opened {
    /// Opens (or makes) this user's file in `dir` (`None`: nowhere).
    pub fn open(dir: Option<PathBuf>) -> Opened {
        Opened {
            at: dir.map(|dir| {
                let file = open_own(&dir);
                (dir, file)
            }),
        }
    }

    /// The usage directory.
    pub fn dir(&self) -> Option<&Path> {
        self.at.as_ref().map(|(dir, _)| dir.as_path())
    }
}

/// The job id of a holder: `BOOT-PID-START`.
pub(crate) fn job_id(boot: Option<&str>, pid: u32, start: u64) -> String {
    let boot = boot.map_or("", |b| b.get(..8).unwrap_or(b));
    format!("{boot}-{pid}-{start}")
}

/// How many times a name a co-user raced for is looked at again.
const TRIES: usize = 10;

/// Why the usage directory cannot be used.
#[derive(Debug)]
pub(crate) enum Unusable {
    /// It does not exist (nor a directory on the way to it).
    Missing,
    /// The whole sentence why, naming the real path at fault and its owner.
    Refused(String),
}

/// The usage directory open, and its owner and mode (fstat): reached from
/// `/` through directories only root (or, for a user who is not root, that
/// user) owns and nobody else may write unless sticky, never through
/// another user's link ([`walk`](crate::walk::walk)); made
/// sticky and world-writable when missing and `create`.
pub(crate) fn open_dir(dir: &Path, create: bool) -> Result<(OwnedFd, libc::stat), Unusable> {
    use crate::walk::{Stop, Way, walk};
    let uid = crate::sys::process::effective_uid();
    let way = Way {
        verb: "use",
        what: "the usage directory",
        also: (uid != 0).then_some(uid),
        make_missing: false,
    };
    let parent = walk(dir, way).map_err(|stop| match stop {
        Stop::Missing(_) => Unusable::Missing,
        Stop::Refused(e) => Unusable::Refused(e.to_string()),
    })?;
    let cannot = |e: &dyn std::fmt::Display| {
        Unusable::Refused(format!("{}: {e}", crate::show::show_path(&parent.target())))
    };
    let mut made = false;
    let fd = loop {
        match parent.open() {
            Ok(fd) => break fd,
            Err(e) if create && !made && e.kind() == io::ErrorKind::NotFound => {
                match nix::sys::stat::mkdirat(
                    &parent.fd,
                    parent.name.as_os_str(),
                    nix::sys::stat::Mode::from_bits_truncate(0o700),
                ) {
                    Ok(()) => made = true,
                    Err(nix::errno::Errno::EEXIST) => {}
                    Err(e) => return Err(cannot(&e.desc())),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Unusable::Missing),
            Err(e) => return Err(cannot(&crate::proc::os_text(&e))),
        }
    };
    if made {
        // Through the descriptor, whatever the umask.
        crate::sys::fs::fchmod(&fd, 0o1777).map_err(|e| cannot(&crate::proc::os_text(&e)))?;
    }
    let st = nix::sys::stat::fstat(&fd).map_err(|e| cannot(&e.desc()))?;
    Ok((fd, st))
}

/// Why records in the usage directory `dir` (its fstat `st`) cannot be
/// trusted to stay, if they cannot: it belongs to a user other than root
/// and this one, who can remove or replace any file in it, or anyone may
/// write it without the sticky bit.
pub(crate) fn distrust(dir: &Path, st: &libc::stat) -> Option<String> {
    let shown = crate::show::show_path(dir);
    if st.st_uid != 0 && st.st_uid != crate::sys::process::effective_uid() {
        return Some(format!(
            "{shown} is owned by {}, who can remove or replace any record in it",
            crate::walk::user(st.st_uid)
        ));
    }
    (st.st_mode & 0o022 != 0 && st.st_mode & libc::S_ISVTX == 0).then(|| {
        format!(
            "{shown} may be written by others and is not sticky ({:o}), so anyone can remove \
             or replace any record in it",
            st.st_mode & 0o7777
        )
    })
}

/// This user's usage file, opened for appending: in a usage directory
/// only root or this user owns ([`open_dir`], [`distrust`]: another
/// user's is not used, and the note says whose it is).
fn open_own(dir: &Path) -> Result<std::fs::File, String> {
    let (dir_fd, st) = open_dir(dir, true).map_err(|u| match u {
        Unusable::Missing => format!("{} does not exist", crate::show::show_path(dir)),
        Unusable::Refused(why) => why,
    })?;
    if let Some(why) = distrust(dir, &st) {
        return Err(format!(
            "{why}; records are kept only in a usage directory of root's or this user's \
             (sudo devlock setup makes one; DEVLOCK_USAGE_DIR names another)"
        ));
    }
    let uid = crate::sys::process::effective_uid();
    let shown = |e: io::Error| {
        format!(
            "{}: {}",
            crate::show::show_path(dir),
            crate::proc::os_text(&e)
        )
    };
    let (stem, file, size) = open_file(&dir_fd, uid).map_err(shown)?;
    if size <= ROTATE_AT {
        return Ok(file);
    }
    // Ours (checked): renamed over the old one (ours or missing, or the
    // rename fails and this file grows on), then made anew under the same
    // stem, so that a user keeps one file and one .old.
    let (from, to) = (format!("{stem}.jsonl"), format!("{stem}.jsonl.old"));
    if nix::fcntl::renameat(&dir_fd, from.as_str(), &dir_fd, to.as_str()).is_ok()
        && let Ok(Some((anew, _))) = open_stem(&dir_fd, &stem, uid)
    {
        return Ok(anew);
    }
    Ok(file)
}

/// The file of this user's records in the usage directory open as `dir`,
/// its stem and its size: `UID.jsonl`, or, where a co-user made that name
/// (or its `.old`) first, one of this user's `UID.TAG.jsonl` (TAG sixteen
/// random hex digits: nobody can make it before this user has).
fn open_file(dir: &OwnedFd, uid: u32) -> io::Result<(String, std::fs::File, u64)> {
    for _ in 0..TRIES {
        let stem = stem_for(dir, uid)?;
        if let Some((file, size)) = open_stem(dir, &stem, uid)? {
            return Ok((stem, file, size));
        }
    }
    Err(io::Error::other(
        "co-users keep taking the names of this user's usage file",
    ))
}

/// `STEM.jsonl` open for appending: made 0644 with O_EXCL when missing,
/// opened without O_CREAT when there (`fs.protected_regular`), never
/// through a symbolic link, and kept only as a regular file of this user's
/// with one link (in a sticky directory nobody else can then rename,
/// replace or remove it), with its size; `None` when something else took
/// the name.
fn open_stem(dir: &OwnedFd, stem: &str, uid: u32) -> io::Result<Option<(std::fs::File, u64)>> {
    let flags = OFlag::O_WRONLY | OFlag::O_APPEND | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let name = CString::new(format!("{stem}.jsonl")).expect("no NUL in a number");
    let fd = match crate::sys::fs::openat(dir.as_fd(), &name, flags | OFlag::O_NONBLOCK, 0) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match crate::sys::fs::openat(
                dir.as_fd(),
                &name,
                flags | OFlag::O_CREAT | OFlag::O_EXCL,
                0o644,
            ) {
                Ok(fd) => {
                    crate::sys::fs::fchmod(&fd, 0o644)?;
                    fd
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        // Something else took the name meanwhile (a link, a FIFO, a file
        // of theirs): passed over.
        Err(_) => return Ok(None),
    };
    let st = nix::sys::stat::fstat(&fd).map_err(io::Error::from)?;
    let size = u64::try_from(st.st_size).unwrap_or(0);
    Ok(is_ours(&st, uid).then(|| (std::fs::File::from(fd), size)))
}

/// A regular file of `uid`'s with one link.
fn is_ours(st: &libc::stat, uid: u32) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_uid == uid && st.st_nlink == 1
}

/// The stem of this user's usage file: `UID` unless a co-user has taken
/// `UID.jsonl` or `UID.jsonl.old`, else a tagged stem of this user's that
/// the directory lists (found again by every later hold), else a new one.
fn stem_for(dir: &OwnedFd, uid: u32) -> io::Result<String> {
    // Missing, or ours: either keeps the stem this user's.
    let free = |name: &str| match nix::sys::stat::fstatat(
        dir,
        name,
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    ) {
        Err(nix::errno::Errno::ENOENT) => true,
        Ok(st) => is_ours(&st, uid),
        Err(_) => false,
    };
    let usable = |stem: &str| free(&format!("{stem}.jsonl")) && free(&format!("{stem}.jsonl.old"));
    let plain = uid.to_string();
    if usable(&plain) {
        return Ok(plain);
    }
    let mut tagged: Vec<String> = read::names(dir)?
        .into_iter()
        .filter_map(|name| {
            let stem = name
                .strip_suffix(".jsonl")
                .or_else(|| name.strip_suffix(".jsonl.old"))?;
            let (named, tag) = read::parse_stem(stem)?;
            (named == uid && tag).then(|| stem.to_owned())
        })
        .collect();
    tagged.sort();
    tagged.dedup();
    if let Some(stem) = tagged.into_iter().find(|s| usable(s)) {
        return Ok(stem);
    }
    Ok(format!("{uid}.{:016x}", crate::sys::fs::random_u64()?))
}

/// The host name, for records of several machines put together.
pub(crate) fn host() -> Option<String> {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
}
