//! `--slots N`: the slot number a holder takes, the lowest slot key nobody
//! has (see the module doc).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Result;
use etcd_client::{EventType, PutOptions, WatchOptions};

use super::Cluster;
use super::turn::RETRY_PAUSE;
use super::wanted::Settings;
use crate::request::Request;
use crate::show::human_duration;

/// `--slots`: numbers this holder, with the lowest slot key nobody has
/// (see the module doc). At most N holders exist at once, so one frees up
/// soon if none is left (a holder whose line key was removed by hand keeps
/// its slot key until its lease is revoked).
/// Keys put there by anything but a holder (by hand, without a lease) can
/// take every number: then `-n` and `-w` bound this wait as they bound the
/// line's, naming the keys.
pub(super) async fn claim_slot(
    settings: &Settings,
    cluster: &Cluster,
    lease: i64,
    request: &Request,
    line_key: &str,
    deadline: Option<Instant>,
) -> Result<u64> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let prefix = super::slot_prefix(&request.name);
    let started = Instant::now();
    loop {
        let response = cluster.get_prefix("numbering the slot", &prefix).await?;
        let revision = response.header().map_or(0, |h| h.revision());
        let mut used = HashSet::new();
        for kv in response.kvs() {
            let number = String::from_utf8_lossy(kv.key())
                .strip_prefix(&prefix)
                .and_then(|n| n.parse::<u64>().ok());
            let Some(number) = number else { continue };
            // Ours already: an answer that was lost, and the put made again.
            if kv.lease() == lease {
                return Ok(number);
            }
            used.insert(number);
        }
        if let Some(free) = (1..=request.slots).find(|n| !used.contains(n)) {
            let key = super::slot_key(&request.name, free);
            let taken = cluster
                .ask("numbering the slot", |mut client| {
                    let txn = Txn::new()
                        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(
                            key.as_str(),
                            line_key,
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    async move { client.txn(txn).await }
                })
                .await?;
            if taken.succeeded() {
                return Ok(free);
            }
            continue;
        }
        // Every number taken: wait for one to go, and look again.
        let why = || {
            format!(
                "every slot number is taken ({prefix}1..{}), by keys no holder's lease keeps",
                request.slots
            )
        };
        if settings.no_wait {
            return Err(crate::error::busy(
                request.name.as_str(),
                false,
                format!("{} is busy: {}", request.name.as_str(), why()),
            ));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(crate::error::busy(
                request.name.as_str(),
                true,
                format!(
                    "gave up on {} after {}: {}",
                    request.name.as_str(),
                    human_duration(started.elapsed()),
                    why()
                ),
            ));
        }
        let Ok((_, mut client)) = cluster.client("watching the slots").await else {
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let gone = async {
            let mut stream = client.watch(prefix.clone(), Some(options)).await?;
            while let Some(response) = stream.message().await? {
                if response.canceled()
                    || response
                        .events()
                        .iter()
                        .any(|e| e.event_type() == EventType::Delete)
                {
                    break;
                }
            }
            Ok::<_, etcd_client::Error>(())
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), gone).await;
    }
}
