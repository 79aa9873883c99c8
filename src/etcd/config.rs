//! Where etcd is and who to be there (`--etcd`, `--etcd-user`, the TLS
//! files, `--etcd-prefix`): checked once, then a client per endpoint.

use std::time::Duration;

use anyhow::Result;
use etcd_client::{Client, ConnectOptions};

use super::tls::{self, Tls, TlsFiles};
use super::{MAX_PREFIX, PREFIX, cluster};
use crate::messages::etcd as messages;

/// `NAME:PASSWORD` split at the first colon.
fn split_user(text: &str) -> Option<(&str, &str)> {
    text.split_once(':').filter(|(name, _)| !name.is_empty())
}

/// Where etcd is and who to be there.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub endpoints: Vec<String>,
    pub(super) user: Option<(String, String)>,
    pub(super) tls: Option<Tls>,
}

impl Config {
    /// Checks the URLs (http://HOST:PORT, https://HOST:PORT or HOST:PORT,
    /// which is https:// when TLS files are given), the user and the TLS
    /// files.
    pub(crate) fn new(
        endpoints: &[String],
        user: Option<&str>,
        tls: &TlsFiles,
        prefix: &str,
    ) -> Result<Config> {
        if prefix.len() > MAX_PREFIX || prefix.contains('\0') {
            return Err(crate::error::usage(format!(
                "--etcd-prefix must be at most {MAX_PREFIX} bytes, without NUL"
            )));
        }
        let _ = PREFIX.set(prefix.to_owned());
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim())
            .filter(|e| !e.is_empty())
            .map(|e| check_url(e, tls.any()))
            .collect::<Result<_>>()?;
        let Some(first) = endpoints.first() else {
            return Err(crate::error::usage("--etcd needs at least one URL"));
        };
        let https = first.starts_with("https://");
        if endpoints.iter().any(|e| e.starts_with("https://") != https) {
            return Err(crate::error::usage(messages::mixed_schemes()));
        }
        if tls.any() && !https {
            return Err(crate::error::usage(messages::tls_needs_https(first)));
        }
        let user = match user {
            None => None,
            Some(text) => {
                let (name, password) = split_user(text)
                    .ok_or_else(|| crate::error::usage("--etcd-user must be NAME:PASSWORD"))?;
                Some((name.to_owned(), password.to_owned()))
            }
        };
        let tls = if https { Some(Tls::load(tls)?) } else { None };
        Ok(Config {
            endpoints,
            user,
            tls,
        })
    }

    /// The endpoints as one would type them back.
    pub(crate) fn shown(&self) -> String {
        self.endpoints.join(",")
    }

    /// The user name given, if any (never the password).
    pub(crate) fn user_name(&self) -> Option<&str> {
        self.user.as_ref().map(|(name, _)| name.as_str())
    }

    /// The TLS identity, for status.
    pub(crate) fn tls_view(&self) -> Option<tls::TlsView> {
        self.tls.as_ref().map(Tls::view)
    }

    /// A client for one endpoint. Without a user nothing is sent yet (the
    /// first request finds out whether etcd answers); with one, it logs in.
    pub(crate) async fn connect_one(&self, url: &str) -> Result<Client, etcd_client::Error> {
        let connect_timeout = if self.endpoints.len() > 1 {
            cluster::ATTEMPT_TIMEOUT
        } else {
            cluster::REQUEST_TIMEOUT
        };
        let mut options = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            .with_timeout(cluster::REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            // A member cut off from its cluster says so at once (and ends
            // the watches on it) rather than keep requests waiting for a
            // leader it cannot reach: devlock moves to the next endpoint.
            .with_require_leader(true);
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls.options());
        }
        if let Some((name, password)) = &self.user {
            // Tokens expire (etcd's --auth-token-ttl, 5 minutes by
            // default); a long hold must still renew and revoke its lease.
            options = options
                .with_user(name.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        Client::connect([url], Some(options)).await
    }
}

fn check_url(url: &str, tls: bool) -> Result<String> {
    let bad = |why: &str| {
        crate::error::usage(format!(
            "bad etcd URL {url:?}: {why} (expected http://HOST:PORT or https://HOST:PORT)"
        ))
    };
    let (scheme, rest) = match url.split_once("://") {
        Some(("http", rest)) => ("http", rest),
        Some(("https", rest)) => ("https", rest),
        Some(_) => return Err(bad("only http:// and https:// are supported")),
        None if tls => ("https", url),
        None => ("http", url),
    };
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    if host.is_empty() || host.contains('/') || host.contains('@') {
        return Err(bad("no host"));
    }
    port.parse::<u16>()
        .map_err(|_| bad("the port is not a number"))?;
    Ok(format!("{scheme}://{rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EtcdKind;
    use crate::etcd::{DEFAULT_PREFIX, is};

    #[test]
    fn urls_are_checked() {
        assert_eq!(
            check_url("127.0.0.1:2379", false).unwrap(),
            "http://127.0.0.1:2379"
        );
        assert_eq!(
            check_url("127.0.0.1:2379", true).unwrap(),
            "https://127.0.0.1:2379"
        );
        assert_eq!(check_url("http://h:1/", true).unwrap(), "http://h:1");
        assert_eq!(check_url("https://h:1", false).unwrap(), "https://h:1");
        for bad in [
            "ftp://h:1",
            "http://h",
            "http://:1",
            "h:port",
            "http://u@h:1",
            "unix://h:1",
        ] {
            assert!(check_url(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_cluster_speaks_one_scheme() {
        let urls = |u: &[&str]| u.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let none = TlsFiles::default();
        let default = DEFAULT_PREFIX;
        assert!(Config::new(&urls(&["http://a:1", "https://b:1"]), None, &none, default).is_err());
        let ca = TlsFiles {
            ca: Some("/nonexistent".into()),
            ..TlsFiles::default()
        };
        let err = Config::new(&urls(&["http://a:1"]), None, &ca, default).unwrap_err();
        assert!(matches!(
            crate::error::root(&err),
            Some(crate::Error::Usage(_))
        ));
        let err = Config::new(&urls(&["https://a:1"]), None, &ca, default).unwrap_err();
        assert!(is(&err, EtcdKind::Tls));
        assert!(format!("{err:#}").contains("/nonexistent"), "{err:#}");
    }
}
