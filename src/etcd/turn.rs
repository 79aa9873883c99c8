//! Waiting one's turn in a line: one watch stream over the lines waited in,
//! never a poll; etcd failing meanwhile is ridden out (see `Trouble`).

use std::time::{Duration, Instant};

use anyhow::Result;
use etcd_client::{EventType, WatchOptions};

use super::is;
use super::keeper::RELEASE_TIMEOUT;
use super::wanted::Settings;
use super::{Cluster, Place, blockers, holders, lines_of};
use crate::error::EtcdKind;
use crate::flock::record::now_ms;
use crate::messages::etcd as messages;
use crate::proc;
use crate::request::Request;
use crate::show::human_duration;

/// How long to wait before asking etcd again after it failed a waiter.
pub(super) const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// One line waited in: the request, our key and the line as last known.
pub(super) struct Waiting<'a> {
    pub request: &'a Request,
    pub key: String,
    pub line: Vec<Place>,
}

impl Waiting<'_> {
    /// Whether nothing stands before our key; an error if it is gone.
    fn ours(&self) -> Result<bool> {
        let index = self.position()?;
        Ok(blockers(&self.line, index).is_empty())
    }

    /// Whether all that stands before our key is being let go: places of
    /// this machine whose devlock has ended (the command it became), which
    /// its watcher gives back just after (a round trip to etcd), or whose
    /// lease runs out. A `-n` take right after the last holder's command
    /// exited waits for that, up to [`RELEASE_TIMEOUT`], rather than
    /// finding it busy (what a lock file's holder never is once reaped).
    fn letting_go(&self) -> bool {
        let Ok(at) = self.position() else {
            return false;
        };
        let host = super::hostname();
        blockers(&self.line, at).iter().all(|place| {
            place.entry.as_ref().is_some_and(|e| {
                e.host == host && !proc::process::is_same_process(e.pid, e.pid_start)
            })
        })
    }

    fn position(&self) -> Result<usize> {
        self.line
            .iter()
            .position(|p| p.key == self.key)
            .ok_or_else(|| place_gone(self.request.name.as_str()))
    }
}

