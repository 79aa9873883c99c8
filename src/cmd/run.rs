//! `devlock RESOURCE... -- COMMAND`: take every lock, run the command, pass on
//! how it ended.

use std::io::IsTerminal;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cli::RunPlan;
use crate::exit::ExitCode;
use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Context, Held, Taken};
use crate::flock::record::Record;
use crate::flock::trust::Notes;
use crate::gpu::device::DeviceReport;
use crate::gpu::gate as devices;
use crate::interrupt::{self, Stop};
use crate::job_env::JobEnv;
use crate::plan::Plan;
use crate::proc::locks::LockTable;
use crate::resource::Resource;
use crate::supervise;
use crate::take::Takes;
use crate::wait_display::{BeforeWait, WaitDisplay, WaitPlan};

/// Takes every lock of `plan` and becomes its command. (`plan` by value:
/// [`Plan::look`] refines its locks in place.)
pub(crate) fn run(mut plan: RunPlan) -> Result<ExitCode> {
    let began = Instant::now();
    // A typo must not wait its turn first.
    let found = supervise::check_command(&plan.command[0])?;
    plan.locks.look()?;
    let plan = plan;
    supervise::sane_start();
    supervise::block_handled_signals();
    interrupt::hold_job_stops();
    let mut dir = ScratchDir::open_or_create(&plan.dir)?;
    let resources = &plan.locks.resources;
    crate::known::check(&dir, resources, plan.new_names, plan.quiet)?;
    let notes = Notes::new(&mut dir, resources).without_setup_warning(!plan.setup_warning);
    let dir = dir;
    let idle_timeout = crate::usage::idle::within_site(plan.idle_timeout, &dir, resources)?;
    // Opened as a wait begins: a take that waited then writes its start
    // line in one write after the grant (see usage::Opened); one that did
    // not wait opens it after the grant, as before, and a nested take that
    // passes through, or a busy `-n`, never.
    let open = || crate::usage::Opened::open(crate::usage::dir_for(Some(&dir)));
    let usage = std::sync::OnceLock::new();
    let open_usage = || {
        usage.get_or_init(open);
    };
    let taken = take_all(&plan, &dir, &notes, BeforeWait(&open_usage))?;
    let usage = usage.into_inner().unwrap_or_else(open);
    let mut env = child_env(&taken, &plan.dir, &plan.step, plan.locks.probe_timeout)?;
    let budget_of = budget_held(&taken, &plan.locks);
    if let Some((_, mem, total)) = &budget_of {
        env.extend(budget_env(*mem, *total));
    }
    let held: Vec<Held> = taken
        .into_iter()
        .filter_map(|(_, took)| match took {
            Taken::Held(held) => Some(held),
            Taken::Inherited(_) => None,
        })
        .collect();
    if held.is_empty() {
        crate::status::notes::say_notes(&notes, plan.quiet);
        interrupt::release_job_stops();
        return Ok(supervise::pass_through(&plan.command, &env));
    }
    let job = Job {
        plan: &plan,
        dir: &dir,
        notes: &notes,
        held: &held,
        waited: began.elapsed(),
        idle_timeout,
        budget_of,
        usage,
    };
    start_watched(job, &mut env);
    crate::status::notes::say_notes(&notes, plan.quiet);
    // The place in line goes as the command starts (the next in line then
    // waits in the kernel for the lock itself), but for a budget's, which
    // its watcher gives up once the job settled; the queue file stays open
    // in the command, after the lock's, for the agreement on the slot count.
    for lock in held.iter().filter(|h| !h.is_budget()) {
        lock.step_aside();
    }
    // A job stop held back since the last look (or while a warning was said) is the job's: it stops
    // here, holding, and goes on to the exec once continued.
    let held_stop = interrupt::take_job_stop();
    interrupt::release_job_stops();
    if let Some(sig) = held_stop {
        interrupt::stop_as(sig);
    }
    // The lock files apart from the rest (a shared holder's label), to be
    // let go of before the places in line (see supervise::exec).
    let locks: Vec<_> = held
        .iter()
        .flat_map(Held::files)
        .map(|l| l.file().as_fd())
        .collect();
    let is_lock = |fd: &BorrowedFd| locks.iter().any(|l| l.as_raw_fd() == fd.as_raw_fd());
    let labels: Vec<_> = held
        .iter()
        .flat_map(Held::inheritable_fds)
        .filter(|fd| !is_lock(fd))
        .collect();
    let after: Vec<_> = held.iter().filter_map(Held::line_fd).collect();
    Ok(supervise::exec(
        &plan.command,
        Some(&found),
        &labels,
        &locks,
        &after,
        &env,
    ))
}

