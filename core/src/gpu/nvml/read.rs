//! NVML read through: one session's snapshot of every GPU, its memory,
//! processes and MIG instances, each call's failure kept as [`Unknown`].

use super::*;

/// `CALL on WHAT: NVML's words`.
pub(super) fn failed(library: &Library, call: &str, what: &str, code: Code) -> Unknown {
    Unknown::new(format!("{call} on {what}: {}", library.describe(code)))
}

/// The answer for a call this NVML does not have.
pub(super) fn absent(call: &str) -> Unknown {
    Unknown::new(format!("this NVML has no {call} (an old driver)"))
}

pub(super) fn memory_of(raw: ffi::Memory) -> Memory {
    Memory {
        used_mib: raw.used / MIB,
        total_mib: raw.total / MIB,
    }
}

pub(super) fn process_of(raw: &ProcessInfo) -> Process {
    let instance = |id: u32| (id != ffi::NO_INSTANCE).then_some(id);
    Process {
        pid: raw.pid,
        used_mib: (raw.used_gpu_memory != ffi::NOT_AVAILABLE).then_some(raw.used_gpu_memory / MIB),
        gpu_instance_id: instance(raw.gpu_instance_id),
        compute_instance_id: instance(raw.compute_instance_id),
    }
}

pub(super) fn processes_of(
    library: &Library,
    device: Handle,
    what: &str,
) -> Result<Vec<Process>, Unknown> {
    let call = library
        .processes_call()
        .unwrap_or("nvmlDeviceGetComputeRunningProcesses_v3");
    match library.processes(device) {
        None => Err(absent("nvmlDeviceGetComputeRunningProcesses_v3 or _v2")),
        Some(Err(code)) => Err(failed(library, call, what, code)),
        Some(Ok(raw)) => Ok(raw.iter().map(process_of).collect()),
    }
}

/// One session: every GPU, in index order.
pub(super) fn session(library: &Library) -> Result<Snapshot, Unknown> {
    let driver_version = match library.driver_version() {
        None => Err(absent("nvmlSystemGetDriverVersion")),
        Some(Ok(version)) => Ok(crate::show::sanitize(&version)),
        Some(Err(code)) => Err(failed(
            library,
            "nvmlSystemGetDriverVersion",
            "the system",
            code,
        )),
    };
    let count = library
        .count()
        .map_err(|code| failed(library, "nvmlDeviceGetCount_v2", "the system", code))?;
    let gpus = (0..count)
        .map(|index| read_gpu(library, index))
        .collect::<Result<_, _>>()?;
    Ok(Snapshot {
        driver_version,
        gpus,
    })
}

pub(super) fn read_gpu(library: &Library, position: u32) -> Result<Gpu, Unknown> {
    let what = format!("GPU {position}");
    let device = library
        .handle(position)
        .map_err(|code| failed(library, "nvmlDeviceGetHandleByIndex_v2", &what, code))?;
    let index = match library.index(device) {
        None => position,
        Some(Ok(index)) => index,
        Some(Err(code)) => return Err(failed(library, "nvmlDeviceGetIndex", &what, code)),
    };
    // Without its identity a GPU cannot be matched to a lock or a UUID in
    // CUDA_VISIBLE_DEVICES; leaving it out would make the list look shorter
    // than the machine.
    let uuid = library
        .uuid(device)
        .map_err(|code| failed(library, "nvmlDeviceGetUUID", &what, code))?;
    let name = library
        .name(device)
        .map_err(|code| failed(library, "nvmlDeviceGetName", &what, code))?;
    let memory = library
        .memory(device)
        .map(memory_of)
        .map_err(|code| failed(library, "nvmlDeviceGetMemoryInfo", &what, code));
    let mig = read_mig(library, device, index, &what);
    let in_mig_mode = matches!(mig, Mig::On { .. });
    let utilization_pct = match library.utilization(device) {
        None => Err(absent("nvmlDeviceGetUtilizationRates")),
        Some(Ok(pct)) => Ok(pct),
        Some(Err(Code::NOT_SUPPORTED)) if in_mig_mode => Err(Unknown::new(format!(
            "NVML does not report {what}'s utilisation in MIG mode"
        ))),
        Some(Err(code)) => Err(failed(
            library,
            "nvmlDeviceGetUtilizationRates",
            &what,
            code,
        )),
    };
    let mut processes = processes_of(library, device, &what);
    let mut mig = mig;
    if let Mig::On {
        instances: Ok(instances),
        ..
    } = &mut mig
    {
        attribute(&mut processes, instances);
    }
    Ok(Gpu {
        index,
        uuid: crate::show::sanitize(&uuid),
        name: crate::show::sanitize(&name),
        memory,
        utilization_pct,
        processes,
        mig,
    })
}

