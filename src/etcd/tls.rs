//! TLS to etcd (`https://` endpoints): the CA, certificate and key files,
//! checked before anything is sent, and a failed handshake told in one line
//! that names the file to look at.
//!
//! The server's certificate is checked against `--etcd-ca FILE` when given
//! (and then only against it, as etcdctl's `--cacert` does), else against
//! the system's roots. `--etcd-cert FILE --etcd-key FILE` is the client's
//! certificate. The files are read once, at start: a file that cannot be
//! read or holds no PEM certificate, a key that does not match its
//! certificate, a client certificate outside its validity period, and a key
//! that others can read are refused before connecting (exit 78, EX_CONFIG),
//! as is a server certificate that does not verify. etcd refusing the client
//! certificate is a refusal like a wrong password (77).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::messages::etcd as messages;
use anyhow::Result;
use etcd_client::{Certificate, Identity, TlsOptions};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Serialize;

/// The files named on the command line or in the environment.
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    pub(crate) fn any(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }
}

/// What TLS to etcd uses, checked.
#[derive(Debug, Clone)]
pub(crate) struct Tls {
    ca: Option<PathBuf>,
    ca_pem: Option<Vec<u8>>,
    client: Option<ClientCert>,
}

#[derive(Debug, Clone)]
struct ClientCert {
    cert: PathBuf,
    key: PathBuf,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    subject: String,
    issuer: String,
    not_after: SystemTime,
}

/// The TLS identity, as `status --etcd --json` shows it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TlsView {
    /// The CA file the server's certificate is checked against; null for
    /// the system's roots.
    pub ca: Option<String>,
    /// The client certificate: file, subject, issuer, end of validity.
    pub cert: Option<String>,
    pub key: Option<String>,
    pub subject: Option<String>,
    pub issuer: Option<String>,
    pub not_after: Option<String>,
}

impl Tls {
    /// Reads and checks the files. Every failure is one line naming a file.
    pub(crate) fn load(files: &TlsFiles) -> Result<Tls> {
        let ca_pem = match &files.ca {
            Some(path) => {
                let pem = read(path)?;
                check_ca(path, &pem)?;
                Some(pem)
            }
            None => None,
        };
        let client = match (&files.cert, &files.key) {
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(crate::error::usage(messages::cert_and_key_go_together()));
            }
            (Some(cert), Some(key)) => Some(ClientCert::load(cert, key)?),
        };
        Ok(Tls {
            ca: files.ca.clone(),
            ca_pem,
            client,
        })
    }

    /// The options etcd-client connects with.
    pub(crate) fn options(&self) -> TlsOptions {
        let mut options = TlsOptions::new();
        options = match &self.ca_pem {
            Some(pem) => options.ca_certificate(Certificate::from_pem(pem)),
            None => options.with_native_roots(),
        };
        if let Some(client) = &self.client {
            options = options.identity(Identity::from_pem(&client.cert_pem, &client.key_pem));
        }
        options
    }

    /// A rustls configuration like the one etcd-client builds from
    /// [`Tls::options`], for a probe.
    pub(super) fn probe_config(&self) -> Option<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca_pem {
            Some(pem) => {
                for cert in CertificateDer::pem_slice_iter(pem) {
                    roots.add(cert.ok()?).ok()?;
                }
            }
            None => {
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots);
        let mut config = match &self.client {
            Some(client) => {
                let (chain, key) = identity(&client.cert_pem, &client.key_pem)?;
                builder.with_client_auth_cert(chain, key).ok()?
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols.push(b"h2".to_vec());
        Some(config)
    }

    /// What the server's certificate is checked against, for messages.
    pub(crate) fn roots(&self) -> String {
        match &self.ca {
            Some(path) => messages::roots_file(path),
            None => messages::system_roots(),
        }
    }

    /// The client certificate's file, if one is given.
    pub(crate) fn cert_file(&self) -> Option<&Path> {
        self.client.as_ref().map(|c| c.cert.as_path())
    }

    pub(crate) fn view(&self) -> TlsView {
        let client = self.client.as_ref();
        TlsView {
            ca: self.ca.as_deref().map(crate::show::show_path),
            cert: client.map(|c| crate::show::show_path(&c.cert)),
            key: client.map(|c| crate::show::show_path(&c.key)),
            subject: client.map(|c| c.subject.clone()),
            issuer: client.map(|c| c.issuer.clone()),
            not_after: client.map(|c| rfc3339(c.not_after)),
        }
    }
}

impl TlsView {
    /// One line for the status table.
    pub(crate) fn line(&self, user: Option<&str>) -> String {
        messages::tls_identity(
            self.ca.as_deref(),
            self.subject.as_deref().zip(self.cert.as_deref()),
            self.issuer.as_deref(),
            self.not_after.as_deref(),
            user,
        )
    }
}

impl ClientCert {
    fn load(cert: &Path, key: &Path) -> Result<ClientCert> {
        let cert_pem = read(cert)?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| tls_file_error(messages::not_pem(cert, "certificate", &e.to_string())))?;
        let Some(leaf) = chain.first() else {
            return Err(tls_file_error(messages::no_certificate(cert)));
        };
        let parsed = parse_cert(cert, leaf)?;
        let tbs = parsed.tbs_certificate();
        let validity = tbs.validity();
        let (not_before, not_after) = (
            validity.not_before.to_system_time(),
            validity.not_after.to_system_time(),
        );
        let now = SystemTime::now();
        if now > not_after {
            return Err(tls_file_error(messages::client_cert_expired(
                cert,
                &rfc3339(not_after),
            )));
        }
        if now < not_before {
            return Err(tls_file_error(messages::client_cert_not_yet_valid(
                cert,
                &rfc3339(not_before),
            )));
        }
        let key_pem = read_private(key)?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| tls_file_error(messages::not_pem(key, "private key", &e.to_string())))?;
        let provider = rustls::crypto::ring::default_provider();
        match rustls::sign::CertifiedKey::from_der(chain, key_der, &provider) {
            Ok(_) => {}
            Err(rustls::Error::InconsistentKeys(_)) => {
                return Err(tls_file_error(messages::key_does_not_match(key, cert)));
            }
            Err(e) => {
                return Err(tls_file_error(messages::unusable_key(key, &e.to_string())));
            }
        }
        Ok(ClientCert {
            cert: cert.to_owned(),
            key: key.to_owned(),
            subject: tbs.subject().to_string(),
            issuer: tbs.issuer().to_string(),
            not_after,
            cert_pem,
            key_pem,
        })
    }
}