/// Waits for and takes every lock of `plan`, showing the wait, and returns
/// them once nothing can stop the command from starting. A job stop
/// (Ctrl-Z) before the command starts gives up every place and lock taken
/// so far, stops, and once continued starts again at the back.
fn take_all(
    plan: &RunPlan,
    dir: &ScratchDir,
    notes: &Notes,
    before_wait: BeforeWait,
) -> Result<Vec<(Resource, Taken)>> {
    let locks = &plan.locks;
    let resources = &locks.resources;
    // Only the first attempt may use it (one back in line after Ctrl-Z looks again).
    let mut seen = locks.budget.as_ref().and_then(|b| b.seen.clone());
    let wait_plan = WaitPlan {
        deadline: plan.timeout().and_then(|t| Instant::now().checked_add(t)),
        timeout: plan.timeout(),
        quiet: plan.quiet,
        on_terminal: std::io::stderr().is_terminal(),
        report_every: plan.report_every,
        step: plan.step.clone(),
        made: dir.made().clone(),
    };
    let (taken, display) = loop {
        let display = WaitDisplay::new(&wait_plan, notes, before_wait);
        let context = Context {
            dir,
            step: plan.step.clone(),
            no_wait: plan.no_wait(),
            stop: Stop::default(),
            observer: &display,
        };
        // With --any --require-idle, the idle candidates as of this attempt
        // (one that rejoins the line later looks again).
        let candidates = match locks.idle_threshold {
            Some(threshold) if locks.any => {
                idle_candidates(&plan.dir, resources.clone(), locks, threshold)
            }
            _ => Ok(resources.clone()),
        };
        let attempt = candidates
            .and_then(|candidates| Takes::new(locks, &candidates, &[]))
            .and_then(|takes| {
                takes
                    .take(&context, seen.take(), false)
                    .map_err(|e| crate::messages::busy::worded(dir, e))
            })
            .and_then(|taken| {
                // On a terminal the waiting line must be gone before anything
                // else is said or the command writes; otherwise the command
                // starts first and the display finishes beside it.
                if display.must_settle_before_spawn()
                    && let Some(sig) = display.settle()
                {
                    return Err(supervise::stopped_before_start(sig));
                }
                if let Some(threshold) = locks.idle_threshold {
                    require_idle(&taken, threshold, locks.probe_timeout)?;
                }
                Ok(taken)
            });
        drop(context);
        let sig = match attempt {
            Ok(taken) => match interrupt::take_job_stop() {
                None => break (taken, display),
                Some(sig) => {
                    if let Some(stop) = display.settle() {
                        return Err(supervise::stopped_before_start(stop));
                    }
                    drop(taken);
                    sig
                }
            },
            Err(e) => match interrupt::suspended() {
                Some(_) => {
                    drop(display);
                    interrupt::take_job_stop().unwrap_or(libc::SIGTSTP)
                }
                None => return Err(e),
            },
        };
        crate::status::notes::say_notes(notes, plan.quiet);
        interrupt::stop_as(sig);
        crate::wait_display::say_back_in_line(&wait_plan, &names_of(resources));
    };
    if let Some(sig) = supervise::pending_stop() {
        return Err(supervise::stopped_before_start(sig));
    }
    // Nothing stops it now: `got ...` may be said, and is, before the exec
    // (no thread of devlock's outlives it).
    display.command_starts();
    if let Some(sig) = display.settle() {
        return Err(supervise::stopped_before_start(sig));
    }
    Ok(taken)
}

