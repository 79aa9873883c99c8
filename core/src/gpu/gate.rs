//! What the driver says is on each GPU, set beside the locks: which processes
//! are inside the gate, which are not, and whether a device is really idle.

use std::collections::HashSet;
use std::time::Duration;

use crate::gpu::device::{Device, DeviceProcess, DeviceReport, Gating, format_mib};
use crate::gpu::source::{self, Probed};
use crate::proc;
use crate::proc::lock_entry::FileId;
use crate::resource::Resource;

/// The group name whose members map to NVIDIA device indices.
pub const GPU_GROUP: &str = "gpu";

/// The device indices a resource stands for: `gpu:N` is device N (and a
/// MIG instance `gpu:N:...` is on it), `gpu` is every device; other names
/// are not devices.
pub fn gpu_indices(resource: &Resource, all: &[u32]) -> Option<Vec<u32>> {
    if resource.as_str() == GPU_GROUP {
        return Some(all.to_vec());
    }
    if let Some(parent) = resource.mig_parent() {
        return Some(vec![parent.gpu_index()?]);
    }
    Some(vec![resource.gpu_index()?])
}

/// A lock that gates devices: its resource and who holds it.
#[derive(Debug, Clone)]
pub struct Gate {
    pub resource: Resource,
    pub lock: FileId,
    /// Processes the kernel (and matching records) name as holders.
    pub holder_pids: Vec<u32>,
}

/// Asks the driver, within `timeout`, and sorts each process in or out of
/// the gates.
pub fn probe(timeout: Duration, gates: &[Gate]) -> DeviceReport {
    probe_sourced(timeout, gates).report
}

/// [`probe`], saying which source answered.
pub(crate) fn probe_sourced(timeout: Duration, gates: &[Gate]) -> Probed {
    let mut probed = source::probe(timeout);
    if let DeviceReport::Devices(devices) = probed.report {
        probed.report = DeviceReport::Devices(judged(devices, gates));
    }
    probed
}

fn judged(mut devices: Vec<Device>, gates: &[Gate]) -> Vec<Device> {
    let all: Vec<u32> = devices.iter().map(|d| d.index).collect();
    for d in &mut devices {
        let mapped: Vec<&Gate> = gates
            .iter()
            .filter(|g| gpu_indices(&g.resource, &all).is_some_and(|ix| ix.contains(&d.index)))
            .collect();
        judge(&mut d.processes, &mapped);
        for instance in &mut d.mig_instances {
            // An instance is gated by its own lock and by what excludes it
            // (gpu:N, gpu), not by a sibling's.
            let mapped: Vec<&Gate> = mapped
                .iter()
                .copied()
                .filter(|g| {
                    g.resource.mig_parent().is_none()
                        || instance.name.as_deref() == Some(g.resource.as_str())
                })
                .collect();
            judge(&mut instance.processes, &mapped);
        }
    }
    devices
}

fn judge(processes: &mut [DeviceProcess], mapped: &[&Gate]) {
    for p in processes {
        // Pid 0: a process outside this PID namespace, which no gate here
        // can be shown to hold.
        // The narrowest lock first: a job under gpu:N (or a MIG instance)
        // holds gpu:N and gpu too, shared, and its memory is the narrow
        // lock's, whatever order the directory lists them in.
        let gate = (p.pid != 0)
            .then(|| {
                (0..=2)
                    .flat_map(|b| mapped.iter().filter(move |g| breadth(&g.resource) == b))
                    .find(|g| inside(p.pid, g))
            })
            .flatten()
            .map(|g| g.resource.to_string());
        p.gating = Some(Gating {
            user: (p.pid != 0)
                .then(|| proc::process::uid_of(p.pid).map(proc::process::user_name))
                .flatten(),
            gated: gate.is_some(),
            gate,
        });
    }
}

/// How much of the machine a GPU lock covers: a MIG instance, a GPU, the
/// group.
fn breadth(resource: &Resource) -> u8 {
    if resource.mig_parent().is_some() {
        0
    } else if resource.gpu_index().is_some() {
        1
    } else {
        2
    }
}

/// Whether `pid` works inside `gate`: it holds the lock through a descriptor
/// (as the kernel reports it), or descends from a holder.
fn inside(pid: u32, gate: &Gate) -> bool {
    let holders: HashSet<u32> = gate.holder_pids.iter().copied().collect();
    let mut line = std::iter::once(pid).chain(proc::process::ancestors(pid).map(|(p, _)| p));
    if line.any(|p| holders.contains(&p)) {
        return true;
    }
    proc::fdinfo::fd_locks(&pid.to_string())
        .unwrap_or_default()
        .iter()
        .any(|(_, l)| l.file == gate.lock && !l.blocked)
}

