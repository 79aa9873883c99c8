//! GPU device probing: what GPUs this machine has and which processes use them, asked of `nvidia-smi` under a hard timeout.
//!
//! Probing is advisory. Anything we cannot establish is reported as unknown
//! (`None` fields, [`DeviceReport::Unknown`]), never as zero or free.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::text::human_duration;
use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;
use serde::Serialize;

/// How long the CLI lets a probe run before giving up on it (`--probe-timeout`).
#[cfg(test)]
pub(crate) const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

const GPU_QUERY: [&str; 2] = [
    "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu",
    "--format=csv,noheader,nounits",
];
const APPS_QUERY: [&str; 2] = [
    "--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
    "--format=csv,noheader,nounits",
];

/// After SIGKILL, how long to wait for the process to die before leaving
/// its reaping to a background thread (a wedged driver can hold it in the kernel).
const KILL_GRACE: Duration = Duration::from_millis(500);

/// One GPU as reported by the vendor tool (and, once [`crate::gpu::gate`]
/// has looked, which of its processes work inside a lock's gate): the one
/// device type, from the probe to status's JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub(crate) struct Device {
    /// The vendor's device index (what `CUDA_VISIBLE_DEVICES` counts).
    pub index: u32,
    /// Stable device identifier, e.g. `GPU-5f3c1a2b-...`.
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Memory in use, MiB; `None` when the tool could not say.
    pub memory_used_mib: Option<u64>,
    /// Total memory, MiB; `None` when the tool could not say.
    pub memory_total_mib: Option<u64>,
    /// GPU utilization in percent; `None` when the tool could not say.
    pub utilization_pct: Option<u32>,
    /// Compute processes running on this device.
    pub processes: Vec<DeviceProcess>,
    /// Why `processes` means nothing: the source could not list them (NVML
    /// refused the call). A device with this set is never called idle.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes_unknown: Option<String>,
    /// Whether the GPU is in MIG mode; `None` when the source cannot say
    /// (nvidia-smi's query, or a GPU without MIG).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_mode: Option<bool>,
    /// In MIG mode, its instances (NVML only), sorted by GPU and compute
    /// instance id.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mig_instances: Vec<MigInstance>,
    /// In MIG mode, why the instances could not be listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mig_unknown: Option<String>,
}

/// One MIG instance of a GPU in MIG mode: a device of its own, one level
/// below its GPU (see [`crate::gpu::mig`] for its resource name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub(crate) struct MigInstance {
    /// Its resource name, `gpu:N:PROFILE:giG.ciC`; `None` when its profile
    /// cannot be written in one (then it cannot be locked).
    pub name: Option<String>,
    /// `MIG-...`, what `CUDA_VISIBLE_DEVICES` takes.
    pub uuid: String,
    /// The MIG profile, e.g. `1g.18gb`.
    pub profile: Option<String>,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    pub memory_used_mib: Option<u64>,
    pub memory_total_mib: Option<u64>,
    /// Compute processes inside this instance.
    pub processes: Vec<DeviceProcess>,
    /// Why `processes` means nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes_unknown: Option<String>,
}

/// A compute process seen on a device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct DeviceProcess {
    /// Process id (in the tool's pid namespace).
    pub pid: u32,
    /// Process name as the tool reports it; may contain commas and spaces.
    pub name: String,
    /// Device memory used by this process, MiB; `None` when unknown.
    pub used_mib: Option<u64>,
    /// Whether it works inside a gate, once [`crate::gpu::gate`] has looked.
    pub gating: Option<Gating>,
    /// The container it runs in, seen from the host (NVML's source only).
    pub container: Option<String>,
}

/// Where a process on a GPU stands with the locks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gating {
    /// Its user, from the kernel.
    pub user: Option<String>,
    /// It, or an ancestor, holds the lock of a resource mapped to its device.
    pub gated: bool,
    /// The resource whose holder it belongs to.
    pub gate: Option<String>,
}

impl DeviceProcess {
    /// Whether it works inside a gate (false until looked at).
    pub(crate) fn gated(&self) -> bool {
        self.gating.as_ref().is_some_and(|g| g.gated)
    }