/// In MIG mode the whole GPU's process list (aggregate, privileged callers
/// only) and the instances' own lists complete each other: an instance whose
/// own list failed takes its share of the GPU's, and a GPU whose list failed
/// takes the union of its instances' when every one of them is known.
pub(super) fn attribute(gpu: &mut Result<Vec<Process>, Unknown>, instances: &mut [Instance]) {
    if let Ok(all) = &*gpu {
        for instance in instances.iter_mut().filter(|i| i.processes.is_err()) {
            instance.processes = Ok(all
                .iter()
                .filter(|p| {
                    p.gpu_instance_id == Some(instance.gpu_instance_id)
                        && p.compute_instance_id == Some(instance.compute_instance_id)
                })
                .cloned()
                .collect());
        }
        return;
    }
    let union: Result<Vec<Vec<Process>>, Unknown> =
        instances.iter().map(|i| i.processes.clone()).collect();
    if let Ok(lists) = union {
        *gpu = Ok(lists.into_iter().flatten().collect());
    }
}

pub(super) fn read_mig(library: &Library, device: Handle, gpu: u32, what: &str) -> Mig {
    if !library.has_mig() {
        return Mig::NotSupported;
    }
    match library.mig_mode(device) {
        None | Some(Err(Code::NOT_SUPPORTED)) => Mig::NotSupported,
        Some(Err(code)) => Mig::Unknown(failed(library, "nvmlDeviceGetMigMode", what, code)),
        Some(Ok((0, pending))) => Mig::Off {
            pending_on: pending == 1,
        },
        Some(Ok((_, pending))) => Mig::On {
            pending_off: pending == 0,
            instances: read_instances(library, device, gpu, what),
        },
    }
}

pub(super) fn read_instances(
    library: &Library,
    device: Handle,
    gpu: u32,
    what: &str,
) -> Result<Vec<Instance>, Unknown> {
    let max = match library.max_mig_devices(device) {
        None => return Err(absent("nvmlDeviceGetMaxMigDeviceCount")),
        Some(result) => {
            result.map_err(|code| failed(library, "nvmlDeviceGetMaxMigDeviceCount", what, code))?
        }
    };
    let mut instances = Vec::new();
    for slot in 0..max {
        let here = format!("MIG device {slot} of {what}");
        let handle = match library.mig_device(device, slot) {
            None => return Err(absent("nvmlDeviceGetMigDeviceHandleByIndex")),
            // An empty slot.
            Some(Err(Code::NOT_FOUND)) => continue,
            Some(Err(code)) => {
                return Err(failed(
                    library,
                    "nvmlDeviceGetMigDeviceHandleByIndex",
                    &here,
                    code,
                ));
            }
            Some(Ok(handle)) => handle,
        };
        instances.push(read_instance(library, device, handle, gpu, slot, &here)?);
    }
    instances.sort_by_key(|i| (i.gpu_instance_id, i.compute_instance_id));
    Ok(instances)
}

/// A required answer about a MIG device: the call, or why it is unknown.
pub(super) fn need<T>(
    library: &Library,
    call: &str,
    what: &str,
    answer: Option<Result<T, Code>>,
) -> Result<T, Unknown> {
    match answer {
        None => Err(absent(call)),
        Some(Ok(value)) => Ok(value),
        Some(Err(code)) => Err(failed(library, call, what, code)),
    }
}

pub(super) fn read_instance(
    library: &Library,
    parent: Handle,
    handle: Handle,
    gpu: u32,
    mig_index: u32,
    what: &str,
) -> Result<Instance, Unknown> {
    // Handles may be reused and change under a reconfiguration (nvml.h);
    // a handle that is not this GPU's MIG device is not silently taken as one.
    if !need(
        library,
        "nvmlDeviceIsMigDeviceHandle",
        what,
        library.is_mig_device(handle),
    )? {
        return Err(Unknown::new(format!("{what} is not a MIG device handle")));
    }
    let owner = need(
        library,
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        what,
        library.mig_parent(handle),
    )?;
    if owner != parent {
        return Err(Unknown::new(format!("{what} belongs to another GPU")));
    }
    let uuid = library
        .uuid(handle)
        .map_err(|code| failed(library, "nvmlDeviceGetUUID", what, code))?;
    let device_name = library
        .name(handle)
        .map_err(|code| failed(library, "nvmlDeviceGetName", what, code))?;
    let gpu_instance_id = need(
        library,
        "nvmlDeviceGetGpuInstanceId",
        what,
        library.gpu_instance_id(handle),
    )?;
    let compute_instance_id = need(
        library,
        "nvmlDeviceGetComputeInstanceId",
        what,
        library.compute_instance_id(handle),
    )?;
    let profile = mig::profile_of_device_name(&device_name).map(str::to_owned);
    let name = match &profile {
        None => Err(Unknown::new(format!(
            "NVML's name for {what}, \"{}\", names no MIG profile",
            crate::show::sanitize(&device_name)
        ))),
        Some(profile) => mig::instance_name(gpu, profile, gpu_instance_id, compute_instance_id)
            .map_err(|why| Unknown::new(format!("{what} has no resource name: {why}"))),
    };
    Ok(Instance {
        name,
        mig_index,
        uuid: crate::show::sanitize(&uuid),
        device_name: crate::show::sanitize(&device_name),
        profile,
        gpu_instance_id,
        compute_instance_id,
        memory: library
            .memory(handle)
            .map(memory_of)
            .map_err(|code| failed(library, "nvmlDeviceGetMemoryInfo", what, code)),
        processes: processes_of(library, handle, what),
    })
}
