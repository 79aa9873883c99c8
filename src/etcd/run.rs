//! `devlock --etcd URL RESOURCE... -- COMMAND`: the same run as with lock
//! files, with the locks in etcd: once they are granted, devlock hands the
//! lease to a watcher (which keeps it, and stops the job should it be lost)
//! and execs the command, as with lock files.

use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

use super::Config;
use super::keeper::GUARD;
use super::session::{Acquired, Got, Session, Settings, Wanted};
use crate::cli::RunPlan;
use crate::exit::ExitCode;
use crate::job_env::JobEnv;
use crate::plan::Plan;
use crate::request::Request;
use crate::resource::Resource;
use crate::supervise;

/// The shortest TTL etcd grants with its default timing.
const MIN_TTL: Duration = Duration::from_secs(2);
/// The longest lease etcd grants (its MaxLeaseTTL).
const MAX_TTL: Duration = Duration::from_secs(9_000_000_000);
const DEFAULT_TTL: Duration = Duration::from_secs(10);
const DEFAULT_KILL_AFTER: Duration = Duration::from_secs(2);
/// What a leader election may take etcd, with its default timing (a
/// 1 s election timeout, randomised up to twice that), for a cluster's
/// renewals to ride out: the time a leader that died or was cut off goes
/// unnoticed, and the vote.
const ELECTION: Duration = Duration::from_secs(2);

/// Runs `plan`'s command under its locks: waits for them with the session
/// on a thread, hands the lease over to a watcher, and becomes the command.
pub(crate) fn run(mut plan: RunPlan, config: Config) -> Result<ExitCode> {
    let (ttl, kill_after) = check_margins(&plan, config.endpoints.len())?;
    let found = supervise::check_command(&plan.command[0])?;
    // This machine's part, as with lock files: the caller's
    // CUDA_VISIBLE_DEVICES (--any skips candidates outside it), one MIG
    // instance per command.
    plan.locks.look()?;
    let step = plan.step.clone();
    supervise::sane_start();
    supervise::block_handled_signals();
    super::block_sigpipe();
    let settings = Settings {
        config,
        ttl,
        kill_after,
        no_wait: plan.no_wait(),
        timeout: plan.timeout(),
        quiet: plan.quiet,
        report_every: plan.report_every,
        step: step.clone(),
        command: plan
            .command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
    };
    let mut session = Session::start(settings, wanted(&plan.locks)?)?;
    let (acquired, stopped) = session.wait_for_locks()?;
    let env = match child_env(acquired.got(), &step, plan.locks.probe_timeout) {
        Ok(env) => env,
        Err(e) => {
            session.release();
            return Err(e);
        }
    };
    if let Acquired::AllInherited(_) = acquired {
        session.finish();
        return Ok(supervise::pass_through(&plan.command, &env));
    }
    if let Some(sig) = stopped.or_else(supervise::pending_stop) {
        session.release();
        return Err(supervise::stopped_before_start(sig));
    }
    if session.lease_lost() {
        let why = session.release().unwrap_or_default();
        return Err(crate::error::etcd(
            crate::error::EtcdKind::Unreachable,
            format!("{why}; the command was not started"),
        ));
    }
    let (watchers_end, commands_end) = match super::job::descriptor() {
        Ok(ends) => ends,
        Err(e) => {
            session.release();
            return Err(cannot_watch(e));
        }
    };
    // The session's thread and runtime end here, with every connection:
    // this process has one thread again, to fork the watcher from, and the
    // command inherits no socket.
    let held = session
        .hand_over()
        .ok_or_else(|| anyhow::anyhow!("the etcd session ended unexpectedly"))?;
    let lease = held.lease;
    let config = held.config.clone();
    let (commands_fd, pid) = (commands_end.as_raw_fd(), std::process::id());
    let started = crate::watcher::start_with(move |command| {
        keep_for(held, watchers_end.into_job(command, pid, commands_fd));
    });
    if let Err(e) = started {
        // Nobody would keep the lease: the command must not run.
        give_back(config, lease);
        return Err(cannot_watch(e));
    }
    Ok(supervise::exec(
        &plan.command,
        Some(&found),
        &[commands_end.as_fd()],
        &[],
        &[],
        &env,
    ))
}

