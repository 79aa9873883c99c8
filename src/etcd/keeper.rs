//! The lease: renewed every third of its TTL, under a deadline of devlock's
//! own that stops the job (the command and every process that holds the
//! job's descriptor) before etcd could let the lease expire and admit
//! someone else. The session keeps it while devlock waits; the watcher from
//! the grant on ([`hold`]), and gives it back once the job has ended.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    EventType, LeaseKeepAliveResponse, LeaseKeepAliveStream, LeaseKeeper, WatchOptions,
};
use tokio::sync::Notify;

use super::job::Job;
use super::{Cluster, Config, Entry};
use crate::show::human_duration;

/// Slack kept between SIGKILL and the earliest moment etcd could let the
/// lease expire: this thread waking late on a busy machine, the kill
/// reaching every process, clocks ticking at slightly different rates.
pub(super) const GUARD: Duration = Duration::from_secs(1);

/// How long releasing may take before devlock leaves the lease to expire.
pub(super) const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest the renewals sleep between looks at the boot clock.
const MAX_NAP: Duration = Duration::from_millis(250);

/// Time on CLOCK_BOOTTIME, which keeps counting while the machine sleeps (a
/// suspended machine's lease runs out on the server all the same).
pub(super) fn boot_now() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map_or(Duration::ZERO, Duration::from)
}

/// What the renewals, the waiting code and the main thread share.
pub(super) struct LeaseState {
    ttl: Duration,
    kill_after: Duration,
    /// Boot time until which etcd cannot have let the lease expire.
    confirmed_until: Mutex<Duration>,
    lost: Mutex<Option<Lost>>,
    lost_notify: Notify,
    /// Wakes the renewals to stop; `releasing` tells the watches of our own
    /// keys that the deletes to come are ours.
    released: Notify,
    releasing: AtomicBool,
    /// Set in the watcher: from then on a lost lease stops the job.
    job: Mutex<Option<Arc<Job>>>,
    /// Done once the stop was said on stderr (see [`stop_work`]).
    said: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

#[derive(Debug, Clone)]
struct Lost {
    why: String,
    /// Whether etcd still answers (a key removed by someone else), so that
    /// revoking the lease is worth a try; not after renewals failed.
    etcd_answers: bool,
}

/// What the watcher needs to keep a lease the session took.
pub(super) struct Held {
    pub config: Config,
    pub lease: i64,
    /// Boot time until which etcd cannot have let the lease expire.
    pub confirmed_until: Duration,
    pub ttl: Duration,
    pub kill_after: Duration,
    /// Each key taken, the revision it joined at, and its label.
    pub keys: Vec<(String, i64, Entry)>,
}

impl LeaseState {
    /// A lease of `ttl` whose grant request was sent at boot time `sent`.
    pub(super) fn new(ttl: Duration, kill_after: Duration, sent: Duration) -> Arc<LeaseState> {
        Arc::new(LeaseState {
            ttl,
            kill_after,
            confirmed_until: Mutex::new(sent + ttl),
            lost: Mutex::new(None),
            lost_notify: Notify::new(),
            released: Notify::new(),
            releasing: AtomicBool::new(false),
            job: Mutex::new(None),
            said: Mutex::new(None),
        })
    }

    /// Boot time until which etcd cannot have let the lease expire.
    pub(super) fn confirmed_until(&self) -> Duration {
        *self.confirmed_until.lock().unwrap()
    }

    pub(super) fn is_lost(&self) -> bool {
        self.lost.lock().unwrap().is_some()
    }

    pub(super) fn lost_reason(&self) -> Option<String> {
        self.lost.lock().unwrap().as_ref().map(|l| l.why.clone())
    }

    /// Resolves once the lease is lost, with the reason.
    pub(super) async fn wait_lost(&self) -> String {
        loop {
            let notified = self.lost_notify.notified();
            if let Some(why) = self.lost_reason() {
                return why;
            }
            notified.await;
        }
    }

    /// Stops the renewals: the lease is being given back (and our keys'
    /// removal is ours).
    pub(super) fn release(&self) {
        self.releasing.store(true, Ordering::SeqCst);
        // One waiter (the renewals); the permit waits if it is not asleep.
        self.released.notify_one();
    }

