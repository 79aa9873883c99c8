//! The etcd side of one run, on its own thread: the lease and its renewals,
//! the places in line, and stopping the command when the lease cannot be
//! kept. The main thread only waits for signals and supervises the command.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use etcd_client::{Client, EventType, LeaseKeepAliveStream, LeaseKeeper, PutOptions, WatchOptions};
use tokio::sync::{Notify, mpsc};

use super::{Config, Entry, Place, blockers, holders, join_line, key_of, line_of};
use crate::exit::{ExitCode, coded};
use crate::procfs;
use crate::record::now_ms;
use crate::resource::Resource;
use crate::supervise::{self, Received};
use crate::text::{sanitize, short_duration};

/// Slack kept between SIGKILL and the earliest moment etcd could let the
/// lease expire: this thread waking late on a busy machine, the kill
/// reaching the command, clocks ticking at slightly different rates.
pub const GUARD: Duration = Duration::from_secs(1);

/// How long releasing may take before devlock leaves the lease to expire.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// One lock to take.
#[derive(Debug, Clone)]
pub struct Request {
    pub resource: Resource,
    pub exclusive: bool,
    /// For a group taken on behalf of a member: that member.
    pub via: Option<Resource>,
}

/// Everything the session needs to know, fixed at start.
#[derive(Debug, Clone)]
pub struct Settings {
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
    Started { pid: u32, pidfd: Option<i32> },
    Release,
}

/// How the wait ended.
pub enum Acquired {
    /// Every lock is already held by an ancestor: nothing was taken.
    AllInherited,
    /// Taken (some perhaps passed through).
    Taken,
}

enum FromSession {
    Acquired(Result<Acquired>),
    Released { lost: Option<String> },
}

