//! nvidia-smi as a device source: its two CSV queries, run under a hard
//! timeout ([`crate::gpu::tool`]), parsed into the device model
//! ([`crate::gpu::device`]) and joined on the GPU's UUID.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::gpu::device::{Device, DeviceProcess, DeviceReport, Probe};
use crate::gpu::tool::{deadline_in, lookup_tool, run_tool};

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

/// Runs one query; `Err` is the reason to report as unknown.
fn query(
    program: &Path,
    args: &[&str],
    deadline: Instant,
    timeout: Duration,
) -> Result<String, String> {
    run_tool("nvidia-smi", program, args, deadline, timeout)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::device::format_mib;
    use crate::show::human_duration;
    use std::os::unix::fs::PermissionsExt;

    const SEVERAL_GPUS: &str = include_str!("../../../tests/fixtures/nvidia-smi/several.gpus.csv");
    const SEVERAL_APPS: &str = include_str!("../../../tests/fixtures/nvidia-smi/several.apps.csv");
    const NA_GPUS: &str = include_str!("../../../tests/fixtures/nvidia-smi/na.gpus.csv");
    const NA_APPS: &str = include_str!("../../../tests/fixtures/nvidia-smi/na.apps.csv");
    const IDLE_GPUS: &str = include_str!("../../../tests/fixtures/nvidia-smi/idle.gpus.csv");
    const IDLE_APPS: &str = include_str!("../../../tests/fixtures/nvidia-smi/idle.apps.csv");

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