    /// Whether asking etcd to revoke the lease is worth a try.
    pub(super) fn etcd_answers(&self) -> bool {
        self.lost
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|l| l.etcd_answers)
    }

    /// Marks the lease lost; `at_once` when etcd has freed the lock already
    /// (no grace left: SIGTERM and SIGKILL come together).
    fn mark_lost(&self, why: String, etcd_answers: bool, at_once: bool) {
        if at_once {
            *self.confirmed_until.lock().unwrap() = boot_now();
        }
        *self.lost.lock().unwrap() = Some(Lost { why, etcd_answers });
        self.lost_notify.notify_waiters();
    }
}

/// Renews the lease every third of its TTL, the first time at boot time
/// `first`. A renewal counts from when it was sent: etcd restarted the TTL
/// no earlier than that. When no renewal is confirmed in time to stop the
/// work before the lease could expire, marks the lease lost and stops the
/// work.
pub(super) async fn keep(
    cluster: Arc<Cluster>,
    lease: i64,
    state: Arc<LeaseState>,
    first: Duration,
) {
    let renew_every = state.ttl / 3;
    // The renewal stream, and the endpoint it goes to.
    let mut stream: Option<(usize, LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut next_renew = first;
    let mut last_error = "no answer".to_owned();
    let mut last_confirmed = boot_now();
    let mut gone = false;
    loop {
        let confirmed_until = *state.confirmed_until.lock().unwrap();
        let term_at = confirmed_until.saturating_sub(state.kill_after + GUARD);
        if boot_now() >= term_at {
            break;
        }
        // Short naps: tokio's clock stops while the machine is suspended,
        // the boot clock does not, and a resumed machine must notice soon.
        let wake = next_renew.min(term_at);
        let nap = wake.saturating_sub(boot_now()).min(MAX_NAP);
        tokio::select! {
            _ = tokio::time::sleep(nap) => {}
            _ = state.released.notified() => return,
        }
        let sent = boot_now();
        if sent >= term_at {
            break;
        }
        if sent < next_renew {
            continue;
        }
        // Half of what is left, so that an endpoint that does not answer
        // leaves time to try the next one (a leader that died, a member cut
        // off): etcd elects a new leader within a second or two.
        let left = term_at - sent;
        let attempt_for = (left / 2)
            .max(Duration::from_millis(500))
            .min(renew_every.max(Duration::from_millis(500)))
            .min(left);
        let mut tried = None;
        let attempt = renew(&cluster, lease, &mut stream, &mut tried);
        match tokio::time::timeout(attempt_for, attempt).await {
            Ok(Ok(Some(response))) if response.ttl() > 0 => {
                let granted = Duration::from_secs(response.ttl() as u64);
                *state.confirmed_until.lock().unwrap() = sent + state.ttl.min(granted);
                last_confirmed = sent;
                next_renew = sent + renew_every;
            }
            Ok(Ok(Some(_))) => {
                last_error = "etcd says the lease no longer exists".to_owned();
                gone = true;
                break;
            }
            Ok(Err(Renewal::Etcd(e))) if super::innermost(&e).contains("lease not found") => {
                last_error = "etcd says the lease no longer exists".to_owned();
                gone = true;
                break;
            }
            outcome => {
                last_error = match outcome {
                    Ok(Err(Renewal::Etcd(e))) => super::innermost(&e),
                    Ok(Err(Renewal::Connect(e))) => format!("{e:#}"),
                    Ok(Ok(None)) => "the renewal stream closed".to_owned(),
                    _ => "no answer".to_owned(),
                };
                if let Some(endpoint) = tried {
                    cluster.failed(endpoint);
                }
                stream = None;
                next_renew = boot_now() + Duration::from_millis(200);
            }
        }
    }
    // Given back meanwhile (a renewal under way as the job ended meets the
    // lease revoked): nothing was lost.
    if state.releasing.load(Ordering::SeqCst) {
        return;
    }
    // etcd saying the lease is gone has freed the lock already.
    state.mark_lost(
        format!(
            "lost the etcd lease: no renewal confirmed for {} ({last_error})",
            human_duration(boot_now().saturating_sub(last_confirmed))
        ),
        gone,
        gone,
    );
    stop_work(state).await;
}

/// One renewal over `stream`, opened first if there is none; `tried` says
/// on which endpoint.
async fn renew(
    cluster: &Cluster,
    lease: i64,
    stream: &mut Option<(usize, LeaseKeeper, LeaseKeepAliveStream)>,
    tried: &mut Option<usize>,
) -> Result<Option<LeaseKeepAliveResponse>, Renewal> {
    if stream.is_none() {
        let (endpoint, mut client) = cluster
            .client("renewing the lease")
            .await
            .map_err(Renewal::Connect)?;
        *tried = Some(endpoint);
        let (keeper, responses) = client
            .lease_keep_alive(lease)
            .await
            .map_err(Renewal::Etcd)?;
        *stream = Some((endpoint, keeper, responses));
    }
    let (endpoint, keeper, responses) = stream.as_mut().expect("just made");
    *tried = Some(*endpoint);
    keeper.keep_alive().await.map_err(Renewal::Etcd)?;
    responses.message().await.map_err(Renewal::Etcd)
}

/// How a renewal failed.
enum Renewal {
    /// No endpoint would take a stream (the error says why).
    Connect(anyhow::Error),
    Etcd(etcd_client::Error),
}

/// Watches a key this devlock holds: removed by anyone but devlock (a lease
/// revoked or a key deleted by hand), the lock is free for the next in line
/// at once, so the work is killed at once.
pub(super) async fn watch_own_key(
    cluster: Arc<Cluster>,
    key: String,
    joined_at: i64,
    state: Arc<LeaseState>,
) {
    let mut from = joined_at + 1;
    loop {
        let options = WatchOptions::new().with_start_revision(from);
        let Ok((endpoint, mut client)) = cluster.client("watching our key").await else {
            tokio::time::sleep(MAX_NAP).await;
            continue;
        };
        let watched = async {
            let mut stream = client.watch(key.clone(), Some(options)).await?;
            while let Some(response) = stream.message().await? {
                if response.canceled() {
                    // Compacted past `from`: ask for the key itself.
                    return Ok(Watched::Ended);
                }
                for event in response.events() {
                    if event.event_type() == EventType::Delete {
                        return Ok(Watched::Deleted);
                    }
                    if let Some(kv) = event.kv() {
                        from = from.max(kv.mod_revision() + 1);
                    }
                }
            }
            Ok::<_, etcd_client::Error>(Watched::Ended)
        };
        // A member cut off from its cluster may keep the watch open and
        // silent: once devlock has moved on, watch on the new endpoint.
        let watched = async {
            tokio::select! {
                watched = watched => watched,
                () = cluster.moved_from(endpoint) => Ok(Watched::Moved),
            }
        };
        match watched.await {
            Ok(Watched::Deleted) => break,
            Ok(Watched::Moved) => {}
            Ok(Watched::Ended) => match client.get(key.clone(), None).await {
                Ok(response) if response.kvs().is_empty() => break,
                Ok(response) => {
                    let read_at = response.header().map_or(from - 1, |h| h.revision());
                    from = from.max(read_at + 1);
                }
                Err(_) => {
                    cluster.failed(endpoint);
                    tokio::time::sleep(MAX_NAP).await;
                }
            },
            Err(_) => {
                cluster.failed(endpoint);
                tokio::time::sleep(MAX_NAP).await;
            }
        }
    }
    if state.is_lost() || state.releasing.load(Ordering::SeqCst) {
        return;
    }
    state.mark_lost(
        format!("our key {key} was removed from etcd, so the lock is no longer ours"),
        true,
        true,
    );
    stop_work(state).await;
}

enum Watched {
    Deleted,
    Ended,
    Moved,
}

/// SIGTERM to the job, then SIGKILL until it has ended, both before etcd
/// could let the lease expire. Nothing to do before the watcher runs (the
/// session's wait then ends on the loss, and nothing ran).
async fn stop_work(state: Arc<LeaseState>) {
    let Some(job) = state.job.lock().unwrap().clone() else {
        return;
    };
    let kill_at = state.confirmed_until().saturating_sub(GUARD);
    job.signal(libc::SIGTERM);
    // Said after the signal, on a thread of its own: a stderr nobody reads
    // must not hold up the kill.
    let message = format!(
        "devlock: {}; stopping the command before the lock can pass on: SIGTERM sent, SIGKILL in {}",
        state.lost_reason().unwrap_or_default(),
        human_duration(kill_at.saturating_sub(boot_now()))
    );
    let (said, done) = std::sync::mpsc::channel();
    *state.said.lock().unwrap() = Some(done);
    std::thread::spawn(move || {
        eprintln!("{message}");
        let _ = said.send(());
    });
    while boot_now() < kill_at && !job.has_ended() {
        let nap = kill_at.saturating_sub(boot_now()).min(MAX_NAP);
        tokio::select! {
            () = tokio::time::sleep(nap) => {}
            () = job.ended() => {}
        }
    }
    // Again and again until the job has ended: a process can fork between
    // a look at /proc and the kill. Backing off, so one stuck in the
    // kernel does not cost a core.
    let mut nap = Duration::from_millis(1);
    for _ in 0..1000 {
        if job.has_ended() {
            break;
        }
        job.signal(libc::SIGKILL);
        tokio::select! {
            () = tokio::time::sleep(nap) => {}
            () = job.ended() => {}
        }
        nap = (nap * 2).min(MAX_NAP);
    }
}

/// The watcher's part of an etcd hold: keeps the lease the session took
/// (renewed at once: the session's renewals stopped at the hand-over),
/// watches its keys, labels them with the running command, and once the
/// job has ended gives the lease back; a lost lease stops the job first
/// ([`stop_work`]), and is given back only once the job has ended.
pub(super) async fn hold(held: Held, job: Arc<Job>) {
    let cluster = Cluster::new(held.config);
    let state = LeaseState::new(
        held.ttl,
        held.kill_after,
        held.confirmed_until.saturating_sub(held.ttl),
    );
    *state.job.lock().unwrap() = Some(job.clone());
    tokio::spawn(keep(cluster.clone(), held.lease, state.clone(), boot_now()));
    for (key, joined_at, _) in &held.keys {
        tokio::spawn(watch_own_key(
            cluster.clone(),
            key.clone(),
            *joined_at,
            state.clone(),
        ));
    }
    let labelling = tokio::spawn(label(cluster.clone(), held.lease, held.keys));
    tokio::select! {
        () = job.ended() => {}
        _ = state.wait_lost() => {
            // Past the TTL the lease has run out anyway.
            let _ = tokio::time::timeout(held.ttl, job.ended()).await;
        }
    }
    labelling.abort();
    state.release();
    if job.has_ended() && state.etcd_answers() {
        revoke(&cluster, held.lease).await;
    }
    // The stop said, if it was, before the watcher goes (bounded: a stderr
    // nobody reads must not keep it for ever).
    let said = state.said.lock().unwrap().take();
    if let Some(said) = said {
        let _ = tokio::task::spawn_blocking(move || said.recv_timeout(held.ttl)).await;
    }
}

/// Labels each key with the command that runs (devlock's pid, which the
/// command kept): off the command's path, who runs since when.
async fn label(cluster: Arc<Cluster>, lease: i64, keys: Vec<(String, i64, Entry)>) {
    for (key, _, mut entry) in keys {
        entry.child = Some(entry.pid);
        let me = std::process::id();
        entry.watcher = crate::proc::process::start_time(me).map(|start| (me, start));
        let value = serde_json::to_vec(&entry).expect("entries serialise");
        let put = |mut client: etcd_client::Client| {
            let (key, value) = (key.clone(), value.clone());
            let options = etcd_client::PutOptions::new().with_lease(lease);
            async move { client.put(key, value, Some(options)).await }
        };
        let _ = cluster.ask_within(RELEASE_TIMEOUT, "labelling", put).await;
    }
}

/// Revokes the lease (every key goes with it); if etcd does not answer, the
/// lease runs out by itself.
pub(super) async fn revoke(cluster: &Cluster, lease: i64) {
    let revoke = |mut client: etcd_client::Client| async move { client.lease_revoke(lease).await };
    let _ = cluster
        .ask_within(RELEASE_TIMEOUT, "giving back the lease", revoke)
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_time_moves_forward() {
        let a = boot_now();
        std::thread::sleep(Duration::from_millis(5));
        assert!(boot_now() >= a + Duration::from_millis(5));
    }
}