/// The handle the main thread keeps.
pub struct Session {
    to: mpsc::UnboundedSender<ToSession>,
    from: std::sync::mpsc::Receiver<FromSession>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Session {
    /// Starts the session thread. Call after blocking the handled signals.
    pub fn start(settings: Settings, requests: Vec<Request>) -> Result<Session> {
        let (to, rx) = mpsc::unbounded_channel();
        let (tx, from) = std::sync::mpsc::channel();
        // SAFETY: pthread_self cannot fail.
        let main_thread = unsafe { libc::pthread_self() };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("devlock-etcd".into())
            .spawn(move || {
                let report = move |message: FromSession| {
                    let _ = tx.send(message);
                    // SAFETY: the main thread outlives this one (it joins it).
                    unsafe { libc::pthread_kill(main_thread, supervise::wake_signal()) };
                };
                runtime.block_on(run_session(settings, requests, rx, report));
            })?;
        Ok(Session {
            to,
            from,
            thread: Some(thread),
        })
    }

    /// Waits for every lock, passing a stopping signal on to the session
    /// (which leaves the line and then reports the stop).
    pub fn wait_for_locks(&self) -> Result<Acquired> {
        loop {
            match self.from.try_recv() {
                Ok(FromSession::Acquired(result)) => return result,
                Ok(FromSession::Released { .. }) => unreachable!("released before acquired"),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return Err(anyhow::anyhow!("the etcd session ended unexpectedly"));
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
            }
            if let Some(sig) = supervise::wait_stop_or_wake(Duration::from_secs(3600))
                && sig.signo != supervise::wake_signal()
            {
                let _ = self.to.send(ToSession::Stop(sig));
            }
        }
    }

    /// Tells the session which process to stop if the lease is lost.
    pub fn started(&self, pid: u32) {
        // SAFETY: pidfd_open on our own unreaped child.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let pidfd = (pidfd >= 0).then_some(pidfd as i32);
        let _ = self.to.send(ToSession::Started { pid, pidfd });
    }

    /// Gives the locks back; says why the lease was lost, if it was.
    pub fn release(mut self) -> Option<String> {
        let _ = self.to.send(ToSession::Release);
        let mut lost = None;
        while let Ok(message) = self.from.recv() {
            if let FromSession::Released { lost: why } = message {
                lost = why;
                break;
            }
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        lost
    }
}

/// What the keeper and the waiters share.
struct Shared {
    lost: Mutex<Option<String>>,
    lost_notify: Notify,
    release_notify: Notify,
    /// The command (pid, pidfd) once started, with the moment SIGKILL is due.
    child: Mutex<Option<(u32, Option<i32>)>>,
    confirmed_until: Mutex<Instant>,
    kill_after: Duration,
}

impl Shared {
    fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap().clone()
    }

    async fn wait_lost(&self) -> String {
        loop {
            let notified = self.lost_notify.notified();
            if let Some(why) = self.lost() {
                return why;
            }
            notified.await;
        }
    }
}

async fn run_session(
    settings: Settings,
    requests: Vec<Request>,
    mut rx: mpsc::UnboundedReceiver<ToSession>,
    report: impl Fn(FromSession),
) {
    let config = &settings.config;
    let mut client = match config.connect().await {
        Ok(client) => client,
        Err(e) => return report(FromSession::Acquired(Err(e))),
    };
    let mut pending = Vec::new();
    for request in &requests {
        match inherited(config, &mut client, request).await {
            Ok(true) => {}
            Ok(false) => pending.push(request.clone()),
            Err(e) => return report(FromSession::Acquired(Err(e))),
        }
    }
    if pending.is_empty() {
        return report(FromSession::Acquired(Ok(Acquired::AllInherited)));
    }
    let ttl_secs = settings.ttl.as_secs_f64().ceil() as i64;
    let sent = Instant::now();
    let grant = match config
        .ask("granting a lease", client.lease_grant(ttl_secs, None))
        .await
    {
        Ok(grant) => grant,
        Err(e) => return report(FromSession::Acquired(Err(e))),
    };
    let lease = grant.id();
    let ttl = settings
        .ttl
        .min(Duration::from_secs(grant.ttl().max(0) as u64));
    let shared = Arc::new(Shared {
        lost: Mutex::new(None),
        lost_notify: Notify::new(),
        release_notify: Notify::new(),
        child: Mutex::new(None),
        confirmed_until: Mutex::new(sent + ttl),
        kill_after: settings.kill_after,
    });
    tokio::spawn(keep(client.clone(), lease, settings.ttl, shared.clone()));

    let mut entries = Vec::new();
    let waiting = take_in_order(&settings, &mut client, lease, &pending, &mut entries);
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
        why = shared.wait_lost() => Err(coded(ExitCode::EtcdUnreachable, format!("{why}; left the line"))),
    };
    if let Err(e) = outcome {
        shared.release_notify.notify_one();
        revoke(&mut client, lease).await;
        return report(FromSession::Acquired(Err(e)));
    }
    report(FromSession::Acquired(Ok(Acquired::Taken)));

