//! The caller's `CUDA_VISIBLE_DEVICES`: which GPUs a job may ask for, and
//! what its command is told about the ones it got.
//!
//! A wrapper or a site policy that restricts a job to some GPUs does so
//! with `CUDA_VISIBLE_DEVICES`; devlock must not hand the job another GPU
//! behind its back. The caller's entries are GPU indices, read as
//! `nvidia-smi` numbers them (PCI bus order, which is what devlock exports
//! with `CUDA_DEVICE_ORDER=PCI_BUS_ID`), or `GPU-...` UUIDs (or unique
//! prefixes of them), which the probe maps to indices. As CUDA does, the
//! list ends at the first entry that is neither.

use std::time::Duration;

use crate::gpu::device::{DeviceReport, Probe};
use crate::gpu::source::Auto;
use crate::resource::Resource;
use crate::show::sanitize;
use anyhow::Result;

/// The GPUs the caller lets the job use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Visible {
    /// The variable as the caller set it, for messages.
    pub shown: String,
    /// Device indices, as nvidia-smi numbers them, in numeric order.
    pub indices: Vec<u32>,
}

/// One entry of the list, as CUDA reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    Index(u32),
    Uuid(String),
    Mig(String),
}

/// The entries up to the first one CUDA would stop at.
fn entries(text: &str) -> Vec<Entry> {
    let mut found = Vec::new();
    for entry in text.split(',').map(str::trim) {
        if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
            match entry.parse() {
                Ok(index) => found.push(Entry::Index(index)),
                Err(_) => break,
            }
        } else if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("GPU-") {
            found.push(Entry::Uuid(entry.to_owned()));
        } else if entry.len() > 4 && entry[..4].eq_ignore_ascii_case("MIG-") {
            found.push(Entry::Mig(entry.to_owned()));
        } else {
            break;
        }
    }
    found
}

impl Visible {
    /// The caller's set, or `None` when `CUDA_VISIBLE_DEVICES` is unset.
    /// UUIDs are looked up with the probe (within `probe_timeout`), which
    /// runs only when there are UUIDs to map.
    ///
    /// On an AMD machine the caller's set is `ROCR_VISIBLE_DEVICES` (amd-smi's
    /// indices, what devlock exports there), so that a nested devlock stays
    /// inside its job's GPUs as it does with NVIDIA's.
    pub(crate) fn from_env(probe_timeout: Duration) -> Result<Option<Visible>> {
        let Some(value) = std::env::var_os(variable()) else {
            return Ok(None);
        };
        let shown = value.to_string_lossy().into_owned();
        let list = entries(&shown);
        let needs_probe = list.iter().any(|e| matches!(e, Entry::Uuid(_)));
        let report = if needs_probe {
            Auto.probe(probe_timeout)
        } else {
            DeviceReport::Devices(Vec::new())
        };
        Visible::resolve(shown, &list, &report).map(Some)
    }

    fn resolve(shown: String, list: &[Entry], report: &DeviceReport) -> Result<Visible> {
        let named = |what: &str| format!("{}={} names {what}", variable(), sanitize(&shown));
        let mut indices = Vec::new();
        for entry in list {
            let index = match entry {
                Entry::Index(index) => *index,
                Entry::Mig(mig) => {
                    return Err(crate::error::usage(format!(
                        "{}, a MIG device, which devlock cannot map to a GPU index; \
                             give the GPUs' indices or GPU-UUIDs instead",
                        named(&sanitize(mig))
                    )));
                }
                Entry::Uuid(uuid) => {
                    let devices = match report {
                        DeviceReport::Devices(devices) => devices,
                        DeviceReport::NoInfo => {
                            return Err(crate::error::device(format!(
                                "{}, and without nvidia-smi devlock cannot tell which \
                                     GPU that is (set DEVLOCK_NVIDIA_SMI, or give indices)",
                                named(&sanitize(uuid))
                            )));
                        }
                        DeviceReport::Unknown { reason } => {
                            return Err(crate::error::device(format!(
                                "{}, and nvidia-smi could not say which GPU that is: {}",
                                named(&sanitize(uuid)),
                                sanitize(reason)
                            )));
                        }
                    };
                    let lower = uuid.to_ascii_lowercase();
                    let matching: Vec<u32> = devices
                        .iter()
                        .filter(|d| d.uuid.to_ascii_lowercase().starts_with(&lower))
                        .map(|d| d.index)
                        .collect();
                    match matching[..] {
                        [index] => index,
                        [] => {
                            return Err(crate::error::usage(format!(
                                "{}, which nvidia-smi does not list",
                                named(&sanitize(uuid))
                            )));
                        }
                        _ => {
                            return Err(crate::error::usage(format!(
                                "{}, which is the start of several GPUs' UUIDs",
                                named(&sanitize(uuid))
                            )));
                        }
                    }
                }
            };
            if !indices.contains(&index) {
                indices.push(index);
            }
        }
        indices.sort_unstable();
        Ok(Visible { shown, indices })
    }