    /// Its user, once looked up.
    pub(crate) fn user(&self) -> Option<&str> {
        self.gating.as_ref().and_then(|g| g.user.as_deref())
    }

    /// The resource whose holder it belongs to.
    pub(crate) fn gate(&self) -> Option<&str> {
        self.gating.as_ref().and_then(|g| g.gate.as_deref())
    }
}

/// As the probe saw it, `{pid, name, used_mib}`; once gated, `{pid, name,
/// user, used_mib, gated, gate}` (status's JSON; `gate` only when inside).
impl Serialize for DeviceProcess {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let Some(g) = &self.gating else {
            let mut s = serializer.serialize_struct("DeviceProcess", 3)?;
            s.serialize_field("pid", &self.pid)?;
            s.serialize_field("name", &self.name)?;
            s.serialize_field("used_mib", &self.used_mib)?;
            return s.end();
        };
        let mut s = serializer.serialize_struct("DeviceProcess", 7)?;
        s.serialize_field("pid", &self.pid)?;
        s.serialize_field("name", &self.name)?;
        s.serialize_field("user", &g.user)?;
        s.serialize_field("used_mib", &self.used_mib)?;
        s.serialize_field("gated", &g.gated)?;
        if let Some(gate) = &g.gate {
            s.serialize_field("gate", gate)?;
        }
        if let Some(container) = &self.container {
            s.serialize_field("container", container)?;
        }
        s.end()
    }
}

/// Outcome of a probe.
///
/// Serialized internally tagged on `"status"`:
/// `{"status":"none"}`, `{"status":"unknown","reason":"..."}`,
/// `{"status":"ok","devices":[...]}`; unknown numeric fields are `null`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "ReportJson")]
pub(crate) enum DeviceReport {
    /// No probing tool is installed; nothing to say, and nothing wrong.
    NoInfo,
    /// The tool exists but we could not learn the device state.
    Unknown {
        /// Human-readable cause, e.g. a timeout or the tool's error message.
        reason: String,
    },
    /// The devices and their processes.
    Devices(Vec<Device>),
}

impl DeviceReport {
    /// The devices, when the probe listed them.
    pub(crate) fn devices(&self) -> &[Device] {
        match self {
            DeviceReport::Devices(devices) => devices,
            _ => &[],
        }
    }
}

// serde cannot internally tag a newtype variant holding a sequence, so the
// JSON shape goes through this mirror with struct variants.
#[derive(Serialize)]
#[serde(tag = "status", rename_all = "lowercase")]
enum ReportJson {
    None,
    Unknown { reason: String },
    Ok { devices: Vec<Device> },
}

impl From<DeviceReport> for ReportJson {
    fn from(report: DeviceReport) -> Self {
        match report {
            DeviceReport::NoInfo => ReportJson::None,
            DeviceReport::Unknown { reason } => ReportJson::Unknown { reason },
            DeviceReport::Devices(devices) => ReportJson::Ok { devices },
        }
    }
}

/// The seam for other vendors (amd-smi, NVML) later.
pub(crate) trait Probe {
    /// Reports the devices, taking at most about `timeout` (plus a short kill grace).
    fn probe(&self, timeout: Duration) -> DeviceReport;
}

/// Probes NVIDIA GPUs by running `nvidia-smi`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NvidiaSmi {
    /// The program to run; `None` means not installed (probing yields [`DeviceReport::NoInfo`]).
    pub program: Option<PathBuf>,
}

impl NvidiaSmi {
    /// Uses `$DEVLOCK_NVIDIA_SMI` if set and non-empty, else `nvidia-smi` found on `$PATH`.
    pub(crate) fn from_env() -> Self {
        NvidiaSmi {
            program: lookup(
                std::env::var_os("DEVLOCK_NVIDIA_SMI"),
                std::env::var_os("PATH"),
            ),
        }
    }
}

