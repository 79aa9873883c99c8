//! The holder's sampler: a thread that asks the GPU source (NVML, else
//! nvidia-smi) every [`period`] what the held GPUs compute and what the
//! job's processes use on them, for its usage record and its idle policy.
//!
//! Per sample and held GPU, over the time since the sample before: the GPU
//! computed for `utilization.gpu` percent of it (NVML's
//! `nvmlDeviceGetUtilizationRates`, the share of its last sample period in
//! which a kernel ran; nvidia-smi's `utilization.gpu`, the same counter),
//! and it was idle for the job when that is 0 or when none of the job's
//! processes is on it. A GPU whose utilization the source cannot say (a
//! MIG GPU) counts neither busy nor idle while the job has a process on
//! it.

use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime};

use crate::gpu::device::DeviceReport;
use crate::gpu::gate::gpu_indices;
use crate::resource::Resource;
use crate::usage::{Measured, any_gpus};

/// How often the holder samples, unless `DEVLOCK_SAMPLE_EVERY` says: low
/// enough to cost nothing measurable, often enough for an idle timeout in
/// minutes. An idle timeout shorter than 20 s samples four times per
/// timeout (at least every 250 ms).
pub(crate) const DEFAULT_PERIOD: Duration = Duration::from_secs(5);

/// The sampling period for a hold with `idle_timeout`.
pub(crate) fn period(idle_timeout: Option<Duration>) -> Duration {
    let base = std::env::var("DEVLOCK_SAMPLE_EVERY")
        .ok()
        .and_then(|v| crate::units::parse_duration(&v).ok())
        .filter(|d| !d.is_zero())
        .unwrap_or(DEFAULT_PERIOD);
    match idle_timeout {
        Some(t) => base.min((t / 4).max(Duration::from_millis(250))),
        None => base,
    }
}

/// What the sampler knows now.
#[derive(Debug, Clone, Default)]
pub(crate) struct Now {
    pub measured: Measured,
    /// The GPUs it found the resources on.
    pub gpus: Vec<u32>,
    /// Each held GPU's utilization at the last sample, percent.
    pub util: Vec<(u32, Option<u32>)>,
    /// Since when no held GPU computed for the job (none while it does):
    /// the last busy sample, or the start.
    pub idle_since: Option<SystemTime>,
    /// Whether the source answered at all.
    pub answered: bool,
}

/// The sampler of one hold; dropping it stops the thread (at its next wake).
#[derive(Debug)]
pub(crate) struct Sampler {
    now: Arc<Mutex<Now>>,
    _quit: mpsc::Sender<()>,
}

/// What a sample is taken of.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub resources: Vec<Resource>,
    /// The processes whose trees are the job's (devlock and its command).
    pub roots: Vec<u32>,
    pub period: Duration,
    pub probe_timeout: Duration,
    /// A file whose modification time, while in the future, says the job
    /// is busy without the GPU (`devlock busy`).
    pub busy_file: Option<std::path::PathBuf>,
}

impl Job {
    /// Whether any resource maps to GPUs: only then is there anything to sample.
    pub(crate) fn has_gpus(&self) -> bool {
        any_gpus(&self.resources)
    }
}

