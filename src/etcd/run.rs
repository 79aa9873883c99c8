//! `devlock --etcd URL RESOURCE... -- COMMAND`: the same run as with lock
//! files, with the locks in etcd and the command tied to the lease.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::Config;
use super::keeper::GUARD;
use super::session::{Acquired, Got, Session, Settings, Wanted};
use crate::cli::RunArgs;
use crate::exit::{ExitCode, coded};
use crate::plan::Plan;
use crate::request::Request;
use crate::resource::Resource;
use crate::supervise::{self, Received};

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

/// Runs `args`'s command under the locks of `plan` (built from `args`).
pub(crate) fn run(plan: &mut Plan, args: &RunArgs, config: Config) -> Result<ExitCode> {
    let (ttl, kill_after) = check_margins(args, config.endpoints.len())?;
    supervise::check_command(&args.command[0])?;
    // This machine's part, as with lock files: the caller's
    // CUDA_VISIBLE_DEVICES (--any skips candidates outside it), one MIG
    // instance per command.
    plan.look()?;
    let step = args.step_name();
    supervise::sane_start();
    supervise::block_handled_signals();
    super::block_sigpipe();
    // Before the session's connections: the guard holds nothing of devlock's.
    let guard = super::parent::Guard::start();
    let settings = Settings {
        config,
        ttl,
        kill_after,
        no_wait: args.no_wait,
        timeout: args.timeout,
        quiet: args.quiet,
        report_every: args.report_every,
        conflict_code: ExitCode::Command(i32::from(args.conflict_exit_code)),
        step: step.clone(),
        command: args.command_line(),
    };
    let mut session = Session::start(settings, wanted(plan)?)?;
    let (acquired, stopped) = session.wait_for_locks()?;
    let env = match child_env(acquired.got(), &step, plan.probe_timeout) {
        Ok(env) => env,
        Err(e) => {
            session.release();
            return Err(e);
        }
    };
    if let Acquired::AllInherited(_) = acquired {
        session.finish();
        drop(guard);
        return Ok(supervise::pass_through(&args.command, &env));
    }
    if let Some(sig) = stopped.or_else(supervise::pending_stop) {
        session.release();
        return Err(supervise::stopped_before_start(sig));
    }
    if session.lease_lost() {
        let why = session.release().unwrap_or_default();
        return Err(coded(
            ExitCode::EtcdUnreachable,
            format!("{why}; the command was not started"),
        ));
    }
    // What the command starts stays under devlock, even when its parent
    // exits first: the lock covers it, and a lost lease stops it.
    crate::sys::process::become_subreaper();
    let child = match spawn_tied(&args.command, &env, guard) {
        Ok(child) => child,
        Err(e) => {
            session.release();
            return Err(e);
        }
    };
    session.started(child.id());
    let (code, signal) = super::parent::supervise_reaping(child, None, true);
    wait_for_what_it_left(signal, kill_after, args.quiet, &|| session.lease_lost());
    match session.release() {
        None => Ok(code),
        Some(why) => Err(coded(
            ExitCode::LeaseLost,
            format!(
                "{why}; everything under devlock was stopped because the lock no longer \
                 protected it (the command {})",
                match code {
                    ExitCode::Signal(n) => format!("was killed by signal {n}"),
                    other => format!("ended with exit status {}", other.code()),
                }
            ),
        )),
    }
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
            return Err(coded(
                ExitCode::Usage,
                format!(
                    "--any with --etcd cannot take {group} and {candidate} as candidates: \
                     {candidate} holds {group} shared; name candidates of one level"
                ),
            ));
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
fn child_env(got: &Got, step: &str, probe_timeout: Duration) -> Result<supervise::Env> {
    let names: Vec<&str> = got.resources.iter().map(Resource::as_str).collect();
    let mut env: supervise::Env = vec![
        ("DEVLOCK_RESOURCES".into(), names.join(" ").into()),
        ("DEVLOCK_STEP".into(), step.into()),
        (
            "DEVLOCK_FENCE".into(),
            fences(&got.resources, &got.fences).into(),
        ),
    ];
    if let Some(slot) = got.slot {
        env.push(("DEVLOCK_SLOT".into(), slot.to_string().into()));
    }
    // What `etcdctl lock` tells its command, for the first resource, so
    // scripts written for it run unchanged (a nested take passes its
    // enclosing one's on).
    if let Some(key) = &got.lock_key {
        let first = got.resources.first();
        let fence = got.fences.iter().find(|(name, _)| Some(name) == first);
        env.push(("ETCD_LOCK_KEY".into(), key.into()));
        if let Some((_, fence)) = fence {
            env.push(("ETCD_LOCK_REV".into(), fence.to_string().into()));
        }
    }
    let gpu_env = match got.resources.iter().find(|r| r.mig_parent().is_some()) {
        Some(instance) => {
            crate::gpu::cuda::mig_env(instance, &crate::gpu::source::probe(probe_timeout).report)?
        }
        None => crate::gpu::cuda::child_env(&got.resources),
    };
    env.extend(gpu_env.into_iter().map(|(k, v)| (k.into(), v.into())));
    Ok(env)
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

/// Holds the lock until every process the command started has exited too,
/// as the inherited descriptor does with the file backend. A stopping
/// signal goes to all of them (one from a terminal only to those it did not
/// reach, outside devlock's process group), the one the command got
/// included; a second one, or `kill_after` later, SIGKILL. A lost lease
/// kills them from the session thread.
fn wait_for_what_it_left(
    first: Option<Received>,
    kill_after: Duration,
    quiet: bool,
    lease_lost: &dyn Fn() -> bool,
) {
    let own_group = crate::sys::process::own_group();
    let mut signalled: Option<Instant> = None;
    let forward = |sig: Received, signalled: &mut Option<Instant>| {
        if signalled.is_some() {
            crate::proc::process::signal_descendants(libc::SIGKILL);
            return;
        }
        let skip = (!sig.from_process).then_some(own_group);
        crate::proc::process::signal_descendants_outside(sig.signo, skip);
        *signalled = Some(Instant::now());
    };
    let mut first = first;
    let mut said = quiet;
    let mut empty_looks = 0;
    loop {
        // Reaps any child of ours (devlock is their subreaper).
        match crate::sys::process::poll_child(None, false) {
            // Nothing left under devlock.
            Ok(None) => return,
            Ok(Some((_, crate::sys::process::ChildState::Running))) => {}
            Ok(Some(_)) => continue,
            Err(e) => {
                eprintln!(
                    "devlock: cannot wait for what the command left behind: {}",
                    crate::proc::os_text(&e)
                );
                return;
            }
        }
        if let Some(sig) = first.take() {
            forward(sig, &mut signalled);
        }
        if !said && !lease_lost() {
            let left = crate::proc::process::live_descendants(std::process::id());
            // The last one may have died between the reap and this look
            // (a zombie is not listed): reap again rather than name nobody.
            if left.is_empty() && empty_looks < 3 {
                empty_looks += 1;
                continue;
            }
            if left.is_empty() {
                said = true;
                continue;
            }
            eprintln!(
                "devlock: the command has exited; holding the lock until what it started has too (pid {})",
                left.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            said = true;
        }
        let timeout = signalled.map(|t| kill_after.saturating_sub(t.elapsed()));
        if timeout.is_some_and(|t| t.is_zero()) {
            crate::proc::process::signal_descendants(libc::SIGKILL);
        }
        match supervise::wait_signal(timeout.filter(|t| !t.is_zero())) {
            Some(sig) if sig.signo != libc::SIGCHLD => forward(sig, &mut signalled),
            _ => {}
        }
    }
}

/// The TTL and kill grace, checked so SIGKILL lands at least [`GUARD`] before
/// the lease could expire, with at least one renewal period before SIGTERM,
/// and for a cluster (several endpoints) an [`ELECTION`] more.
fn check_margins(args: &RunArgs, endpoints: usize) -> Result<(Duration, Duration)> {
    let usage = |m: String| Err(coded(ExitCode::Usage, m));
    if args.require_idle {
        return usage(crate::messages::etcd::require_idle_refused());
    }
    if args.mem.is_some() {
        return usage(crate::messages::etcd::mem_refused());
    }
    let ttl = args.ttl.unwrap_or(DEFAULT_TTL);
    let kill_after = args.kill_after.unwrap_or(DEFAULT_KILL_AFTER);
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

/// Starts the command so that it dies with devlock: the lease dies with
/// devlock, and the command must not outlive the lock that covers it. The
/// kernel sends it SIGKILL when devlock's main thread ends, however it ends,
/// and the job's guard ends its process group then, as for the flock
/// backend.
fn spawn_tied(
    command: &[OsString],
    env: &supervise::Env,
    guard: Option<super::parent::Guard>,
) -> Result<super::parent::Child> {
    let placement = super::parent::Placement::choose();
    let (own_group, terminal) = placement.spawn_settings();
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)));
    super::parent::Child::start_with(placement, guard, |group| {
        if own_group {
            cmd.process_group(group.unwrap_or(0));
        }
        crate::sys::process::tie_to_parent(&mut cmd, terminal);
        cmd.spawn().map(|child| child.id())
    })
    .map_err(|e| supervise::cannot_start(&command[0], &e))
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
        argv.extend(["r", "--", "true"]);
        check_margins(
            &crate::cli::Cli::try_parse_from(argv).unwrap().run,
            endpoints,
        )
    }

    #[test]
    fn the_ttl_must_cover_the_kill_grace() {
        assert!(margins(&[]).is_ok());
        assert!(margins(&["--ttl", "3s", "--kill-after", "500ms"]).is_ok());
        assert!(margins(&["--ttl", "3s", "--kill-after", "2s"]).is_err());
        assert!(margins(&["--ttl", "1s", "--kill-after", "0s"]).is_err());
        assert!(margins(&["--any", "r2"]).is_ok());
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
