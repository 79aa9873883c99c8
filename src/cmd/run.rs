//! `devlock RESOURCE... -- COMMAND`: take every lock, run the command, pass on
//! how it ended.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cli::RunArgs;
use crate::exit::{ExitCode, coded};
use crate::flock::budget;
use crate::flock::dir::ScratchDir;
use crate::flock::take::{self as acquire, Context, Pending, Taken};
use crate::flock::trust;
use crate::gpu::device::DeviceReport;
use crate::gpu::gate as devices;
use crate::interrupt::{self, Stop};
use crate::proc;
use crate::request::Request;
use crate::resource::Resource;
use crate::supervise;
use crate::wait_display::WaitPlan;

pub(crate) fn run(args: &RunArgs, dir_path: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let resources = validate(args)?;
    if args.ttl.is_some() || args.kill_after.is_some() {
        return Err(coded(
            ExitCode::Usage,
            "--ttl and --kill-after apply only with --etcd",
        ));
    }
    // A typo must not wait its turn first.
    let found = supervise::check_command(&args.command[0])?;
    let resources = within_visible_devices(args, resources, probe_timeout)?;
    crate::gpu::cuda::check_mig(&resources, args.any, usize::from(args.count()))?;
    let (totals, seen) = budget_totals(args, &resources, probe_timeout)?;
    // Only the first attempt may use it (one back in line after Ctrl-Z looks again).
    let seen = std::cell::RefCell::new(seen);
    let step = args.step_name();
    supervise::sane_start();
    supervise::block_handled_signals();
    interrupt::hold_job_stops();
    trust::enable();
    trust::note_resources(&resources);
    let dir = ScratchDir::open_or_create(dir_path)?;
    trust::note_dir(&dir);
    let plan = WaitPlan {
        deadline: args.timeout.and_then(|t| Instant::now().checked_add(t)),
        timeout: args.timeout,
        quiet: args.quiet,
        on_terminal: std::io::stderr().is_terminal(),
        report_every: args.report_every,
        conflict_code: ExitCode::Command(i32::from(args.conflict_exit_code)),
        step: step.clone(),
    };
    let context = || Context {
        dir: &dir,
        step: step.clone(),
        no_wait: args.no_wait,
        plan: Some(&plan),
        stop: Stop::default(),
        board: None,
    };
    // A job stop (Ctrl-Z) before the command starts gives up every place and
    // lock taken so far, stops, and once continued starts again at the back.
    let (taken, pending) = loop {
        let mut pending = Pending::default();
        // With --any --require-idle, the idle candidates as of this attempt
        // (one that rejoins the line later looks again).
        let candidates = if args.require_idle && args.any {
            idle_candidates(dir_path, resources.clone(), args, probe_timeout)
        } else {
            Ok(resources.clone())
        };
        let attempt = candidates
            .and_then(|candidates| match args.mem {
                Some(_) => take_budget(
                    &context(),
                    args,
                    &candidates,
                    probe_timeout,
                    seen.borrow_mut().take(),
                    &mut pending,
                ),
                None => take_all(&context(), args, &candidates, &mut pending),
            })
            .and_then(|taken| {
                // On a terminal the waiting line must be gone before anything
                // else is said or the command writes; otherwise the command
                // starts first and the display finishes beside it.
                if pending.must_settle_before_spawn()
                    && let Some(sig) = std::mem::take(&mut pending).settle()
                {
                    return Err(supervise::stopped_before_start(sig));
                }
                if args.require_idle {
                    require_idle(&taken, args.idle_threshold(), probe_timeout)?;
                }
                Ok(taken)
            });
        let sig = match attempt {
            Ok(taken) => match interrupt::take_job_stop() {
                None => break (taken, pending),
                Some(sig) => {
                    if let Some(stop) = pending.settle() {
                        return Err(supervise::stopped_before_start(stop));
                    }
                    drop(taken);
                    sig
                }
            },
            Err(e) => match interrupt::suspended() {
                Some(_) => {
                    drop(pending);
                    interrupt::take_job_stop().unwrap_or(libc::SIGTSTP)
                }
                None => return Err(e),
            },
        };
        trust::flush(args.quiet);
        interrupt::stop_as(sig);
        crate::wait_display::say_back_in_line(&plan, &names_of(&resources));
    };
    if let Some(sig) = supervise::pending_stop() {
        return Err(supervise::stopped_before_start(sig));
    }
    let mut env = child_env(&taken, dir_path, &step, probe_timeout)?;
    let budget_of = budget_held(&taken, args, &totals);
    if let Some((_, mem, total)) = &budget_of {
        env.extend(budget_env(*mem, *total));
    }
    let held: Vec<acquire::Held> = taken
        .into_iter()
        .filter_map(|(_, took)| match took {
            Taken::Held(held) => Some(held),
            Taken::Inherited(_) => None,
        })
        .collect();
    if held.is_empty() {
        trust::flush(args.quiet);
        return Ok(pass_through(&args.command, &env));
    }
    let fds: Vec<_> = held
        .iter()
        .flat_map(acquire::Held::inheritable_fds)
        .collect();
    // The label is there before the command runs (status and anyone who
    // waits see who holds it at once), and names the command once it runs.
    let mut record = context().record();
    for lock in &held {
        lock.label(&record);
    }
    trust::flush(args.quiet);
    let child = supervise::spawn(
        &args.command,
        Some(&found),
        &fds,
        &env,
        supervise::Placement::choose(),
    )?;
    // From here devlock stops with its job (Ctrl-Z), as any job does. A job
    // stop held since the last look before the start was meant for the whole
    // job, which the command is part of now.
    let held_stop = interrupt::take_job_stop();
    interrupt::release_job_stops();
    if let Some(sig) = held_stop {
        child.pass_on_job_stop(sig);
    }
    let signal = pending.settle();
    record.child = Some(child.id());
    record.child_start = proc::process::start_time(child.id());
    for lock in &held {
        lock.label(&record);
    }
    let mut budget_watch = budget_of.map(|(resource, mem, _)| {
        let monitor = budget::Monitor::start(
            &ask_of(args, &resource, probe_timeout),
            vec![child.id()],
            args.settle(),
        );
        budget::Watch {
            strict: args.mem_strict,
            quiet: args.quiet,
            ..budget::Watch::new(monitor, resource, step.clone(), mem, args.settle())
        }
    });
    let mut watch = PathWatch {
        dir: &dir,
        held: &held,
        record: &record,
        warned: false,
        lost: Vec::new(),
    };
    let code = supervise::supervise_watching(child, signal, &mut |tick| {
        if tick == supervise::Tick::Second {
            watch.check();
        }
        if let Some(budget) = budget_watch.as_mut() {
            let actions = match tick {
                supervise::Tick::Second => budget.check(),
                supervise::Tick::Stopped => budget.stopped(),
            };
            act_on_budget(budget, actions, &held, &record);
        }
    });
    drop(watch);
    drop(budget_watch);
    // Let go of the locks before our places in line, so the next in line
    // finds the lock free when it wakes.
    drop(held);
    Ok(code)
}

