//! The etcd side of one run, on its own thread: the places in line and the
//! lease (see `keeper`). The main thread waits for signals, says what the
//! session reports, and supervises the command.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use etcd_client::{EventType, PutOptions, WatchOptions};
use tokio::sync::mpsc;

use super::keeper::{self, LeaseState, boot_now};
use super::{Cluster, Config, Entry, Place, blockers, holders, join_line, key_of, line_of};
use crate::exit::{ExitCode, coded, exit_code_of};
use crate::flock::record::{Record, now_ms};
use crate::proc;
use crate::request::Request;
use crate::supervise::{self, Received};
use crate::sys::process::PidFd;
use crate::sys::signal::Thread;
use crate::text::human_duration;

use crate::messages::etcd as messages;

/// How long releasing may take before devlock leaves the lease to expire.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long to wait before asking etcd again after it failed a waiter.
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// Everything the session needs to know, fixed at start.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub config: Config,
    pub ttl: Duration,
    pub kill_after: Duration,
    pub no_wait: bool,
    pub timeout: Option<Duration>,
    pub quiet: bool,
    pub report_every: Duration,
    pub conflict_code: ExitCode,
    pub step: String,
    pub command: Vec<String>,
}

enum ToSession {
    Stop(Received),
    Started { pid: u32, pidfd: Option<PidFd> },
    Release,
}

/// How the wait ended, with each lock's fencing token: its key's create
/// revision (an ancestor's key for a lock passed through).
pub(super) enum Acquired {
    /// Every lock is already held by an ancestor: nothing was taken.
    AllInherited(Fences),
    /// Taken (some perhaps passed through).
    Taken(Fences),
}

/// The fencing token of each lock, by resource name.
pub(super) type Fences = Vec<(crate::resource::Resource, i64)>;

impl Acquired {
    pub(super) fn fences(&self) -> &Fences {
        match self {
            Acquired::AllInherited(fences) | Acquired::Taken(fences) => fences,
        }
    }
}

enum FromSession {
    /// A line for standard error, written by the main thread so that a
    /// stderr nobody reads never holds up the lease.
    Say(String),
    Acquired(Result<Acquired>, Option<Arc<LeaseState>>),
    Released {
        lost: Option<String>,
    },
}

/// The handle the main thread keeps.
pub(super) struct Session {
    to: mpsc::UnboundedSender<ToSession>,
    from: std::sync::mpsc::Receiver<FromSession>,
    thread: Option<std::thread::JoinHandle<()>>,
    lease: Option<Arc<LeaseState>>,
}

/// Wakes the main thread when the session thread ends, however it ends (a
/// panic included), so it never sleeps on a session that is gone.
struct WakeOnExit(Thread);

impl Drop for WakeOnExit {
    fn drop(&mut self) {
        // The main thread outlives this one (it joins it).
        self.0.signal(supervise::wake_signal());
    }
}

impl Session {
    /// Starts the session thread. Call after blocking the handled signals.
    pub(super) fn start(settings: Settings, requests: Vec<Request>) -> Result<Session> {
        let (to, rx) = mpsc::unbounded_channel();
        let (tx, from) = std::sync::mpsc::channel();
        let main_thread = Thread::current();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("devlock-etcd".into())
            .spawn(move || {
                let _wake = WakeOnExit(main_thread);
                let report = move |message: FromSession| {
                    let _ = tx.send(message);
                    main_thread.signal(supervise::wake_signal());
                };
                runtime.block_on(run_session(settings, requests, rx, report));
            })?;
        Ok(Session {
            to,
            from,
            thread: Some(thread),
            lease: None,
        })
    }

