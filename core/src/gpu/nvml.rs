//! NVIDIA's management library (NVML) as a device source: each GPU's memory, utilisation and compute processes, and for a GPU in MIG mode its instances, asked in-process on a thread that a hung driver cannot hold the caller to.
//!
//! `libnvidia-ml.so.1` is loaded at run time ([`ffi`], dlopen(3)), so the
//! binary runs the same on machines without a driver. `DEVLOCK_NVML` picks
//! the library: unset or empty, the system's `libnvidia-ml.so.1`; `none`, no
//! NVML at all; anything else, that file (tests point it at a fake).
//!
//! **Once per process.** The first [`probe_at`] starts one thread per library
//! (`devlock-nvml`), which opens the library, calls `nvmlInit_v2` once, and
//! from then on answers each probe with a session of queries. A failure to
//! load or initialise is remembered, not retried: a devlock process lives
//! for one job, and fifty waiters all retrying `nvmlInit` is the stampede
//! this design avoids. `nvmlShutdown` is never called; the process's exit
//! releases what NVML holds.
//!
//! **A hard time limit.** The caller waits for the answer at most `timeout`
//! (cold start included: loading, `nvmlInit_v2` and the first queries). A
//! call that does not return by then is abandoned where it is: the thread
//! stays blocked inside the driver, holding nothing of devlock's (no lock
//! file, no mutex: the only shared state, the worker's status, is locked for
//! a moment before and after each session). Probes that come while a session
//! runs queue behind it, within their own timeout; once a caller has given
//! up on a session, later probes in the same process report unknown at once,
//! naming how long the call has been stuck, instead of queueing behind it; if
//! the call ever returns, the next probe is served again. The thread dies
//! with the process. One caveat no thread can remove: if the driver holds
//! the thread in uninterruptible sleep (state D), the kernel completes the
//! process's exit only when that call returns, and since threads share one
//! descriptor table, descriptors (lock files included) close only then: a
//! lock is released late, never early. A subprocess (the `nvidia-smi` path)
//! does not have this caveat; a caller that holds locks while it probes can
//! run the session in a child process of its own for the same reason.
//!
//! **Unknown, never free.** Whatever NVML cannot tell is an [`Unknown`] with
//! the reason (the call, the device, NVML's words), never a zero: a process
//! list that failed is not an empty list, a used-memory value NVML gives as
//! `NVML_VALUE_NOT_AVAILABLE` is unknown, a GPU whose identity cannot be read
//! makes the whole answer unknown rather than a shorter list.
//!
//! Pids are as NVML reports them: in the host's (initial) PID namespace,
//! also when devlock runs in a container.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::gpu::device::{Device, DeviceProcess, MigInstance};
use crate::resource::mig;
use crate::show::human_duration;
use crate::sys::nvml as ffi;
use ffi::{Code, Handle, Library, OpenError, ProcessInfo};

mod read;
use read::*;

/// The library's name, as the driver installs it.
pub(crate) const LIBRARY: &str = "libnvidia-ml.so.1";

/// The environment variable that picks the library: a path, `none`, or
/// unset/empty for [`LIBRARY`].
pub(crate) const ENV: &str = "DEVLOCK_NVML";

const MIB: u64 = 1024 * 1024;

/// Where NVML comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Location {
    /// The system's [`LIBRARY`], found as dlopen(3) finds it; missing is not
    /// an error (the machine has no NVIDIA driver).
    System,
    /// This file; missing or unloadable is an error (someone asked for it).
    Path(PathBuf),
    /// `DEVLOCK_NVML=none`: do not use NVML.
    Off,
}

impl Location {
    /// From `$DEVLOCK_NVML`.
    pub(crate) fn from_env() -> Location {
        Location::parse(std::env::var_os(ENV))
    }

    /// From a value of `DEVLOCK_NVML`.
    pub(crate) fn parse(value: Option<OsString>) -> Location {
        match value {
            None => Location::System,
            Some(v) if v.is_empty() => Location::System,
            Some(v) if v == "none" => Location::Off,
            Some(v) => Location::Path(PathBuf::from(v)),
        }
    }
}