/// The budget a run holds, if any: its resource, budget and the device's
/// total (none when it runs inside a holder, passing through).
fn budget_held(
    taken: &[(Resource, Taken)],
    args: &RunArgs,
    totals: &[(Resource, u64)],
) -> Option<(Resource, u64, u64)> {
    let mem = args.mem?;
    let (resource, _) = taken.iter().find(|(r, took)| {
        r.gpu_index().is_some() && matches!(took, Taken::Held(h) if h.request.via.is_none())
    })?;
    let total = totals.iter().find(|(r, _)| r == resource)?.1;
    Some((resource.clone(), mem, total))
}

/// What a budget's job learns ([`budget::job_env`]).
fn budget_env(mem: u64, total: u64) -> supervise::Env {
    let mut env = supervise::Env::new();
    for (name, value) in budget::job_env(mem, total) {
        env.push((name.into(), value.into()));
    }
    env
}

/// Does what the budget's watch says: step aside once the job started,
/// mark it over budget (or back under) in its registration, stop it under
/// `--mem-strict` as a signal to devlock would (the first stopping signal
/// goes on to the command).
fn act_on_budget(
    budget: &budget::Watch,
    actions: Vec<budget::Action>,
    held: &[acquire::Held],
    record: &crate::flock::record::Record,
) {
    let Some(hold) = held
        .iter()
        .find(|h| h.request.name == budget.resource && h.request.via.is_none())
    else {
        return;
    };
    for action in actions {
        match action {
            budget::Action::StepAside => hold.step_aside(),
            budget::Action::Relabel(over) => {
                let mut record = record.clone();
                record.over_mib = over;
                hold.label(&record);
            }
            budget::Action::Stop => crate::sys::signal::raise(libc::SIGTERM),
        }
    }
}