    /// `CUDA_VISIBLE_DEVICES=2,3 (GPUs 2 and 3)`, or without the part in
    /// parentheses when the variable already says just that.
    fn describe(&self) -> String {
        let shown = sanitize(&self.shown);
        let plain = self
            .indices
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let gpus = match self.indices.len() {
            0 => "no GPU".to_owned(),
            1 => format!("GPU {}", self.indices[0]),
            _ => format!("GPUs {plain}"),
        };
        let var = variable();
        if shown == plain && !self.indices.is_empty() {
            format!("{var}={shown}")
        } else {
            format!("{var}={shown} ({gpus})")
        }
    }

    fn allows(&self, resource: &Resource) -> bool {
        resource
            .gpu_index()
            .is_none_or(|index| self.indices.contains(&index))
    }

    /// Fails with a usage error naming both when a resource is a GPU
    /// outside the set.
    pub(crate) fn check(&self, resources: &[Resource]) -> Result<()> {
        let Some(outside) = resources.iter().find(|r| !self.allows(r)) else {
            return Ok(());
        };
        Err(crate::error::usage(format!(
            "{outside} is outside {}; ask for {} or change {}",
            self.describe(),
            self.inside_names(),
            variable()
        )))
    }

    /// The `--any` candidates inside the set (other resources are kept);
    /// a usage error naming both when fewer than `count` are left.
    pub(crate) fn filter_candidates(
        &self,
        candidates: &[Resource],
        count: usize,
    ) -> Result<Vec<Resource>> {
        let kept: Vec<Resource> = candidates
            .iter()
            .filter(|r| self.allows(r))
            .cloned()
            .collect();
        if kept.len() >= count {
            return Ok(kept);
        }
        let names = |rs: &[Resource]| {
            rs.iter()
                .map(Resource::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let what = if kept.is_empty() {
            format!(
                "none of {} is inside {}",
                names(candidates),
                self.describe()
            )
        } else {
            format!(
                "only {} of {} {} inside {}, and --count asks for {count}",
                names(&kept),
                names(candidates),
                if kept.len() == 1 { "is" } else { "are" },
                self.describe()
            )
        };
        Err(crate::error::usage(format!(
            "--any: {what}; ask for {} or change {}",
            self.inside_names(),
            variable()
        )))
    }

    fn inside_names(&self) -> String {
        if self.indices.is_empty() {
            return "no GPU".to_owned();
        }
        self.indices
            .iter()
            .map(|i| format!("gpu:{i}"))
            .collect::<Vec<_>>()
            .join(" or ")
    }
}

/// The variable that restricts a job to some GPUs here: `ROCR_VISIBLE_DEVICES`
/// on an AMD machine, else `CUDA_VISIBLE_DEVICES`.
fn variable() -> &'static str {
    if crate::gpu::source::amd_first() {
        "ROCR_VISIBLE_DEVICES"
    } else {
        "CUDA_VISIBLE_DEVICES"
    }
}

/// Whether the caller's set matters for these resources: some are `gpu:N`.
pub(crate) fn concerns(resources: &[Resource]) -> bool {
    resources.iter().any(|r| r.gpu_index().is_some())
}

/// What the command is told about the GPUs it holds: their indices in
/// numeric order (rank 0 on the lowest), numbered as nvidia-smi does, so
/// with `CUDA_DEVICE_ORDER=PCI_BUS_ID`. Nothing when it holds no `gpu:N`
/// (the whole `gpu` group, say), so the caller's own setting passes
/// through.
///
/// On an AMD machine ([`crate::gpu::source::amd_first`]) the ROCm
/// variables instead: `ROCR_VISIBLE_DEVICES` with amd-smi's indices, and
/// `HIP_VISIBLE_DEVICES` (and `CUDA_VISIBLE_DEVICES`, which HIP also reads)
/// renumbered from 0 within them ([`crate::gpu::amd::child_env`]).
pub fn child_env<'a>(held: impl IntoIterator<Item = &'a Resource>) -> Vec<(&'static str, String)> {
    let mut indices: Vec<u32> = held.into_iter().filter_map(Resource::gpu_index).collect();
    if indices.is_empty() {
        return Vec::new();
    }
    if crate::gpu::source::amd_first() {
        return crate::gpu::amd::child_env(&indices);
    }
    indices.sort_unstable();
    indices.dedup();
    let list = indices
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    // Without CUDA_DEVICE_ORDER CUDA numbers devices fastest-first, and the
    // numbers would not match nvidia-smi's.
    vec![
        ("CUDA_VISIBLE_DEVICES", list),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned()),
    ]
}

