//! AMD GPUs: what `amd-smi` (its JSON output) and the kernel (DRM fdinfo, amdgpu's sysfs files) say is on each one, and what a command holding some is told (ROCR/HIP variables).
//!
//! [`AmdSmi`] runs `amd-smi` (`$DEVLOCK_AMD_SMI`, else on `$PATH`) with the
//! same hard time limit as `nvidia-smi`; without it, [`drm_devices`] reads
//! the kernel's files. Both give the one device type ([`Device`]). As
//! elsewhere, what cannot be established is `None`, never zero, and output
//! that does not have the documented shape is an error (the devices are
//! then unknown).
//!
//! **amd-smi** (ROCm's `amd-smi`, a Python CLI over libamd_smi) prints, with
//! `--json`, a JSON array with one object per GPU, `"gpu"` being its index:
//! `list` gives `bdf` and `uuid`; `static --asic --vram` the market name and
//! VRAM size; `metric --mem-usage --usage` used/total VRAM and
//! `gfx_activity`; `process` each GPU's `process_list`. Quantities are
//! `{"value": N, "unit": "MB"}` (amd-smi's `MB` is MiB: it divides bytes by
//! 1024²) or `"N/A"`. The shapes are those of the amd-smi docs and changelog
//! for ROCm 6.3/6.4 (tests/fixtures/amd-smi/README.md says which pages).
//! Process pids are the KFD's, i.e. the host's PID namespace.
//!
//! **DRM fdinfo** (Documentation/gpu/drm-usage-stats.rst): each open DRM
//! file of a process has `/proc/PID/fdinfo/FD` lines `drm-driver`,
//! `drm-pdev` (the PCI address, amd-smi's `bdf`), `drm-client-id` (one per
//! open file: descriptors that share a file, by dup or fork, repeat it) and
//! memory keys: `drm-resident-vram` (standard), or amdgpu's older
//! `drm-memory-vram`, in bytes or with `KiB`/`MiB`. It needs no tool, but
//! `/proc/PID/fd` of another user's process is readable only by root: such
//! processes are *unreadable*, and a GPU can then not be called idle.
//!
//! **sysfs** (`/sys/class/drm/cardN/device/`): amdgpu's
//! `mem_info_vram_total`, `mem_info_vram_used` (bytes) and
//! `gpu_busy_percent`, world-readable.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, bail};
use serde_json::Value;

use crate::gpu::device::{Device, DeviceProcess, DeviceReport, Probe};
use crate::gpu::tool::{deadline_in, lookup_tool, run_tool};

mod drm;
pub(crate) use drm::*;

/// `amd-smi list --json`: index, PCI address and UUID of each GPU.
pub(crate) const LIST_ARGS: [&str; 2] = ["list", "--json"];
/// `amd-smi static --asic --vram --json`: market name and VRAM size.
pub(crate) const STATIC_ARGS: [&str; 4] = ["static", "--asic", "--vram", "--json"];
/// `amd-smi metric --mem-usage --usage --json`: VRAM in use and activity.
pub(crate) const METRIC_ARGS: [&str; 4] = ["metric", "--mem-usage", "--usage", "--json"];
/// `amd-smi process --json`: the processes on each GPU.
pub(crate) const PROCESS_ARGS: [&str; 2] = ["process", "--json"];

const MIB: u64 = 1024 * 1024;

/// One GPU of `amd-smi list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Listed {
    pub(crate) gpu: u32,
    /// PCI address, e.g. `0000:0c:00.0` (DRM fdinfo's `drm-pdev`).
    pub(crate) bdf: Option<String>,
    pub(crate) uuid: Option<String>,
}

/// One GPU of `amd-smi static --asic --vram`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Static {
    pub(crate) gpu: u32,
    /// e.g. `AMD Instinct MI300X`.
    pub(crate) market_name: Option<String>,
    pub(crate) vram_total_mib: Option<u64>,
}

/// One GPU of `amd-smi metric --mem-usage --usage`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Metric {
    pub(crate) gpu: u32,
    pub(crate) vram_used_mib: Option<u64>,
    pub(crate) vram_total_mib: Option<u64>,
    /// Graphics engine activity, percent.
    pub(crate) gfx_activity_pct: Option<u32>,
}

/// A process on an AMD GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AmdProcess {
    /// In the host's PID namespace.
    pub(crate) pid: u32,
    /// As amd-smi reports it (`N/A` when it has none).
    pub(crate) name: String,
    /// VRAM it holds; `None` when unknown.
    pub(crate) vram_mib: Option<u64>,
}

