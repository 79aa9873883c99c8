//! The endpoints of one etcd cluster, used one at a time, as etcdctl does:
//! every request goes to the current endpoint, and one that cannot be
//! reached, does not answer in time, or has no leader (a member cut off
//! from the others, or one mid-election) makes devlock move to the next and
//! ask again there.
//!
//! Asking again is safe because every request devlock makes can be repeated:
//! reads; joining the line (a put of the same key with the same lease, which
//! keeps its create revision, and so its place, and the read in the same
//! transaction); labels; revoking a lease. A lease granted by an answer
//! that was lost holds no key and runs out by itself. Every process starts
//! at the first endpoint named (machines that list them in different orders
//! spread their watches over the members). A stream (a watch, the lease's renewals)
//! that fails moves devlock on the same way, and a watch on an endpoint
//! devlock has moved away from is started again on the new one, since a
//! member cut off from the rest may keep a watch open and silent.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use etcd_client::Client;
use tokio::sync::{OnceCell, watch};

use super::Config;
use super::is;
use crate::error::EtcdKind;

/// How long one request may take, over every endpoint tried, before devlock
/// treats etcd as unreachable (at start, and for status).
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one endpoint may take to answer before the next is tried, when
/// there is a next one (etcdctl's --dial-timeout).
pub(super) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// The endpoints, a client for each once used, and which one is current.
pub(crate) struct Cluster {
    pub config: Config,
    clients: Vec<OnceCell<Client>>,
    current: watch::Sender<usize>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("endpoints", &self.config.endpoints)
            .field("current", &self.current())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    pub(crate) fn new(config: Config) -> Arc<Cluster> {
        let n = config.endpoints.len();
        Arc::new(Cluster {
            clients: (0..n).map(|_| OnceCell::new()).collect(),
            current: watch::Sender::new(0),
            config,
        })
    }

    pub(crate) fn url(&self, endpoint: usize) -> &str {
        &self.config.endpoints[endpoint]
    }

    pub(crate) fn current(&self) -> usize {
        *self.current.borrow()
    }

    /// Moves on from `endpoint` after it failed, unless another failure
    /// moved on already.
    pub(crate) fn failed(&self, endpoint: usize) {
        let n = self.clients.len();
        self.current.send_if_modified(|current| {
            if *current == endpoint && n > 1 {
                *current = (endpoint + 1) % n;
                true
            } else {
                false
            }
        });
    }

    /// Resolves once devlock has moved away from `endpoint`.
    pub(crate) async fn moved_from(&self, endpoint: usize) {
        let mut seen = self.current.subscribe();
        // The sender lives as long as `self`.
        let _ = seen.wait_for(|current| *current != endpoint).await;
    }

    async fn client_of(&self, endpoint: usize) -> Result<Client, etcd_client::Error> {
        self.clients[endpoint]
            .get_or_try_init(|| self.config.connect_one(self.url(endpoint)))
            .await
            .cloned()
    }

    /// The current endpoint and its client, for a stream; connecting (with
    /// a user, logging in) moves on like any request.
    pub(crate) async fn client(&self, doing: &str) -> Result<(usize, Client)> {
        self.each_endpoint(REQUEST_TIMEOUT, doing, |client| async move { Ok(client) })
            .await
    }

    /// One request, asked of each endpoint in turn until one answers, in
    /// at most [`REQUEST_TIMEOUT`] in all.
    pub(crate) async fn ask<T, F, Fut>(&self, doing: &str, request: F) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.ask_within(REQUEST_TIMEOUT, doing, request).await
    }

    /// Every key under `prefix` (one request, as [`Cluster::ask`]).
    pub(crate) async fn get_prefix(
        &self,
        doing: &str,
        prefix: &str,
    ) -> Result<etcd_client::GetResponse> {
        self.ask(doing, |mut client| {
            let prefix = prefix.to_owned();
            async move {
                client
                    .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
                    .await
            }
        })
        .await
    }

    /// [`Cluster::ask`] in at most `budget`.
    pub(crate) async fn ask_within<T, F, Fut>(
        &self,
        budget: Duration,
        doing: &str,
        request: F,
    ) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.each_endpoint(budget, doing, request)
            .await
            .map(|(_, value)| value)
    }

    async fn each_endpoint<T, F, Fut>(
        &self,
        budget: Duration,
        doing: &str,
        mut request: F,
    ) -> Result<(usize, T)>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let n = self.clients.len();
        let started = Instant::now();
        let first = self.current();
        let mut worst: Option<anyhow::Error> = None;
        // Round after round while the members answer that they have no
        // leader or it changed (an election, after one was stopped or cut
        // off: etcdctl rides it out too), within the budget; any other
        // failure of every endpoint is said at once.
        let mut round = 0;
        loop {
            if round > 0 {
                let electing = worst.as_ref().is_some_and(|w| {
                    let said = format!("{w:#}");
                    ELECTING.iter().any(|e| said.contains(e))
                });
                let left = budget.saturating_sub(started.elapsed());
                if !electing || left.is_zero() {
                    break;
                }
                tokio::time::sleep(ELECTION_PAUSE.min(left)).await;
            }
            round += 1;
            for k in 0..n {
                let endpoint = (first + k) % n;
                let left = budget.saturating_sub(started.elapsed());
                if left.is_zero() {
                    break;
                }
                // A share of the budget for each endpoint but the last, which
                // gets what is left.
                let attempt_for = if k + 1 < n {
                    left.min(ATTEMPT_TIMEOUT.min(budget / n as u32))
                } else {
                    left
                };
                let attempt = async {
                    let client = self.client_of(endpoint).await?;
                    request(client).await
                };
                let err = match tokio::time::timeout(attempt_for, attempt).await {
                    Ok(Ok(value)) => return Ok((endpoint, value)),
                    Ok(Err(e)) => self.config.diagnose(self.url(endpoint), doing, e).await,
                    Err(_) => self
                        .config
                        .no_answer(self.url(endpoint), doing, attempt_for),
                };
                // A refusal is the cluster's answer, not one member's trouble.
                if is(&err, EtcdKind::Denied)
                    || matches!(crate::error::root(&err), Some(crate::Error::Usage(_)))
                {
                    return Err(err);
                }
                self.failed(endpoint);
                worst = Some(match worst {
                    Some(w) if telling(&w) >= telling(&err) => w,
                    _ => err,
                });
            }
        }
        let err = worst.unwrap_or_else(|| self.config.no_answer(self.url(first), doing, budget));
        Err(if n > 1 {
            err.context(format!(
                "no etcd endpoint of {} answered",
                self.config.shown()
            ))
        } else {
            err
        })
    }
}

/// What members say during an election, which a next round gets past.
const ELECTING: [&str; 3] = [
    "etcdserver: no leader",
    "etcdserver: leader changed",
    "etcdserver: request timed out",
];

/// The pause between rounds of asking members that have no leader.
const ELECTION_PAUSE: Duration = Duration::from_millis(100);

/// How much an endpoint's failure says, to report the most telling one
/// when all fail: a TLS failure (the files or the server's certificate),
/// then an answer from etcd itself ("no leader"), then the rest (refused,
/// no answer).
fn telling(err: &anyhow::Error) -> u8 {
    if is(err, EtcdKind::Tls) {
        2
    } else if format!("{err:#}").contains("etcdserver:") {
        1
    } else {
        0
    }
}
