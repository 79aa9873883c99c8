//! The library's error: what kind of failure it is and the one line the
//! command line says for it, as data. It names no exit number: the front
//! end's `impl From<&Error> for ExitCode` (src/exit.rs) is the one place a
//! kind becomes one, and the Python package raises the class of the kind.
//!
//! Inside the crate failures travel as `anyhow` errors (for their context)
//! whose root is an [`Error`] made by one of the constructors below (or a
//! [`Busy`]); they become an [`Error`] where they leave the crate.

/// Why a take, a hold or a look at the locks failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock is held (or has others ahead in line) and the take was not
    /// to wait (`-n`, `wait=False`).
    #[error("{0}")]
    Busy(Busy),
    /// The wait ran out of time (`-w`, `timeout=`) and left the line.
    #[error("{0}")]
    Timeout(Busy),
    /// A bad resource name or a bad combination of options (exit 2).
    #[error("{0}")]
    Usage(String),
    /// An option this build does not have (exit 2).
    #[error("{0}")]
    NotSupported(String),
    /// The scratch directory or a lock file is unsafe or unusable: a
    /// symbolic link, a FIFO, a network filesystem (exit 74).
    #[error("{0}")]
    Unsafe(String),
    /// A device whose state could not be learned, or (`--require-idle`)
    /// that runs work outside the gate (exit 69).
    #[error("{0}")]
    DeviceUnknown(String),
    /// In use in a way no wait can end, said even with `-q`: an exclusive
    /// take inside a shared hold of the same job, a file `setup` must
    /// replace that is locked (exit 75, never the conflict code).
    #[error("{0}")]
    InUse(String),
    /// The etcd backend failed, as `kind` says.
    #[error("{message}")]
    Etcd {
        /// What went wrong with etcd.
        kind: EtcdKind,
        /// The one line.
        message: String,
    },
    /// The command could not be started, as `kind` says.
    #[error("{message}")]
    Command {
        /// Why it could not run.
        kind: CommandKind,
        /// The one line.
        message: String,
    },
    /// A stopping signal came before the command started.
    #[error("{message}")]
    Signal {
        /// The signal's number.
        signo: i32,
        /// The one line.
        message: String,
    },
    /// Not allowed: `devlock setup` or `forget` without root (exit 77).
    #[error("{0}")]
    Denied(String),
    /// Anything else (exit 1).
    #[error("{0}")]
    Other(String),
}

/// What went wrong with etcd (`--etcd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EtcdKind {
    /// Not reached, no answer in time, not etcd, or the lease was lost.
    Unreachable,
    /// The user name, password or client certificate was refused.
    Denied,
    /// TLS cannot work: files, verification, TLS on one side only.
    Tls,
}

/// Why the command could not be started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommandKind {
    /// No such command.
    NotFound,
    /// Found, but not executable.
    CannotExecute,
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
/// The backend makes it with what is in the way and a plain line; the front
/// end words that line, and names the holder, on the same value.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Busy {
    /// The lock in the way (for `--any`: every candidate, space-separated).
    pub resource: String,
    /// Who holds it, when it can be told.
    pub holder: Option<Holder>,
    /// The wait ran out of time, rather than not waiting.
    pub timed_out: bool,
    /// The one line the command line says, without `devlock: `.
    pub message: String,
    /// What stands in the way, as the backend found it: the lock files and
    /// figures the front ends word the message from (boxed: a busy is an
    /// error, and errors stay small).
    #[doc(hidden)]
    pub in_the_way: Box<InTheWay>,
}

/// What stands in the way of a busy take: the backend's
/// `flock::in_the_way::InTheWay`, named through [`Backend`].
pub type InTheWay = <Locks as Backend>::InTheWay;

/// Where the data a [`Busy`] carries is defined. The locks' module (which
/// imports this one, as every module below it does) names its type here, so
/// that this module imports none of them: no circle between the modules.
#[doc(hidden)]
pub trait Backend {
    /// What stands in the way of a busy take; [`Default`] when nothing more
    /// than its line is known.
    type InTheWay: std::fmt::Debug + Clone + Default + Send + Sync + 'static;
}

/// The lock backend, the one [`Backend`].
#[doc(hidden)]
#[derive(Debug)]
pub enum Locks {}

impl Busy {
    /// A lock devlock did not take in the way (a stranger's byte lock, a
    /// file lease): busy as a holder is, naming its owner by the kernel's
    /// pid and `/proc`'s user, as an error; its line says all there is.
    pub(crate) fn stranger(resource: &str, pid: Option<u32>, message: String) -> anyhow::Error {
        let holder = pid.map(|pid| Holder {
            step: None,
            pid: Some(pid),
            user: crate::proc::process::uid_of(pid)
                .map(|uid| crate::show::sanitize(&crate::proc::process::user_name(uid))),
        });
        anyhow::Error::new(Busy {
            resource: resource.to_owned(),
            holder,
            timed_out: false,
            message,
            in_the_way: Box::default(),
        })
    }
}