/// Why a device cannot be called idle, in one line for `--require-idle`.
pub fn not_idle_reason(
    info: &DeviceReport,
    resource: &Resource,
    threshold_mib: u64,
) -> Option<String> {
    let devices = match info {
        DeviceReport::NoInfo => {
            return Some(format!(
                "cannot check that {resource} is idle: no NVML library and no nvidia-smi found (set DEVLOCK_NVML or DEVLOCK_NVIDIA_SMI, or run without --require-idle)"
            ));
        }
        DeviceReport::Unknown { reason } => {
            return Some(format!(
                "cannot check that {resource} is idle: {reason}; not starting"
            ));
        }
        DeviceReport::Devices(devices) => devices,
    };
    let all: Vec<u32> = devices.iter().map(|d| d.index).collect();
    let indices = gpu_indices(resource, &all)?;
    for index in indices {
        let Some(device) = devices.iter().find(|d| d.index == index) else {
            return Some(format!(
                "{resource} names GPU {index}, which nvidia-smi does not list; not starting"
            ));
        };
        let (processes, unknown) = if resource.mig_parent().is_some() {
            let Some(instance) = device
                .mig_instances
                .iter()
                .find(|i| i.name.as_deref() == Some(resource.as_str()))
            else {
                return Some(format!(
                    "{resource} names a MIG instance that GPU {index} does not have{}; not starting",
                    match &device.mig_unknown {
                        Some(why) => format!(" (its instances are unknown: {why})"),
                        None => String::new(),
                    }
                ));
            };
            (&instance.processes, &instance.processes_unknown)
        } else {
            (&device.processes, &device.processes_unknown)
        };
        if let Some(why) = unknown {
            return Some(format!(
                "cannot check that {resource} is idle: its processes are unknown ({why}); not starting"
            ));
        }
        if let Some(reason) = busy(resource, processes, threshold_mib) {
            return Some(reason);
        }
    }
    None
}

/// The first process outside the gate above the threshold, in words.
fn busy(resource: &Resource, processes: &[DeviceProcess], threshold_mib: u64) -> Option<String> {
    for p in processes.iter().filter(|p| !p.gated()) {
        let who = format!(
            "pid {} ({}, {})",
            p.pid,
            crate::show::sanitize(&p.name),
            p.user().unwrap_or("user unknown")
        );
        match p.used_mib {
            Some(mib) if mib <= threshold_mib => continue,
            Some(mib) => {
                return Some(format!(
                    "{resource} is not idle: {who} holds {} on it without holding the lock; not starting. \
                     Stop it or run without --require-idle.",
                    format_mib(mib)
                ));
            }
            None => {
                return Some(format!(
                    "{resource} is not idle: {who} is on it without holding the lock, using an unknown amount of memory; \
                     not starting. Stop it or run without --require-idle."
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_and_members_map_to_indices() {
        let all = [0, 1, 2];
        let r = |s: &str| s.parse::<Resource>().unwrap();
        assert_eq!(gpu_indices(&r("gpu"), &all), Some(vec![0, 1, 2]));
        assert_eq!(gpu_indices(&r("gpu:1"), &all), Some(vec![1]));
        assert_eq!(gpu_indices(&r("dataset"), &all), None);
    }

    #[test]
    fn a_process_inside_a_member_and_its_group_counts_for_the_member() {
        let me = std::process::id();
        let gate = |name: &str| Gate {
            resource: name.parse().unwrap(),
            lock: FileId {
                major: 0,
                minor: 0,
                ino: 0,
            },
            holder_pids: vec![me],
        };
        let (group, member, instance) = (gate("gpu"), gate("gpu:1"), gate("gpu:1:1g.18gb:gi9.ci0"));
        let mut processes = vec![DeviceProcess {
            pid: me,
            ..Default::default()
        }];
        judge(&mut processes, &[&group, &member]);
        assert_eq!(processes[0].gate(), Some("gpu:1"));
        judge(&mut processes, &[&group, &member, &instance]);
        assert_eq!(processes[0].gate(), Some("gpu:1:1g.18gb:gi9.ci0"));
        judge(&mut processes, &[&group]);
        assert_eq!(processes[0].gate(), Some("gpu"));
    }

    #[test]
    fn descendants_of_a_holder_are_inside_the_gate() {
        let me = std::process::id();
        let parent = proc::process::parent_pid(me).unwrap();
        let gate = Gate {
            resource: "gpu:0".parse().unwrap(),
            lock: FileId {
                major: 0,
                minor: 0,
                ino: 0,
            },
            holder_pids: vec![parent],
        };
        assert!(inside(me, &gate));
        let stranger = Gate {
            holder_pids: vec![4_000_000],
            ..gate
        };
        assert!(!inside(me, &stranger));
    }
}
