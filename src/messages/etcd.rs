//! The etcd backend's sentences (`--etcd`): the same kinds of lines, about
//! keys in etcd rather than files.

use std::path::Path;
use std::time::Duration;

use crate::show::{human_duration, sanitize};
use crate::text::short_duration;

/// `train (pid 12 on host-a, alice) for 3s`
pub(crate) fn holder(step: &str, pid: u32, host: &str, user: &str, held: Duration) -> String {
    format!(
        "{} (pid {pid} on {}, {}) for {}",
        sanitize(step),
        sanitize(host),
        sanitize(user),
        short_duration(held)
    )
}

/// Who holds a key in a resource's line that devlock did not write:
/// `etcdctl lock` (etcd's `concurrency.Mutex`) puts exactly such keys.
pub(crate) const FOREIGN_CLIENT: &str = "etcdctl lock or another client";

/// A key in a resource's line that devlock did not write, with what
/// etcd says of it: its key and the revision it joined the line at.
pub(crate) fn foreign_key(key: &str, revision: i64) -> String {
    format!(
        "{FOREIGN_CLIENT} (key {}, in line since revision {revision})",
        sanitize(key)
    )
}

/// Why `--mem` is refused with `--etcd`.
pub(crate) fn mem_refused() -> String {
    "--mem is not available with --etcd: a budget is admitted by measuring the GPU's \
         memory on the machine that has it, and a job on another machine can neither be \
         measured nor use that memory; take gpu:N whole with --etcd, or use --mem without \
         --etcd on the GPU's machine"
        .to_owned()
}

/// Why `--require-idle` is refused with `--etcd`.
pub(crate) fn require_idle_refused() -> String {
    "--require-idle is not available with --etcd: it checks the GPU of this machine for \
         work outside the lock directory's gate, which etcd's locks are not"
        .to_owned()
}

/// `gpu is busy: held by ...`
pub(crate) fn busy(name: &str, who: &str) -> String {
    format!("{name} is busy: held by {who}")
}

/// `devlock: waiting for gpu: held by ...; 2 ahead in line (waiting
/// 1m00s) (train)`; `waited` after the first line.
pub(crate) fn waiting(
    name: &str,
    who: &str,
    ahead: usize,
    waited: Option<Duration>,
    step: &str,
) -> String {
    let waited = waited
        .map(|w| format!(" (waiting {})", short_duration(w)))
        .unwrap_or_default();
    format!(
        "devlock: waiting for {name}: held by {who}; {ahead} ahead in line{waited} ({})",
        sanitize(step)
    )
}

/// `devlock: got gpu after 1.5s (train)`
pub(crate) fn got(name: &str, waited: Duration, step: &str) -> String {
    format!(
        "devlock: got {name} after {} ({})",
        human_duration(waited),
        sanitize(step)
    )
}

// TLS: the files, checked before connecting.

pub(crate) fn cert_and_key_go_together() -> String {
    "--etcd-cert and --etcd-key go together: a client certificate needs its key".to_owned()
}

pub(crate) fn tls_needs_https(url: &str) -> String {
    format!(
        "--etcd-ca, --etcd-cert and --etcd-key are for https:// endpoints, and {url} is not one"
    )
}

pub(crate) fn mixed_schemes() -> String {
    "the etcd endpoints mix http:// and https://; one cluster speaks one of them".to_owned()
}

pub(crate) fn cannot_read(path: &Path, err: &std::io::Error) -> String {
    format!(
        "cannot read {}: {}",
        crate::show::show_path(path),
        crate::proc::os_text(err)
    )
}

pub(crate) fn not_pem(path: &Path, what: &str, why: &str) -> String {
    format!(
        "{} holds no PEM {what} devlock can read: {why}",
        crate::show::show_path(path)
    )
}

pub(crate) fn no_certificate(path: &Path) -> String {
    format!(
        "{} holds no certificate (expected PEM, -----BEGIN CERTIFICATE-----)",
        crate::show::show_path(path)
    )
}