/// `gpu:0 gpu:1`
fn names_of(resources: &[Resource]) -> String {
    resources
        .iter()
        .map(Resource::as_str)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Once a second while the command runs: whether each held lock file is
/// still the file its path names. If someone renamed or removed it, the
/// next devlock makes a fresh one and runs beside this job: that is said
/// once on stderr (even with `-q`: exclusion is broken), and registered for
/// status to show as long as this devlock lives.
struct PathWatch<'a> {
    dir: &'a ScratchDir,
    held: &'a [acquire::Held],
    record: &'a crate::flock::record::Record,
    warned: bool,
    lost: Vec<crate::flock::registration::Registration>,
}

impl PathWatch<'_> {
    fn check(&mut self) {
        if self.warned {
            return;
        }
        for held in self.held {
            for file in held.files() {
                let name = &held.request.name;
                if file.still_at_path(self.dir) {
                    continue;
                }
                self.warned = true;
                crate::tty::say_while_command_runs(&format!(
                    "devlock: warning: {} no longer names the file this job holds (someone renamed or \
                     removed it); another devlock may now take {name} beside this one\n",
                    file.path().display()
                ));
                if let Ok(reg) = crate::flock::registration::Registration::create(
                    self.dir,
                    name,
                    self.record,
                    crate::flock::registration::Kind::Lost,
                ) {
                    self.lost.push(reg);
                }
                return;
            }
        }
    }
}

/// The resources, checked against the caller's CUDA_VISIBLE_DEVICES: a GPU
/// outside it is a usage error, and `--any` skips the candidates outside it.
fn within_visible_devices(
    args: &RunArgs,
    resources: Vec<Resource>,
    probe_timeout: Duration,
) -> Result<Vec<Resource>> {
    if !crate::gpu::cuda::concerns(&resources) {
        return Ok(resources);
    }
    let Some(visible) = crate::gpu::cuda::Visible::from_env(probe_timeout)? else {
        return Ok(resources);
    };
    if args.any {
        return visible.filter_candidates(&resources, usize::from(args.count()));
    }
    visible.check(&resources)?;
    Ok(resources)
}

/// The locks a command line asks for, in the one global order (sorted lock
/// file names) whatever order the user wrote, so two jobs naming the same
/// resources can never each hold what the other waits for. A member `G:M`
/// also takes its group `G` shared, so a holder of the whole group excludes
/// every member and members run side by side.
fn take_all(
    ctx: &Context,
    args: &RunArgs,
    resources: &[Resource],
    pending: &mut Pending,
) -> Result<Vec<(Resource, Taken)>> {
    let exclusive = !args.shared;
    let slots = u64::from(args.slots.unwrap_or(0));
    // An --any candidate's group comes with the candidate that wins.
    let (fixed, candidates): (Vec<Request>, Vec<Request>) = if args.any {
        let candidates = resources
            .iter()
            .map(|resource| Request {
                name: resource.clone(),
                exclusive,
                via: None,
                slots,
            })
            .collect();
        (Vec::new(), candidates)
    } else {
        (
            crate::request::in_order(resources, exclusive, slots),
            Vec::new(),
        )
    };
    let mut taken = Vec::new();
    for request in &fixed {
        let (took, waited) = acquire::take(ctx, request)?;
        pending.add(waited)?;
        taken.push((request.name.clone(), took));
    }
    if args.any {
        let chosen =
            crate::flock::any::take_any(ctx, &candidates, usize::from(args.count()), pending)?;
        for took in chosen {
            let name = match &took {
                Taken::Held(held) => held.request.name.clone(),
                Taken::Inherited(lock) => {
                    Resource::from_lock_path(lock.path()).expect("a lock file of ours")
                }
            };
            taken.push((name, took));
        }
    }
    Ok(taken)
}

/// What a `--mem` request asks of `gpu:N`.
fn ask_of(args: &RunArgs, resource: &Resource, probe_timeout: Duration) -> budget::Ask {
    budget::Ask {
        index: resource.gpu_index().expect("validated: gpu:N"),
        mem_mib: args.mem.unwrap_or(0),
        headroom_mib: args.mem_headroom(),
        probe_timeout,
        seen: None,
    }
}

