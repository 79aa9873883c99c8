//! A second look at an endpoint whose connection ended without a word, to
//! say why in one line: over TLS, whether etcd refused the client
//! certificate (TLS 1.3 sends it after the client's handshake is done, so
//! the server's alert can be lost when the client's first write meets the
//! closed socket); over plain http://, whether the server wants TLS. The
//! probe only reads after its handshake, so nothing can race the alert.
//! Used only after a failure.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::tls::{self, Tls};
use crate::messages::etcd as messages;

/// The whole probe's time, connect and handshake and the wait for a word.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the connection to `url` ended, when a probe can tell: None when it
/// cannot (the caller's error stands).
pub(super) async fn why_closed(url: &str, tls: Option<&Tls>) -> Option<anyhow::Error> {
    let (https, host, port) = split(url)?;
    let probe = async {
        let tcp = TcpStream::connect((host, port)).await.ok()?;
        match (https, tls) {
            (true, Some(tls)) => over_tls(url, host, tcp, tls).await,
            (false, _) => wants_tls(url, host, tcp).await,
            (true, None) => None,
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, probe).await.ok()?
}

fn split(url: &str) -> Option<(bool, &str, u16)> {
    let (https, rest) = match url.split_once("://")? {
        ("https", rest) => (true, rest),
        ("http", rest) => (false, rest),
        _ => return None,
    };
    let (host, port) = rest.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((https, host, port.parse().ok()?))
}

/// Completes a handshake as devlock would, then waits for the server's
/// first word: an alert about the client's certificate is a refusal.
async fn over_tls(url: &str, host: &str, tcp: TcpStream, tls: &Tls) -> Option<anyhow::Error> {
    let config = tls.probe_config()?;
    let name = ServerName::try_from(host.to_owned()).ok()?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let mut stream = match connector.connect(name, tcp).await {
        Ok(stream) => stream,
        Err(e) => return tls::classify(&e, url, Some(tls)),
    };
    let mut byte = [0u8; 1];
    match stream.read(&mut byte).await {
        Err(e) => tls::classify(&e, url, Some(tls)),
        Ok(_) => None,
    }
}

/// Starts a TLS handshake with a plain-http endpoint: a server that answers
/// with a certificate wants https://. Nothing is sent but a hello.
async fn wants_tls(url: &str, host: &str, tcp: TcpStream) -> Option<anyhow::Error> {
    let seen = Arc::new(SawCertificate::default());
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .ok()?
            .dangerous()
            .with_custom_certificate_verifier(seen.clone())
            .with_no_client_auth();
    let name = ServerName::try_from(host.to_owned()).ok()?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let _ = connector.connect(name, tcp).await;
    seen.0
        .load(Ordering::SeqCst)
        .then(|| crate::error::etcd(crate::error::EtcdKind::Tls, messages::wants_tls(url)))
}

/// Notes that the server sent a certificate, and refuses it: the probe
/// only asks whether the server speaks TLS.
#[derive(Debug, Default)]
struct SawCertificate(AtomicBool);

impl ServerCertVerifier for SawCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.store(true, Ordering::SeqCst);
        Err(rustls::Error::InvalidCertificate(
            rustls::CertificateError::ApplicationVerificationFailure,
        ))
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("not checked".into()))
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("not checked".into()))
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}
