//! The etcd side of one run's wait, on its own thread: the places in line
//! and the lease (see `keeper`). The main thread waits for signals and says
//! what the session reports; once every lock is granted, the session hands
//! the lease and its keys over to the watcher (see `keeper::hold`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio::sync::mpsc;

use super::Cluster;
use super::keeper::{self, LeaseState, boot_now, revoke};
use super::nested::passed_through;
use super::taking::{Label, Taken, Taking};
pub(super) use super::wanted::{Fences, Got, Settings, Wanted};
use crate::supervise::{self, Received};
use crate::sys::signal::Thread;

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
    let Some((lease, ttl, state, entries)) =
        acquire(&settings, &cluster, &wanted, &mut rx, &report).await
    else {
        return;
    };
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

/// Waits for every lock, until stopped or the lease is lost, and reports how
/// the wait ended. What holding then needs (the lease, its TTL and state,
/// and each lock taken), or `None` once nothing is held.
async fn acquire(
    settings: &Settings,
    cluster: &Arc<Cluster>,
    wanted: &Wanted,
    rx: &mut mpsc::UnboundedReceiver<ToSession>,
    report: &impl Fn(FromSession),
) -> Option<(i64, Duration, Arc<LeaseState>, Vec<Taken>)> {
    let failed = |e| FromSession::Acquired(Err(e), None);
    let (pending, candidates, count, mut got) = match passed_through(cluster, wanted).await {
        Ok(left) => left,
        Err(e) => {
            report(failed(e));
            return None;
        }
    };
    if pending.is_empty() && count == 0 {
        got.resources.sort();
        report(FromSession::Acquired(Ok(Acquired::AllInherited(got)), None));
        return None;
    }
    let (lease, ttl, state) = match grant_lease(cluster, settings).await {
        Ok(granted) => granted,
        Err(e) => {
            report(failed(e));
            return None;
        }
    };

    let mut entries = Vec::new();
    let say = |line: String| report(FromSession::Say(line));
    let deadline = settings.timeout.and_then(|t| Instant::now().checked_add(t));
    let taking = Taking {
        settings,
        cluster,
        lease,
        label: Label::of_this_process(&settings.step),
        deadline,
        say: &say,
    };
    let waiting = taking.all(
        &pending,
        &candidates,
        count,
        &mut got.resources,
        &mut entries,
    );
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
        revoke(cluster, lease).await;
        report(failed(e));
        return None;
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
    Some((lease, ttl, state, entries))
}

/// Grants the lease and starts its renewals: its id, the TTL counted on and
/// the state the renewals, the waiting and the main thread share.
async fn grant_lease(
    cluster: &Arc<Cluster>,
    settings: &Settings,
) -> Result<(i64, Duration, Arc<LeaseState>)> {
    let ttl_secs = settings.ttl.as_secs_f64().ceil() as i64;
    let sent = boot_now();
    let grant = cluster
        .ask("granting a lease", |mut client| async move {
            client.lease_grant(ttl_secs, None).await
        })
        .await?;
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
    Ok((lease, ttl, state))
}