/// [`take_all`] with a memory budget: the group `gpu` shared as for any
/// member, then the budget on `gpu:N` (with `--any`, on the first
/// candidate that admits it).
fn take_budget(
    ctx: &Context,
    args: &RunArgs,
    resources: &[Resource],
    probe_timeout: Duration,
    seen: Option<Seen>,
    pending: &mut Pending,
) -> Result<Vec<(Resource, Taken)>> {
    let ask = |r: &Resource| budget::Ask {
        seen: seen.clone(),
        ..ask_of(args, r, probe_timeout)
    };
    let mut taken = Vec::new();
    if args.any {
        let asks: Vec<(Request, budget::Ask)> = resources
            .iter()
            .map(|r| (budget_request(r), ask(r)))
            .collect();
        for (name, took) in budget::take_any(ctx, &asks, pending)? {
            taken.push((name, took));
        }
        return Ok(taken);
    }
    for request in crate::request::in_order(resources, false, 0) {
        let (took, waited) = if request.via.is_none() {
            budget::take(ctx, &request, &ask(&request.name))?
        } else {
            acquire::take(ctx, &request)?
        };
        pending.add(waited)?;
        taken.push((request.name.clone(), took));
    }
    Ok(taken)
}

/// A budget's request on `gpu:N`: the lock shared.
fn budget_request(resource: &Resource) -> Request {
    Request {
        name: resource.clone(),
        exclusive: false,
        via: None,
        slots: 0,
    }
}

pub(crate) fn validate(args: &RunArgs) -> Result<Vec<Resource>> {
    let usage = |message: &str| Err(coded(ExitCode::Usage, message.to_owned()));
    if args.resources.is_empty() {
        return usage("missing RESOURCE: usage: devlock [OPTIONS] RESOURCE... -- COMMAND...");
    }
    if args.command.is_empty() {
        return usage(
            "missing `-- COMMAND`: put the command after `--`, as in `devlock gpu -- python train.py`",
        );
    }
    let mut resources = Resource::parse_all(&args.resources)?;
    crate::cli::refuse_subcommand_names(&resources)?;
    resources.sort();
    resources.dedup();
    if args.no_wait && args.timeout.is_some() {
        return usage(
            "--no-wait and --timeout contradict each other: -n fails at once, -w DURATION \
             waits up to DURATION; give one of them",
        );
    }
    crate::request::check_count(args.count(), args.count.is_some(), args.any, &resources)?;
    if args.idle_threshold.is_some() && !args.require_idle {
        return usage(
            "--idle-threshold needs --require-idle: it is the memory --require-idle lets a \
             process outside the gate hold",
        );
    }
    if args.conflict_exit_code == 0 {
        return usage(
            "--conflict-exit-code 0 would report a busy lock as success; give 1-255 \
             (75 by default)",
        );
    }
    if args.report_every < Duration::from_millis(10) {
        return usage("--report-every must be at least 10ms");
    }
    crate::request::check_slots(args.slots, args.any, args.shared, &resources)?;
    validate_mem(args, &resources)?;
    if args.require_idle
        && !resources
            .iter()
            .any(|r| devices::gpu_indices(r, &[]).is_some())
    {
        return usage("--require-idle needs a GPU resource (gpu or gpu:N) to check");
    }
    Ok(resources)
}

/// `--mem` and its companions, by the rules the library shares
/// ([`budget::check_usage`]).
fn validate_mem(args: &RunArgs, resources: &[Resource]) -> Result<()> {
    budget::check_usage(&budget::Shape {
        mem: args.mem,
        companions: args.mem_headroom.is_some() || args.settle.is_some() || args.mem_strict,
        shared: args.shared,
        slots: args.slots.is_some(),
        any: args.any,
        count: args.count(),
        resources,
    })
}

/// With `--mem`: each candidate's total memory, asked once before any wait
/// ([`budget::totals`]).
fn budget_totals(
    args: &RunArgs,
    resources: &[Resource],
    probe_timeout: Duration,
) -> Result<(Totals, Option<Seen>)> {
    let Some(mem) = args.mem else {
        return Ok((Vec::new(), None));
    };
    let (totals, seen) = budget::totals(mem, args.mem_headroom(), resources, probe_timeout)?;
    Ok((totals, Some(seen)))
}

