//! The exit codes devlock itself uses, in one place (for the binary and the
//! bindings: not part of the library's API).

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

/// An error that carries the exit code devlock should end with.
#[derive(Debug)]
pub struct Coded {
    /// How devlock ends.
    pub code: ExitCode,
    /// The one line it says, after `devlock: `.
    pub message: String,
    /// The lock was busy or the wait timed out: an outcome `--quiet` keeps
    /// to the exit status, not a failure to report.
    pub busy: bool,
}

impl std::fmt::Display for Coded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Coded {}

/// Builds an error that ends devlock with `code`.
pub fn coded(code: ExitCode, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Coded {
        code,
        message: message.into(),
        busy: false,
    })
}

/// The error of a busy lock or a timed-out wait (`-n`, `-w`): said unless
/// `--quiet`, and ended with `code` (the conflict exit code).
pub fn busy(code: ExitCode, message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Coded {
        code,
        message: message.into(),
        busy: true,
    })
}

/// Whether an error is a busy lock or a timeout, as [`busy`] made it.
pub fn is_busy(err: &anyhow::Error) -> bool {
    err.chain()
        .find_map(|e| e.downcast_ref::<Coded>())
        .is_some_and(|c| c.busy)
}

/// The exit code an error maps to: the innermost [`Coded`] wins, anything
/// else is a general failure.
pub fn exit_code_of(err: &anyhow::Error) -> ExitCode {
    err.chain()
        .find_map(|e| e.downcast_ref::<Coded>())
        .map_or(ExitCode::GeneralError, |c| c.code)
}

#[cfg(test)]
mod coded_tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn code_survives_added_context() {
        let err = Err::<(), _>(coded(ExitCode::IoError, "bad file"))
            .context("opening gpu")
            .unwrap_err();
        assert_eq!(exit_code_of(&err), ExitCode::IoError);
        assert_eq!(format!("{err:#}"), "opening gpu: bad file");
        assert_eq!(
            exit_code_of(&anyhow::anyhow!("plain")),
            ExitCode::GeneralError
        );
    }
}