pub(crate) fn bad_certificate(path: &Path, why: &str) -> String {
    format!(
        "{} holds a certificate devlock cannot use: {why}",
        crate::show::show_path(path)
    )
}

pub(crate) fn client_cert_expired(path: &Path, not_after: &str) -> String {
    format!(
        "the client certificate {} expired on {not_after}",
        crate::show::show_path(path)
    )
}

pub(crate) fn client_cert_not_yet_valid(path: &Path, not_before: &str) -> String {
    format!(
        "the client certificate {} is not valid before {not_before}",
        crate::show::show_path(path)
    )
}

pub(crate) fn key_does_not_match(key: &Path, cert: &Path) -> String {
    format!(
        "the key {} does not match the certificate {}",
        crate::show::show_path(key),
        crate::show::show_path(cert)
    )
}

pub(crate) fn unusable_key(key: &Path, why: &str) -> String {
    format!(
        "the key {} cannot be used: {why}",
        crate::show::show_path(key)
    )
}

/// ssh's refusal, in devlock's words.
pub(crate) fn key_too_open(key: &Path, mode: u32) -> String {
    format!(
        "the private key {k} can be read by others (mode {mode:04o}); like ssh, devlock \
             refuses such a key (chmod 600 {k})",
        k = crate::show::show_path(key)
    )
}

// TLS: the handshake.

pub(crate) fn roots_file(path: &Path) -> String {
    crate::show::show_path(path)
}

pub(crate) fn system_roots() -> String {
    "the system's CA certificates".to_owned()
}

pub(crate) fn no_system_roots() -> String {
    "no CA certificates found on this system for https:// (install them, e.g. Debian's \
         ca-certificates, or give --etcd-ca FILE)"
        .to_owned()
}

pub(crate) fn server_cert_rejected(url: &str, roots: &str, why: &str) -> String {
    format!("the certificate of etcd at {url} does not verify against {roots}: {why}")
}

pub(crate) fn not_tls(url: &str) -> String {
    format!("{url} does not answer in TLS (is it an http:// endpoint?)")
}

pub(crate) fn wants_tls(url: &str) -> String {
    format!(
        "{url} answers in TLS: use https:// (and --etcd-ca FILE unless its certificate comes \
             from a CA this system trusts)"
    )
}

pub(crate) fn tls_failed(url: &str, why: &str) -> String {
    format!("TLS to etcd at {url} failed: {why}")
}

pub(crate) fn client_cert_refused(url: &str, cert: &Path, alert: &str) -> String {
    format!(
        "etcd at {url} refused the client certificate {} (TLS alert {alert})",
        crate::show::show_path(cert)
    )
}

pub(crate) fn client_cert_wanted(url: &str) -> String {
    format!(
        "etcd at {url} wants a client certificate (--etcd-cert FILE --etcd-key FILE, or \
             DEVLOCK_ETCD_CERT and DEVLOCK_ETCD_KEY)"
    )
}

/// The status table's last line: who devlock is to etcd.
pub(crate) fn tls_identity(
    ca: Option<&str>,
    client: Option<(&str, &str)>,
    issuer: Option<&str>,
    not_after: Option<&str>,
    user: Option<&str>,
) -> String {
    let roots = ca.map_or_else(system_roots, sanitize);
    let who = match client {
        Some((subject, file)) => format!(
            "client certificate {} ({}, issued by {}, valid until {})",
            sanitize(subject),
            sanitize(file),
            sanitize(issuer.unwrap_or("?")),
            not_after.unwrap_or("?")
        ),
        None => "no client certificate".to_owned(),
    };
    let user = user.map_or_else(String::new, |u| format!(", user {}", sanitize(u)));
    format!("(TLS: server checked against {roots}; {who}{user})")
}

/// The status table's last line without TLS, when a user is given.
pub(crate) fn plain_identity(user: &str) -> String {
    format!("(no TLS; user {})", sanitize(user))
}