fn tls_file_error(message: String) -> anyhow::Error {
    crate::error::etcd(crate::error::EtcdKind::Tls, message)
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| tls_file_error(messages::cannot_read(path, &e)))
}

/// Reads a private key, refusing one that others can read: anyone's that
/// every user may open, or the caller's own that its group or others may
/// (ssh's rule for its keys). The mode is the opened file's, so a swap
/// between the check and the read changes nothing.
fn read_private(path: &Path) -> Result<Vec<u8>> {
    let mut file = File::open(path).map_err(|e| tls_file_error(messages::cannot_read(path, &e)))?;
    let meta = file
        .metadata()
        .map_err(|e| tls_file_error(messages::cannot_read(path, &e)))?;
    let mode = meta.mode() & 0o7777;
    let own = meta.uid() == nix::unistd::geteuid().as_raw();
    if mode & 0o007 != 0 || (own && mode & 0o077 != 0) {
        return Err(tls_file_error(messages::key_too_open(path, mode)));
    }
    let mut pem = Vec::new();
    file.read_to_end(&mut pem)
        .map_err(|e| tls_file_error(messages::cannot_read(path, &e)))?;
    Ok(pem)
}

/// Every certificate in a CA file must parse as a trust anchor: rustls
/// would skip one that does not, and a file that is mostly unreadable would
/// then fail later as "unknown issuer".
fn check_ca(path: &Path, pem: &[u8]) -> Result<()> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| tls_file_error(messages::not_pem(path, "certificate", &e.to_string())))?;
    if certs.is_empty() {
        return Err(tls_file_error(messages::no_certificate(path)));
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| tls_file_error(messages::bad_certificate(path, &e.to_string())))?;
    }
    Ok(())
}

fn parse_cert(path: &Path, der: &CertificateDer<'_>) -> Result<x509_cert::Certificate> {
    use x509_cert::der::Decode;
    x509_cert::Certificate::from_der(der.as_ref())
        .map_err(|e| tls_file_error(messages::bad_certificate(path, &e.to_string())))
}

fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_seconds(time).to_string()
}

/// How a connection failed at the TLS layer, from the causes of a failed
/// request: None when it did not.
pub(crate) fn classify(
    err: &(dyn std::error::Error + 'static),
    url: &str,
    tls: Option<&Tls>,
) -> Option<anyhow::Error> {
    use rustls::Error as E;
    let roots = tls.map_or_else(messages::system_roots, Tls::roots);
    let rejected = |reason: String| {
        crate::error::etcd(
            crate::error::EtcdKind::Tls,
            messages::server_cert_rejected(url, &roots, &reason),
        )
    };
    if let Some(found) = chain_find::<rustls::Error>(err) {
        return Some(match found {
            E::InvalidCertificate(why) => rejected(certificate_reason(why)),
            E::InvalidMessage(_)
            | E::InappropriateMessage { .. }
            | E::InappropriateHandshakeMessage { .. } => {
                crate::error::etcd(crate::error::EtcdKind::Tls, messages::not_tls(url))
            }
            E::AlertReceived(alert) => refused(url, tls, &format!("{alert:?}"))?,
            other => crate::error::etcd(
                crate::error::EtcdKind::Tls,
                messages::tls_failed(url, &other.to_string()),
            ),
        });
    }
    // An alert that comes after the handshake (TLS 1.3 sends the client's
    // certificate last) reaches the client as text.
    let mut next = Some(err);
    while let Some(e) = next {
        let text = e.to_string();
        if let Some(alert) = text.strip_prefix("received fatal alert: ") {
            return refused(url, tls, alert);
        }
        // tokio-rustls: the server closed the connection mid-handshake, as
        // a plain-http server does on a TLS hello.
        if text == "tls handshake eof" {
            return Some(crate::error::etcd(
                crate::error::EtcdKind::Tls,
                messages::not_tls(url),
            ));
        }
        next = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

/// The server ended the handshake with `alert`: when it is about the
/// client's certificate, etcd refused it (or wanted one).
fn refused(url: &str, tls: Option<&Tls>, alert: &str) -> Option<anyhow::Error> {
    const ABOUT_THE_CLIENT: [&str; 8] = [
        "BadCertificate",
        "UnknownCA",
        "CertificateExpired",
        "CertificateRevoked",
        "CertificateUnknown",
        "CertificateRequired",
        "UnsupportedCertificate",
        "AccessDenied",
    ];
    if !ABOUT_THE_CLIENT.contains(&alert) {
        return Some(crate::error::etcd(
            crate::error::EtcdKind::Tls,
            messages::tls_failed(url, &format!("TLS alert {alert}")),
        ));
    }
    let message = match tls.and_then(Tls::cert_file) {
        Some(cert) => messages::client_cert_refused(url, cert, alert),
        None => messages::client_cert_wanted(url),
    };
    Some(crate::error::etcd(crate::error::EtcdKind::Denied, message))
}

/// Why rustls refused the server's certificate, in words.
fn certificate_reason(why: &rustls::CertificateError) -> String {
    use rustls::CertificateError as C;
    let at = |t: &rustls::pki_types::UnixTime| {
        rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(t.as_secs()))
    };
    match why {
        C::UnknownIssuer => "it is not signed by a CA found there".to_owned(),
        C::Expired => "it has expired".to_owned(),
        C::ExpiredContext { not_after, .. } => format!("it expired on {}", at(not_after)),
        C::NotValidYet => "it is not valid yet".to_owned(),
        C::NotValidYetContext { not_before, .. } => {
            format!("it is not valid before {}", at(not_before))
        }
        C::NotValidForName | C::NotValidForNameContext { .. } => {
            "it is not made out to that host name or address".to_owned()
        }
        C::BadSignature => "its signature does not verify".to_owned(),
        C::Revoked => "it is revoked".to_owned(),
        other => format!("{other:?}"),
    }
}

/// The first error of type `T` in a chain, looking inside the I/O errors
/// that wrap TLS errors too (an `io::Error`'s source skips what it wraps).
fn chain_find<'a, T: std::error::Error + 'static>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(found) = e.downcast_ref::<T>() {
            return Some(found);
        }
        next = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

/// The client's certificate chain and key, parsed again for a probe.
fn identity(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    use rustls::pki_types::pem::PemObject;
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).ok()?;
    Some((chain, key))
}