/// Resolves the program [`NvidiaSmi::from_env`] would run, from the values of
/// `DEVLOCK_NVIDIA_SMI` and `PATH`. An explicit override is taken as is (if it
/// is missing, probing reports why); otherwise `None` when no executable
/// `nvidia-smi` is on the path.
pub(crate) fn lookup(env_override: Option<OsString>, path: Option<OsString>) -> Option<PathBuf> {
    lookup_tool("nvidia-smi", env_override, path)
}

/// [`lookup`] for any tool name.
pub(crate) fn lookup_tool(
    tool: &str,
    env_override: Option<OsString>,
    path: Option<OsString>,
) -> Option<PathBuf> {
    if let Some(program) = env_override.filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(program));
    }
    // Empty PATH entries mean the current directory; running a binary from
    // wherever the user happens to stand is not something we want.
    std::env::split_paths(&path?)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(tool))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

impl Probe for NvidiaSmi {
    fn probe(&self, timeout: Duration) -> DeviceReport {
        let Some(program) = &self.program else {
            return DeviceReport::NoInfo;
        };
        match probe_devices(program, timeout) {
            Ok(devices) => DeviceReport::Devices(devices),
            Err(reason) => DeviceReport::Unknown { reason },
        }
    }
}

fn probe_devices(program: &Path, timeout: Duration) -> Result<Vec<Device>, String> {
    let deadline = deadline_in(timeout);
    let unparsable = |e: anyhow::Error| format!("unexpected nvidia-smi output: {e:#}");
    let gpus = parse_gpus(&query(program, &GPU_QUERY, deadline, timeout)?).map_err(unparsable)?;
    if gpus.is_empty() {
        return Ok(gpus);
    }
    let apps = parse_apps(&query(program, &APPS_QUERY, deadline, timeout)?).map_err(unparsable)?;
    Ok(join(gpus, apps))
}

/// `timeout` from now, clamped so that absurd timeouts cannot overflow `Instant`.
pub(crate) fn deadline_in(timeout: Duration) -> Instant {
    Instant::now() + timeout.min(Duration::from_secs(365 * 86_400))
}

/// Runs one query; `Err` is the reason to report as unknown.
fn query(
    program: &Path,
    args: &[&str],
    deadline: Instant,
    timeout: Duration,
) -> Result<String, String> {
    run_tool("nvidia-smi", program, args, deadline, timeout)
}

/// Runs `program ARGS` (the vendor tool `tool`) to completion or to
/// `deadline`, killing its process group then; its standard output, or
/// the reason to report the devices as unknown.
pub(crate) fn run_tool(
    tool: &str,
    program: &Path,
    args: &[&str],
    deadline: Instant,
    timeout: Duration,
) -> Result<String, String> {
    let output = run(program, args, deadline)
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?
        .ok_or_else(|| {
            format!(
                "{tool} did not answer within {} (killed)",
                human_duration(timeout)
            )
        })?;
    if !output.status.success() {
        return Err(failure_reason(tool, &output));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn failure_reason(tool: &str, output: &Output) -> String {
    let what = match (output.status.code(), output.status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("failed ({})", output.status),
    };
    // Real nvidia-smi prints driver errors on stdout, so fall back to it.
    match first_line(&output.stderr).or_else(|| first_line(&output.stdout)) {
        Some(line) => format!("{tool} {what}: {line}"),
        None => format!("{tool} {what}"),
    }
}

fn first_line(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
}

enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exited,
}

/// Runs `program` to completion, or kills its whole process group at
/// `deadline` and returns `Ok(None)`.
fn run(program: &Path, args: &[&str], deadline: Instant) -> std::io::Result<Option<Output>> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so a timeout also kills anything it forked.
        .process_group(0)
        .spawn()?;
    let pid = Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    spawn_reader(child.stdout.take(), tx.clone(), Event::Stdout);
    spawn_reader(child.stderr.take(), tx.clone(), Event::Stderr);
    thread::spawn(move || {
        // WNOWAIT leaves the child a zombie until we reap it ourselves, so its
        // pid (which is also the group id) cannot be recycled before killpg.
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
        while waitid(Id::Pid(pid), flags) == Err(Errno::EINTR) {}
        let _ = tx.send(Event::Exited);
    });

    let (mut stdout, mut stderr, mut exited) = (None, None, false);
    while stdout.is_none() || stderr.is_none() || !exited {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::Stdout(bytes)) => stdout = Some(bytes),
            Ok(Event::Stderr(bytes)) => stderr = Some(bytes),
            Ok(Event::Exited) => exited = true,
            Err(_) => {
                kill_and_reap(child, pid, exited, &rx);
                return Ok(None);
            }
        }
    }
    let status = child.wait()?;
    Ok(Some(Output {
        status,
        stdout: stdout.unwrap_or_default(),
        stderr: stderr.unwrap_or_default(),
    }))
}