    /// Waits for every lock. A stopping signal goes to the session, which
    /// leaves the line; one that comes as the last lock is granted is handed
    /// back, so the command is not started.
    pub(super) fn wait_for_locks(&mut self) -> Result<(Acquired, Option<Received>)> {
        let mut stopped = None;
        loop {
            match self.from.try_recv() {
                Ok(FromSession::Say(line)) => eprintln!("{line}"),
                Ok(FromSession::Acquired(result, lease)) => {
                    self.lease = lease;
                    return result.map(|acquired| (acquired, stopped));
                }
                Ok(FromSession::Released { .. }) => unreachable!("released before acquired"),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return Err(anyhow::anyhow!("the etcd session ended unexpectedly"));
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if let Some(sig) = supervise::wait_stop_or_wake(Duration::from_secs(3600))
                        && sig.signo != supervise::wake_signal()
                        && sig.signo != libc::SIGWINCH
                    {
                        stopped = Some(sig);
                        let _ = self.to.send(ToSession::Stop(sig));
                    }
                }
            }
        }
    }

    /// Waits for the session thread, which has nothing left to do.
    pub(super) fn finish(mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Whether the lease is already lost (then the command must not start).
    pub(super) fn lease_lost(&self) -> bool {
        self.lease.as_ref().is_some_and(|l| l.is_lost())
    }

    /// Tells the session which process to stop if the lease is lost.
    pub(super) fn started(&self, pid: u32) {
        // Our own child, not yet reaped: the pidfd names it.
        let pidfd = PidFd::open(pid);
        let _ = self.to.send(ToSession::Started { pid, pidfd });
    }

    /// Gives the locks back; says why the lease was lost, if it was.
    pub(super) fn release(mut self) -> Option<String> {
        let _ = self.to.send(ToSession::Release);
        let mut lost = None;
        while let Ok(message) = self.from.recv() {
            match message {
                FromSession::Released { lost: why } => {
                    lost = why;
                    break;
                }
                FromSession::Say(line) => eprintln!("{line}"),
                FromSession::Acquired(..) => {}
            }
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        lost
    }
}

async fn run_session(
    settings: Settings,
    requests: Vec<Request>,
    mut rx: mpsc::UnboundedReceiver<ToSession>,
    report: impl Fn(FromSession),
) {
    let cluster = Cluster::new(settings.config.clone());
    let failed = |e| FromSession::Acquired(Err(e), None);
    let ancestors = possible_devlock_ancestors();
    let mut pending = Vec::new();
    let mut fences = Fences::new();
    for request in &requests {
        match inherited(&cluster, request, &ancestors).await {
            Ok(Some(fence)) => fences.push((request.name.clone(), fence)),
            Ok(None) => pending.push(request.clone()),
            Err(e) => return report(failed(e)),
        }
    }
    if pending.is_empty() {
        return report(FromSession::Acquired(
            Ok(Acquired::AllInherited(fences)),
            None,
        ));
    }
    let ttl_secs = settings.ttl.as_secs_f64().ceil() as i64;
    let sent = boot_now();
    let grant = match cluster
        .ask("granting a lease", |mut client| async move {
            client.lease_grant(ttl_secs, None).await
        })
        .await
    {
        Ok(grant) => grant,
        Err(e) => return report(failed(e)),
    };
    let lease = grant.id();
    // etcd may grant more than asked (never less); count on what was asked.
    let ttl = settings
        .ttl
        .min(Duration::from_secs(grant.ttl().max(0) as u64));
    let state = LeaseState::new(ttl, settings.kill_after, sent);
    tokio::spawn(keeper::keep(cluster.clone(), lease, state.clone()));

    let mut entries = Vec::new();
    let say = |line: String| report(FromSession::Say(line));
    let waiting = take_in_order(&settings, &cluster, lease, &pending, &mut entries, &say);
    let stop = async {
        loop {
            match rx.recv().await {
                Some(ToSession::Stop(sig)) => return sig,
                Some(_) => {}
                None => std::future::pending::<()>().await,
            }
        }
    };
    let outcome = tokio::select! {
        result = waiting => result,
        sig = stop => Err(coded(
            ExitCode::Signal(sig.signo),
            format!("stopped by signal {} while waiting; left the line", sig.signo),
        )),
        why = state.wait_lost() => Err(coded(
            ExitCode::EtcdUnreachable,
            format!("{why}; left the line, nothing ran"),
        )),
    };
    if let Err(e) = outcome {
        state.release();
        revoke(&cluster, lease).await;
        return report(failed(e));
    }
    fences.extend(entries.iter().map(|e| (e.request.clone(), e.fence)));
    report(FromSession::Acquired(
        Ok(Acquired::Taken(fences)),
        Some(state.clone()),
    ));
    for Taken { key, joined_at, .. } in &entries {
        tokio::spawn(keeper::watch_own_key(
            cluster.clone(),
            key.clone(),
            *joined_at,
            state.clone(),
        ));
    }

    let mut labelling = None;
    while let Some(message) = rx.recv().await {
        match message {
            ToSession::Started { pid, pidfd } => {
                state.command_started(pidfd);
                // Labels only, off the command's path: who runs, since when.
                // A command that is over first does not wait for them.
                let labeller = cluster.clone();
                let labels: Vec<(String, Vec<u8>)> = entries
                    .iter_mut()
                    .map(|Taken { key, entry, .. }| {
                        entry.child = Some(pid);
                        (
                            key.clone(),
                            serde_json::to_vec(&*entry).expect("entries serialise"),
                        )
                    })
                    .collect();
                labelling = Some(tokio::spawn(async move {
                    for (key, value) in labels {
                        let put = |mut client: etcd_client::Client| {
                            let (key, value) = (key.clone(), value.clone());
                            let options = PutOptions::new().with_lease(lease);
                            async move { client.put(key, value, Some(options)).await }
                        };
                        let _ = labeller.ask_within(RELEASE_TIMEOUT, "labelling", put).await;
                    }
                }));
            }
            ToSession::Release => break,
            ToSession::Stop(_) => {}
        }
    }
    if let Some(labelling) = labelling {
        labelling.abort();
    }
    state.release();
    let lost = state.lost_reason();
    if state.etcd_answers() {
        revoke(&cluster, lease).await;
    }
    report(FromSession::Released { lost });
}

/// Whether an ancestor of this process already holds `request` (a nested
/// devlock), checked against etcd's line and this machine's processes: the
/// revision of its key if so.
async fn inherited(
    cluster: &Cluster,
    request: &Request,
    ancestors: &[(u32, u64)],
) -> Result<Option<i64>> {
    if ancestors.is_empty() {
        return Ok(None);
    }
    let (line, _) = cluster
        .ask("reading the line", |mut client| async move {
            line_of(&mut client, &request.name).await
        })
        .await?;
    let host = super::hostname();
    for place in holders(&line) {
        let Some(entry) = &place.entry else { continue };
        let is_ancestor = entry.host == host
            && ancestors.iter().any(|&(pid, start)| {
                pid == entry.pid && entry.pid_start.is_none_or(|s| s == start)
            });
        if !is_ancestor {
            continue;
        }
        if request.exclusive && !entry.exclusive {
            return Err(coded(
                ExitCode::Busy,
                format!(
                    "{} is held only shared by a devlock this command runs under (pid {}); an exclusive take would wait for itself",
                    request.name.as_str(),
                    entry.pid
                ),
            ));
        }
        return Ok(Some(place.create_revision));
    }
    Ok(None)
}

/// This process's ancestors with their start times, when one of them may be
/// a devlock: a devlock set `DEVLOCK_RESOURCES` for its command, or an
/// ancestor runs a program called devlock, or the kernel will not say what
/// it runs. Usually there is none, which spares asking etcd.
fn possible_devlock_ancestors() -> Vec<(u32, u64)> {
    let ancestors: Vec<(u32, u64)> = proc::process::ancestors(std::process::id())
        .map(|(pid, stat)| (pid, stat.start))
        .collect();
    let maybe_nested = std::env::var_os("DEVLOCK_RESOURCES").is_some()
        || ancestors.iter().any(|(pid, _)| {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .map_or(true, |exe| exe.to_string_lossy().contains("devlock"))
        });
    if maybe_nested { ancestors } else { Vec::new() }
}

/// A lock taken: its key, label, fencing token and the revision it joined at.
struct Taken {
    request: crate::resource::Resource,
    key: String,
    entry: Entry,
    fence: i64,
    joined_at: i64,
}

/// Joins each line in turn, holding the earlier locks while waiting for the
/// later ones (the requests come in the one global order).
async fn take_in_order(
    settings: &Settings,
    cluster: &Cluster,
    lease: i64,
    requests: &[Request],
    entries: &mut Vec<Taken>,
    say: &dyn Fn(String),
) -> Result<()> {
    let deadline = settings.timeout.and_then(|t| Instant::now().checked_add(t));
    // Who we are, once for every request (pid, start time, user as the
    // file backend's records have them).
    let label = Record::for_this_process(&settings.step);
    // etcd keys are not the kernel's to check: the name as the environment
    // gives it, else the uid's.
    let user = std::env::var("USER")
        .ok()
        .unwrap_or_else(|| proc::process::user_name(nix::unistd::getuid().as_raw()));
    let host = super::hostname();
    for request in requests {
        let key = key_of(&request.name, lease);
        let mut entry = Entry {
            step: settings.step.clone(),
            pid: label.pid,
            pid_start: Some(label.pid_start),
            child: None,
            user: user.clone(),
            host: host.clone(),
            since_ms: now_ms(),
            granted_ms: None,
            command: settings.command.clone(),
            exclusive: request.exclusive,
            via: request.via.as_ref().map(|v| v.as_str().to_owned()),
        };
        let value = serde_json::to_vec(&entry).expect("entries serialise");
        let joined = cluster
            .ask("joining the line", |mut client| {
                let value = value.clone();
                let key = &key;
                async move { join_line(&mut client, &request.name, key, value, lease).await }
            })
            .await?;
        let started = Instant::now();
        let joined_at = joined.1;
        // The put's own revision unless an answer was lost and the put was
        // made again: then the first one's, which the key keeps.
        let fence = joined
            .0
            .iter()
            .find(|p| p.key == key)
            .map_or(joined_at, |p| p.create_revision);
        let waited = wait_turn(settings, cluster, request, &key, joined, deadline, say).await?;
        entry.granted_ms = Some(now_ms());
        if waited && !settings.quiet {
            say(messages::got(
                request.name.as_str(),
                started.elapsed(),
                &settings.step,
            ));
        }
        entries.push(Taken {
            request: request.name.clone(),
            key,
            entry,
            fence,
            joined_at,
        });
    }
    Ok(())
}

/// Waits until nothing stands before `key` in its line; says whether it had
/// to wait. Sleeps on one watch of the line, never polls. etcd
/// failing meanwhile is retried: the lease's own deadline decides when the
/// wait is lost.
async fn wait_turn(
    settings: &Settings,
    cluster: &Cluster,
    request: &Request,
    key: &str,
    joined: (Vec<Place>, i64),
    deadline: Option<Instant>,
    say: &dyn Fn(String),
) -> Result<bool> {
    let name = request.name.as_str();
    let started = Instant::now();
    let mut last_report: Option<Instant> = None;
    let mut read = Some(joined);
    let mut trouble = Trouble {
        said: false,
        name,
        say,
    };
    loop {
        let gave_up = |why: String| {
            crate::exit::busy(
                settings.conflict_code,
                format!(
                    "gave up on {name} after {}: {why}",
                    human_duration(started.elapsed())
                ),
            )
        };
        let (line, revision) = match read.take() {
            Some(line) => line,
            None => match cluster
                .ask("reading the line", |mut client| async move {
                    line_of(&mut client, &request.name).await
                })
                .await
            {
                Ok(line) => line,
                Err(e) => {
                    trouble.ride_out(e, deadline, &gave_up).await?;
                    continue;
                }
            },
        };
        let Some(index) = line.iter().position(|p| p.key == key) else {
            return Err(place_gone(name));
        };
        let in_the_way = blockers(&line, index);
        if in_the_way.is_empty() {
            return Ok(last_report.is_some());
        }
        let who = describe_holders(&line);
        if settings.no_wait {
            return Err(crate::exit::busy(
                settings.conflict_code,
                messages::busy(name, &who),
            ));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(gave_up(format!("held by {who}")));
        }
        let report_due = last_report.is_none_or(|t| t.elapsed() >= settings.report_every);
        if report_due {
            if !settings.quiet {
                let waited = last_report.map(|_| started.elapsed());
                say(messages::waiting(
                    name,
                    &who,
                    in_the_way.len(),
                    waited,
                    &settings.step,
                ));
            }
            last_report = Some(Instant::now());
        }
        let mut in_the_way: HashSet<String> = in_the_way.iter().map(|p| p.key.clone()).collect();
        let next_report = last_report
            .and_then(|t| t.checked_add(settings.report_every))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
        let until = deadline.map_or(next_report, |d| d.min(next_report));
        // One watch over the whole line, from just after the revision it
        // was read at: events come in revision order, so nothing between
        // the read and the watch is missed, and our own key's removal is
        // seen before anything that happened after it. Keys put later come
        // after ours and never stand in the way.
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let (endpoint, mut client) = match cluster.client("watching the line").await {
            Ok(client) => client,
            Err(e) => {
                trouble.ride_out(e, deadline, &gave_up).await?;
                continue;
            }
        };
        let watch = async {
            let mut stream = client
                .watch(super::resource_prefix(&request.name), Some(options))
                .await?;
            while let Some(response) = stream.message().await? {
                if response.canceled() {
                    return Ok(Turn::ReadAgain);
                }
                for event in response.events() {
                    let Some(kv) = event
                        .kv()
                        .filter(|_| event.event_type() == EventType::Delete)
                    else {
                        continue;
                    };
                    let gone = String::from_utf8_lossy(kv.key());
                    if gone == key {
                        return Ok(Turn::Lost);
                    }
                    in_the_way.remove(gone.as_ref());
                }
                if in_the_way.is_empty() {
                    return Ok(Turn::Ours);
                }
            }
            Ok::<_, etcd_client::Error>(Turn::ReadAgain)
        };
        // A watch on an endpoint devlock has moved away from may stay
        // silent (a member cut off from its cluster): read the line again.
        let watch = async {
            tokio::select! {
                turn = watch => turn,
                () = cluster.moved_from(endpoint) => Ok(Turn::ReadAgain),
            }
        };
        match tokio::time::timeout_at(until.into(), watch).await {
            Ok(Ok(Turn::Ours)) => return Ok(true),
            Ok(Ok(Turn::Lost)) => return Err(place_gone(name)),
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
        if exit_code_of(&err) != ExitCode::EtcdUnreachable {
            return Err(err);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(gave_up(format!("{err:#}")));
        }
        if !self.said {
            (self.say)(format!(
                "devlock: {}; still waiting for {}",
                crate::text::clean(&format!("{err:#}")),
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
    /// Nothing stands in the way any more.
    Ours,
    /// Our own key was removed.
    Lost,
    /// Read the line again (the watch ended or fell behind a compaction).
    ReadAgain,
}

fn place_gone(name: &str) -> anyhow::Error {
    coded(
        ExitCode::EtcdUnreachable,
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
            None => messages::foreign_key(&place.key),
        })
        .collect();
    shown.join(", ")
}

/// Revokes the lease (every key goes with it); if etcd does not answer, the
/// lease runs out by itself.
async fn revoke(cluster: &Cluster, lease: i64) {
    let revoke = |mut client: etcd_client::Client| async move { client.lease_revoke(lease).await };
    let _ = cluster
        .ask_within(RELEASE_TIMEOUT, "giving back the lease", revoke)
        .await;
}
