//! The library's entry point: take a machine-wide lock from Rust code.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Busy, Error, Result};
use crate::exit::{ExitCode, coded};
use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Context, Held, Taken};
use crate::flock::wait::Quiet;
use crate::interrupt::Stop;
use crate::request::Request;
use crate::resource::Resource;

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
    /// The scratch directory ([`crate::DEFAULT_DIR`] by default).
    pub dir: PathBuf,
    /// Whether and how long to wait when someone else holds the lock.
    pub wait: Wait,
    /// The label status shows for the holder.
    pub step: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            // Empty counts as unset, as on the command line.
            dir: std::env::var_os("DEVLOCK_DIR")
                .filter(|d| !d.is_empty())
                .map_or_else(|| crate::flock::dir::DEFAULT_DIR.into(), PathBuf::from),
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
#[derive(Debug)]
pub struct Lock;

/// A held lock; dropping it releases the lock (unless it was already held by
/// this process, in which case the outer holder keeps it).
#[derive(Debug)]
pub struct Guard {
    resource: Resource,
    held: Option<Held>,
}

impl Guard {
    /// The resource this guard holds.
    pub fn resource(&self) -> &Resource {
        &self.resource
    }

    /// Whether this take passed through a lock this process already held.
    pub fn is_nested(&self) -> bool {
        self.held.is_none()
    }
}

impl Lock {
    /// Takes `resource` exclusively, machine-wide, waiting as `options.wait`
    /// says. A lock this process already holds (through another guard, or a
    /// descriptor inherited from a `devlock` parent) passes through.
    ///
    /// # Signals
    ///
    /// The first call installs a handler for `SIGRTMIN+1` that does
    /// nothing, without `SA_RESTART`, for the life of the process: with
    /// [`Wait::Timeout`], a timer thread sends it to the waiting thread to
    /// interrupt its lock call when the time is up (the way util-linux
    /// flock's `-w` uses SIGALRM, but aimed at one thread). A program that
    /// uses `SIGRTMIN+1` itself should not use this library's timeout. The
    /// waiting thread has the signal unblocked while it waits; its mask is
    /// restored afterwards. No other signal is touched.
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
        Lock::take(resource, options).map_err(Error::from)
    }

    fn take(resource: &str, options: &Options) -> anyhow::Result<Guard> {
        let resource: Resource = resource
            .parse()
            .map_err(|e: String| coded(ExitCode::Usage, e))?;
        let dir = ScratchDir::open_or_create(&options.dir)?;
        let ctx = Context {
            dir: &dir,
            step: options.step.clone(),
            no_wait: options.wait == Wait::NoWait,
            stop: Stop::default(),
            observer: &Quiet,
        };
        let request = Request {
            name: resource.clone(),
            exclusive: true,
            via: None,
            slots: 0,
            for_group: false,
        };
        let taken = match options.wait {
            Wait::Timeout(limit) => {
                with_deadline(&ctx, limit, || crate::take::take_one(&ctx, &request))
            }
            _ => crate::take::take_one(&ctx, &request),
        };
        let taken = match taken {
            Ok(taken) => taken,
            // Interrupted because the deadline stopped the wait: the timeout.
            Err(e) if is_interrupted(&e) && ctx.stop.was_requested() => {
                return Err(anyhow::Error::new(Busy {
                    resource: resource.to_string(),
                    holder: None,
                    timed_out: true,
                    message: format!("timed out waiting for {resource}"),
                }));
            }
            Err(e) if is_interrupted(&e) => {
                return Err(e.context(format!("the wait for {resource} was interrupted")));
            }
            Err(e) => return Err(e),
        };
        let held = match taken {
            Taken::Held(held) => {
                let _ = held.label(&ctx.record());
                Some(held)
            }
            Taken::Inherited(_) => None,
        };
        Ok(Guard { resource, held })
    }
}

/// Runs `wait` on this thread and interrupts it when `limit` has passed.
fn with_deadline<T>(ctx: &Context, limit: Duration, wait: impl FnOnce() -> T) -> T {
    crate::interrupt::install();
    let me = crate::sys::signal::Thread::current();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let stop = ctx.stop.clone();
    let timer = std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(limit) {
            stop.stop(me);
        }
    });
    let mask = crate::interrupt::unblock_here();
    let result = {
        // Marked finished however `wait` ends, a panic included: the timer
        // thread interrupts the wait until it is.
        let _finished = ctx.stop.finished_on_drop();
        wait()
    };
    crate::interrupt::restore(&mask);
    drop(done_tx);
    let _ = timer.join();
    result
}

fn is_interrupted(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
    })
}