/// A GPU as the four amd-smi queries describe it together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AmdGpu {
    /// amd-smi's GPU index.
    pub(crate) index: u32,
    pub(crate) bdf: Option<String>,
    pub(crate) uuid: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) memory_used_mib: Option<u64>,
    pub(crate) memory_total_mib: Option<u64>,
    pub(crate) utilization_pct: Option<u32>,
    pub(crate) processes: Vec<AmdProcess>,
}

/// Parses `text` and hands each per-GPU object with its index to `each`.
fn for_each_gpu<T>(
    text: &str,
    mut each: impl FnMut(u32, &serde_json::Map<String, Value>) -> anyhow::Result<T>,
) -> anyhow::Result<Vec<T>> {
    let value: Value = serde_json::from_str(text).context("not JSON")?;
    let Value::Array(entries) = value else {
        bail!("expected a JSON array with one object per GPU");
    };
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for (n, entry) in entries.iter().enumerate() {
        let Value::Object(object) = entry else {
            bail!("entry {n} is not an object");
        };
        let gpu = object
            .get("gpu")
            .and_then(Value::as_u64)
            .and_then(|g| u32::try_from(g).ok())
            .with_context(|| format!("entry {n} has no \"gpu\" index"))?;
        if !seen.insert(gpu) {
            bail!("GPU {gpu} appears twice");
        }
        out.push(each(gpu, object).with_context(|| format!("GPU {gpu}"))?);
    }
    Ok(out)
}

/// A string field; `"N/A"` and anything not a string is unknown.
fn text_field(object: &serde_json::Map<String, Value>, key: &str) -> Option<String> {
    object
        .get(key)
        .and_then(Value::as_str)
        .filter(|s| *s != "N/A" && !s.is_empty())
        .map(str::to_owned)
}

/// `{"value": N, "unit": U}` (or a bare number of `default_unit`) in MiB;
/// `"N/A"`, a negative or fractional value, or an unknown unit is unknown.
fn mib(value: Option<&Value>, default_unit: &str) -> Option<u64> {
    let (number, unit) = match value? {
        Value::Object(q) => (q.get("value")?.as_u64()?, q.get("unit")?.as_str()?),
        Value::Number(n) => (n.as_u64()?, default_unit),
        _ => return None,
    };
    let bytes_per_unit = match unit {
        "B" => 1,
        "KB" | "KiB" => 1024,
        "MB" | "MiB" => MIB,
        "GB" | "GiB" => 1024 * MIB,
        _ => return None,
    };
    Some(number.checked_mul(bytes_per_unit)? / MIB)
}

/// `{"value": N, "unit": "%"}` (or a bare number) as a percentage 0-100.
fn percent(value: Option<&Value>) -> Option<u32> {
    let number = match value? {
        Value::Object(q) if q.get("unit").and_then(Value::as_str) == Some("%") => {
            q.get("value")?.as_u64()?
        }
        Value::Number(n) => n.as_u64()?,
        _ => return None,
    };
    u32::try_from(number).ok().filter(|p| *p <= 100)
}

/// Parses `amd-smi list --json`.
pub(crate) fn parse_list(text: &str) -> anyhow::Result<Vec<Listed>> {
    for_each_gpu(text, |gpu, object| {
        Ok(Listed {
            gpu,
            bdf: text_field(object, "bdf"),
            uuid: text_field(object, "uuid"),
        })
    })
}

/// Parses `amd-smi static --asic --vram --json`.
pub(crate) fn parse_static(text: &str) -> anyhow::Result<Vec<Static>> {
    for_each_gpu(text, |gpu, object| {
        let asic = object.get("asic").and_then(Value::as_object);
        let vram = object.get("vram").and_then(Value::as_object);
        Ok(Static {
            gpu,
            market_name: asic.and_then(|a| text_field(a, "market_name")),
            vram_total_mib: vram.and_then(|v| mib(v.get("size"), "MB")),
        })
    })
}

/// Parses `amd-smi metric --mem-usage --usage --json`.
pub(crate) fn parse_metric(text: &str) -> anyhow::Result<Vec<Metric>> {
    for_each_gpu(text, |gpu, object| {
        let memory = object.get("mem_usage").and_then(Value::as_object);
        let usage = object.get("usage").and_then(Value::as_object);
        Ok(Metric {
            gpu,
            vram_used_mib: memory.and_then(|m| mib(m.get("used_vram"), "MB")),
            vram_total_mib: memory.and_then(|m| mib(m.get("total_vram"), "MB")),
            gfx_activity_pct: usage.and_then(|u| percent(u.get("gfx_activity"))),
        })
    })
}

/// What amd-smi writes in place of a process when a GPU has none.
const NO_PROCESSES: &str = "No running processes detected";

