//! Which source answers for the GPUs: NVML in-process first, `nvidia-smi` as the fallback, then AMD's `amd-smi` or the kernel's DRM files, and the name of the one that answered.
//!
//! `DEVLOCK_NVML` picks the library ([`nvml::Location`]): unset or empty,
//! the system's `libnvidia-ml.so.1`; `none`, no NVML; a path, that file.
//! NVML missing (no driver), switched off, or failing (an old driver, an
//! init error) falls back to `nvidia-smi` within what is left of the time
//! limit, which is also where `DEVLOCK_NVIDIA_SMI` still counts: an
//! explicit `DEVLOCK_NVIDIA_SMI` with `DEVLOCK_NVML` unset names the tool to
//! ask, and NVML is not tried (a site that points devlock at a wrapper
//! script keeps it). A hung NVML call uses the whole limit and is reported
//! unknown: nothing is left to try the subprocess in, and a driver that
//! hangs NVML would hang `nvidia-smi` too.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::gpu::amd::{AmdSmi, drm_devices};
use crate::gpu::device::{DeviceReport, Probe};
use crate::gpu::nvidia_smi::NvidiaSmi;
use crate::gpu::nvml;

/// The source that answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Source {
    /// NVIDIA's management library, in-process.
    #[serde(rename = "nvml")]
    Nvml,
    /// The `nvidia-smi` program.
    #[serde(rename = "nvidia-smi")]
    NvidiaSmi,
    /// The `amd-smi` program.
    #[serde(rename = "amd-smi")]
    AmdSmi,
    /// The kernel's DRM files: amdgpu's sysfs and each process's fdinfo.
    #[serde(rename = "drm-fdinfo")]
    DrmFdinfo,
}

impl Source {
    /// As status writes it.
    pub fn name(self) -> &'static str {
        match self {
            Source::Nvml => "NVML",
            Source::NvidiaSmi => "nvidia-smi",
            Source::AmdSmi => "amd-smi",
            Source::DrmFdinfo => "the kernel's DRM fdinfo",
        }
    }
}

/// A probe's answer and who gave it (`None`: nobody was there to ask).
#[derive(Debug, Clone)]
pub struct Probed {
    pub report: DeviceReport,
    pub(crate) source: Option<Source>,
}

/// Asks for the devices, NVML first, within `timeout` in all; on a machine
/// without NVIDIA's tools, AMD's ([`amd_first`] turns the order round).
pub fn probe(timeout: Duration) -> Probed {
    if amd_first() {
        let probed = amd(timeout);
        if probed.report != DeviceReport::NoInfo {
            return probed;
        }
        return nvidia(timeout);
    }
    let probed = nvidia(timeout);
    if probed.report != DeviceReport::NoInfo {
        return probed;
    }
    amd(timeout)
}

/// An explicit `DEVLOCK_AMD_SMI` with neither `DEVLOCK_NVIDIA_SMI` nor a
/// `DEVLOCK_NVML` library set, or an amdgpu driver without an NVIDIA one:
/// the machine's GPUs are AMD's. Also what decides which variables `gpu:N`
/// exports ([`crate::gpu::cuda`]).
pub(crate) fn amd_first() -> bool {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    if set("DEVLOCK_AMD_SMI") {
        let nvml_named =
            std::env::var_os("DEVLOCK_NVML").is_some_and(|v| !v.is_empty() && v != "none");
        return !set("DEVLOCK_NVIDIA_SMI") && !nvml_named;
    }
    std::path::Path::new("/sys/module/amdgpu").exists()
        && !std::path::Path::new("/sys/module/nvidia").exists()
}

fn amd(timeout: Duration) -> Probed {
    let report = AmdSmi::from_env().probe(timeout);
    if report != DeviceReport::NoInfo {
        return Probed {
            report,
            source: Some(Source::AmdSmi),
        };
    }
    match drm_devices(
        std::path::Path::new("/sys/class/drm"),
        std::path::Path::new("/proc"),
    ) {
        Some(report) => Probed {
            report,
            source: Some(Source::DrmFdinfo),
        },
        None => Probed {
            report: DeviceReport::NoInfo,
            source: None,
        },
    }
}

fn nvidia(timeout: Duration) -> Probed {
    let location = nvml::Location::from_env();
    let smi = NvidiaSmi::from_env();
    let smi_named = std::env::var_os("DEVLOCK_NVIDIA_SMI").is_some_and(|v| !v.is_empty());
    if smi_named && location == nvml::Location::System {
        return via_smi(&smi, timeout);
    }
    let started = Instant::now();
    let why = match nvml::probe_at(&location, timeout) {
        nvml::Outcome::Devices(snapshot) => {
            return Probed {
                report: DeviceReport::Devices(nvml::devices(snapshot)),
                source: Some(Source::Nvml),
            };
        }
        nvml::Outcome::Off | nvml::Outcome::NotInstalled { .. } => return via_smi(&smi, timeout),
        nvml::Outcome::Unknown(why) if why.reason.starts_with("NVML") => why.reason,
        nvml::Outcome::Unknown(why) => format!("NVML: {}", why.reason),
    };
    let nvml_unknown = || Probed {
        report: DeviceReport::Unknown {
            reason: why.clone(),
        },
        source: Some(Source::Nvml),
    };
    let left = timeout.saturating_sub(started.elapsed());
    if smi.program.is_none() || left < Duration::from_millis(50) {
        return nvml_unknown();
    }
    match smi.probe(left) {
        DeviceReport::NoInfo => nvml_unknown(),
        DeviceReport::Unknown { reason } => Probed {
            report: DeviceReport::Unknown {
                reason: format!("{why}; and {reason}"),
            },
            source: Some(Source::NvidiaSmi),
        },
        devices => Probed {
            report: devices,
            source: Some(Source::NvidiaSmi),
        },
    }
}

fn via_smi(smi: &NvidiaSmi, timeout: Duration) -> Probed {
    let report = smi.probe(timeout);
    let source = (report != DeviceReport::NoInfo).then_some(Source::NvidiaSmi);
    Probed { report, source }
}

/// The probe for callers that want only the devices.
#[derive(Debug, Clone, Copy)]
pub struct Auto;

impl Probe for Auto {
    fn probe(&self, timeout: Duration) -> DeviceReport {
        probe(timeout).report
    }
}