impl Sampler {
    /// Starts the thread (it blocks every signal: the caller's threads hear
    /// them). `None` when the thread cannot be started.
    pub(crate) fn start(job: Job) -> Option<Sampler> {
        let now = Arc::new(Mutex::new(Now {
            idle_since: Some(SystemTime::now()),
            ..Now::default()
        }));
        let (quit, quit_rx) = mpsc::channel::<()>();
        let shared = now.clone();
        std::thread::Builder::new()
            .name("devlock-usage".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                crate::sys::signal::block(&crate::sys::signal::SigSet::all());
                run(&job, &shared, &quit_rx);
            })
            .ok()?;
        Some(Sampler { now, _quit: quit })
    }

    /// What it knows now.
    pub(crate) fn now(&self) -> Now {
        self.now.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn run(job: &Job, now: &Mutex<Now>, quit: &mpsc::Receiver<()>) {
    let mut last = Instant::now();
    loop {
        match quit.recv_timeout(job.period) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let report = crate::gpu::source::probe(job.probe_timeout).report;
        if report == DeviceReport::NoInfo {
            // No GPU source on this machine (no NVML, no nvidia-smi, no
            // amd-smi): nothing will ever answer, so stop asking.
            return;
        }
        let dt = last.elapsed().min(job.period * 2).as_secs_f64();
        last = Instant::now();
        let mut n = now.lock().unwrap_or_else(|e| e.into_inner());
        add_sample(&mut n, &report, job, dt, SystemTime::now());
    }
}

/// Whether `pid` is one of `roots` or descends from one.
fn under(pid: u32, roots: &[u32]) -> bool {
    roots.contains(&pid) || crate::proc::process::ancestors(pid).any(|(p, _)| roots.contains(&p))
}

/// Adds one sample of `report`, covering the `dt` seconds before `at`.
pub(crate) fn add_sample(n: &mut Now, report: &DeviceReport, job: &Job, dt: f64, at: SystemTime) {
    let DeviceReport::Devices(devices) = report else {
        return;
    };
    n.answered = true;
    let all: Vec<u32> = devices.iter().map(|d| d.index).collect();
    let mut gpus: Vec<u32> = job
        .resources
        .iter()
        .filter_map(|r| gpu_indices(r, &all))
        .flatten()
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    n.gpus = gpus.clone();
    n.measured.gpus = gpus.clone();
    n.util.clear();
    let mut busy = false;
    let mut mem = 0u64;
    let m = &mut n.measured;
    m.samples += 1;
    for index in &gpus {
        let Some(device) = devices.iter().find(|d| d.index == *index) else {
            n.util.push((*index, None));
            continue;
        };
        let ours: Vec<_> = device
            .processes
            .iter()
            .chain(device.mig_instances.iter().flat_map(|i| i.processes.iter()))
            .filter(|p| under(p.pid, &job.roots))
            .collect();
        mem += ours.iter().filter_map(|p| p.used_mib).sum::<u64>();
        n.util.push((*index, device.utilization_pct));
        if ours.is_empty() {
            m.sampled_gpu_s += dt;
            m.idle_gpu_s += dt;
            continue;
        }
        match device.utilization_pct {
            Some(0) => {
                m.sampled_gpu_s += dt;
                m.idle_gpu_s += dt;
            }
            Some(pct) => {
                m.sampled_gpu_s += dt;
                m.busy_gpu_s += dt * f64::from(pct.min(100)) / 100.0;
                busy = true;
            }
            // Cannot say: not idle either.
            None => busy = true,
        }
    }
    if mem > 0 || m.peak_mib.is_some() {
        m.peak_mib = Some(m.peak_mib.unwrap_or(0).max(mem));
    }
    let said_busy = job
        .busy_file
        .as_deref()
        .and_then(super::idle::BusyFile::busy_until)
        .is_some_and(|until| until > at);
    if busy || said_busy {
        n.idle_since = None;
    } else if n.idle_since.is_none() {
        n.idle_since = Some(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::device::{Device, DeviceProcess};

    fn job(roots: Vec<u32>) -> Job {
        Job {
            resources: vec![Resource::parse("gpu:0".as_ref()).unwrap()],
            roots,
            period: DEFAULT_PERIOD,
            probe_timeout: Duration::from_secs(1),
            busy_file: None,
        }
    }

    fn report(util: u32, pid: Option<u32>) -> DeviceReport {
        DeviceReport::Devices(vec![Device {
            index: 0,
            utilization_pct: Some(util),
            processes: pid
                .map(|pid| DeviceProcess {
                    pid,
                    used_mib: Some(700),
                    ..DeviceProcess::default()
                })
                .into_iter()
                .collect(),
            ..Device::default()
        }])
    }

    #[test]
    fn busy_idle_and_peak_add_up_per_gpu_second() {
        let me = std::process::id();
        let j = job(vec![me]);
        let mut n = Now::default();
        let t = SystemTime::now();
        add_sample(&mut n, &report(50, Some(me)), &j, 4.0, t);
        assert_eq!(n.idle_since, None);
        add_sample(&mut n, &report(0, Some(me)), &j, 4.0, t);
        assert_eq!(n.idle_since, Some(t));
        // Someone else computes; the job has no process there: idle.
        add_sample(
            &mut n,
            &report(90, None),
            &j,
            2.0,
            t + Duration::from_secs(1),
        );
        assert_eq!(
            n.idle_since,
            Some(t),
            "still idle since the first idle sample"
        );
        let m = n.measured.clone();
        assert_eq!(m.samples, 3);
        assert_eq!(m.sampled_gpu_s, 10.0);
        assert_eq!(m.busy_gpu_s, 2.0);
        assert_eq!(m.idle_gpu_s, 6.0);
        assert_eq!(m.peak_mib, Some(700));
    }

    #[test]
    fn the_period_follows_the_idle_timeout() {
        assert_eq!(period(None), DEFAULT_PERIOD);
        assert_eq!(
            period(Some(Duration::from_secs(2))),
            Duration::from_millis(500)
        );
        assert_eq!(period(Some(Duration::from_secs(3600))), DEFAULT_PERIOD);
        assert_eq!(
            period(Some(Duration::from_millis(10))),
            Duration::from_millis(250)
        );
    }
}