/// Waits until nothing stands before our key in one of the lines of
/// `waits` (read at `revision`); says which, and whether it had to wait.
/// Sleeps on one watch stream over the lines, never polls. etcd failing
/// meanwhile is retried: the lease's own deadline decides when the wait is
/// lost.
pub(super) async fn wait_turn(
    settings: &Settings,
    cluster: &Cluster,
    name: &str,
    waits: &mut [Waiting<'_>],
    revision: i64,
    deadline: Option<Instant>,
    say: &dyn Fn(String),
) -> Result<(usize, bool, i64)> {
    let started = Instant::now();
    let mut last_report: Option<Instant> = None;
    let mut revision = revision;
    let mut read_again = false;
    let mut trouble = Trouble {
        said: false,
        name,
        say,
    };
    // With -n, how long to wait for what is being let go (see `letting_go`).
    let mut grace: Option<Instant> = None;
    loop {
        let gave_up = |why: String| gave_up_on(name, started, why);
        if read_again {
            match read_lines(cluster, waits).await {
                Ok(read_at) => {
                    revision = read_at;
                    read_again = false;
                }
                Err(e) => {
                    trouble.ride_out(e, deadline, &gave_up).await?;
                    continue;
                }
            }
        }
        for (i, wait) in waits.iter().enumerate() {
            if wait.ours()? {
                return Ok((i, last_report.is_some(), revision));
            }
        }
        let who = who_holds(waits);
        if settings.no_wait {
            let over = grace.get_or_insert_with(|| Instant::now() + RELEASE_TIMEOUT);
            if !waits.iter().all(Waiting::letting_go) || Instant::now() >= *over {
                return Err(crate::error::busy(name, false, messages::busy(name, &who)));
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(gave_up(format!("held by {who}")));
        }
        let report_due = last_report.is_none_or(|t| t.elapsed() >= settings.report_every);
        if report_due && grace.is_none() {
            if !settings.quiet {
                let waited = last_report.map(|_| started.elapsed());
                let ahead = fewest_ahead(waits);
                say(messages::waiting(name, &who, ahead, waited, &settings.step));
            }
            last_report = Some(Instant::now());
        }
        let next_report = last_report
            .and_then(|t| t.checked_add(settings.report_every))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
        let until = deadline.map_or(next_report, |d| d.min(next_report));
        let until = grace.map_or(until, |g| g.min(until));
        let (endpoint, mut client) = match cluster.client("watching the line").await {
            Ok(client) => client,
            Err(e) => {
                trouble.ride_out(e, deadline, &gave_up).await?;
                continue;
            }
        };
        let watch = watch_on(cluster, endpoint, &mut client, waits, revision);
        let outcome = tokio::time::timeout_at(until.into(), watch).await;
        // Whatever the watch saw is in the lines known; reading them again
        // makes sure, unless the wait is over.
        read_again = true;
        match outcome {
            Ok(Ok(Turn::Ours(i, granted_at))) => return Ok((i, true, granted_at)),
            Ok(Ok(Turn::Lost(i))) => return Err(place_gone(waits[i].request.name.as_str())),
            Ok(Ok(Turn::ReadAgain)) | Err(_) => {}
            // With another endpoint to go to, the reading again that
            // follows says whether etcd is really unreachable.
            Ok(Err(_)) if cluster.config.endpoints.len() > 1 => {
                cluster.failed(endpoint);
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Ok(Err(e)) => {
                let e = cluster
                    .config
                    .failure(cluster.url(endpoint), "watching the line", e);
                trouble.ride_out(e, deadline, &gave_up).await?;
            }
        }
    }
}

/// The busy error of a wait that ran out of time (`-w`).
fn gave_up_on(name: &str, started: Instant, why: String) -> anyhow::Error {
    crate::error::busy(
        name,
        true,
        format!(
            "gave up on {name} after {}: {why}",
            human_duration(started.elapsed())
        ),
    )
}

/// Reads the lines of `waits` again, at one revision: that revision.
async fn read_lines(cluster: &Cluster, waits: &mut [Waiting<'_>]) -> Result<i64> {
    let resources: Vec<&crate::resource::Resource> =
        waits.iter().map(|w| &w.request.name).collect();
    let (lines, read_at) = cluster
        .ask("reading the line", |mut client| {
            let resources = resources.clone();
            async move { lines_of(&mut client, &resources).await }
        })
        .await?;
    for (wait, line) in waits.iter_mut().zip(lines) {
        wait.line = line;
    }
    Ok(read_at)
}

/// Who holds each line of `waits`, naming the line when there are several.
fn who_holds(waits: &[Waiting<'_>]) -> String {
    waits
        .iter()
        .map(|w| {
            let who = describe_holders(&w.line);
            if waits.len() == 1 {
                who
            } else {
                format!("{who} ({})", w.request.name.as_str())
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// How many stand in our way in the line where the fewest do.
fn fewest_ahead(waits: &[Waiting<'_>]) -> usize {
    waits
        .iter()
        .filter_map(|w| w.position().ok().map(|i| blockers(&w.line, i).len()))
        .min()
        .unwrap_or(0)
}

/// [`watch_lines`] on `endpoint`, until devlock moves away from it.
async fn watch_on(
    cluster: &Cluster,
    endpoint: usize,
    client: &mut etcd_client::Client,
    waits: &mut [Waiting<'_>],
    revision: i64,
) -> Result<Turn, etcd_client::Error> {
    let watch = watch_lines(client, waits, revision);
    // A watch on an endpoint devlock has moved away from may stay
    // silent (a member cut off from its cluster): read the line again.
    tokio::select! {
        turn = watch => turn,
        () = cluster.moved_from(endpoint) => Ok(Turn::ReadAgain),
    }
}

/// Watches the lines of `waits` (read at `revision`) until one of them is
/// ours, our key is gone, or the lines must be read again.
async fn watch_lines(
    client: &mut etcd_client::Client,
    waits: &mut [Waiting<'_>],
    revision: i64,
) -> Result<Turn, etcd_client::Error> {
    // One watch per line on one stream, from just after the revision
    // they were read at: events come in revision order, so nothing
    // between the read and the watch is missed, and our own key's
    // removal is seen before anything that happened after it. Keys put
    // later come after ours and never stand in the way; each delete is
    // taken out of the line known.
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision + 1);
    let prefixes: Vec<String> = waits
        .iter()
        .map(|w| super::resource_prefix(&w.request.name))
        .collect();
    let mut stream = client
        .watch(prefixes[0].clone(), Some(options.clone()))
        .await?;
    for prefix in &prefixes[1..] {
        stream.watch(prefix.clone(), Some(options.clone())).await?;
    }
    while let Some(response) = stream.message().await? {
        if response.canceled() {
            return Ok(Turn::ReadAgain);
        }
        let mut deleted_at = 0;
        for event in response.events() {
            let Some(kv) = event
                .kv()
                .filter(|_| event.event_type() == EventType::Delete)
            else {
                continue;
            };
            deleted_at = deleted_at.max(kv.mod_revision());
            let gone = String::from_utf8_lossy(kv.key());
            let Some(i) = prefixes.iter().position(|p| gone.starts_with(p.as_str())) else {
                continue;
            };
            let wait = &mut waits[i];
            if gone == wait.key {
                return Ok(Turn::Lost(i));
            }
            wait.line.retain(|p| p.key != gone);
        }
        for (i, wait) in waits.iter().enumerate() {
            if wait.ours().unwrap_or(false) {
                let at = response.header().map_or(revision, |h| h.revision());
                return Ok(Turn::Ours(i, if deleted_at > 0 { deleted_at } else { at }));
            }
        }
    }
    Ok(Turn::ReadAgain)
}

/// etcd failing a waiter: said once, then tried again after a pause, until
/// the deadline (the lease's own deadline ends the wait from outside).
struct Trouble<'a> {
    said: bool,
    name: &'a str,
    say: &'a dyn Fn(String),
}

impl Trouble<'_> {
    async fn ride_out(
        &mut self,
        err: anyhow::Error,
        deadline: Option<Instant>,
        gave_up: &dyn Fn(String) -> anyhow::Error,
    ) -> Result<()> {
        if !is(&err, EtcdKind::Unreachable) {
            return Err(err);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(gave_up(format!("{err:#}")));
        }
        if !self.said {
            (self.say)(format!(
                "devlock: {}; still waiting for {}",
                crate::show::clean(&format!("{err:#}")),
                self.name
            ));
            self.said = true;
        }
        tokio::time::sleep(RETRY_PAUSE).await;
        Ok(())
    }
}

/// How a watch of the line ended.
enum Turn {
    /// Nothing stands in the way of the one at this index any more, since
    /// this revision (the delete that freed it).
    Ours(usize, i64),
    /// Our own key (in the line at this index) was removed.
    Lost(usize),
    /// Read the line again (the watch ended or fell behind a compaction).
    ReadAgain,
}

fn place_gone(name: &str) -> anyhow::Error {
    crate::error::etcd(
        crate::error::EtcdKind::Unreachable,
        format!(
            "our place in line for {name} is gone from etcd (the key or its lease was removed); nothing ran"
        ),
    )
}

/// `step (pid 12 on host, user) for 3s`, for each holder.
fn describe_holders(line: &[Place]) -> String {
    let now = now_ms();
    let shown: Vec<String> = holders(line)
        .iter()
        .map(|place| match &place.entry {
            Some(e) => {
                let held = now.saturating_sub(e.granted_ms.unwrap_or(e.since_ms));
                messages::holder(
                    &e.step,
                    e.pid,
                    &e.host,
                    &e.user,
                    Duration::from_millis(held),
                )
            }
            None => messages::foreign_key(&place.key, place.create_revision),
        })
        .collect();
    shown.join(", ")
}