/// Why something is not known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unknown {
    /// In words, e.g. `nvmlDeviceGetMemoryInfo on GPU 1: GPU is lost (NVML error 15)`.
    pub(crate) reason: String,
}

impl Unknown {
    fn new(reason: impl Into<String>) -> Unknown {
        Unknown {
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown, because {}", self.reason)
    }
}

/// Memory of a GPU or MIG instance, MiB (rounded down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Memory {
    pub(crate) used_mib: u64,
    pub(crate) total_mib: u64,
}

/// A compute process NVML sees on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Process {
    /// In the host's PID namespace.
    pub(crate) pid: u32,
    /// Device memory it uses; `None` when NVML cannot say.
    pub(crate) used_mib: Option<u64>,
    /// The GPU instance it runs in (MIG mode only).
    pub(crate) gpu_instance_id: Option<u32>,
    /// The compute instance it runs in (MIG mode only).
    pub(crate) compute_instance_id: Option<u32>,
}

/// One MIG instance (a MIG device, in NVML's words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Instance {
    /// Its resource name ([`mig::instance_name`]); unknown when NVML's name
    /// for it carries no usable profile.
    pub(crate) name: Result<String, Unknown>,
    /// The MIG device index under its GPU.
    pub(crate) mig_index: u32,
    /// `MIG-...`, what `CUDA_VISIBLE_DEVICES` takes.
    pub(crate) uuid: String,
    /// NVML's device name, e.g. `NVIDIA H200 MIG 1g.18gb`.
    pub(crate) device_name: String,
    /// The profile from that name, e.g. `1g.18gb`.
    pub(crate) profile: Option<String>,
    pub(crate) gpu_instance_id: u32,
    pub(crate) compute_instance_id: u32,
    pub(crate) memory: Result<Memory, Unknown>,
    /// Processes inside this instance.
    pub(crate) processes: Result<Vec<Process>, Unknown>,
}

/// A GPU's MIG state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Mig {
    /// The GPU (or this NVML) has no MIG.
    NotSupported,
    /// MIG off; `pending_on` when it turns on at the next GPU reset.
    Off { pending_on: bool },
    /// MIG on: the GPU is shared out as these instances (sorted by GPU
    /// instance id, then compute instance id).
    On {
        pending_off: bool,
        instances: Result<Vec<Instance>, Unknown>,
    },
    /// NVML could not say.
    Unknown(Unknown),
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gpu {
    /// NVML's index (nvidia-smi's, and CUDA's with `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub(crate) index: u32,
    /// `GPU-...`.
    pub(crate) uuid: String,
    pub(crate) name: String,
    /// In MIG mode NVML gives the whole GPU's figures only to a privileged caller.
    pub(crate) memory: Result<Memory, Unknown>,
    /// Unknown in MIG mode (NVML does not report it there).
    pub(crate) utilization_pct: Result<u32, Unknown>,
    /// Every compute process on the GPU, inside an instance or not.
    pub(crate) processes: Result<Vec<Process>, Unknown>,
    pub(crate) mig: Mig,
}

/// What one session saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) driver_version: Result<String, Unknown>,
    pub(crate) gpus: Vec<Gpu>,
}

/// The answer to a probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// `DEVLOCK_NVML=none`.
    Off,
    /// The system has no loadable `libnvidia-ml.so.1`: not an error, the
    /// caller falls back (to nvidia-smi, or to "no device information").
    NotInstalled { reason: String },
    /// NVML is there (or was asked for) but did not answer: the devices'
    /// state is unknown, never free.
    Unknown(Unknown),
    /// The devices.
    Devices(Snapshot),
}

/// Asks the NVML at `location`, within `timeout`.
pub(crate) fn probe_at(location: &Location, timeout: Duration) -> Outcome {
    let (path, named) = match location {
        Location::Off => return Outcome::Off,
        Location::System => (PathBuf::from(LIBRARY), false),
        Location::Path(path) => (path.clone(), true),
    };
    let worker = match worker_for(&path, named) {
        Ok(worker) => worker,
        Err(why) => return Outcome::Unknown(Unknown::new(why)),
    };
    worker.ask(timeout)
}

enum Failure {
    NotInstalled(String),
    Unknown(Unknown),
}