/// What the session takes for `plan`: its locks in the global order, or
/// with `--any` the candidates' groups (shared) and the candidates.
fn wanted(plan: &Plan) -> Result<Wanted> {
    if !plan.any {
        return Ok(Wanted {
            fixed: plan.in_order(),
            candidates: Vec::new(),
            count: 0,
            members: plan.resources.clone(),
        });
    }
    // One key per resource and lease: a candidate that is another's group
    // would be that key twice.
    for candidate in &plan.resources {
        if let Some(group) = candidate
            .held_shared()
            .into_iter()
            .find(|g| plan.resources.contains(g))
        {
            return Err(crate::error::usage(format!(
                "--any with --etcd cannot take {group} and {candidate} as candidates: \
                     {candidate} holds {group} shared; name candidates of one level"
            )));
        }
    }
    let mut groups: Vec<Request> = Vec::new();
    for resource in &plan.resources {
        for group in resource.held_shared() {
            if !groups.iter().any(|g| g.name == group) {
                groups.push(Request {
                    name: group,
                    exclusive: false,
                    via: Some(resource.clone()),
                    slots: 0,
                    for_group: false,
                });
            }
        }
    }
    groups.sort_by(|a, b| a.name.cmp(&b.name));
    let exclusive = plan.exclusive();
    Ok(Wanted {
        fixed: groups,
        candidates: plan
            .resources
            .iter()
            .map(|r| Request {
                name: r.clone(),
                exclusive,
                via: None,
                slots: 0,
                for_group: false,
            })
            .collect(),
        count: usize::from(plan.count),
        members: Vec::new(),
    })
}

/// What the command learns: the resources it got, their fencing tokens, its
/// slot, and the device variables for the GPUs among them, as this
/// machine's driver numbers them (a MIG instance's UUID from its NVML).
fn child_env(got: &Got, step: &str, probe_timeout: Duration) -> Result<crate::job_env::Env> {
    // A nested take passes its enclosing one's key on.
    let lock_key = got.lock_key.as_ref().map(|key| {
        let first = got.resources.first();
        let fence = got.fences.iter().find(|(name, _)| Some(name) == first);
        (key.clone(), fence.map(|(_, fence)| *fence))
    });
    let job = JobEnv {
        resources: got.resources.iter().collect(),
        step,
        dir: None,
        slot: got.slot,
        fences: Some(fences(&got.resources, &got.fences)),
        lock_key,
    };
    job.vars(probe_timeout)
}

