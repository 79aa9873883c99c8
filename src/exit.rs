//! The exit codes devlock itself uses, and the one place an error's kind
//! becomes one (for the binary and the bindings: not part of the library's
//! API).

use crate::error::{CommandKind, Error, EtcdKind};

/// How devlock ends when it does not pass on the command's own status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCode {
    /// Everything went well.
    Success,
    /// devlock failed for a reason not covered below (I/O, `/proc`, ...).
    GeneralError,
    /// The command line was wrong: unknown flag, bad name, bad duration.
    Usage,
    /// A device the lock maps to is busy with work outside the gate
    /// (`--require-idle`), or its state could not be read.
    NotIdle,
    /// etcd (`--etcd`) could not be reached, did not answer in time, or is
    /// not etcd (EX_NOHOST).
    EtcdUnreachable,
    /// The scratch directory or a lock file is unsafe or unusable.
    IoError,
    /// The lock is held by someone else and we were told not to wait, or the
    /// wait timed out (EX_TEMPFAIL; `--conflict-exit-code` overrides it).
    Busy,
    /// etcd refused the user name or password, or the client certificate
    /// (EX_NOPERM).
    EtcdDenied,
    /// TLS to etcd cannot work: a CA, certificate or key file that cannot be
    /// used (unreadable, not PEM, a key that does not match or that others
    /// can read, a client certificate out of its validity), a server
    /// certificate that does not verify, TLS on one side only (EX_CONFIG).
    EtcdTls,
    /// `devlock setup` was run without root (EX_NOPERM).
    NoPermission,
    /// The command was found but could not be executed.
    CannotExecute,
    /// The command was not found.
    NotFound,
    /// devlock or its command was ended by signal N.
    Signal(i32),
    /// The command's own exit status, passed on.
    Command(i32),
}

impl ExitCode {
    /// The number the process exits with.
    pub fn code(self) -> i32 {
        match self {
            ExitCode::Success => 0,
            ExitCode::GeneralError => 1,
            ExitCode::Usage => 2,
            ExitCode::EtcdUnreachable => 68,
            ExitCode::NotIdle => 69,
            ExitCode::IoError => 74,
            ExitCode::Busy => 75,
            ExitCode::EtcdDenied | ExitCode::NoPermission => 77,
            ExitCode::EtcdTls => 78,
            ExitCode::CannotExecute => 126,
            ExitCode::NotFound => 127,
            ExitCode::Signal(n) => 128 + n,
            ExitCode::Command(n) => n,
        }
    }
}

/// The one place an exit number is chosen for a failure. A busy lock and a
/// timeout are [`ExitCode::Busy`] here; `--conflict-exit-code` renumbers
/// them (and only them) where the binary ends (src/main.rs).
impl From<&Error> for ExitCode {
    fn from(err: &Error) -> ExitCode {
        match err {
            Error::Busy(_) | Error::Timeout(_) | Error::InUse(_) => ExitCode::Busy,
            Error::Usage(_) | Error::NotSupported(_) => ExitCode::Usage,
            Error::Unsafe(_) => ExitCode::IoError,
            Error::DeviceUnknown(_) => ExitCode::NotIdle,
            Error::Etcd { kind, .. } => match kind {
                EtcdKind::Unreachable => ExitCode::EtcdUnreachable,
                EtcdKind::Denied => ExitCode::EtcdDenied,
                EtcdKind::Tls => ExitCode::EtcdTls,
                _ => ExitCode::GeneralError,
            },
            Error::Command { kind, .. } => match kind {
                CommandKind::NotFound => ExitCode::NotFound,
                CommandKind::CannotExecute => ExitCode::CannotExecute,
                _ => ExitCode::GeneralError,
            },
            Error::Signal { signo, .. } => ExitCode::Signal(*signo),
            Error::Denied(_) => ExitCode::NoPermission,
            // The core's Error is non_exhaustive for the library's users
            // (and so for this crate); every kind it has is named above.
            Error::Other(_) | _ => ExitCode::GeneralError,
        }
    }
}

/// The exit code of a crate-internal error: its typed root's, else a
/// general failure.
pub(crate) fn of(err: &anyhow::Error) -> ExitCode {
    match crate::error::root(err) {
        Some(root) => ExitCode::from(root),
        None if err.downcast_ref::<crate::error::Busy>().is_some() => ExitCode::Busy,
        None => ExitCode::GeneralError,
    }
}

/// The command line's number for the library's [`Error`] (which lives in
/// the core, where no exit number is chosen), as the tests and the
/// bindings ask for it.
pub trait ExitCodeOf {
    /// The exit code the command line would end with (75 for a busy lock,
    /// before `--conflict-exit-code`).
    fn exit_code(&self) -> i32;
}

impl ExitCodeOf for Error {
    fn exit_code(&self) -> i32 {
        ExitCode::from(self).code()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_sysexits_and_the_shell() {
        assert_eq!(ExitCode::Success.code(), 0);
        assert_eq!(ExitCode::GeneralError.code(), 1);
        assert_eq!(ExitCode::Usage.code(), 2);
        assert_eq!(ExitCode::NotIdle.code(), 69);
        assert_eq!(ExitCode::IoError.code(), 74);
        assert_eq!(ExitCode::Busy.code(), 75);
        assert_eq!(ExitCode::EtcdUnreachable.code(), 68);
        assert_eq!(ExitCode::EtcdDenied.code(), 77);
        assert_eq!(ExitCode::NoPermission.code(), 77);
        assert_eq!(ExitCode::EtcdTls.code(), 78);
        assert_eq!(ExitCode::CannotExecute.code(), 126);
        assert_eq!(ExitCode::NotFound.code(), 127);
        assert_eq!(ExitCode::Signal(15).code(), 143);
        assert_eq!(ExitCode::Signal(9).code(), 137);
        assert_eq!(ExitCode::Command(3).code(), 3);
    }
}

#[cfg(test)]
mod kind_tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn the_kind_picks_the_number_through_context() {
        let err = Err::<(), _>(crate::error::unsafe_file("bad file"))
            .context("opening gpu")
            .unwrap_err();
        assert_eq!(of(&err), ExitCode::IoError);
        assert_eq!(of(&anyhow::anyhow!("plain")), ExitCode::GeneralError);
        assert_eq!(
            of(&crate::error::busy("gpu", false, "busy")),
            ExitCode::Busy
        );
        assert_eq!(
            of(&crate::error::in_use("held only shared")),
            ExitCode::Busy
        );
        assert_eq!(
            of(&crate::error::signal(15, "stopped")),
            ExitCode::Signal(15)
        );
        let timeout = Error::from(crate::error::busy("gpu", true, "gave up"));
        assert_eq!((timeout.exit_code(), timeout.is_busy()), (75, true));
    }
}