type Answer = Result<Snapshot, Failure>;

/// A session asked for: its number and where the answer goes.
type Job = (u64, mpsc::SyncSender<Answer>);

/// The thread that owns one library.
struct Worker {
    status: Arc<Mutex<Status>>,
    /// Locked with `status` held, so that jobs queue in number order.
    jobs: Mutex<mpsc::Sender<Job>>,
}

/// What the worker is doing, for callers deciding whether to queue.
#[derive(Default)]
struct Status {
    /// The number of the last job queued (jobs count from 1).
    last_job: u64,
    /// The job in progress and when it began.
    running: Option<(u64, Instant)>,
    /// Callers gave up waiting on this job and the ones before it.
    abandoned_up_to: u64,
}

/// One worker per library path, for the life of the process.
static WORKERS: Mutex<Vec<(PathBuf, Arc<Worker>)>> = Mutex::new(Vec::new());

fn worker_for(path: &Path, named: bool) -> Result<Arc<Worker>, String> {
    let mut workers = WORKERS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, worker)) = workers.iter().find(|(p, _)| p == path) {
        return Ok(Arc::clone(worker));
    }
    let (tx, rx) = mpsc::channel::<Job>();
    let status = Arc::new(Mutex::new(Status::default()));
    let shared = Arc::clone(&status);
    let owned = path.to_path_buf();
    thread::Builder::new()
        .name("devlock-nvml".to_owned())
        .spawn(move || {
            let set = |running| {
                shared
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .running = running
            };
            let mut started: Option<Result<&'static Library, Failure>> = None;
            for (job, reply) in rx {
                set(Some((job, Instant::now())));
                let library = started.get_or_insert_with(|| start(&owned, named));
                let answer = match library {
                    Ok(library) => session(library).map_err(Failure::Unknown),
                    Err(Failure::NotInstalled(why)) => Err(Failure::NotInstalled(why.clone())),
                    Err(Failure::Unknown(why)) => Err(Failure::Unknown(why.clone())),
                };
                // Idle again before answering, so that the caller may ask
                // again as soon as it has the answer.
                set(None);
                // The caller may have given up waiting; then nobody listens.
                let _ = reply.send(answer);
            }
        })
        .map_err(|e| format!("cannot start a thread for NVML: {e}"))?;
    let worker = Arc::new(Worker {
        status,
        jobs: Mutex::new(tx),
    });
    workers.push((path.to_path_buf(), Arc::clone(&worker)));
    Ok(worker)
}

impl Worker {
    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a session and waits for it at most `timeout`. A session in
    /// progress is waited for (it counts against `timeout`), unless a caller
    /// already gave up on it: then the driver is likely hung, and the answer
    /// comes at once.
    fn ask(&self, timeout: Duration) -> Outcome {
        let (reply, answer) = mpsc::sync_channel(1);
        let job = {
            let mut status = self.status();
            if let Some((running, since)) = status.running
                && running <= status.abandoned_up_to
            {
                return Outcome::Unknown(Unknown::new(format!(
                    "an earlier NVML call has not returned for {} (the driver may be hung); \
                     not asking again until it does",
                    human_duration(round_ms(since.elapsed()))
                )));
            }
            status.last_job += 1;
            let job = status.last_job;
            let sent = self
                .jobs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .send((job, reply));
            if sent.is_err() {
                return Outcome::Unknown(Unknown::new("the NVML thread has stopped"));
            }
            job
        };
        match answer.recv_timeout(timeout) {
            Ok(Ok(snapshot)) => Outcome::Devices(snapshot),
            Ok(Err(Failure::NotInstalled(reason))) => Outcome::NotInstalled { reason },
            Ok(Err(Failure::Unknown(why))) => Outcome::Unknown(why),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut status = self.status();
                status.abandoned_up_to = status.abandoned_up_to.max(job);
                Outcome::Unknown(Unknown::new(format!(
                    "NVML did not answer within {} (the call is left on a thread of its own)",
                    human_duration(timeout)
                )))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                Outcome::Unknown(Unknown::new("the NVML thread stopped while asking"))
            }
        }
    }
}

/// Whole milliseconds, so that messages read `1.2s`, not `1.234567891s`.
fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis().min(u128::from(u64::MAX)) as u64)
}