    let mut labelling = None;
    while let Some(message) = rx.recv().await {
        match message {
            ToSession::Started { pid, pidfd } => {
                *shared.child.lock().unwrap() = Some((pid, pidfd));
                if shared.lost().is_some() {
                    tokio::spawn(stop_command(shared.clone()));
                }
                // Labels only, off the command's path: who runs, since when.
                // A command that is over first does not wait for them.
                let mut labeller = client.clone();
                let labels: Vec<(String, Vec<u8>)> = entries
                    .iter_mut()
                    .map(|(key, entry)| {
                        entry.child = Some(pid);
                        (
                            key.clone(),
                            serde_json::to_vec(&*entry).expect("entries serialise"),
                        )
                    })
                    .collect();
                labelling = Some(tokio::spawn(async move {
                    for (key, value) in labels {
                        let options = PutOptions::new().with_lease(lease);
                        let put = labeller.put(key, value, Some(options));
                        let _ = tokio::time::timeout(RELEASE_TIMEOUT, put).await;
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
    shared.release_notify.notify_one();
    let lost = shared.lost();
    if lost.is_none() {
        revoke(&mut client, lease).await;
    }
    report(FromSession::Released { lost });
}

/// Whether an ancestor of this process already holds `request` (a nested
/// devlock), checked against etcd's line and this machine's processes.
async fn inherited(config: &Config, client: &mut Client, request: &Request) -> Result<bool> {
    let ancestors = ancestors();
    if ancestors.is_empty() {
        return Ok(false);
    }
    let (line, _) = config
        .ask("reading the line", line_of(client, &request.resource))
        .await?;
    let host = super::hostname();
    for place in holders(&line) {
        let Some(entry) = &place.entry else { continue };
        let is_ancestor = entry.host == host
            && ancestors.iter().any(|&(pid, start)| {
                pid == entry.pid && (entry.pid_start.is_none() || entry.pid_start == start)
            });
        if !is_ancestor {
            continue;
        }
        if request.exclusive && !entry.exclusive {
            return Err(coded(
                ExitCode::Busy,
                format!(
                    "{} is held only shared by a devlock this command runs under (pid {}); an exclusive take would wait for itself",
                    request.resource.as_str(),
                    entry.pid
                ),
            ));
        }
        return Ok(true);
    }
    Ok(false)
}

/// This process's ancestors with their start times, when one of them may be
/// a devlock: a devlock set `DEVLOCK_RESOURCES` for its command, or an
/// ancestor runs a program called devlock, or the kernel will not say what
/// it runs. Usually there is none, which spares asking etcd.
fn ancestors() -> Vec<(u32, Option<u64>)> {
    let mut out = Vec::new();
    let mut maybe_nested = std::env::var_os("DEVLOCK_RESOURCES").is_some();
    let mut pid = std::process::id();
    while let Some(parent) = procfs::parent_pid(pid).filter(|&p| p > 1) {
        maybe_nested |= std::fs::read_link(format!("/proc/{parent}/exe"))
            .map_or(true, |exe| exe.to_string_lossy().contains("devlock"));
        out.push((parent, procfs::start_time(parent)));
        pid = parent;
    }
    if !maybe_nested {
        out.clear();
    }
    out
}

/// Joins each line in turn, holding the earlier locks while waiting for the
/// later ones (the requests come in the one global order).
async fn take_in_order(
    settings: &Settings,
    client: &mut Client,
    lease: i64,
    requests: &[Request],
    entries: &mut Vec<(String, Entry)>,
) -> Result<()> {
    let config = &settings.config;
    let deadline = settings.timeout.map(|t| Instant::now() + t);
    let host = super::hostname();
    let user =
        std::env::var("USER").unwrap_or_else(|_| procfs::user_name(nix::unistd::getuid().as_raw()));
    for request in requests {
        let key = key_of(&request.resource, lease);
        let mut entry = Entry {
            step: settings.step.clone(),
            pid: std::process::id(),
            pid_start: procfs::start_time(std::process::id()),
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
        let joined = config
            .ask(
                "joining the line",
                join_line(client, &request.resource, &key, value, lease),
            )
            .await?;
        let started = Instant::now();
        let waited = wait_turn(settings, client, request, &key, joined, deadline).await?;
        entry.granted_ms = Some(now_ms());
        if waited && !settings.quiet {
            eprintln!(
                "devlock: got {} after {}",
                request.resource.as_str(),
                crate::text::human_duration(started.elapsed())
            );
        }
        entries.push((key, entry));
    }
    Ok(())
}

/// Waits until nothing stands before `key` in its line; says whether it had
/// to wait. Sleeps on a watch of the last key in the way, never polls.
async fn wait_turn(
    settings: &Settings,
    client: &mut Client,
    request: &Request,
    key: &str,
    joined: (Vec<Place>, i64),
    deadline: Option<Instant>,
) -> Result<bool> {
    let config = &settings.config;
    let name = request.resource.as_str();
    let started = Instant::now();
    let mut last_report: Option<Instant> = None;
    let mut read = Some(joined);
    loop {
        let (line, revision) = match read.take() {
            Some(line) => line,
            None => {
                config
                    .ask("reading the line", line_of(client, &request.resource))
                    .await?
            }
        };
        let Some(index) = line.iter().position(|p| p.key == key) else {
            return Err(coded(
                ExitCode::EtcdUnreachable,
                format!("our place in line for {name} vanished from etcd (the lease expired)"),
            ));
        };
        let in_the_way = blockers(&line, index);
        let Some(last) = in_the_way.last() else {
            return Ok(last_report.is_some());
        };
        let who = describe_holders(&line);
        if settings.no_wait {
            return Err(coded(
                settings.conflict_code,
                format!("{name} is busy: held by {who}"),
            ));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(coded(
                settings.conflict_code,
                format!(
                    "gave up on {name} after {}: held by {who}",
                    crate::text::human_duration(started.elapsed())
                ),
            ));
        }
        let report_due = last_report.is_none_or(|t| t.elapsed() >= settings.report_every);
        if report_due {
            if !settings.quiet {
                let ahead = in_the_way.len();
                let waited = match last_report {
                    None => String::new(),
                    Some(_) => format!(" (waiting {})", short_duration(started.elapsed())),
                };
                eprintln!(
                    "devlock: waiting for {name}: held by {who}; {ahead} ahead in line{waited}"
                );
            }
            last_report = Some(Instant::now());
        }
        let watched = last.key.clone();
        let next_report = last_report.unwrap_or_else(Instant::now) + settings.report_every;
        let until = deadline.map_or(next_report, |d| d.min(next_report));
        // The watch starts after the revision the line was read at, so a
        // delete between the read and the watch is not missed.
        let options = WatchOptions::new().with_start_revision(revision + 1);
        let watch = async {
            let mut stream = client.watch(watched, Some(options)).await?;
            while let Some(response) = stream.message().await? {
                if response.canceled() {
                    return Ok(false);
                }
                if response
                    .events()
                    .iter()
                    .any(|e| e.event_type() == EventType::Delete)
                {
                    return Ok(true);
                }
            }
            Ok::<_, etcd_client::Error>(false)
        };
        match tokio::time::timeout_at(until.into(), watch).await {
            // The only key in the way is gone; keys created since come
            // after ours, so the line need not be read again.
            Ok(Ok(true)) if in_the_way.len() == 1 => return Ok(true),
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => return Err(config.failure("watching the line", e)),
        }
    }
}

/// `step (pid 12 on host, user) for 3s`, for each holder.
fn describe_holders(line: &[Place]) -> String {
    let now = now_ms();
    let shown: Vec<String> = holders(line)
        .iter()
        .map(|place| match &place.entry {
            Some(e) => {
                let held = now.saturating_sub(e.granted_ms.unwrap_or(e.since_ms));
                format!(
                    "{} (pid {} on {}, {}) for {}",
                    sanitize(&e.step),
                    e.pid,
                    sanitize(&e.host),
                    sanitize(&e.user),
                    short_duration(Duration::from_millis(held))
                )
            }
            None => format!("a key devlock did not write ({})", sanitize(&place.key)),
        })
        .collect();
    shown.join(", ")
}

/// Revokes the lease (every key goes with it); if etcd does not answer, the
/// lease runs out by itself.
async fn revoke(client: &mut Client, lease: i64) {
    let _ = tokio::time::timeout(RELEASE_TIMEOUT, client.lease_revoke(lease)).await;
}

/// Renews the lease every third of its TTL. A renewal counts from when it
/// was sent: etcd restarted the TTL no earlier than that. When no renewal is
/// confirmed in time to stop the command before the lease could expire,
/// marks the lease lost and stops the command.
async fn keep(mut client: Client, lease: i64, ttl: Duration, shared: Arc<Shared>) {
    let renew_every = ttl / 3;
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    let mut next_renew = Instant::now() + renew_every;
    let mut last_error = "no answer".to_owned();
    let mut last_confirmed = Instant::now();
    loop {
        let confirmed_until = *shared.confirmed_until.lock().unwrap();
        let term_at = confirmed_until
            .checked_sub(shared.kill_after + GUARD)
            .unwrap_or(confirmed_until);
        if Instant::now() >= term_at {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next_renew.min(term_at).into()) => {}
            _ = shared.release_notify.notified() => return,
        }
        if Instant::now() >= term_at {
            break;
        }
        let sent = Instant::now();
        let attempt_until = term_at.min(sent + renew_every.max(Duration::from_millis(500)));
        let attempt = async {
            if stream.is_none() {
                stream = Some(client.lease_keep_alive(lease).await?);
            }
            let (keeper, responses) = stream.as_mut().expect("just made");
            keeper.keep_alive().await?;
            responses.message().await
        };
        match tokio::time::timeout_at(attempt_until.into(), attempt).await {
            Ok(Ok(Some(response))) if response.ttl() > 0 => {
                let granted = Duration::from_secs(response.ttl() as u64);
                *shared.confirmed_until.lock().unwrap() = sent + ttl.min(granted);
                last_confirmed = sent;
                next_renew = sent + renew_every;
            }
            Ok(Ok(Some(_))) => {
                last_error = "etcd says the lease no longer exists".to_owned();
                *shared.confirmed_until.lock().unwrap() = Instant::now();
                break;
            }
            outcome => {
                last_error = match outcome {
                    Ok(Err(e)) => super::innermost(&e),
                    Ok(Ok(None)) => "the renewal stream closed".to_owned(),
                    _ => "no answer".to_owned(),
                };
                stream = None;
                next_renew = Instant::now() + Duration::from_millis(200);
            }
        }
    }
    let why = format!(
        "lost the etcd lease: no renewal confirmed for {} ({last_error})",
        crate::text::human_duration(last_confirmed.elapsed())
    );
    *shared.lost.lock().unwrap() = Some(why);
    shared.lost_notify.notify_waiters();
    stop_command(shared).await;
}

/// SIGTERM to the command, then SIGKILL to it and everything under it, both
/// before etcd could let the lease expire and admit someone else.
async fn stop_command(shared: Arc<Shared>) {
    let Some((pid, pidfd)) = *shared.child.lock().unwrap() else {
        return;
    };
    let kill_at = shared
        .confirmed_until
        .lock()
        .unwrap()
        .checked_sub(GUARD)
        .unwrap_or_else(Instant::now);
    let why = shared.lost().unwrap_or_default();
    eprintln!(
        "devlock: {why}; stopping the command before the lock can pass on: SIGTERM now, SIGKILL in {}",
        crate::text::human_duration(kill_at.saturating_duration_since(Instant::now()))
    );
    signal_child(pid, pidfd, libc::SIGTERM);
    tokio::time::sleep_until(kill_at.into()).await;
    for descendant in descendants(pid) {
        // SAFETY: plain kill; a pid gone meanwhile gets ESRCH.
        unsafe { libc::kill(descendant as libc::pid_t, libc::SIGKILL) };
    }
    signal_child(pid, pidfd, libc::SIGKILL);
}

fn signal_child(pid: u32, pidfd: Option<i32>, signal: libc::c_int) {
    // SAFETY: pidfd_send_signal on a pidfd we own names exactly our child,
    // even after it has been reaped; kill(2) is the fallback.
    unsafe {
        match pidfd {
            Some(fd) => {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd,
                    signal,
                    std::ptr::null::<()>(),
                    0,
                );
            }
            None => {
                libc::kill(pid as libc::pid_t, signal);
            }
        }
    }
}

/// Every process under `root`, from /proc's parent links.
fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let links: Vec<(u32, u32)> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, procfs::parent_pid(pid)?)))
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            links
                .iter()
                .filter(|&&(_, pp)| pp == parent)
                .map(|&(p, _)| p),
        );
        i += 1;
    }
    found.remove(0);
    found
}
