//! The library's options, and its take waited for on the calling thread
//! ([`Lock::acquire`], over [`crate::Acquiring`]): a lock from Rust code.

use std::path::PathBuf;
use std::time::Duration;

use crate::api::{Acquiring, Hold, Spec};
use crate::error::Result;

/// How long a take ([`Lock::acquire`], [`crate::Acquiring`]) may wait.
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

impl Lock {
    /// Takes `spec` (a resource's name, or a [`Spec`] with the command
    /// line's `--shared`, `--slots`, `--any` and `--mem`), machine-wide,
    /// waiting as `options.wait` says, and holds it until the [`Hold`] is
    /// dropped. It is [`crate::Acquiring`]'s take, which the command line and
    /// the Python package take through too, waited for here: the same plan
    /// (a member `G:M` takes its group `G` shared; a GPU outside the
    /// caller's `CUDA_VISIBLE_DEVICES` is a usage error), the same files,
    /// line, records and usage record, the same typed [`crate::Error`]. A
    /// lock held through a descriptor inherited from a `devlock` parent
    /// passes through; to take inside a hold of this process, give its
    /// [`Hold::locks`] to [`crate::Acquiring::start`].
    ///
    /// # Signals
    ///
    /// The first wait installs a handler for `SIGRTMIN+1` that does
    /// nothing, without `SA_RESTART`, for the life of the process: a wait
    /// sleeps in the kernel on a thread of its own, which blocks every other
    /// signal, and a timeout (or a cancel) sends it that signal to
    /// interrupt its lock call (the way util-linux flock's `-w` uses
    /// SIGALRM, but aimed at one thread). A program that uses `SIGRTMIN+1`
    /// itself should not wait here. No other signal is touched.
    ///
    /// ```
    /// let dir = tempfile::tempdir()?;
    /// let options = devlock::Options { dir: dir.path().into(), ..Default::default() };
    /// let hold = devlock::Lock::acquire("gpu", &options)?;
    /// // ... use the GPU; every other devlock of "gpu" in this directory waits ...
    /// let busy = std::process::Command::new("flock")
    ///     .args(["-n", &dir.path().join("gpu.lock").to_string_lossy(), "true"])
    ///     .status()?;
    /// assert!(!busy.success());
    /// drop(hold);
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn acquire(spec: impl Into<Spec>, options: &Options) -> Result<Hold> {
        let mut acquiring = Acquiring::start(&spec.into(), options, &[])?;
        loop {
            // A timeout ends the wait itself (its deadline bounds each call).
            if let Some(outcome) = acquiring.wait(Duration::MAX) {
                return outcome;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(dir: &std::path::Path, wait: Wait) -> Options {
        Options {
            dir: dir.into(),
            wait,
            step: "unit".into(),
        }
    }

    /// Issue #32.8: a member is taken with its group, by the plan the
    /// command line and Python use, never as a bare lock of its own.
    #[test]
    fn a_member_is_taken_with_its_group_as_the_command_line_takes_it() {
        let tmp = tempfile::tempdir().unwrap();
        let group = Lock::acquire("gpu", &options(tmp.path(), Wait::Block)).unwrap();
        let err = Lock::acquire("gpu:0", &options(tmp.path(), Wait::NoWait)).unwrap_err();
        let busy = err.busy().expect("busy, as devlock -n gpu:0 is");
        assert_eq!(busy.resource, "gpu", "{busy:?}");
        assert_eq!(err.exit_code(), 75);
        drop(group);
        let member = Lock::acquire("gpu:1", &options(tmp.path(), Wait::NoWait)).unwrap();
        assert_eq!(member.cuda_visible_devices().as_deref(), Some("1"));
        assert!(member.locks().contains(&crate::HeldLock {
            resource: "gpu".into(),
            exclusive: false
        }));
        // The group's exclusive take waits for the member's shared hold.
        let err = Lock::acquire(
            "gpu",
            &options(tmp.path(), Wait::Timeout(Duration::from_millis(20))),
        )
        .unwrap_err();
        assert!(err.busy().is_some_and(|b| b.timed_out), "{err}");
    }

    #[test]
    fn a_spec_takes_slots_and_a_usage_error_is_the_command_lines() {
        let tmp = tempfile::tempdir().unwrap();
        let mut spec = Spec::new(["pool"]);
        spec.slots = Some(2);
        let now = options(tmp.path(), Wait::NoWait);
        let a = Lock::acquire(spec.clone(), &now).unwrap();
        let b = Lock::acquire(spec.clone(), &now).unwrap();
        assert_ne!(a.slot(), b.slot());
        assert!(Lock::acquire(spec, &now).unwrap_err().busy().is_some());
        let err = Lock::acquire("gpu:01", &now).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{err}");
    }
}