/// Opens and initialises the library, once per process.
fn start(path: &Path, named: bool) -> Result<&'static Library, Failure> {
    let library = match Library::open(path) {
        Ok(library) => library,
        Err(OpenError::NotLoadable(why)) if !named => return Err(Failure::NotInstalled(why)),
        Err(why) => {
            return Err(Failure::Unknown(Unknown::new(format!(
                "cannot use {} as NVML: {why}",
                crate::show::show_path(path)
            ))));
        }
    };
    library.init().map_err(|code| {
        Failure::Unknown(Unknown::new(format!(
            "nvmlInit_v2 failed: {}",
            library.describe(code)
        )))
    })?;
    Ok(library)
}

/// The snapshot as the one device type ([`Device`]), as nvidia-smi's
/// probe gives it; what NVML could not say stays unknown (`None`, or the
/// reason in `processes_unknown` / `mig_unknown`), never zero or empty.
pub(crate) fn devices(snapshot: Snapshot) -> Vec<Device> {
    snapshot.gpus.into_iter().map(device_of).collect()
}

fn device_of(gpu: Gpu) -> Device {
    let (memory_used_mib, memory_total_mib) = split_memory(&gpu.memory);
    let (processes, processes_unknown) = processes_for(gpu.processes);
    let mut device = Device {
        index: gpu.index,
        uuid: gpu.uuid,
        name: gpu.name,
        memory_used_mib,
        memory_total_mib,
        utilization_pct: gpu.utilization_pct.ok(),
        processes,
        processes_unknown,
        ..Device::default()
    };
    match gpu.mig {
        Mig::NotSupported => {}
        Mig::Off { .. } => device.mig_mode = Some(false),
        Mig::Unknown(why) => device.mig_unknown = Some(why.reason),
        Mig::On { instances, .. } => {
            device.mig_mode = Some(true);
            match instances {
                Ok(instances) => {
                    device.mig_instances = instances.into_iter().map(instance_of).collect()
                }
                Err(why) => device.mig_unknown = Some(why.reason),
            }
        }
    }
    device
}

fn instance_of(instance: Instance) -> MigInstance {
    let (memory_used_mib, memory_total_mib) = split_memory(&instance.memory);
    let (processes, processes_unknown) = processes_for(instance.processes);
    MigInstance {
        name: instance.name.ok(),
        uuid: instance.uuid,
        profile: instance.profile,
        gpu_instance_id: instance.gpu_instance_id,
        compute_instance_id: instance.compute_instance_id,
        memory_used_mib,
        memory_total_mib,
        processes,
        processes_unknown,
    }
}

fn split_memory(memory: &Result<Memory, Unknown>) -> (Option<u64>, Option<u64>) {
    match memory {
        Ok(m) => (Some(m.used_mib), Some(m.total_mib)),
        Err(_) => (None, None),
    }
}

/// NVML names no process, and its pids are the host's: outside a
/// container each is named by the kernel's `comm` (and the container it
/// runs in, if any); inside one, where a host pid cannot be mapped
/// ([`crate::proc::container::local_pid`]), it is pid 0, named by its host pid:
/// listed, never dropped, never inside a gate.
fn processes_for(list: Result<Vec<Process>, Unknown>) -> (Vec<DeviceProcess>, Option<String>) {
    let list = match list {
        Err(why) => return (Vec::new(), Some(why.reason)),
        Ok(list) => list,
    };
    let processes = list
        .into_iter()
        .map(|p| {
            let (pid, name) = match crate::proc::container::local_pid(p.pid) {
                Some(pid) => (
                    pid,
                    crate::proc::process::comm_of(pid).unwrap_or_else(|| "[unknown]".to_owned()),
                ),
                None => (
                    0,
                    format!("[host pid {}, not visible inside this container]", p.pid),
                ),
            };
            DeviceProcess {
                pid,
                container: (pid != 0)
                    .then(|| crate::proc::container::container_of(pid))
                    .flatten(),
                name,
                used_mib: p.used_mib,
                gating: None,
            }
        })
        .collect();
    (processes, None)
}

#[cfg(test)]
mod tests;
