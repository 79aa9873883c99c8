//! The GPU families: each GPU the probe lists (memory, processes in and
//! outside a gate, utilisation), the budgets held on it, and its MIG
//! instances.

use super::families::{
    GPU_BUDGETED, GPU_GATED, GPU_INFO, GPU_PROCESSES, GPU_ROOM, GPU_TOTAL, GPU_UNGATED, GPU_USED,
    GPU_UTILIZATION, MIG_TOTAL, MIG_USED,
};
use super::{Exposition, bytes};
use crate::gpu::device::{Device, DeviceReport};
use crate::resource::Resource;
use crate::view::ResourceView;

/// The GPU families, in the order they are listed.
pub(super) fn gpus(out: &mut Exposition, resources: &[ResourceView], info: Option<&DeviceReport>) {
    let devices: &[Device] = info.map_or(&[], DeviceReport::devices);
    let each = |value: &dyn Fn(&Device) -> f64| -> Vec<(Vec<String>, f64)> {
        devices
            .iter()
            .map(|d| (vec![d.index.to_string()], value(d)))
            .collect()
    };
    out.family(
        &GPU_INFO,
        devices
            .iter()
            .map(|d| {
                (
                    vec![d.index.to_string(), d.uuid.clone(), d.name.clone()],
                    1.0,
                )
            })
            .collect(),
    );
    out.family(&GPU_TOTAL, each(&|d| bytes(d.memory_total_mib)));
    out.family(&GPU_USED, each(&|d| bytes(d.memory_used_mib)));
    let used_by = |d: &Device, gated: bool| -> f64 {
        if d.processes_unknown.is_some() {
            return f64::NAN;
        }
        d.processes
            .iter()
            .filter(|p| p.gated() == gated)
            .map(|p| bytes(p.used_mib))
            .sum()
    };
    out.family(&GPU_GATED, each(&|d| used_by(d, true)));
    out.family(&GPU_UNGATED, each(&|d| used_by(d, false)));
    out.family(
        &GPU_PROCESSES,
        devices
            .iter()
            .flat_map(|d| {
                [true, false].map(|gated| {
                    let count = match d.processes_unknown {
                        Some(_) => f64::NAN,
                        None => d.processes.iter().filter(|p| p.gated() == gated).count() as f64,
                    };
                    (vec![d.index.to_string(), gated.to_string()], count)
                })
            })
            .collect(),
    );
    out.family(
        &GPU_UTILIZATION,
        each(&|d| d.utilization_pct.map_or(f64::NAN, |u| f64::from(u) / 100.0)),
    );
    budgets(out, resources);
    mig_instances(out, devices);
}

/// The memory budgets held on each `gpu:N`, and the room left there.
fn budgets(out: &mut Exposition, resources: &[ResourceView]) {
    let memory: Vec<_> = resources
        .iter()
        .filter(|r| {
            r.name
                .parse::<Resource>()
                .is_ok_and(|r| r.gpu_index().is_some())
        })
        .filter_map(|r| r.memory.as_ref())
        .collect();
    out.family(
        &GPU_BUDGETED,
        memory
            .iter()
            .map(|m| (vec![m.index.to_string()], bytes(Some(m.budgets_mib))))
            .collect(),
    );
    out.family(
        &GPU_ROOM,
        memory
            .iter()
            .map(|m| (vec![m.index.to_string()], bytes(Some(m.room_mib))))
            .collect(),
    );
}

/// Each GPU's MIG instances' memory.
fn mig_instances(out: &mut Exposition, devices: &[Device]) {
    let instances = || {
        devices.iter().flat_map(|d| {
            d.mig_instances.iter().map(move |i| {
                let name = i.name.clone().unwrap_or_else(|| {
                    format!(
                        "gpu:{}:?:gi{}.ci{}",
                        d.index, i.gpu_instance_id, i.compute_instance_id
                    )
                });
                (vec![d.index.to_string(), name], i)
            })
        })
    };
    out.family(
        &MIG_TOTAL,
        instances()
            .map(|(l, i)| (l, bytes(i.memory_total_mib)))
            .collect(),
    );
    out.family(
        &MIG_USED,
        instances()
            .map(|(l, i)| (l, bytes(i.memory_used_mib)))
            .collect(),
    );
}
