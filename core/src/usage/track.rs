//! A hold's usage, from the command's start to its end: the start line, the
//! sampler, the idle policy, progress lines and the end line; the one
//! piece the command line's supervisor and the library's hold both drive,
//! once a second.

use std::time::{Duration, Instant, SystemTime};

use super::idle::{BusyFile, Policy};
use super::sample::{Job, Now, Sampler};
use super::{How, Log, Measured, PROGRESS_EVERY, Start, VERSION, job_id};
use crate::hold_event::HoldEvent;
use crate::resource::Resource;

/// What a hold is, for its usage (the facts its record is written from).
#[derive(Debug, Clone)]
pub struct HoldFacts {
    pub resources: Vec<Resource>,
    pub step: String,
    /// The holder (devlock, or the library's process) and its start time.
    pub pid: u32,
    pub pid_start: u64,
    pub boot_id: Option<String>,
    pub start_ms: u64,
    pub waited: Duration,
    pub mem_mib: Option<u64>,
    pub idle_timeout: Option<Duration>,
    /// Where its records go ([`super::dir_for`]); `None`: nowhere.
    pub usage_dir: Option<std::path::PathBuf>,
    /// `cli` or `python`.
    pub from: &'static str,
    /// The processes whose trees are the job's.
    pub roots: Vec<u32>,
    pub probe_timeout: Duration,
    pub quiet: bool,
}

/// The usage of one hold while it runs.
#[derive(Debug)]
pub struct Tracker {
    log: Option<Log>,
    sampler: Option<Sampler>,
    policy: Option<Policy>,
    busy: Option<BusyFile>,
    last_progress: Instant,
    labelled: Option<u64>,
    stopped_idle: bool,
    /// A library hold kept past its block's end: when the block ended.
    pub kept_since_ms: Option<u64>,
}

/// Whether a hold's usage needs a process beside the command while it
/// runs: only to sample GPUs (for its record or its idle policy). Without
/// one, the start line is all that is written ([`start_line`]) and readers
/// observe the end later, from the kernel (the holder is gone).
pub fn needs_watch(hold: &HoldFacts) -> bool {
    let job = Job {
        resources: hold.resources.clone(),
        roots: Vec::new(),
        period: super::sample::DEFAULT_PERIOD,
        probe_timeout: hold.probe_timeout,
        busy_file: None,
    };
    job.has_gpus() && (hold.usage_dir.is_some() || hold.idle_timeout.is_some())
}

/// The start line alone, for a hold nothing watches, in the file opened
/// before the take: what to say when it cannot be written.
pub fn start_record(hold: &HoldFacts, opened: super::Opened) -> Option<HoldEvent> {
    Log::start_in(&start_of(hold), opened)
        .err()
        .map(|why| HoldEvent::NoRecord { why })
}

fn start_of(hold: &HoldFacts) -> Start {
    let mut gpus: Vec<u32> = hold
        .resources
        .iter()
        .filter_map(|r| crate::gpu::gate::gpu_indices(r, &[]))
        .flatten()
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    Start {
        v: VERSION,
        job: job_id(hold.boot_id.as_deref(), hold.pid, hold.pid_start),
        resources: hold.resources.iter().map(|r| r.to_string()).collect(),
        gpus,
        step: hold.step.clone(),
        pid: hold.pid,
        pid_start: hold.pid_start,
        boot_id: hold.boot_id.clone(),
        host: super::host(),
        start_ms: hold.start_ms,
        waited_ms: hold.waited.as_millis() as u64,
        mem_mib: hold.mem_mib,
        idle_timeout_s: hold.idle_timeout.map(|d| d.as_secs().max(1)),
        from: hold.from.to_owned(),
    }
}

impl Tracker {
    /// Writes the start line and starts the sampler (for GPU resources);
    /// with what to say when the start line cannot be written.
    pub fn start(hold: &HoldFacts) -> (Tracker, Option<HoldEvent>) {
        let names: Vec<String> = hold.resources.iter().map(|r| r.to_string()).collect();
        let start = start_of(hold);
        let (log, no_record) = match Log::start(&start, hold.usage_dir.as_deref()) {
            Ok(log) => (log, None),
            Err(why) => (None, Some(HoldEvent::NoRecord { why })),
        };
        let busy = Some(BusyFile::for_holder(hold.pid, hold.pid_start));
        let job = Job {
            resources: hold.resources.clone(),
            roots: hold.roots.clone(),
            period: super::sample::period(hold.idle_timeout),
            probe_timeout: hold.probe_timeout,
            busy_file: busy.as_ref().map(|b| b.path.clone()),
        };
        let sampler = job.has_gpus().then(|| Sampler::start(job)).flatten();
        let policy = hold
            .idle_timeout
            .filter(|_| sampler.is_some())
            .map(|t| Policy::new(t, names.join(" "), hold.step.clone()));
        let tracker = Tracker {
            log,
            sampler,
            policy,
            busy,
            last_progress: Instant::now(),
            labelled: None,
            stopped_idle: false,
            kept_since_ms: None,
        };
        (tracker, no_record)
    }

    fn now(&self) -> Now {
        self.sampler.as_ref().map(Sampler::now).unwrap_or_default()
    }

    /// Once a second: a progress line when due, the idle mark
    /// ([`HoldEvent::IdleMark`]) and what the idle policy says.
    pub(crate) fn tick(&mut self) -> Vec<HoldEvent> {
        let mut events = Vec::new();
        let Some(sampler) = &self.sampler else {
            self.progress_if_due(Measured::default);
            return events;
        };
        let now = sampler.now();
        self.progress_if_due(|| now.measured.clone());
        if !now.answered {
            return events;
        }
        let mut idle_since = now.idle_since;
        if let Some(kept) = self.kept_since_ms {
            // Kept past its block's end: idle since then, whatever the GPU does.
            let ended = std::time::UNIX_EPOCH + Duration::from_millis(kept);
            idle_since = Some(idle_since.map_or(ended, |i| i.min(ended)));
        }
        let idle_ms = idle_since.map(super::ms_of);
        if idle_ms != self.labelled {
            self.labelled = idle_ms;
            events.push(HoldEvent::IdleMark(idle_ms));
        }
        if let Some(policy) = self.policy.as_mut() {
            let said = policy.check(idle_since, SystemTime::now());
            if said.iter().any(HoldEvent::is_stop) {
                self.stopped_idle = true;
            }
            events.extend(said);
        }
        events
    }

    fn progress_if_due(&mut self, measured: impl FnOnce() -> Measured) {
        if self.last_progress.elapsed() < PROGRESS_EVERY {
            return;
        }
        self.last_progress = Instant::now();
        if let Some(log) = &self.log {
            log.progress(measured());
        }
    }

    /// The end line: how it ended (an idle stop, said by the policy, wins
    /// over the signal that stop sent).
    pub fn finish(self, how: How, code: Option<i32>, signal: Option<i32>) {
        let measured = self.now().measured;
        if let Some(busy) = &self.busy {
            busy.remove();
        }
        let how = if self.stopped_idle { How::Idle } else { how };
        if let Some(log) = &self.log {
            log.end(how, code, signal, self.kept_since_ms, measured);
        }
    }
}