fn spawn_reader(
    pipe: Option<impl Read + Send + 'static>,
    tx: Sender<Event>,
    event: fn(Vec<u8>) -> Event,
) {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        let _ = tx.send(event(bytes));
    });
}

fn kill_and_reap(mut child: Child, pid: Pid, mut exited: bool, rx: &Receiver<Event>) {
    let _ = killpg(pid, Signal::SIGKILL);
    let grace = Instant::now() + KILL_GRACE;
    while !exited {
        match rx.recv_timeout(grace.saturating_duration_since(Instant::now())) {
            Ok(Event::Exited) => exited = true,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    if exited {
        let _ = child.wait();
    } else {
        thread::spawn(move || child.wait());
    }
}

/// Parses `--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu`
/// output (`csv,noheader,nounits`). Blank lines are ignored.
pub(crate) fn parse_gpus(text: &str) -> anyhow::Result<Vec<Device>> {
    let mut devices = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [index, uuid, name, used, total, util] = fields[..] else {
            bail!(
                "line {}: expected 6 fields, found {}: {line:?}",
                n + 1,
                fields.len()
            );
        };
        devices.push(Device {
            index: index
                .parse()
                .with_context(|| format!("line {}: bad GPU index {index:?}", n + 1))?,
            uuid: uuid.to_owned(),
            name: name.to_owned(),
            memory_used_mib: number(used),
            memory_total_mib: number(total),
            utilization_pct: number(util),
            processes: Vec::new(),
            ..Device::default()
        });
    }
    Ok(devices)
}

/// Parses `--query-compute-apps=gpu_uuid,pid,used_memory,process_name` output
/// (`csv,noheader,nounits`) into `(gpu uuid, process)` pairs. The name is the
/// last field, so commas inside it are kept.
pub(crate) fn parse_apps(text: &str) -> anyhow::Result<Vec<(String, DeviceProcess)>> {
    let mut apps = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let fields: Vec<&str> = line.splitn(4, ',').map(str::trim).collect();
        let [uuid, pid, used, name] = fields[..] else {
            bail!(
                "line {}: expected 4 fields, found {}: {line:?}",
                n + 1,
                fields.len()
            );
        };
        // Without a pid the process is useless to the caller; a guess would be worse.
        let pid = pid
            .parse()
            .with_context(|| format!("line {}: bad pid {pid:?}", n + 1))?;
        let process = DeviceProcess {
            pid,
            name: name.to_owned(),
            used_mib: number(used),
            gating: None,
            container: None,
        };
        apps.push((uuid.to_owned(), process));
    }
    Ok(apps)
}

/// `[N/A]`, `[Not Supported]`, `[Unknown Error]`, empty, or garbage: unknown.
fn number<T: std::str::FromStr>(field: &str) -> Option<T> {
    field.parse().ok()
}

/// Attaches each process to the device with its UUID; processes on a UUID
/// not in `gpus` are dropped.
pub(crate) fn join(mut gpus: Vec<Device>, apps: Vec<(String, DeviceProcess)>) -> Vec<Device> {
    for (uuid, process) in apps {
        if let Some(device) = gpus.iter_mut().find(|d| d.uuid == uuid) {
            device.processes.push(process);
        }
    }
    gpus
}

