//! The vendor-neutral device model: one GPU, its MIG instances and the
//! processes on it, as every source (NVML, nvidia-smi, amd-smi, DRM fdinfo)
//! reports them and as status shows them; and the [`Probe`] every source is.
//!
//! Probing is advisory. Anything we cannot establish is reported as unknown
//! (`None` fields, [`DeviceReport::Unknown`]), never as zero or free.

use std::time::Duration;

use serde::Serialize;

/// One GPU as reported by the vendor tool (and, once [`crate::gpu::gate`]
/// has looked, which of its processes work inside a lock's gate): the one
/// device type, from the probe to status's JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct Device {
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
/// below its GPU (see [`crate::resource::mig`] for its resource name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct MigInstance {
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
pub struct DeviceProcess {
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
pub struct Gating {
    /// Its user, from the kernel.
    pub user: Option<String>,
    /// It, or an ancestor, holds the lock of a resource mapped to its device.
    pub gated: bool,
    /// The resource whose holder it belongs to.
    pub gate: Option<String>,
}

impl DeviceProcess {
    /// Whether it works inside a gate (false until looked at).
    pub fn gated(&self) -> bool {
        self.gating.as_ref().is_some_and(|g| g.gated)
    }

    /// Its user, once looked up.
    pub fn user(&self) -> Option<&str> {
        self.gating.as_ref().and_then(|g| g.user.as_deref())
    }

    /// The resource whose holder it belongs to.
    pub fn gate(&self) -> Option<&str> {
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
pub enum DeviceReport {
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
    pub fn devices(&self) -> &[Device] {
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

/// A source of device reports (NVML, nvidia-smi, amd-smi).
pub trait Probe {
    /// Reports the devices, taking at most about `timeout` (plus a short kill grace).
    fn probe(&self, timeout: Duration) -> DeviceReport;
}

/// Formats a MiB amount for humans: `"38.2 GiB"` from 1024 MiB up, else `"512 MiB"`.
pub fn format_mib(mib: u64) -> String {
    if mib >= 1024 {
        format!("{:.1} GiB", mib as f64 / 1024.0)
    } else {
        format!("{mib} MiB")
    }
}
