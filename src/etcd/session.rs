//! The etcd side of one run's wait, on its own thread: the places in line
//! and the lease (see `keeper`). The main thread waits for signals and says
//! what the session reports; once every lock is granted, the session hands
//! the lease and its keys over to the watcher (see `keeper::hold`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use etcd_client::{EventType, PutOptions, WatchOptions};
use tokio::sync::mpsc;

use super::is;
use super::keeper::{self, LeaseState, boot_now};
use super::{
    Cluster, Config, Entry, Place, blockers, holders, join_lines, key_of, line_of, lines_of,
};
use crate::error::EtcdKind;
use crate::flock::record::{Record, now_ms};
use crate::proc;
use crate::request::Request;
use crate::show::human_duration;
use crate::supervise::{self, Received};
use crate::sys::signal::Thread;

use crate::messages::etcd as messages;

/// How long releasing may take before devlock leaves the lease to expire.
pub(super) const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

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
    pub step: String,
    pub command: Vec<String>,
}

enum ToSession {
    Stop(Received),
    /// The watcher keeps the lease from now on: stop without giving it back.
    HandOver,
    Release,
}

/// How the wait ended, with what the command is told: each lock's fencing
/// token (its key's create revision; an ancestor's key for a lock passed
/// through), the resources it got and its slot.
pub(super) enum Acquired {
    /// Every lock is already held by an ancestor: nothing was taken.
    AllInherited(Got),
    /// Taken (some perhaps passed through).
    Taken(Got),
}

/// The fencing token of each lock, by resource name.
pub(super) type Fences = Vec<(crate::resource::Resource, i64)>;

/// What the command is given.
#[derive(Debug, Clone, Default)]
pub(super) struct Got {
    pub fences: Fences,
    /// The resources asked for, or `--any`'s picks, sorted.
    pub resources: Vec<crate::resource::Resource>,
    /// `--slots`: the slot number taken.
    pub slot: Option<u64>,
    /// The key of the first of `resources`, when this run put it
    /// (`ETCD_LOCK_KEY`, as `etcdctl lock` sets it).
    pub lock_key: Option<String>,
}