/// Formats a MiB amount for humans: `"38.2 GiB"` from 1024 MiB up, else `"512 MiB"`.
pub(crate) fn format_mib(mib: u64) -> String {
    if mib >= 1024 {
        format!("{:.1} GiB", mib as f64 / 1024.0)
    } else {
        format!("{mib} MiB")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEVERAL_GPUS: &str = include_str!("../../tests/fixtures/nvidia-smi/several.gpus.csv");
    const SEVERAL_APPS: &str = include_str!("../../tests/fixtures/nvidia-smi/several.apps.csv");
    const NA_GPUS: &str = include_str!("../../tests/fixtures/nvidia-smi/na.gpus.csv");
    const NA_APPS: &str = include_str!("../../tests/fixtures/nvidia-smi/na.apps.csv");
    const IDLE_GPUS: &str = include_str!("../../tests/fixtures/nvidia-smi/idle.gpus.csv");
    const IDLE_APPS: &str = include_str!("../../tests/fixtures/nvidia-smi/idle.apps.csv");

    /// The `several` apps fixture has `@PIDn@` placeholders; fill them the way
    /// the fake script does by default (`424n`).
    fn several_apps() -> String {
        (1..=9).fold(SEVERAL_APPS.to_owned(), |text, n| {
            text.replace(&format!("@PID{n}@"), &format!("424{n}"))
        })
    }

    #[test]
    fn parses_several_gpus() {
        let gpus = parse_gpus(SEVERAL_GPUS).unwrap();
        assert_eq!(gpus.len(), 4);
        assert_eq!(gpus[0].index, 0);
        assert_eq!(gpus[0].uuid, "GPU-5f3c1a2b-7d4e-4c1f-9a8b-1c2d3e4f5a60");
        assert_eq!(gpus[0].name, "NVIDIA H100 80GB HBM3");
        assert_eq!(gpus[0].memory_used_mib, Some(38925));
        assert_eq!(gpus[0].memory_total_mib, Some(81559));
        assert_eq!(gpus[0].utilization_pct, Some(97));
        assert_eq!(gpus[1].memory_used_mib, Some(0));
        assert_eq!(gpus[3].index, 3);
        assert!(gpus.iter().all(|g| g.processes.is_empty()));
    }

    #[test]
    fn parses_apps_keeping_commas_in_names() {
        let apps = parse_apps(&several_apps()).unwrap();
        assert_eq!(apps.len(), 4);
        assert_eq!(apps[0].0, "GPU-5f3c1a2b-7d4e-4c1f-9a8b-1c2d3e4f5a60");
        let expected = DeviceProcess {
            pid: 4241,
            name: "python3".into(),
            used_mib: Some(38912),
            gating: None,
            container: None,
        };
        assert_eq!(apps[0].1, expected);
        assert_eq!(apps[2].1.name, "python3 -c import a,b");
        assert_eq!(apps[2].1.pid, 4243);
    }

    #[test]
    fn joins_on_uuid() {
        let gpus = join(
            parse_gpus(SEVERAL_GPUS).unwrap(),
            parse_apps(&several_apps()).unwrap(),
        );
        let pids: Vec<Vec<u32>> = gpus
            .iter()
            .map(|g| g.processes.iter().map(|p| p.pid).collect())
            .collect();
        assert_eq!(pids, vec![vec![4241], vec![], vec![4242, 4243], vec![4244]]);
    }

    #[test]
    fn join_drops_processes_on_unknown_gpus() {
        let apps = parse_apps("GPU-nope, 7, 10, ghost\n").unwrap();
        let gpus = join(parse_gpus(IDLE_GPUS).unwrap(), apps);
        assert!(gpus.iter().all(|g| g.processes.is_empty()));
    }

    #[test]
    fn unavailable_fields_are_unknown_not_zero() {
        let gpus = parse_gpus(NA_GPUS).unwrap();
        assert_eq!(gpus[0].memory_used_mib, None);
        assert_eq!(gpus[0].memory_total_mib, Some(81559));
        assert_eq!(gpus[0].utilization_pct, None);
        assert_eq!(gpus[1].memory_used_mib, Some(2061));
        assert_eq!(gpus[1].memory_total_mib, None);
        assert_eq!(gpus[1].utilization_pct, None);
        let apps = parse_apps(NA_APPS).unwrap();
        assert_eq!(apps[0].1.used_mib, None);
        assert_eq!(apps[1].1.used_mib, Some(2048));
        assert_eq!(number::<u64>(""), None);
        assert_eq!(number::<u64>("12.5"), None);
        assert_eq!(number::<u32>("-1"), None);
    }

    #[test]
    fn idle_has_devices_and_no_apps() {
        assert_eq!(parse_gpus(IDLE_GPUS).unwrap().len(), 2);
        assert!(parse_apps(IDLE_APPS).unwrap().is_empty());
        assert!(parse_gpus("").unwrap().is_empty());
    }

    #[test]
    fn malformed_lines_are_errors() {
        assert!(parse_gpus("0, GPU-x, name, 1, 2\n").is_err());
        assert!(parse_gpus("0, GPU-x, name, 1, 2, 3, 4\n").is_err());
        assert!(parse_gpus("[N/A], GPU-x, name, 1, 2, 3\n").is_err());
        assert!(parse_gpus("No devices were found\n").is_err());
        assert!(parse_apps("GPU-x, 12, 30\n").is_err());
        assert!(parse_apps("GPU-x, [N/A], 30, python\n").is_err());
    }

    #[test]
    fn formats_mib() {
        assert_eq!(format_mib(0), "0 MiB");
        assert_eq!(format_mib(512), "512 MiB");
        assert_eq!(format_mib(1023), "1023 MiB");
        assert_eq!(format_mib(1024), "1.0 GiB");
        assert_eq!(format_mib(39117), "38.2 GiB");
        assert_eq!(format_mib(81559), "79.6 GiB");
    }

    #[test]
    fn formats_durations() {
        assert_eq!(human_duration(Duration::from_secs(5)), "5s");
        assert_eq!(human_duration(Duration::from_millis(300)), "300ms");
        assert_eq!(human_duration(Duration::from_millis(2500)), "2.5s");
    }

    #[test]
    fn serializes_tagged_on_status() {
        let json = |r: DeviceReport| serde_json::to_value(r).unwrap();
        assert_eq!(
            json(DeviceReport::NoInfo),
            serde_json::json!({"status": "none"})
        );
        assert_eq!(
            json(DeviceReport::Unknown {
                reason: "why".into()
            }),
            serde_json::json!({"status": "unknown", "reason": "why"})
        );
        let mut gpus = parse_gpus(NA_GPUS).unwrap();
        gpus.truncate(1);
        gpus[0].processes.push(DeviceProcess {
            pid: 1,
            name: "p".into(),
            used_mib: None,
            gating: None,
            container: None,
        });
        assert_eq!(
            json(DeviceReport::Devices(gpus)),
            serde_json::json!({"status": "ok", "devices": [{
                "index": 0, "uuid": "GPU-0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c40",
                "name": "NVIDIA H100 80GB HBM3", "memory_used_mib": null,
                "memory_total_mib": 81559, "utilization_pct": null,
                "processes": [{"pid": 1, "name": "p", "used_mib": null}],
            }]})
        );
    }

    #[test]
    fn lookup_prefers_override_then_path() {
        let dir = tempfile::tempdir().unwrap();
        let empty = tempfile::tempdir().unwrap();
        let smi = dir.path().join("nvidia-smi");
        std::fs::write(&smi, "#!/bin/sh\n").unwrap();
        let path = std::env::join_paths([empty.path(), dir.path()]).unwrap();

        assert_eq!(
            lookup(Some("/opt/x/smi".into()), Some(path.clone())),
            Some("/opt/x/smi".into())
        );
        // Not executable yet: skipped.
        assert_eq!(lookup(None, Some(path.clone())), None);
        std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            lookup(Some("".into()), Some(path.clone())),
            Some(smi.clone())
        );
        assert_eq!(lookup(None, Some(path)), Some(smi));
        assert_eq!(lookup(None, Some(empty.path().into())), None);
        assert_eq!(lookup(None, None), None);
    }

    #[test]
    fn missing_program_is_no_info() {
        assert_eq!(
            NvidiaSmi { program: None }.probe(DEFAULT_PROBE_TIMEOUT),
            DeviceReport::NoInfo
        );
    }
}