/// Parses `amd-smi process --json` into each GPU's processes.
pub(crate) fn parse_process(text: &str) -> anyhow::Result<Vec<(u32, Vec<AmdProcess>)>> {
    for_each_gpu(text, |gpu, object| {
        let list = object
            .get("process_list")
            .and_then(Value::as_array)
            .context("no \"process_list\"")?;
        let mut processes = Vec::new();
        for (n, entry) in list.iter().enumerate() {
            let info = entry
                .get("process_info")
                .with_context(|| format!("process {n} has no \"process_info\""))?;
            let info = match info {
                Value::String(s) if s == NO_PROCESSES => continue,
                Value::Object(info) => info,
                other => bail!("process {n}: unexpected {other}"),
            };
            // Without a pid the entry is useless; a guess would be worse.
            let pid = info
                .get("pid")
                .and_then(Value::as_u64)
                .and_then(|p| u32::try_from(p).ok())
                .with_context(|| format!("process {n} has no pid"))?;
            let vram = info
                .get("memory_usage")
                .and_then(Value::as_object)
                .and_then(|m| mib(m.get("vram_mem"), "B"))
                .or_else(|| mib(info.get("mem_usage"), "B"));
            processes.push(AmdProcess {
                pid,
                name: text_field(info, "name").unwrap_or_else(|| "N/A".to_owned()),
                vram_mib: vram,
            });
        }
        Ok((gpu, processes))
    })
}

/// The GPUs `list` names, each with what the other answers say about it.
/// Entries for GPUs `list` does not name are dropped.
pub(crate) fn join(
    listed: Vec<Listed>,
    statics: &[Static],
    metrics: &[Metric],
    processes: Vec<(u32, Vec<AmdProcess>)>,
) -> Vec<AmdGpu> {
    let mut processes: BTreeMap<u32, Vec<AmdProcess>> = processes.into_iter().collect();
    let mut gpus: Vec<AmdGpu> = listed
        .into_iter()
        .map(|l| {
            let s = statics.iter().find(|s| s.gpu == l.gpu);
            let m = metrics.iter().find(|m| m.gpu == l.gpu);
            AmdGpu {
                index: l.gpu,
                bdf: l.bdf,
                uuid: l.uuid,
                name: s.and_then(|s| s.market_name.clone()),
                memory_used_mib: m.and_then(|m| m.vram_used_mib),
                memory_total_mib: m
                    .and_then(|m| m.vram_total_mib)
                    .or_else(|| s.and_then(|s| s.vram_total_mib)),
                utilization_pct: m.and_then(|m| m.gfx_activity_pct),
                processes: processes.remove(&l.gpu).unwrap_or_default(),
            }
        })
        .collect();
    gpus.sort_by_key(|g| g.index);
    gpus
}

/// What a command holding AMD GPUs `indices` is told: ROCm's runtime sees
/// only those (`ROCR_VISIBLE_DEVICES`, numeric order), and HIP's own
/// variables, which count the devices ROCr left visible, are set to all of
/// them (`0..n`) so that a caller's value cannot narrow them further or
/// point past the end. Nothing when it holds none.
pub(crate) fn child_env(indices: &[u32]) -> Vec<(&'static str, String)> {
    let mut indices = indices.to_vec();
    indices.sort_unstable();
    indices.dedup();
    if indices.is_empty() {
        return Vec::new();
    }
    let join =
        |it: &mut dyn Iterator<Item = u32>| it.map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let renumbered = join(&mut (0..indices.len() as u32));
    vec![
        ("ROCR_VISIBLE_DEVICES", join(&mut indices.iter().copied())),
        ("HIP_VISIBLE_DEVICES", renumbered.clone()),
        // HIP reads CUDA_VISIBLE_DEVICES too (for portability), after ROCr.
        ("CUDA_VISIBLE_DEVICES", renumbered),
    ]
}

/// Probes AMD GPUs by running `amd-smi`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AmdSmi {
    /// The program to run; `None`: not installed.
    pub(crate) program: Option<std::path::PathBuf>,
}

impl AmdSmi {
    /// `$DEVLOCK_AMD_SMI` if set and non-empty, else `amd-smi` on `$PATH`.
    pub(crate) fn from_env() -> AmdSmi {
        AmdSmi {
            program: lookup_tool(
                "amd-smi",
                std::env::var_os("DEVLOCK_AMD_SMI"),
                std::env::var_os("PATH"),
            ),
        }
    }
}