/// A probe's answer and when it came.
type Seen = budget::Seen;

/// Each `--mem` candidate's total memory, MiB.
type Totals = Vec<(Resource, u64)>;

/// With `--any --require-idle`: the candidates whose GPUs run no work
/// outside the gate now, so that the first of them to be free is taken, not
/// the first free one. Too few idle is exit 69, naming why for each; the
/// one taken is checked again once held.
fn idle_candidates(
    dir_path: &Path,
    candidates: Vec<Resource>,
    args: &RunArgs,
    probe_timeout: Duration,
) -> Result<Vec<Resource>> {
    let report = crate::status::model::gather(dir_path, &[], Some(probe_timeout))?;
    let info = report.device_info.unwrap_or(DeviceReport::NoInfo);
    let mut idle = Vec::new();
    let mut reasons = Vec::new();
    for candidate in &candidates {
        match devices::not_idle_reason(&info, candidate, args.idle_threshold()) {
            Some(reason) => reasons.push(reason),
            None => idle.push(candidate.clone()),
        }
    }
    let count = usize::from(args.count());
    if idle.len() >= count {
        return Ok(idle);
    }
    let names: Vec<&str> = candidates.iter().map(Resource::as_str).collect();
    let how_many = if count == 1 {
        "none of them is idle".to_owned()
    } else {
        format!("{} of them are idle, --count asks for {count}", idle.len())
    };
    Err(coded(
        ExitCode::NotIdle,
        format!(
            "--any {} --require-idle: {how_many}: {}",
            names.join(" "),
            reasons.join(" | ")
        ),
    ))
}

/// Fails fast, with the lock released, when a GPU the resources map to runs
/// work outside the gate or cannot be checked. Never waits and retries: a
/// person decides what to do about the intruder.
fn require_idle(
    taken: &[(Resource, Taken)],
    threshold_mib: u64,
    probe_timeout: Duration,
) -> Result<()> {
    let table = proc::locks::LockTable::read().unwrap_or_default();
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
            return Err(coded(ExitCode::NotIdle, reason));
        }
    }
    Ok(())
}

/// Replaces devlock with the command: the inherited lock already covers it.
pub(crate) fn pass_through(command: &[OsString], env: &supervise::Env) -> ExitCode {
    supervise::discard_wakes();
    // An empty mask unblocks what block_handled_signals blocked.
    crate::sys::signal::set_mask(&crate::sys::signal::SigSet::empty());
    let err = std::process::Command::new(&command[0])
        .args(&command[1..])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .exec();
    let err = supervise::cannot_start(&command[0], &err);
    eprintln!("devlock: {err:#}");
    crate::exit::exit_code_of(&err)
}

/// What the command learns about its locks: the resources it got (the
/// members an `--any` chose, not the groups taken on their behalf), the
/// matching CUDA devices, and its semaphore slot.
fn child_env(
    taken: &[(Resource, Taken)],
    dir: &Path,
    step: &str,
    probe_timeout: Duration,
) -> Result<supervise::Env> {
    let mut got = Vec::new();
    let mut slot = None;
    for (resource, took) in taken {
        if let Taken::Held(held) = took {
            if held.request.via.is_some() {
                continue;
            }
            slot = slot.or(held.slot().map(|s| s.number));
        }
        got.push(resource);
    }
    let names: Vec<&str> = got.iter().map(|r| r.as_str()).collect();
    // Absolute, so that a nested devlock that changed directory meets the
    // same gate, and byte for byte as given (not every path is UTF-8).
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    let mut env = supervise::Env::new();
    env.push(("DEVLOCK_RESOURCES".into(), names.join(" ").into()));
    env.push(("DEVLOCK_DIR".into(), dir.into_os_string()));
    env.push(("DEVLOCK_STEP".into(), step.into()));
    if let Some(slot) = slot {
        env.push(("DEVLOCK_SLOT".into(), slot.to_string().into()));
    }
    // A MIG instance is named to CUDA by its UUID, which only the probe knows.
    let gpu_env = match got.iter().find(|r| r.mig_parent().is_some()) {
        Some(instance) => {
            crate::gpu::cuda::mig_env(instance, &crate::gpu::source::probe(probe_timeout).report)?
        }
        None => crate::gpu::cuda::child_env(got),
    };
    for (name, value) in gpu_env {
        env.push((name.into(), value.into()));
    }
    Ok(env)
}