/// `DEVLOCK_FENCE`: each resource's fencing token, in the order of
/// `DEVLOCK_RESOURCES`.
fn fences(resources: &[Resource], fences: &super::session::Fences) -> String {
    resources
        .iter()
        .filter_map(|r| fences.iter().find(|(name, _)| name == r))
        .map(|(_, fence)| fence.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// In the watcher: keeps the lease until the job has ended (see
/// `keeper::hold`).
fn keep_for(held: super::keeper::Held, job: super::job::Job) {
    let job = Arc::new(job);
    let waiter = job.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let waiting = std::thread::Builder::new()
        .name("devlock-job".into())
        .spawn(move || waiter.wait_for_the_end());
    match (runtime, waiting) {
        (Ok(runtime), Ok(_)) => runtime.block_on(super::keeper::hold(held, job)),
        (Err(e), _) | (_, Err(e)) => {
            // The lease would run out under the job: it must not run on.
            eprintln!(
                "devlock: cannot keep the etcd lease ({}); stopping the command",
                crate::proc::os_text(&e)
            );
            job.signal(libc::SIGKILL);
        }
    }
}

/// Gives a lease back that nobody will keep (the watcher did not start).
fn give_back(config: Config, lease: i64) {
    if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        runtime.block_on(super::keeper::revoke(
            &super::cluster::Cluster::new(config),
            lease,
        ));
    }
}

/// The watcher could not be started: nobody would keep the lease.
fn cannot_watch(err: std::io::Error) -> anyhow::Error {
    crate::error::other(format!(
        "cannot start the watcher that keeps the etcd lease ({}); the command was not started",
        crate::proc::os_text(&err)
    ))
}

/// The TTL and kill grace, checked so SIGKILL lands at least [`GUARD`] before
/// the lease could expire, with at least one renewal period before SIGTERM,
/// and for a cluster (several endpoints) an [`ELECTION`] more.
fn check_margins(plan: &RunPlan, endpoints: usize) -> Result<(Duration, Duration)> {
    let usage = |m: String| Err(crate::error::usage(m));
    if plan.locks.idle_threshold.is_some() {
        return usage(crate::messages::etcd::require_idle_refused());
    }
    if plan.locks.budget.is_some() {
        return usage(crate::messages::etcd::mem_refused());
    }
    let ttl = plan.lease.ttl.unwrap_or(DEFAULT_TTL);
    let kill_after = plan.lease.kill_after.unwrap_or(DEFAULT_KILL_AFTER);
    if ttl < MIN_TTL || ttl > MAX_TTL {
        return usage(format!(
            "--ttl must be between {}s and {}s",
            MIN_TTL.as_secs(),
            MAX_TTL.as_secs()
        ));
    }
    let election = if endpoints > 1 {
        ELECTION
    } else {
        Duration::ZERO
    };
    let needed = kill_after.checked_add(GUARD + election + ttl / 3);
    if needed.is_none_or(|needed| needed > ttl) {
        let also = if endpoints > 1 {
            format!(", {}s for a leader election", ELECTION.as_secs())
        } else {
            String::new()
        };
        return usage(format!(
            "--ttl {} is too short for --kill-after {}: the TTL must cover the kill grace, \
             {}s of slack{also} and a third of itself (try --ttl {:.0}s)",
            humantime::format_duration(ttl),
            humantime::format_duration(kill_after),
            GUARD.as_secs(),
            ((kill_after.as_secs_f64() + (GUARD + election).as_secs_f64()) * 1.5).ceil()
        ));
    }
    Ok((ttl, kill_after))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn margins(extra: &[&str]) -> Result<(Duration, Duration)> {
        margins_with(1, extra)
    }

    fn margins_with(endpoints: usize, extra: &[&str]) -> Result<(Duration, Duration)> {
        let mut argv = vec!["devlock"];
        argv.extend(extra);
        // gpu:0, for --mem and --require-idle to pass the command line's
        // rules and meet etcd's.
        argv.extend(["gpu:0", "--", "true"]);
        let args = crate::cli::Cli::try_parse_from(argv).unwrap().run;
        let plan = RunPlan::from_args(&args, "/nonexistent".as_ref(), Duration::ZERO, true)?;
        check_margins(&plan, endpoints)
    }

    #[test]
    fn the_ttl_must_cover_the_kill_grace() {
        assert!(margins(&[]).is_ok());
        assert!(margins(&["--ttl", "3s", "--kill-after", "500ms"]).is_ok());
        assert!(margins(&["--ttl", "3s", "--kill-after", "2s"]).is_err());
        assert!(margins(&["--ttl", "1s", "--kill-after", "0s"]).is_err());
        assert!(margins(&["--any", "gpu:1"]).is_ok());
        assert!(margins(&["--slots", "2"]).is_ok());
        assert!(margins(&["--require-idle"]).is_err());
        let err = margins(&["--mem", "1GiB"]).unwrap_err();
        assert!(format!("{err:#}").contains("measured"), "{err:#}");
        assert!(margins(&["--kill-after", "18446744073709551615s"]).is_err());
        assert!(margins(&["--ttl", "1000years"]).is_err());
    }

    #[test]
    fn a_cluster_leaves_time_for_an_election() {
        assert!(margins_with(3, &[]).is_ok());
        assert!(margins(&["--ttl", "5s"]).is_ok());
        let err = margins_with(3, &["--ttl", "5s"]).unwrap_err();
        assert!(format!("{err:#}").contains("leader election"), "{err:#}");
        assert!(format!("{err:#}").contains("try --ttl 8s"), "{err:#}");
        assert!(margins_with(3, &["--ttl", "8s"]).is_ok());
    }
}
