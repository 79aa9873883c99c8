//! The library's error: what kind of failure it is, and the one line the
//! command line says for it. Kinds meet exit numbers in one place
//! ([`Error::exit_code_with`]): the command line ends with it, and the
//! Python package raises the exception class of the kind.
//!
//! Inside the crate failures travel as `anyhow` errors whose innermost
//! cause says its exit code ([`crate::exit::Coded`]) or is a [`Busy`]; they
//! become an [`Error`] where they leave the crate.

use crate::exit::{ExitCode, exit_code_of, is_busy};

/// Why a take, a hold or a look at the locks failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The lock is held (or has others ahead in line) and the take was not
    /// to wait (`-n`, `wait=False`).
    Busy(Busy),
    /// The wait ran out of time (`-w`, `timeout=`) and left the line.
    Timeout(Busy),
    /// A bad resource name or a bad combination of options (exit 2).
    Usage(String),
    /// The scratch directory or a lock file is unsafe or unusable: a
    /// symbolic link, a FIFO, a network filesystem (exit 74).
    Unsafe(String),
    /// A device whose state could not be learned, or (`--require-idle`)
    /// that runs work outside the gate (exit 69).
    DeviceUnknown(String),
    /// An option this build does not have (exit 2).
    NotSupported(String),
    /// Anything else: the line, and the exit code the command line ends with.
    Other {
        /// The one line, after `devlock: `.
        message: String,
        /// The exit code.
        code: i32,
    },
}

/// The library's `Result`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Who holds a lock, as `devlock -n` names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The holder's step (from a record the kernel backs).
    pub step: Option<String>,
    /// The process the kernel names.
    pub pid: Option<u32>,
    /// Its user, from the kernel.
    pub user: Option<String>,
}

/// A take that found the lock busy without waiting (`-n`), or whose wait
/// ran out of time (`-w`); the message is the command line's, word for word.
#[derive(Debug, Clone)]
pub struct Busy {
    /// The lock in the way (for `--any`: every candidate, space-separated).
    pub resource: String,
    /// Who holds it, when it can be told.
    pub holder: Option<Holder>,
    /// The wait ran out of time, rather than not waiting.
    pub timed_out: bool,
    /// The one line the command line says, without `devlock: `.
    pub message: String,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Busy {}

impl Busy {
    /// A lock devlock did not take in the way (a stranger's byte lock, a
    /// file lease): busy as a holder is, naming its owner by the kernel's
    /// pid and `/proc`'s user, as an error.
    pub(crate) fn stranger(resource: &str, pid: Option<u32>, message: String) -> anyhow::Error {
        let holder = pid.map(|pid| Holder {
            step: None,
            pid: Some(pid),
            user: crate::proc::process::uid_of(pid)
                .map(|uid| crate::text::sanitize(&crate::proc::process::user_name(uid))),
        });
        anyhow::Error::new(Busy {
            resource: resource.to_owned(),
            holder,
            timed_out: false,
            message,
        })
    }
}

/// An option of the command line that this build does not have yet.
#[derive(Debug, Clone)]
pub struct NotSupported(pub String);

impl std::fmt::Display for NotSupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotSupported {}

impl Error {
    /// The exit code the command line ends with, a busy lock or a timeout
    /// with `conflict` (its `--conflict-exit-code`): the one place a kind
    /// becomes a number.
    pub fn exit_code_with(&self, conflict: i32) -> i32 {
        match self {
            Error::Busy(_) | Error::Timeout(_) => conflict,
            Error::Usage(_) | Error::NotSupported(_) => ExitCode::Usage.code(),
            Error::Unsafe(_) => ExitCode::IoError.code(),
            Error::DeviceUnknown(_) => ExitCode::NotIdle.code(),
            Error::Other { code, .. } => *code,
        }
    }

    /// The exit code the command line would end with (75 for a busy lock).
    pub fn exit_code(&self) -> i32 {
        self.exit_code_with(ExitCode::Busy.code())
    }

    /// Whether this is a busy lock or a timeout: an outcome `--quiet`
    /// keeps to the exit status, not a failure to report.
    pub fn is_busy(&self) -> bool {
        matches!(self, Error::Busy(_) | Error::Timeout(_))
    }

    /// The busy lock (or timed-out wait), with who is in the way.
    pub fn busy(&self) -> Option<&Busy> {
        match self {
            Error::Busy(busy) | Error::Timeout(busy) => Some(busy),
            _ => None,
        }
    }

    /// The one line, as the command line says it after `devlock: `.
    pub fn message(&self) -> &str {
        match self {
            Error::Busy(busy) | Error::Timeout(busy) => &busy.message,
            Error::Usage(m)
            | Error::Unsafe(m)
            | Error::DeviceUnknown(m)
            | Error::NotSupported(m)
            | Error::Other { message: m, .. } => m,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Error {}

/// The crate's failures as they leave it: the innermost [`Busy`],
/// [`NotSupported`] or exit code decides the kind; the line is the whole
/// chain, as `devlock: {err:#}` says it.
impl From<anyhow::Error> for Error {
    fn from(err: anyhow::Error) -> Error {
        // The one line reaches a terminal (or a Python traceback): whatever
        // a path or another process put in it, no escape goes with it.
        let message = crate::text::clean(&format!("{err:#}"));
        if let Some(busy) = err.chain().find_map(|e| e.downcast_ref::<Busy>()) {
            let busy = Busy {
                message,
                ..busy.clone()
            };
            return match busy.timed_out {
                true => Error::Timeout(busy),
                false => Error::Busy(busy),
            };
        }
        if err
            .chain()
            .any(|e| e.downcast_ref::<NotSupported>().is_some())
        {
            return Error::NotSupported(message);
        }
        match exit_code_of(&err) {
            _ if is_busy(&err) => Error::Busy(Busy {
                resource: String::new(),
                holder: None,
                timed_out: false,
                message,
            }),
            ExitCode::Usage => Error::Usage(message),
            ExitCode::IoError => Error::Unsafe(message),
            ExitCode::NotIdle => Error::DeviceUnknown(message),
            code => Error::Other {
                message,
                code: code.code(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn the_kind_survives_context_and_picks_the_exit_code() {
        let err = Error::from(
            Err::<(), _>(crate::exit::coded(ExitCode::IoError, "bad file"))
                .context("opening gpu")
                .unwrap_err(),
        );
        assert!(matches!(&err, Error::Unsafe(m) if m == "opening gpu: bad file"));
        assert_eq!(err.exit_code(), 74);
        let busy = Error::from(anyhow::Error::new(Busy {
            resource: "gpu".into(),
            holder: None,
            timed_out: true,
            message: "timed out".into(),
        }));
        assert!(matches!(&busy, Error::Timeout(b) if b.resource == "gpu"));
        assert_eq!((busy.exit_code(), busy.exit_code_with(3)), (75, 3));
        let other = Error::from(anyhow::anyhow!("plain"));
        assert_eq!(other.exit_code(), 1);
        assert!(!other.is_busy());
    }
}