impl Acquired {
    pub(super) fn got(&self) -> &Got {
        match self {
            Acquired::AllInherited(got) | Acquired::Taken(got) => got,
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
    HandedOver(Box<keeper::Held>),
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
    pub(super) fn start(settings: Settings, wanted: Wanted) -> Result<Session> {
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
                runtime.block_on(run_session(settings, wanted, rx, report));
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
                Ok(FromSession::Released { .. } | FromSession::HandedOver(_)) => {
                    unreachable!("released before acquired")
                }
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

    /// Stops the session without giving the lease back: what the watcher
    /// needs to keep it, once the session thread (and its runtime, with
    /// every connection) is gone, so this process has one thread again.
    /// `None` if the session ended otherwise (then nothing is held).
    pub(super) fn hand_over(mut self) -> Option<keeper::Held> {
        let _ = self.to.send(ToSession::HandOver);
        let mut held = None;
        while let Ok(message) = self.from.recv() {
            match message {
                FromSession::HandedOver(h) => held = Some(*h),
                FromSession::Say(line) => eprintln!("{line}"),
                _ => {}
            }
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        held
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
                FromSession::Acquired(..) | FromSession::HandedOver(_) => {}
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
    wanted: Wanted,
    mut rx: mpsc::UnboundedReceiver<ToSession>,
    report: impl Fn(FromSession),
) {
    let cluster = Cluster::new(settings.config.clone());
    let failed = |e| FromSession::Acquired(Err(e), None);
    let ancestors = possible_devlock_ancestors();
    let mut pending = Vec::new();
    let mut got = Got {
        resources: wanted.members.clone(),
        ..Got::default()
    };
    for request in &wanted.fixed {
        match inherited(&cluster, request, &ancestors).await {
            Ok(Some(fence)) => got.fences.push((request.name.clone(), fence)),
            Ok(None) => pending.push(request.clone()),
            Err(e) => return report(failed(e)),
        }
    }
    // A candidate an enclosing devlock holds is a pick that passes through.
    let mut count = wanted.count;
    let mut candidates = Vec::new();
    for request in &wanted.candidates {
        let passed = if count > 0 {
            match inherited(&cluster, request, &ancestors).await {
                Ok(passed) => passed,
                Err(e) => return report(failed(e)),
            }
        } else {
            None
        };
        match passed {
            Some(fence) => {
                count -= 1;
                got.fences.push((request.name.clone(), fence));
                got.resources.push(request.name.clone());
            }
            None => candidates.push(request.clone()),
        }
    }
    if pending.is_empty() && count == 0 {
        got.resources.sort();
        return report(FromSession::Acquired(Ok(Acquired::AllInherited(got)), None));
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
    tokio::spawn(keeper::keep(
        cluster.clone(),
        lease,
        state.clone(),
        boot_now() + ttl / 3,
    ));

    let mut entries = Vec::new();
    let say = |line: String| report(FromSession::Say(line));
    let deadline = settings.timeout.and_then(|t| Instant::now().checked_add(t));
    let taking = Taking {
        settings: &settings,
        cluster: &cluster,
        lease,
        label: Label::of_this_process(&settings.step),
        deadline,
        say: &say,
    };
    let waiting = async {
        taking.in_order(&pending, &mut entries).await?;
        if count == 0 {
            return Ok(());
        }
        let fixed = entries.len();
        taking.any(&candidates, count, &mut entries).await?;
        // The groups taken for candidates that were not picked go back.
        let picks: Vec<crate::resource::Resource> =
            entries[fixed..].iter().map(|t| t.request.clone()).collect();
        let needed: HashSet<crate::resource::Resource> = picks
            .iter()
            .chain(&got.resources)
            .flat_map(|p| p.held_shared())
            .collect();
        let unneeded: Vec<String> = entries[..fixed]
            .iter()
            .filter(|t| !needed.contains(&t.request))
            .map(|t| t.key.clone())
            .collect();
        if !unneeded.is_empty() {
            cluster
                .ask("giving back groups no pick needs", |mut client| {
                    let txn = etcd_client::Txn::new().and_then(
                        unneeded
                            .iter()
                            .map(|k| etcd_client::TxnOp::delete(k.as_str(), None))
                            .collect::<Vec<_>>(),
                    );
                    async move { client.txn(txn).await }
                })
                .await?;
            entries.retain(|t| !unneeded.contains(&t.key));
        }
        // A group kept is held on behalf of a pick (its label says which
        // once the command runs).
        let groups = entries.len() - picks.len();
        for group in entries.iter_mut().take(groups) {
            if let Some(pick) = picks
                .iter()
                .find(|p| p.held_shared().contains(&group.request))
            {
                group.entry.via = Some(pick.as_str().to_owned());
            }
        }
        got.resources.extend(picks);
        Ok::<_, anyhow::Error>(())
    };
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
        sig = stop => Err(crate::error::signal(
            sig.signo,
            format!("stopped by signal {} while waiting; left the line", sig.signo),
        )),
        why = state.wait_lost() => Err(crate::error::etcd(
            crate::error::EtcdKind::Unreachable,
            format!("{why}; left the line, nothing ran"),
        )),
    };
    if let Err(e) = outcome {
        state.release();
        revoke(&cluster, lease).await;
        return report(failed(e));
    }
    got.fences
        .extend(entries.iter().map(|e| (e.request.clone(), e.fence)));
    got.slot = entries.iter().find_map(|e| e.slot);
    got.resources.sort();
    got.lock_key = got.resources.first().and_then(|first| {
        entries
            .iter()
            .find(|e| &e.request == first)
            .map(|e| e.key.clone())
    });
    report(FromSession::Acquired(
        Ok(Acquired::Taken(got)),
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

    while let Some(message) = rx.recv().await {
        match message {
            ToSession::HandOver => {
                // Dropped with this thread's runtime: the renewals and the
                // watches, which the watcher starts afresh; nothing revoked.
                return report(FromSession::HandedOver(Box::new(keeper::Held {
                    config: settings.config.clone(),
                    lease,
                    confirmed_until: state.confirmed_until(),
                    ttl,
                    kill_after: settings.kill_after,
                    keys: entries
                        .into_iter()
                        .map(|t| (t.key, t.joined_at, t.entry))
                        .collect(),
                })));
            }
            ToSession::Release => break,
            ToSession::Stop(_) => {}
        }
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
            return Err(crate::error::in_use(format!(
                "{} is held only shared by a devlock this command runs under (pid {}); an exclusive take would wait for itself",
                request.name.as_str(),
                entry.pid
            )));
        }
        return Ok(Some(entry.fence.unwrap_or(place.create_revision)));
    }
    Ok(None)
}

/// This process and its ancestors with their start times, when one of them may be
/// a devlock: a devlock set `DEVLOCK_RESOURCES` for its command, or an
/// ancestor runs a program called devlock, or the kernel will not say what
/// it runs. Usually there is none, which spares asking etcd.
fn possible_devlock_ancestors() -> Vec<(u32, u64)> {
    let me = std::process::id();
    let ancestors: Vec<(u32, u64)> = proc::process::ancestors(me)
        .map(|(pid, stat)| (pid, stat.start))
        .collect();
    let maybe_nested = std::env::var_os("DEVLOCK_RESOURCES").is_some()
        || ancestors.iter().any(|(pid, _)| {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .map_or(true, |exe| exe.to_string_lossy().contains("devlock"))
        });
    if !maybe_nested {
        return Vec::new();
    }
    // This process among them: a devlock whose command is devlock became it.
    let this = proc::process::start_time(me).map(|start| (me, start));
    this.into_iter().chain(ancestors).collect()
}

/// A lock taken: its key, label, fencing token (the revision it was
/// granted at) and the revision it joined at.
struct Taken {
    request: crate::resource::Resource,
    key: String,
    entry: Entry,
    fence: i64,
    joined_at: i64,
    /// `--slots`: the slot number it took.
    slot: Option<u64>,
}

/// What one run takes: `fixed` in order, then `count` of `candidates`
/// (`--any`); `members` are the resources the command is given when there
/// are no candidates.
#[derive(Debug, Clone)]
pub(super) struct Wanted {
    pub fixed: Vec<Request>,
    pub candidates: Vec<Request>,
    pub count: usize,
    pub members: Vec<crate::resource::Resource>,
}

/// Who we are, for every key's value.
struct Label {
    pid: u32,
    pid_start: u64,
    user: String,
    host: String,
}

impl Label {
    fn of_this_process(step: &str) -> Label {
        // Who we are, once for every request (pid, start time, user as the
        // file backend's records have them).
        let record = Record::for_this_process(step);
        // etcd keys are not the kernel's to check: the name as the
        // environment gives it, else the uid's.
        let user = std::env::var("USER")
            .ok()
            .unwrap_or_else(|| proc::process::user_name(nix::unistd::getuid().as_raw()));
        Label {
            pid: record.pid,
            pid_start: record.pid_start,
            user,
            host: super::hostname(),
        }
    }

    fn entry(&self, settings: &Settings, request: &Request) -> Entry {
        Entry {
            step: settings.step.clone(),
            pid: self.pid,
            pid_start: Some(self.pid_start),
            child: None,
            watcher: None,
            user: self.user.clone(),
            host: self.host.clone(),
            since_ms: now_ms(),
            granted_ms: None,
            command: settings.command.clone(),
            exclusive: request.exclusive && request.slots == 0,
            // A member taken for its whole group says which group.
            via: match (&request.via, request.for_group) {
                (Some(member), _) => Some(member.as_str().to_owned()),
                (None, true) => request.name.group().map(|g| g.as_str().to_owned()),
                (None, false) => None,
            },
            slots: (request.slots > 0).then_some(request.slots),
            fence: None,
        }
    }
}

/// What every take of one run shares.
struct Taking<'a> {
    settings: &'a Settings,
    cluster: &'a Cluster,
    lease: i64,
    label: Label,
    deadline: Option<Instant>,
    say: &'a dyn Fn(String),
}

impl Taking<'_> {
    /// Joins each line in turn, holding the earlier locks while waiting for
    /// the later ones (the requests come in the one global order).
    /// A whole group held exclusively then takes each member known (a line
    /// or a record, see "A whole group and its members" in the module
    /// above), one at a time in name order, as the file backend takes each
    /// member's lock file: a devlock holds a member only with its group
    /// shared, so what can still hold one is another client (`etcdctl lock
    /// /devlock/gpu:0`), which the group's take then waits for, or with
    /// `-n` names, and which waits behind the group's key once it is in.
    async fn in_order(&self, requests: &[Request], entries: &mut Vec<Taken>) -> Result<()> {
        for request in requests {
            let (_, taken) = self.first(std::slice::from_ref(request)).await?;
            entries.push(taken);
            let whole_group = request.exclusive
                && request.slots == 0
                && request.via.is_none()
                && request.name.group().is_none();
            if !whole_group {
                continue;
            }
            let group = &request.name;
            let members = self
                .cluster
                .ask("reading the group's members", |mut client| async move {
                    super::members_of(&mut client, group).await
                })
                .await?;
            for member in members {
                if requests.iter().any(|r| r.name == member) {
                    continue;
                }
                let member = Request {
                    name: member,
                    exclusive: true,
                    via: None,
                    slots: 0,
                    for_group: true,
                };
                let (_, taken) = self.first(std::slice::from_ref(&member)).await?;
                entries.push(taken);
            }
        }
        Ok(())
    }

    /// `--any`: `count` of `candidates` (sorted), the first that are or
    /// become free, picked as the file backend picks them: each from the
    /// candidates after the last pick that leave enough for the rest, so
    /// holding one while waiting for another never goes against the global
    /// lock order.
    async fn any(
        &self,
        candidates: &[Request],
        count: usize,
        entries: &mut Vec<Taken>,
    ) -> Result<()> {
        let mut start = 0;
        for pick in 0..count {
            let window = &candidates[start..candidates.len() - (count - 1 - pick)];
            let (index, taken) = self.first(window).await?;
            entries.push(taken);
            start += index + 1;
        }
        Ok(())
    }

    /// Joins the lines of `requests` at once (one transaction, one
    /// revision) and waits until one of them holds; leaves the others'
    /// lines. The index of the one taken, and the lock.
    async fn first(&self, requests: &[Request]) -> Result<(usize, Taken)> {
        let Taking {
            settings,
            cluster,
            lease,
            label,
            deadline,
            say,
        } = self;
        let (lease, deadline) = (*lease, *deadline);
        let mut entries: Vec<Entry> = requests.iter().map(|r| label.entry(settings, r)).collect();
        let keys: Vec<String> = requests.iter().map(|r| key_of(&r.name, lease)).collect();
        let values: Vec<Vec<u8>> = entries
            .iter()
            .map(|e| serde_json::to_vec(e).expect("entries serialise"))
            .collect();
        let (lines, joined_at) = cluster
            .ask("joining the line", |mut client| {
                let joins: Vec<(&crate::resource::Resource, &str, Vec<u8>)> = requests
                    .iter()
                    .zip(&keys)
                    .zip(&values)
                    .map(|((r, k), v)| (&r.name, k.as_str(), v.clone()))
                    .collect();
                async move { join_lines(&mut client, &joins, lease).await }
            })
            .await?;
        let mut waits: Vec<Waiting> = requests
            .iter()
            .zip(keys)
            .zip(lines)
            .map(|((request, key), line)| Waiting { request, key, line })
            .collect();
        // Everyone uses a resource with one size (0: a plain lock); a
        // member taken for its whole group waits for any size, and is no
        // size itself.
        for wait in &waits {
            let ours = wait.request.slots;
            let group = wait.request.name.group();
            let for_group = |e: &Entry| {
                e.via.is_some() && e.via.as_deref() == group.as_ref().map(|g| g.as_str())
            };
            if let Some(theirs) = wait
                .line
                .iter()
                .filter(|_| !wait.request.for_group)
                .filter(|p| p.key != wait.key && p.entry.as_ref().is_some_and(|e| !for_group(e)))
                .map(Place::slots)
                .find(|&theirs| theirs != ours)
            {
                return Err(crate::flock::queue::slots_mismatch(
                    wait.request.name.as_str(),
                    theirs,
                    ours,
                ));
            }
        }
        let started = Instant::now();
        let name = if requests.len() == 1 {
            requests[0].name.as_str().to_owned()
        } else {
            let names: Vec<&str> = requests.iter().map(|r| r.name.as_str()).collect();
            format!("any of {}", names.join(" "))
        };
        let (index, waited, granted_at) = wait_turn(
            settings, cluster, &name, &mut waits, joined_at, deadline, say,
        )
        .await?;
        let others: Vec<String> = waits
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != index)
            .map(|(_, w)| w.key.clone())
            .collect();
        if !others.is_empty() {
            cluster
                .ask("leaving the other lines", |mut client| {
                    let txn = etcd_client::Txn::new().and_then(
                        others
                            .iter()
                            .map(|k| etcd_client::TxnOp::delete(k.as_str(), None))
                            .collect::<Vec<_>>(),
                    );
                    async move { client.txn(txn).await }
                })
                .await?;
        }
        let request = &requests[index];
        let key = waits.swap_remove(index).key;
        let slot = if request.slots > 0 {
            Some(claim_slot(settings, cluster, lease, request, &key, deadline).await?)
        } else {
            None
        };
        let mut entry = entries.swap_remove(index);
        entry.granted_ms = Some(now_ms());
        entry.fence = Some(granted_at);
        if waited && !settings.quiet {
            say(messages::got(
                request.name.as_str(),
                started.elapsed(),
                &settings.step,
            ));
        }
        Ok((
            index,
            Taken {
                request: request.name.clone(),
                key,
                entry,
                fence: granted_at,
                joined_at,
                slot,
            },
        ))
    }
}

/// `--slots`: numbers this holder, with the lowest slot key nobody has
/// (see the module doc). At most N holders exist at once, so one frees up
/// soon if none is left (a holder whose line key was removed by hand keeps
/// its slot key until its lease is revoked).
/// Keys put there by anything but a holder (by hand, without a lease) can
/// take every number: then `-n` and `-w` bound this wait as they bound the
/// line's, naming the keys.
async fn claim_slot(
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

/// One line waited in: the request, our key and the line as last known.
struct Waiting<'a> {
    request: &'a Request,
    key: String,
    line: Vec<Place>,
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
async fn wait_turn(
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
        let gave_up = |why: String| {
            crate::error::busy(
                name,
                true,
                format!(
                    "gave up on {name} after {}: {why}",
                    human_duration(started.elapsed())
                ),
            )
        };
        if read_again {
            let resources: Vec<&crate::resource::Resource> =
                waits.iter().map(|w| &w.request.name).collect();
            match cluster
                .ask("reading the line", |mut client| {
                    let resources = resources.clone();
                    async move { lines_of(&mut client, &resources).await }
                })
                .await
            {
                Ok((lines, read_at)) => {
                    for (wait, line) in waits.iter_mut().zip(lines) {
                        wait.line = line;
                    }
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
        let who = waits
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
            .join("; ");
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
                let ahead = waits
                    .iter()
                    .filter_map(|w| w.position().ok().map(|i| blockers(&w.line, i).len()))
                    .min()
                    .unwrap_or(0);
                say(messages::waiting(name, &who, ahead, waited, &settings.step));
            }
            last_report = Some(Instant::now());
        }
        let next_report = last_report
            .and_then(|t| t.checked_add(settings.report_every))
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
        let until = deadline.map_or(next_report, |d| d.min(next_report));
        let until = grace.map_or(until, |g| g.min(until));
        // One watch per line on one stream, from just after the revision
        // they were read at: events come in revision order, so nothing
        // between the read and the watch is missed, and our own key's
        // removal is seen before anything that happened after it. Keys put
        // later come after ours and never stand in the way; each delete is
        // taken out of the line known.
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
        let prefixes: Vec<String> = waits
            .iter()
            .map(|w| super::resource_prefix(&w.request.name))
            .collect();
        let watch = async {
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

/// Revokes the lease (every key goes with it); if etcd does not answer, the
/// lease runs out by itself.
pub(super) async fn revoke(cluster: &Cluster, lease: i64) {
    let revoke = |mut client: etcd_client::Client| async move { client.lease_revoke(lease).await };
    let _ = cluster
        .ask_within(RELEASE_TIMEOUT, "giving back the lease", revoke)
        .await;
}
