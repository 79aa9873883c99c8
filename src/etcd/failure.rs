//! etcd client errors worded, each with the exit code it deserves: refused,
//! unreachable, not etcd, TLS (see `tls` and `probe`).

use std::time::Duration;

use super::Config;
use super::{is, probe, tls};
use crate::error::EtcdKind;
use crate::messages::etcd as messages;

impl Config {
    /// Turns a client error from endpoint `at` into one line with the exit
    /// code it deserves.
    pub(crate) fn failure(&self, at: &str, doing: &str, err: etcd_client::Error) -> anyhow::Error {
        use etcd_client::Error as E;
        if let Some(tls_error) = tls::classify(causes(&err), at, self.tls.as_ref()) {
            return tls_error;
        }
        match &err {
            E::GRpcStatus(status) => {
                let message = status.message();
                // gRPC's PERMISSION_DENIED (7) and UNAUTHENTICATED (16).
                let denied = matches!(i32::from(status.code()), 7 | 16)
                    || [
                        "authentication failed",
                        "user name is empty",
                        "permission denied",
                        "invalid auth token",
                    ]
                    .iter()
                    .any(|m| message.contains(m));
                if denied {
                    let who = self.user.as_ref().map_or_else(
                        || {
                            "a request without a user (set DEVLOCK_ETCD_USER=NAME:PASSWORD)"
                                .to_owned()
                        },
                        |(name, _)| format!("user {name}"),
                    );
                    crate::error::etcd(
                        crate::error::EtcdKind::Denied,
                        format!("etcd at {at} refused {who} while {doing}: {message}"),
                    )
                } else {
                    // UNAVAILABLE, DEADLINE_EXCEEDED; CANCELLED, UNKNOWN,
                    // UNIMPLEMENTED, INTERNAL (a server that is not etcd).
                    let cause = transport_cause(&err).unwrap_or_else(|| message.to_owned());
                    let text = match i32::from(status.code()) {
                        14 | 4 => format!("cannot reach etcd at {at} while {doing}: {cause}"),
                        1 | 2 | 12 | 13 => format!(
                            "{at} gave no etcd answer while {doing}: {cause} (is it an etcd client URL?)"
                        ),
                        _ => format!("etcd at {at} failed while {doing}: {cause}"),
                    };
                    crate::error::etcd(crate::error::EtcdKind::Unreachable, text)
                }
            }
            E::InvalidUri(e) => crate::error::usage(format!("bad etcd URL {at}: {e}")),
            _ if innermost(&err).contains("no native certs found") => {
                crate::error::etcd(crate::error::EtcdKind::Tls, messages::no_system_roots())
            }
            _ => crate::error::etcd(
                crate::error::EtcdKind::Unreachable,
                format!(
                    "cannot reach etcd at {at} while {doing}: {}",
                    innermost(&err)
                ),
            ),
        }
    }

    /// [`Config::failure`], with a second look at an endpoint whose
    /// connection ended without a word: a probe may say why (a client
    /// certificate refused, TLS on one side only).
    pub(crate) async fn diagnose(
        &self,
        at: &str,
        doing: &str,
        err: etcd_client::Error,
    ) -> anyhow::Error {
        let closed = abrupt_end(&err);
        let said = self.failure(at, doing, err);
        if closed
            && is(&said, EtcdKind::Unreachable)
            && let Some(why) = probe::why_closed(at, self.tls.as_ref()).await
        {
            return why;
        }
        said
    }

    /// The error for a request that got no answer in time.
    pub(crate) fn no_answer(&self, at: &str, doing: &str, waited: Duration) -> anyhow::Error {
        crate::error::etcd(
            crate::error::EtcdKind::Unreachable,
            format!(
                "etcd at {at} did not answer within {} while {doing}",
                crate::show::human_duration(waited)
            ),
        )
    }
}

/// What a transport failure says deepest down ("connection refused"), when
/// gRPC's status only says "transport error".
fn transport_cause(err: &etcd_client::Error) -> Option<String> {
    use std::error::Error;
    let status = match err {
        etcd_client::Error::GRpcStatus(status) => status,
        _ => return None,
    };
    status.source().map(innermost)
}

/// Whether a request failed because the connection ended (closed, reset, a
/// broken pipe, an HTTP/2 protocol error), rather than because it could not
/// be made or got no answer.
fn abrupt_end(err: &etcd_client::Error) -> bool {
    let mut next = Some(causes(err));
    while let Some(e) = next {
        let text = e.to_string().to_lowercase();
        if [
            "closed",
            "reset",
            "broken pipe",
            "eof",
            "protocol error",
            "frame",
        ]
        .iter()
        .any(|m| text.contains(m))
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The chain of causes of a client error, the gRPC status's included (the
/// client error's own chain ends before it).
fn causes(err: &etcd_client::Error) -> &(dyn std::error::Error + 'static) {
    match err {
        etcd_client::Error::GRpcStatus(status) => status,
        other => other,
    }
}

/// The most specific cause, which is where transport errors say what
/// happened, without Rust's `(os error N)`.
pub(super) fn innermost(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last: &dyn std::error::Error = err;
    while let Some(source) = last.source() {
        last = source;
    }
    let text = last.to_string();
    match text.rsplit_once(" (os error ") {
        Some((words, code)) if code.ends_with(')') => words.to_owned(),
        _ => text,
    }
}