/// A job about to start holding its locks: what its usage record, its
/// watcher and its notes are made from.
struct Job<'a> {
    plan: &'a RunPlan,
    dir: &'a ScratchDir,
    notes: &'a Notes,
    held: &'a [Held],
    waited: Duration,
    /// `--idle-timeout`, or the site's.
    idle_timeout: Option<Duration>,
    /// The budget held: its resource, MiB, and the device's total.
    budget_of: Option<(Resource, u64, u64)>,
    /// This user's usage file, opened before the take.
    usage: crate::usage::Opened,
}

/// Labels the held locks, starts the job's usage record and, where the job
/// needs one, its watcher; adds `DEVLOCK_BUSY_FILE` to `env`.
fn start_watched(job: Job, env: &mut crate::job_env::Env) {
    let Job {
        plan,
        dir,
        notes,
        held,
        waited,
        idle_timeout,
        budget_of,
        usage,
    } = job;
    let (step, probe_timeout) = (&plan.step, plan.locks.probe_timeout);
    // The label names this process, which the command becomes: its pid and
    // start time are the command's (execve keeps both).
    let record = Record::for_this_process(step);
    let hold = crate::usage::track::HoldFacts {
        resources: resources_of(held),
        step: step.clone(),
        pid: record.pid,
        pid_start: record.pid_start,
        boot_id: record.boot_id.clone(),
        start_ms: record.since_ms,
        waited,
        mem_mib: budget_of.as_ref().map(|(_, mem, _)| *mem),
        idle_timeout,
        usage_dir: usage.dir().map(std::path::Path::to_path_buf),
        from: "cli",
        roots: vec![record.pid],
        probe_timeout,
        quiet: plan.quiet,
    };
    for lock in held {
        notes.line(lock.label(&record));
    }
    let watch = crate::watcher::Duties {
        usage: crate::usage::track::needs_watch(&hold),
        budget: budget_of.map(|(resource, mem, _)| {
            let b = plan
                .locks
                .budget
                .as_ref()
                .expect("a budget held was planned");
            (
                b.ask(&resource, probe_timeout, None),
                resource,
                mem,
                b.strict,
                b.settle,
            )
        }),
        paths: notes.renamable() || !held.iter().all(Held::labelled),
    };
    // Named now (its token drawn before the watcher forks, which names the
    // same file), made only if the job runs `devlock busy`; named only to a
    // job whose watcher reads it and removes it at the end: an unwatched
    // hold's job gets an empty name, and `devlock busy` there does nothing
    // (nor is a token drawn for it, between the grant and the command).
    let busy = match watch.usage {
        true => crate::usage::idle::BusyFile::for_holder(record.pid, record.pid_start)
            .path
            .into_os_string(),
        false => Default::default(),
    };
    env.push((crate::usage::idle::BUSY_ENV.into(), busy));
    // The start line is the watcher's where it samples; else this process's
    // (a watcher for the lock files alone writes none).
    if !watch.usage {
        crate::watcher::start_line(&hold, usage);
    }
    if watch.any()
        && let Err(e) = crate::watcher::start(watch, &hold, dir, held, &record, plan.quiet)
    {
        eprintln!(
            "devlock: warning: no watcher for this job ({}): it runs without its usage \
             sampling, idle policy, memory watch and lock-file checks",
            crate::proc::os_text(&e)
        );
    }
}

/// The budget a run holds, if any: its resource, budget and the device's
/// total (none when it runs inside a holder, passing through).
fn budget_held(taken: &[(Resource, Taken)], plan: &Plan) -> Option<(Resource, u64, u64)> {
    let budget = plan.budget.as_ref()?;
    let (resource, _) = taken.iter().find(|(r, took)| {
        r.gpu_index().is_some() && matches!(took, Taken::Held(h) if h.request.via.is_none())
    })?;
    let total = budget.totals.iter().find(|(r, _)| r == resource)?.1;
    Some((resource.clone(), budget.mem_mib, total))
}

/// What a budget's job learns ([`budget::job_env`]).
fn budget_env(mem: u64, total: u64) -> crate::job_env::Env {
    let mut env = crate::job_env::Env::new();
    for (name, value) in crate::flock::budget::job_env(mem, total) {
        env.push((name.into(), value.into()));
    }
    env
}

