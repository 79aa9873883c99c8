//! `devlock RESOURCE... -- COMMAND`: take every lock, run the command, pass on
//! how it ended.

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cli::RunArgs;
use crate::exit::{ExitCode, coded};
use crate::flock::budget::watch::{Action, Monitor, Watch};
use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Context, Held, Taken};
use crate::flock::record::Record;
use crate::flock::registration::{Kind, Registration};
use crate::flock::trust::Notes;
use crate::gpu::device::DeviceReport;
use crate::gpu::gate as devices;
use crate::interrupt::{self, Stop};
use crate::plan::Plan;
use crate::proc::locks::LockTable;
use crate::proc::process::start_time;
use crate::resource::Resource;
use crate::supervise;
use crate::take::Takes;
use crate::wait_display::{WaitDisplay, WaitPlan};

pub(crate) fn run(args: &RunArgs, dir_path: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let began = Instant::now();
    let mut plan = Plan::from_args(args, probe_timeout)?;
    Plan::refuse_lease_flags(args)?;
    // A typo must not wait its turn first.
    let found = supervise::check_command(&args.command[0])?;
    plan.look()?;
    let resources = plan.resources.clone();
    // Only the first attempt may use it (one back in line after Ctrl-Z looks again).
    let mut seen = plan.budget.as_ref().and_then(|b| b.seen.clone());
    let step = args.step_name();
    supervise::sane_start();
    supervise::block_handled_signals();
    // Before any lock file is open: the guard must never hold one.
    let guard = supervise::Guard::start();
    interrupt::hold_job_stops();
    let mut dir = ScratchDir::open_or_create(dir_path)?;
    crate::known::check(&dir, &resources, args.new, args.quiet)?;
    let notes = Notes::new(&mut dir, &resources);
    let dir = dir;
    let wait_plan = WaitPlan {
        deadline: args.timeout.and_then(|t| Instant::now().checked_add(t)),
        timeout: args.timeout,
        quiet: args.quiet,
        on_terminal: std::io::stderr().is_terminal(),
        report_every: args.report_every,
        conflict_code: ExitCode::Command(i32::from(args.conflict_exit_code)),
        step: step.clone(),
        made: dir.made().clone(),
    };
    // A job stop (Ctrl-Z) before the command starts gives up every place and
    // lock taken so far, stops, and once continued starts again at the back.
    let (taken, display) = loop {
        let display = WaitDisplay::new(&wait_plan, &notes);
        let context = Context {
            dir: &dir,
            step: step.clone(),
            no_wait: args.no_wait,
            stop: Stop::default(),
            observer: &display,
        };
        // With --any --require-idle, the idle candidates as of this attempt
        // (one that rejoins the line later looks again).
        let candidates = match plan.idle_threshold {
            Some(threshold) if plan.any => {
                idle_candidates(dir_path, resources.clone(), &plan, threshold)
            }
            _ => Ok(resources.clone()),
        };
        let attempt = candidates
            .and_then(|candidates| Takes::new(&plan, &candidates, &[]))
            .and_then(|takes| takes.take(&context, seen.take(), false))
            .and_then(|taken| {
                // On a terminal the waiting line must be gone before anything
                // else is said or the command writes; otherwise the command
                // starts first and the display finishes beside it.
                if display.must_settle_before_spawn()
                    && let Some(sig) = display.settle()
                {
                    return Err(supervise::stopped_before_start(sig));
                }
                if let Some(threshold) = plan.idle_threshold {
                    require_idle(&taken, threshold, probe_timeout)?;
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
        notes.flush(args.quiet);
        interrupt::stop_as(sig);
        crate::wait_display::say_back_in_line(&wait_plan, &names_of(&resources));
    };
    if let Some(sig) = supervise::pending_stop() {
        return Err(supervise::stopped_before_start(sig));
    }
    // Nothing stops it now: `got ...` may be said.
    display.command_starts();
    let mut env = child_env(&taken, dir_path, &step, probe_timeout)?;
    let budget_of = budget_held(&taken, &plan);
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
        notes.flush(args.quiet);
        drop(guard);
        return Ok(supervise::pass_through(&args.command, &env));
    }
    let fds: Vec<_> = held.iter().flat_map(Held::inheritable_fds).collect();
    // The label is there before the command runs (status and anyone who
    // waits see who holds it at once), and names the command once it runs.
    let mut record = Record::for_this_process(&step);
    let waited = began.elapsed();
    // Named now, made only if the job runs `devlock busy`.
    let busy = crate::usage::idle::BusyFile::for_holder(record.pid, record.pid_start);
    env.push((
        crate::usage::idle::BUSY_ENV.into(),
        busy.path.into_os_string(),
    ));
    for lock in &held {
        notes.line(lock.label(&record));
    }
    notes.flush(args.quiet);
    let child = supervise::spawn(
        &args.command,
        Some(&found),
        &fds,
        &env,
        supervise::Placement::choose(),
        guard,
    )?;
    // From here devlock stops with its job (Ctrl-Z), as any job does. A job
    // stop held since the last look before the start was meant for the whole
    // job, which the command is part of now.
    let held_stop = interrupt::take_job_stop();
    interrupt::release_job_stops();
    if let Some(sig) = held_stop {
        child.pass_on_job_stop(sig);
    }
    let signal = display.settle();
    drop(display);
    record.child = Some(child.id());
    record.child_start = start_time(child.id());
    for lock in &held {
        notes.line(lock.label(&record));
    }
    notes.flush(args.quiet);
    // After the start, off the take's path: the usage record and sampler.
    let mut usage = crate::usage::track::Tracker::start(&crate::usage::track::Hold {
        resources: resources_of(&held),
        step: step.clone(),
        pid: record.pid,
        pid_start: record.pid_start,
        boot_id: record.boot_id.clone(),
        start_ms: record.since_ms,
        waited,
        mem_mib: budget_of.as_ref().map(|(_, mem, _)| *mem),
        idle_timeout: args
            .idle_timeout
            .or_else(|| crate::usage::idle::site_default(&dir)),
        from: "cli",
        roots: vec![record.pid, child.id()],
        probe_timeout,
        quiet: args.quiet,
    });
    let label = std::cell::RefCell::new(record.clone());
    let mut budget_watch = budget_of.map(|(resource, mem, _)| {
        let b = plan.budget.as_ref().expect("a budget held was planned");
        let ask = b.ask(&resource, probe_timeout, None);
        let monitor = Monitor::start(&ask, vec![child.id()], b.settle);
        Watch {
            strict: b.strict,
            quiet: args.quiet,
            ..Watch::new(monitor, resource, step.clone(), mem, b.settle)
        }
    });
    let mut watch = PathWatch {
        dir: &dir,
        held: &held,
        record: &record,
        warned: false,
        lost: Vec::new(),
        self_wait_warned: false,
    };
    let (code, guard) = supervise::supervise_watching(child, signal, &mut |tick| {
        if tick == supervise::Tick::Second {
            watch.check();
            act_on_usage(usage.tick(), &held, &label, args.quiet);
        }
        if let Some(budget) = budget_watch.as_mut() {
            let actions = match tick {
                supervise::Tick::Second => budget.check(),
                supervise::Tick::Stopped => budget.stopped(),
            };
            act_on_budget(budget, actions, &held, &label);
        }
    });
    drop(watch);
    let over_budget = budget_watch.as_ref().is_some_and(|b| b.stopped);
    drop(budget_watch);
    // Let go of the locks before our places in line, so the next in line
    // finds the lock free when it wakes; the dismissed guard is reaped last.
    drop(held);
    // How it ended, for the usage record (an idle stop is the tracker's to say).
    let (how, status, signo) = match code {
        ExitCode::Command(c) => (crate::usage::How::Exit, Some(c), None),
        ExitCode::Signal(s) => (crate::usage::How::Signal, None, Some(s)),
        ExitCode::Success => (crate::usage::How::Exit, Some(0), None),
        _ => (crate::usage::How::Error, None, None),
    };
    let how = if over_budget {
        crate::usage::How::OverBudget
    } else {
        how
    };
    usage.finish(how, status, signo);
    drop(guard);
    Ok(code)
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
fn budget_env(mem: u64, total: u64) -> supervise::Env {
    let mut env = supervise::Env::new();
    for (name, value) in crate::flock::budget::job_env(mem, total) {
        env.push((name.into(), value.into()));
    }
    env
}

/// Does what the budget's watch says: step aside once the job started,
/// mark it over budget (or back under) in its registration, stop it under
/// `--mem-strict` as a signal to devlock would (the first stopping signal
/// goes on to the command).
fn act_on_budget(
    budget: &Watch,
    actions: Vec<Action>,
    held: &[Held],
    label: &std::cell::RefCell<Record>,
) {
    let Some(hold) = held
        .iter()
        .find(|h| h.request.name == budget.resource && h.request.via.is_none())
    else {
        return;
    };
    for action in actions {
        match action {
            Action::StepAside => hold.step_aside(),
            Action::Relabel(over) => {
                let mut record = label.borrow_mut();
                record.over_mib = over;
                let _ = hold.label(&record);
            }
            Action::Stop => crate::sys::signal::raise(libc::SIGTERM),
        }
    }
}

/// Does what the usage tracker's tick says: the idle label on every held
/// lock, the idle warning, and the idle stop (as a signal to devlock would).
fn act_on_usage(
    tick: crate::usage::track::Tick,
    held: &[Held],
    label: &std::cell::RefCell<Record>,
    quiet: bool,
) {
    use crate::usage::idle::Act;
    if let Some(idle) = tick.relabel {
        let mut record = label.borrow_mut();
        record.idle_since_ms = idle;
        for hold in held {
            let _ = hold.label(&record);
        }
    }
    for act in tick.acts {
        match act {
            Act::Warn(text) if !quiet => crate::tty::say_while_command_runs(&text),
            Act::Warn(_) => {}
            Act::Stop(text) => {
                crate::tty::say_while_command_runs(&text);
                crate::sys::signal::raise(libc::SIGTERM);
            }
        }
    }
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

/// Once a second while the command runs: whether each held lock file is
/// still the file its path names. If someone renamed or removed it, the
/// next devlock makes a fresh one and runs beside this job: that is said
/// once on stderr (even with `-q`: exclusion is broken), and registered for
/// status to show as long as this devlock lives.
struct PathWatch<'a> {
    dir: &'a ScratchDir,
    held: &'a [Held],
    record: &'a Record,
    warned: bool,
    lost: Vec<Registration>,
    /// Whether the command was found waiting for a lock this job holds.
    self_wait_warned: bool,
}

impl PathWatch<'_> {
    fn check(&mut self) {
        self.check_self_wait();
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
                    crate::text::show_path(file.path())
                ));
                if let Ok(reg) = Registration::create(self.dir, name, self.record, Kind::Lost) {
                    self.lost.push(reg);
                }
                return;
            }
        }
    }

    /// A lock file that holds somebody's data (`--dir . Cargo` with a
    /// `Cargo.lock`) may be one the command locks itself (cargo does): it
    /// then waits for this job's own hold for ever. Said once, naming it;
    /// looked for only where such a file is held, so a plain run reads
    /// nothing more.
    fn check_self_wait(&mut self) {
        let Some(child) = self.record.child else {
            return;
        };
        if self.self_wait_warned || self.held.iter().all(Held::labelled) {
            return;
        }
        let Ok(table) = crate::proc::locks::LockTable::read() else {
            return;
        };
        for held in self.held.iter().filter(|h| !h.labelled()) {
            let file = held.lock();
            let waiter = table.blocked(file.id()).map(|l| l.pid).find(|&pid| {
                pid == child || crate::proc::process::ancestors(pid).any(|(p, _)| p == child)
            });
            let Some(pid) = waiter else { continue };
            self.self_wait_warned = true;
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|comm| crate::text::sanitize(comm.trim_end()))
                .unwrap_or_else(|_| "a process".to_owned());
            crate::tty::say_while_command_runs(&format!(
                "devlock: warning: {name} (pid {pid}), part of this job, waits for a lock on {}, \
                 which this job holds as {}: it will wait for ever; name the lock after no file \
                 the command locks itself (e.g. devlock --dir . build -- ...)\n",
                crate::text::show_path(file.path()),
                held.request.name
            ));
            return;
        }
    }
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
    let report = crate::status::model::gather(dir_path, &[], Some(plan.probe_timeout))?;
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
            return Err(coded(ExitCode::NotIdle, reason));
        }
    }
    Ok(())
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
            if held.request.via.is_some() || held.request.for_group {
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
