//! The library's entry point: take a machine-wide lock from Rust code.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use anyhow::Result;

use crate::exit::{ExitCode, coded};
use crate::lockfile::{LockFile, TryLock};
use crate::record::Record;
use crate::resource::Resource;
use crate::scratch::ScratchDir;

/// How long [`Lock::acquire`] may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Sleep in the kernel until the lock is free.
    Block,
    /// Fail at once when someone else holds it.
    NoWait,
    /// Give up after this long.
    Timeout(Duration),
}

/// Where and how to take a lock.
#[derive(Debug, Clone)]
pub struct Options {
    /// The scratch directory ([`crate::scratch::DEFAULT_DIR`] by default).
    pub dir: PathBuf,
    pub wait: Wait,
    /// The label status shows for the holder.
    pub step: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            dir: std::env::var_os("DEVLOCK_DIR")
                .map_or_else(|| crate::scratch::DEFAULT_DIR.into(), PathBuf::from),
            wait: Wait::Block,
            step: std::env::args()
                .next()
                .and_then(|a| {
                    std::path::Path::new(&a)
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                })
                .unwrap_or_else(|| "rust".to_owned()),
        }
    }
}

/// Machine-wide locks, the same ones the `devlock` command takes.
pub struct Lock;

/// A held lock; dropping it releases the lock (unless it was already held by
/// this process, in which case the outer holder keeps it).
#[derive(Debug)]
pub struct Guard {
    resource: Resource,
    lock: Option<LockFile>,
}

impl Guard {
    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    /// Whether this take passed through a lock this process already held.
    pub fn is_nested(&self) -> bool {
        self.lock.is_none()
    }
}

impl Lock {
    /// Takes `resource` exclusively, machine-wide, waiting as `options.wait`
    /// says. A lock this process already holds (through another guard, or a
    /// descriptor inherited from a `devlock` parent) passes through.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let options = devlock::Options { dir: dir.path().into(), ..Default::default() };
    /// let guard = devlock::Lock::acquire("gpu", &options)?;
    /// // ... use the GPU; every other devlock of "gpu" in this directory waits ...
    /// let busy = std::process::Command::new("flock")
    ///     .args(["-n", &dir.path().join("gpu.lock").to_string_lossy(), "true"])
    ///     .status()?;
    /// assert!(!busy.success());
    /// drop(guard);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn acquire(resource: &str, options: &Options) -> Result<Guard> {
        let resource: Resource = resource
            .parse()
            .map_err(|e: String| coded(ExitCode::Usage, e))?;
        let dir = ScratchDir::open_or_create(&options.dir)?;
        let name = resource.file_name();
        let lock = loop {
            let lock = LockFile::open(&dir, &name)?;
            match lock.try_lock(true)? {
                TryLock::Taken if lock.still_at_path(&dir) => {
                    return Ok(guard(resource, lock, options));
                }
                TryLock::Taken => continue,
                TryLock::Busy => break lock,
            }
        };
        if crate::run::held_by_inheritance(&lock) {
            return Ok(Guard {
                resource,
                lock: None,
            });
        }
        let busy = || coded(ExitCode::Busy, format!("{resource} is busy"));
        let lock = match options.wait {
            Wait::NoWait => return Err(busy()),
            Wait::Block => block(&dir, lock)?,
            Wait::Timeout(limit) => block_for(dir, lock, limit)?.ok_or_else(busy)?,
        };
        Ok(guard(resource, lock, options))
    }
}

fn guard(resource: Resource, lock: LockFile, options: &Options) -> Guard {
    if lock.is_writable() {
        let _ = Record::for_this_process(&options.step, &[]).write_to(lock.file());
    }
    Guard {
        resource,
        lock: Some(lock),
    }
}

fn block(dir: &ScratchDir, mut lock: LockFile) -> Result<LockFile> {
    loop {
        lock.lock(true)?;
        if lock.still_at_path(dir) {
            return Ok(lock);
        }
        let name = lock
            .path()
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        lock = LockFile::open(dir, &name)?;
    }
}

/// Waits in a helper thread so the caller can stop waiting. If the helper
/// gets the lock after the caller gave up, it lets go at once.
fn block_for(dir: ScratchDir, lock: LockFile, limit: Duration) -> Result<Option<LockFile>> {
    const WAITING: u8 = 0;
    const GAVE_UP: u8 = 1;
    let state = Arc::new(AtomicU8::new(WAITING));
    let (tx, rx) = std::sync::mpsc::channel();
    let helper_state = state.clone();
    std::thread::spawn(move || {
        let got = block(&dir, lock);
        if helper_state.load(Ordering::Acquire) != GAVE_UP {
            let _ = tx.send(got);
        }
    });
    match rx.recv_timeout(limit) {
        Ok(got) => got.map(Some),
        Err(_) => {
            state.store(GAVE_UP, Ordering::Release);
            // It may have got the lock just now.
            match rx.try_recv() {
                Ok(got) => got.map(Some),
                Err(_) => Ok(None),
            }
        }
    }
}
