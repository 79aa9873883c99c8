//! Usage records: one JSON line when a hold's command has started, one every
//! [`PROGRESS_EVERY`] while it runs and one when it has ended, appended to
//! the holder's own file in the usage directory (`UID.jsonl`), kept across
//! reboots; and where that directory is.
//!
//! Who a record is for comes from the kernel, never from the line: a file
//! counts for the user who owns it (fstat), and only a regular file with one
//! link does. A user can therefore write false lines only into a file of
//! their own, counted as their own jobs. Nothing here runs before the
//! command has started: the take pays nothing.

pub(crate) mod history;
pub(crate) mod idle;
pub(crate) mod read;
pub(crate) mod report;
pub(crate) mod sample;
pub(crate) mod track;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};

/// The managed usage directory, made by `devlock setup` (root's, 1777).
pub(crate) const MANAGED_DIR: &str = "/var/lib/devlock/usage";

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

/// Where records go: `DEVLOCK_USAGE_DIR` (`none` or `off`: nowhere), else the
/// managed directory where it exists, else [`OPEN_DIR`].
pub(crate) fn dir() -> Option<PathBuf> {
    match std::env::var_os(ENV) {
        Some(v) if v == "none" || v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ if Path::new(MANAGED_DIR).is_dir() => Some(PathBuf::from(MANAGED_DIR)),
        _ => Some(PathBuf::from(OPEN_DIR)),
    }
}

/// How a hold ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum How {
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
    pub(crate) fn label(self) -> &'static str {
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
pub(crate) struct Measured {
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
pub(crate) struct Start {
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

/// Milliseconds since the epoch.
pub(crate) fn now_ms() -> u64 {
    ms_of(SystemTime::now())
}

pub(crate) fn ms_of(t: SystemTime) -> u64 {
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
    /// Opens (or makes) this user's file in the usage directory and writes
    /// `start`; `None`, with a note on stderr unless `quiet`, when records
    /// cannot be kept (the hold goes on).
    pub(crate) fn start(start: &Start, quiet: bool) -> Option<Log> {
        let dir = dir()?;
        match open_own(&dir) {
            Ok(file) => {
                let log = Log {
                    file,
                    job: start.job.clone(),
                };
                log.write(&Line::Start(start.clone()));
                Some(log)
            }
            Err(err) => {
                if !quiet {
                    crate::tty::say_while_command_runs(&format!(
                        "devlock: note: no usage record for this job: {}: {}\n",
                        dir.display(),
                        crate::proc::os_text(&err)
                    ));
                }
                None
            }
        }
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

/// The job id of a holder: `BOOT-PID-START`.
pub(crate) fn job_id(boot: Option<&str>, pid: u32, start: u64) -> String {
    let boot = boot.map_or("", |b| b.get(..8).unwrap_or(b));
    format!("{boot}-{pid}-{start}")
}

/// The usage file of this user, opened for appending: made 0644 with
/// O_EXCL when missing (the directory too, sticky and world-writable),
/// opened without O_CREAT when there (`fs.protected_regular`), never
/// through a symbolic link, and refused unless it is a regular file of
/// ours with one link.
fn open_own(dir: &Path) -> io::Result<std::fs::File> {
    open_file(dir, false)
}

fn open_file(dir: &Path, rotated: bool) -> io::Result<std::fs::File> {
    let dir_fd = open_dir(dir, true)?;
    let uid = nix::unistd::geteuid().as_raw();
    let name = CString::new(format!("{uid}.jsonl")).expect("no NUL in a number");
    let flags = OFlag::O_WRONLY | OFlag::O_APPEND | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = loop {
        match crate::sys::fs::openat(dir_fd.as_fd(), &name, flags | OFlag::O_NONBLOCK, 0) {
            Ok(fd) => break fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        match crate::sys::fs::openat(
            dir_fd.as_fd(),
            &name,
            flags | OFlag::O_CREAT | OFlag::O_EXCL,
            0o644,
        ) {
            Ok(fd) => {
                crate::sys::fs::fchmod(&fd, 0o644)?;
                break fd;
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    };
    let st = nix::sys::stat::fstat(&fd).map_err(io::Error::from)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != uid || st.st_nlink != 1 {
        return Err(io::Error::other(format!(
            "{uid}.jsonl there is not a regular file of this user's with one link"
        )));
    }
    if st.st_size as u64 > ROTATE_AT && !rotated {
        // Ours (checked above): renamed over the old one, then made anew.
        let (from, to) = (format!("{uid}.jsonl"), format!("{uid}.jsonl.old"));
        if nix::fcntl::renameat(&dir_fd, from.as_str(), &dir_fd, to.as_str()).is_ok() {
            return open_file(dir, true);
        }
    }
    Ok(std::fs::File::from(fd))
}

/// The usage directory's descriptor (not through a symbolic link); made
/// sticky and world-writable when missing and `create`.
pub(crate) fn open_dir(dir: &Path, create: bool) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let path = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match crate::sys::fs::open(&path, flags) {
        Err(e) if create && e.kind() == io::ErrorKind::NotFound => match std::fs::create_dir(dir) {
            Ok(()) => {
                let fd = crate::sys::fs::open(&path, flags)?;
                crate::sys::fs::fchmod(&fd, 0o1777)?;
                Ok(fd)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                crate::sys::fs::open(&path, flags)
            }
            Err(e) => Err(e),
        },
        other => other,
    }
}

/// The host name, for records of several machines put together.
pub(crate) fn host() -> Option<String> {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
}