impl Probe for AmdSmi {
    fn probe(&self, timeout: std::time::Duration) -> DeviceReport {
        let Some(program) = &self.program else {
            return DeviceReport::NoInfo;
        };
        let deadline = deadline_in(timeout);
        let ask = |args: &[&str]| run_tool("amd-smi", program, args, deadline, timeout);
        let unparsable = |e: anyhow::Error| format!("unexpected amd-smi output: {e:#}");
        let answer = (|| {
            let listed = parse_list(&ask(&LIST_ARGS)?).map_err(unparsable)?;
            if listed.is_empty() {
                return Ok(Vec::new());
            }
            let statics = parse_static(&ask(&STATIC_ARGS)?).map_err(unparsable)?;
            let metrics = parse_metric(&ask(&METRIC_ARGS)?).map_err(unparsable)?;
            let processes = parse_process(&ask(&PROCESS_ARGS)?).map_err(unparsable)?;
            Ok(join(listed, &statics, &metrics, processes))
        })();
        match answer {
            Ok(gpus) => DeviceReport::Devices(gpus.into_iter().map(device_of).collect()),
            Err(reason) => DeviceReport::Unknown { reason },
        }
    }
}

/// An amd-smi GPU as the one device type. Its pids are the host's (the
/// KFD's), mapped as NVML's are.
fn device_of(gpu: AmdGpu) -> Device {
    Device {
        index: gpu.index,
        uuid: gpu.uuid.or(gpu.bdf).unwrap_or_default(),
        name: gpu.name.unwrap_or_else(|| "AMD GPU".to_owned()),
        memory_used_mib: gpu.memory_used_mib,
        memory_total_mib: gpu.memory_total_mib,
        utilization_pct: gpu.utilization_pct,
        processes: gpu
            .processes
            .into_iter()
            .map(|p| process(p.pid, true, Some(p.name), p.vram_mib))
            .collect(),
        ..Device::default()
    }
}

/// A process on a GPU: `pid` is the host's (amd-smi) or this namespace's
/// (our own /proc scan).
fn process(pid: u32, host: bool, name: Option<String>, used_mib: Option<u64>) -> DeviceProcess {
    use crate::proc;
    let host_pid = pid;
    let local = if host {
        proc::container::local_pid(pid)
    } else {
        Some(pid)
    };
    match local {
        Some(pid) => DeviceProcess {
            pid,
            name: name
                .filter(|n| n != "N/A")
                .or_else(|| proc::process::comm_of(pid))
                .unwrap_or_else(|| "[unknown]".to_owned()),
            used_mib,
            gating: None,
            container: proc::container::container_of(pid),
        },
        None => DeviceProcess {
            pid: 0,
            name: format!("[host pid {host_pid}, not visible inside this container]"),
            used_mib,
            gating: None,
            container: None,
        },
    }
}

/// The AMD GPUs as the kernel alone describes them: amdgpu's cards in
/// `drm_class` (`/sys/class/drm`), numbered in card order, and the
/// processes with a DRM file open on each (`proc_root`'s fdinfo). `None`
/// when there is no amdgpu card. Processes whose descriptors this user
/// cannot read make every device's list unknown: one of them may be on it.
pub(crate) fn drm_devices(drm_class: &Path, proc_root: &Path) -> Option<DeviceReport> {
    let cards = read_sysfs(drm_class).ok()?;
    if cards.is_empty() {
        return None;
    }
    let scan = match scan_fdinfo(proc_root) {
        Ok(scan) => scan,
        Err(e) => {
            return Some(DeviceReport::Unknown {
                reason: format!("cannot read {}: {e}", crate::show::show_path(proc_root)),
            });
        }
    };
    let usage = vram_by_device(&scan.clients, "amdgpu");
    let unknown = (!scan.unreadable.is_empty()).then(|| {
        format!(
            "the open files of {} process(es) of other users cannot be read (run as root, or install amd-smi)",
            scan.unreadable.len()
        )
    });
    let devices = cards
        .into_iter()
        .enumerate()
        .map(|(index, card)| {
            let processes = card
                .pdev
                .as_ref()
                .and_then(|pdev| usage.get(pdev))
                .map(|list| {
                    list.iter()
                        .map(|(pid, mib)| process(*pid, false, None, *mib))
                        .collect()
                })
                .unwrap_or_default();
            Device {
                index: index as u32,
                uuid: card.pdev.clone().unwrap_or_else(|| card.card.clone()),
                name: format!("AMD GPU ({})", card.card),
                memory_used_mib: card.vram_used_mib,
                memory_total_mib: card.vram_total_mib,
                utilization_pct: card.busy_pct,
                processes,
                processes_unknown: unknown.clone(),
                ..Device::default()
            }
        })
        .collect();
    Some(DeviceReport::Devices(devices))
}

#[cfg(test)]
mod tests;