/// The resources a run holds, as its usage record names them: what it
/// asked for, or the members an `--any` took (not their groups).
fn resources_of(held: &[Held]) -> Vec<Resource> {
    let mut names: Vec<Resource> = held
        .iter()
        .filter(|h| h.request.via.is_none() && !h.request.for_group)
        .map(|h| h.request.name.clone())
        .collect();
    names.dedup();
    names
}

/// `gpu:0 gpu:1`
fn names_of(resources: &[Resource]) -> String {
    resources
        .iter()
        .map(Resource::as_str)
        .collect::<Vec<_>>()
        .join(" ")
}

/// With `--any --require-idle`: the candidates whose GPUs run no work
/// outside the gate now, so that the first of them to be free is taken, not
/// the first free one. Too few idle is exit 69, naming why for each; the
/// one taken is checked again once held.
fn idle_candidates(
    dir_path: &Path,
    candidates: Vec<Resource>,
    plan: &Plan,
    threshold_mib: u64,
) -> Result<Vec<Resource>> {
    let report = crate::view::gather(dir_path, &[], Some(plan.probe_timeout))?;
    let info = report.device_info.unwrap_or(DeviceReport::NoInfo);
    let mut idle = Vec::new();
    let mut reasons = Vec::new();
    for candidate in &candidates {
        match devices::not_idle_reason(&info, candidate, threshold_mib) {
            Some(reason) => reasons.push(reason),
            None => idle.push(candidate.clone()),
        }
    }
    let count = usize::from(plan.count);
    if idle.len() >= count {
        return Ok(idle);
    }
    let names: Vec<&str> = candidates.iter().map(Resource::as_str).collect();
    let how_many = if count == 1 {
        "none of them is idle".to_owned()
    } else {
        format!("{} of them are idle, --count asks for {count}", idle.len())
    };
    Err(crate::error::device(format!(
        "--any {} --require-idle: {how_many}: {}",
        names.join(" "),
        reasons.join(" | ")
    )))
}

/// Fails fast, with the lock released, when a GPU the resources map to runs
/// work outside the gate or cannot be checked. Never waits and retries: a
/// person decides what to do about the intruder.
fn require_idle(
    taken: &[(Resource, Taken)],
    threshold_mib: u64,
    probe_timeout: Duration,
) -> Result<()> {
    let table = LockTable::read().unwrap_or_default();
    let me = std::process::id();
    let gates: Vec<devices::Gate> = taken
        .iter()
        .map(|(resource, took)| {
            let lock = match took {
                Taken::Held(held) => held.lock(),
                Taken::Inherited(lock) => lock,
            };
            devices::Gate {
                resource: resource.clone(),
                lock: lock.id(),
                holder_pids: table
                    .holders(lock.id())
                    .map(|l| l.pid)
                    .chain([me])
                    .collect(),
            }
        })
        .collect();
    let info = devices::probe(probe_timeout, &gates);
    for (resource, took) in taken {
        let is_intention = matches!(took, Taken::Held(h) if h.request.via.is_some());
        if is_intention {
            continue;
        }
        if let Some(reason) = devices::not_idle_reason(&info, resource, threshold_mib) {
            return Err(crate::error::device(reason));
        }
    }
    Ok(())
}

/// What the command learns about its locks ([`JobEnv`]): the resources it
/// got (the members an `--any` chose, not the groups taken on their
/// behalf), the matching GPU devices, and its semaphore slot.
fn child_env(
    taken: &[(Resource, Taken)],
    dir: &Path,
    step: &str,
    probe_timeout: Duration,
) -> Result<crate::job_env::Env> {
    let mut got = Vec::new();
    let mut slot = None;
    for (resource, took) in taken {
        if let Taken::Held(held) = took {
            if held.request.via.is_some() || held.request.for_group {
                continue;
            }
            slot = slot.or(held.slot().map(|s| s.number));
        }
        got.push(resource);
    }
    let job = JobEnv {
        resources: got,
        step,
        dir: Some(dir),
        slot,
        fences: None,
        lock_key: None,
    };
    job.vars(probe_timeout)
}