// One constructor per kind, so that a failure is made where it is found
// with its kind and nothing else: the number comes later, in the front end.

/// A refusal of what was asked: a name, a flag, a combination.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Usage(message.into()))
}

/// The scratch directory or a devlock file is unusable or unsafe.
pub fn unsafe_file(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Unsafe(message.into()))
}

/// A device that cannot be learned, or is busy outside the gate.
pub fn device(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::DeviceUnknown(message.into()))
}

/// In use in a way no wait ends (see [`Error::InUse`]).
pub fn in_use(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::InUse(message.into()))
}

/// Not allowed without root.
pub fn denied(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Denied(message.into()))
}

/// A failure of no other kind.
pub fn other(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Other(message.into()))
}

/// An etcd failure of `kind`.
pub fn etcd(kind: EtcdKind, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Etcd {
        kind,
        message: message.into(),
    })
}

/// A command that cannot be started, for `kind`.
pub fn command(kind: CommandKind, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Command {
        kind,
        message: message.into(),
    })
}

/// Stopped by signal `signo` before the command started.
pub fn signal(signo: i32, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Error::Signal {
        signo,
        message: message.into(),
    })
}

/// A busy outcome whose holder cannot be named (etcd, `forget`): said
/// unless `-q`, ended with the conflict code.
pub fn busy(resource: &str, timed_out: bool, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Busy {
        resource: resource.to_owned(),
        holder: None,
        timed_out,
        message: message.into(),
        in_the_way: Box::default(),
    })
}

/// The typed root of a crate error, if it has one (a [`Busy`] is found
/// by [`Error::from`]).
pub fn root(err: &anyhow::Error) -> Option<&Error> {
    err.downcast_ref::<Error>()
}

impl Error {
    /// Whether this is a busy lock or a timeout: an outcome `--quiet`
    /// keeps to the exit status, not a failure to report, and the one
    /// `--conflict-exit-code` renumbers.
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
            | Error::NotSupported(m)
            | Error::Unsafe(m)
            | Error::DeviceUnknown(m)
            | Error::InUse(m)
            | Error::Denied(m)
            | Error::Other(m)
            | Error::Etcd { message: m, .. }
            | Error::Command { message: m, .. }
            | Error::Signal { message: m, .. } => m,
        }
    }

    /// The same kind with another line (the whole chain's, or the
    /// library's words for it).
    pub fn with_message(mut self, line: String) -> Error {
        match &mut self {
            Error::Busy(busy) | Error::Timeout(busy) => busy.message = line,
            Error::Usage(m)
            | Error::NotSupported(m)
            | Error::Unsafe(m)
            | Error::DeviceUnknown(m)
            | Error::InUse(m)
            | Error::Denied(m)
            | Error::Other(m)
            | Error::Etcd { message: m, .. }
            | Error::Command { message: m, .. }
            | Error::Signal { message: m, .. } => *m = line,
        }
        self
    }
}

/// The crate's failures as they leave it: the typed root (an [`Error`] or
/// a [`Busy`]) decides the kind, anything else is [`Error::Other`]; the
/// line is the whole chain, as `devlock: {err:#}` says it.
impl From<anyhow::Error> for Error {
    fn from(err: anyhow::Error) -> Error {
        // The one line reaches a terminal (or a Python traceback): whatever
        // a path or another process put in it, no escape goes with it.
        let message = crate::show::clean(&format!("{err:#}"));
        let err = match err.downcast::<Error>() {
            Ok(root) => return root.with_message(message),
            Err(err) => err,
        };
        match err.downcast::<Busy>() {
            Ok(busy) if busy.timed_out => Error::Timeout(Busy { message, ..busy }),
            Ok(busy) => Error::Busy(Busy { message, ..busy }),
            Err(_) => Error::Other(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn the_kind_survives_context_and_the_line_is_the_chain() {
        let err = Error::from(
            Err::<(), _>(unsafe_file("bad file"))
                .context("opening gpu")
                .context("taking gpu")
                .unwrap_err(),
        );
        assert!(matches!(&err, Error::Unsafe(m) if m == "taking gpu: opening gpu: bad file"));
        assert_eq!(err.to_string(), "taking gpu: opening gpu: bad file");
        let timeout = Error::from(
            Err::<(), _>(busy("gpu", true, "timed out"))
                .context("waiting")
                .unwrap_err(),
        );
        assert!(matches!(&timeout, Error::Timeout(b) if b.resource == "gpu"));
        assert_eq!(timeout.message(), "waiting: timed out");
        assert!(timeout.is_busy());
        let other = Error::from(anyhow::anyhow!("plain\x1b[2J"));
        assert!(matches!(&other, Error::Other(m) if !m.contains('\x1b')));
        assert!(!other.is_busy());
        assert!(!Error::from(in_use("held only shared")).is_busy());
    }
}