/// A command can be given one MIG instance, alone: CUDA enumerates only one
/// MIG device per process, so a second (or a whole GPU beside it) would be
/// exported and silently unused. `count` is how many `--any` takes (1
/// without `--any`, where every resource is taken).
pub(crate) fn check_mig(resources: &[Resource], any: bool, count: usize) -> Result<()> {
    let instances: Vec<&Resource> = resources
        .iter()
        .filter(|r| r.mig_parent().is_some())
        .collect();
    if instances.is_empty() {
        return Ok(());
    }
    if any {
        if count > 1 {
            return Err(crate::error::usage(format!(
                "--any --count {count} would give one command {count} MIG instances, and CUDA uses \
                     only one MIG instance per process; take one per command (for example one devlock per worker)"
            )));
        }
        return Ok(());
    }
    let pairs: Vec<(&str, &str)> = instances.iter().map(|r| (r.as_str(), "")).collect();
    if let Err(why) = crate::resource::mig::visible_devices(&pairs) {
        return Err(crate::error::usage(why));
    }
    if let Some(gpu) = resources.iter().find(|r| r.gpu_index().is_some()) {
        return Err(crate::error::usage(format!(
            "{} is a MIG instance, and CUDA_VISIBLE_DEVICES cannot give one command a MIG \
                 instance and {gpu} beside it; take them in separate commands",
            instances[0]
        )));
    }
    Ok(())
}

/// `CUDA_VISIBLE_DEVICES` for a command holding the MIG instance
/// `instance`: its `MIG-...` UUID, from the probe.
pub(crate) fn mig_env(
    instance: &Resource,
    report: &DeviceReport,
) -> Result<Vec<(&'static str, String)>> {
    let cannot = |why: String| {
        crate::error::device(format!(
            "cannot tell CUDA which MIG instance {instance} is: {why}"
        ))
    };
    let devices = match report {
        DeviceReport::Devices(devices) => devices,
        DeviceReport::NoInfo => {
            return Err(cannot(
                "no NVML library found to ask for its UUID (set DEVLOCK_NVML)".to_owned(),
            ));
        }
        DeviceReport::Unknown { reason } => return Err(cannot(sanitize(reason))),
    };
    let gpu = instance.mig_parent().and_then(|p| p.gpu_index());
    let uuid = devices
        .iter()
        .filter(|d| Some(d.index) == gpu)
        .flat_map(|d| &d.mig_instances)
        .find(|i| i.name.as_deref() == Some(instance.as_str()))
        .map(|i| i.uuid.clone())
        .ok_or_else(|| {
            cannot(
                "its GPU has no such instance now (devlock status lists the instances; \
                 nvidia-smi's listing has none, NVML's has)"
                    .to_owned(),
            )
        })?;
    let list = crate::resource::mig::visible_devices(&[(instance.as_str(), &uuid)])
        .map_err(crate::error::usage)?;
    Ok(vec![("CUDA_VISIBLE_DEVICES", list)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::device::Device;

    fn device(index: u32, uuid: &str) -> Device {
        Device {
            index,
            uuid: uuid.to_owned(),
            name: "x".to_owned(),
            memory_used_mib: None,
            memory_total_mib: None,
            utilization_pct: None,
            processes: Vec::new(),
            ..Device::default()
        }
    }

    fn resolve(text: &str, report: &DeviceReport) -> Result<Visible> {
        Visible::resolve(text.to_owned(), &entries(text), report)
    }

    fn r(name: &str) -> Resource {
        name.parse().unwrap()
    }

    #[test]
    fn indices_and_uuids_map_to_indices_in_numeric_order() {
        let report = DeviceReport::Devices(vec![device(0, "GPU-aaaa-1"), device(1, "GPU-bbbb-2")]);
        assert_eq!(resolve("3, 2", &report).unwrap().indices, [2, 3]);
        assert_eq!(resolve("GPU-bbbb,0", &report).unwrap().indices, [0, 1]);
        assert_eq!(resolve("gpu-AAAA-1", &report).unwrap().indices, [0]);
        // CUDA stops at the first entry that is neither.
        assert_eq!(resolve("1,-1,0", &report).unwrap().indices, [1]);
        assert_eq!(resolve("", &report).unwrap().indices, Vec::<u32>::new());
        assert!(resolve("GPU-cccc", &report).is_err());
        assert!(resolve("GPU-", &report).unwrap().indices.is_empty());
        let ambiguous = DeviceReport::Devices(vec![device(0, "GPU-ab1"), device(1, "GPU-ab2")]);
        assert!(resolve("GPU-ab", &ambiguous).is_err());
        assert!(resolve("MIG-1234", &report).is_err());
        assert!(resolve("GPU-aaaa", &DeviceReport::NoInfo).is_err());
    }

    #[test]
    fn gpus_outside_the_set_are_refused_or_skipped() {
        let visible = resolve("2,3", &DeviceReport::NoInfo).unwrap();
        assert!(visible.check(&[r("gpu:3"), r("gpu"), r("dataset")]).is_ok());
        let err = visible.check(&[r("gpu:0")]).unwrap_err();
        assert_eq!(
            format!("{err}"),
            "gpu:0 is outside CUDA_VISIBLE_DEVICES=2,3; ask for gpu:2 or gpu:3 or change \
             CUDA_VISIBLE_DEVICES"
        );
        let all = [r("gpu:0"), r("gpu:1"), r("gpu:2"), r("gpu:3")];
        assert_eq!(
            visible.filter_candidates(&all, 1).unwrap(),
            [r("gpu:2"), r("gpu:3")]
        );
        assert!(visible.filter_candidates(&all[..2], 1).is_err());
        assert!(visible.filter_candidates(&all, 3).is_err());
    }

    #[test]
    fn several_devices_are_exported_in_numeric_order() {
        let r = |s: &str| s.parse::<Resource>().unwrap();
        assert_eq!(
            child_env(&[r("gpu:10"), r("gpu:2")]),
            [
                ("CUDA_VISIBLE_DEVICES", "2,10".to_owned()),
                ("CUDA_DEVICE_ORDER", "PCI_BUS_ID".to_owned())
            ]
        );
        assert!(child_env(&[r("gpu"), r("dataset")]).is_empty());
        // A member of gpu that is not an index is no resource at all (one
        // name per device), so none can leave the variable unset unseen.
        assert!("gpu:x".parse::<Resource>().is_err());
    }

    #[test]
    fn a_command_gets_one_mig_instance_alone() {
        let r = |s: &str| s.parse::<Resource>().unwrap();
        let (a, b) = (r("gpu:0:1g.18gb:gi9.ci0"), r("gpu:0:1g.18gb:gi10.ci0"));
        assert!(check_mig(&[a.clone(), r("dataset")], false, 1).is_ok());
        let err = check_mig(&[a.clone(), b.clone()], false, 1).unwrap_err();
        assert!(
            format!("{err}").contains("only one MIG instance per process"),
            "{err}"
        );
        assert!(check_mig(&[a.clone(), r("gpu:1")], false, 1).is_err());
        assert!(check_mig(&[a.clone(), b.clone()], true, 1).is_ok());
        assert!(check_mig(&[a.clone(), b], true, 2).is_err());
        let mut gpu = device(0, "GPU-aaaa-1");
        gpu.mig_instances.push(crate::gpu::device::MigInstance {
            name: Some(a.to_string()),
            uuid: "MIG-c1d2".to_owned(),
            ..Default::default()
        });
        let report = DeviceReport::Devices(vec![gpu]);
        assert_eq!(
            mig_env(&a, &report).unwrap(),
            [("CUDA_VISIBLE_DEVICES", "MIG-c1d2".to_owned())]
        );
        assert!(mig_env(&r("gpu:0:1g.18gb:gi11.ci0"), &report).is_err());
        assert!(mig_env(&a, &DeviceReport::NoInfo).is_err());
    }
}
