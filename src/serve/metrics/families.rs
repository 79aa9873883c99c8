//! Every family `/metrics` writes: its name, its help and its label names,
//! in the order [`super::render`] writes them.

/// One family: its name, its help, its label names.
pub(super) struct Family {
    pub(super) name: &'static str,
    pub(super) help: &'static str,
    pub(super) labels: &'static [&'static str],
}

macro_rules! family {
    ($id:ident, $name:literal, [$($label:literal),*], $help:literal) => {
        pub(super) const $id: Family = Family { name: $name, help: $help, labels: &[$($label),*] };
    };
}

family!(
    BUILD_INFO,
    "devlock_build_info",
    ["version"],
    "devlock's version; always 1"
);
family!(
    STATUS_DURATION,
    "devlock_status_duration_seconds",
    [],
    "How long the snapshot served took to gather, the GPU probe included"
);
family!(
    STATUS_TIMESTAMP,
    "devlock_status_timestamp_seconds",
    [],
    "When the snapshot served was taken (Unix time); one serves for up to a second"
);
family!(
    DIR_MANAGED,
    "devlock_dir_managed",
    [],
    "1 when the lock directory and its files are root's throughout (devlock setup), else 0"
);
family!(
    TRUST_ISSUES,
    "devlock_trust_issues",
    [],
    "Files in the lock directory another user could rename, remove or replace (status names them)"
);
family!(
    LOCK_STATE,
    "devlock_lock_state",
    ["resource", "state"],
    "1 for the state each lock is in (free, held, shared, unknown), 0 for the others"
);
family!(
    LOCK_HOLDERS,
    "devlock_lock_holders",
    ["resource"],
    "Holders of each lock (a devlock and its command are one holder; a request waiting for a member is no holder of its group)"
);
family!(
    LOCK_WAITERS,
    "devlock_lock_waiters",
    ["resource"],
    "Requests waiting in each lock's line"
);
family!(
    HOLDER_HELD,
    "devlock_holder_held_seconds",
    ["resource", "step", "user", "pid", "via"],
    "How long each holder has held the lock (NaN when no record says); via is the member a group's row is held for"
);
family!(
    WAITER_WAITING,
    "devlock_waiter_waiting_seconds",
    ["resource", "step", "user", "pid", "position"],
    "How long each waiter has waited (NaN when no registration says); position 1 is next"
);
family!(
    HOLDER_BUDGET,
    "devlock_holder_budget_bytes",
    ["resource", "step", "user", "pid"],
    "The memory budget (--mem) each budget holder holds"
);
family!(
    HOLDER_OVER_BUDGET,
    "devlock_holder_over_budget",
    ["resource", "step", "user", "pid"],
    "1 when a budget holder went more than a tenth over its budget, else 0"
);
family!(
    HOLDER_IDLE,
    "devlock_holder_idle_seconds",
    ["resource", "step", "user", "pid"],
    "How long a GPU holder's GPUs have computed nothing for its job, as its holder samples them (only while idle)"
);
family!(
    GPU_HELD_DAY,
    "devlock_gpu_held_seconds_24h",
    ["gpu"],
    "Of the last 24 hours, the seconds some job held each GPU, from the usage records"
);
family!(
    HOLDER_GPU_USED,
    "devlock_holder_gpu_memory_used_bytes",
    ["resource", "step", "user", "pid", "gpu"],
    "Device memory each GPU holder's processes use on each of its GPUs"
);
family!(
    GPU_INFO,
    "devlock_gpu_info",
    ["gpu", "uuid", "name"],
    "Each GPU the probe lists, by index, with its UUID and name; always 1"
);
family!(
    GPU_TOTAL,
    "devlock_gpu_memory_total_bytes",
    ["gpu"],
    "Each GPU's memory"
);
family!(
    GPU_USED,
    "devlock_gpu_memory_used_bytes",
    ["gpu"],
    "Each GPU's memory in use, as the driver counts it"
);
family!(
    GPU_GATED,
    "devlock_gpu_memory_gated_bytes",
    ["gpu"],
    "Memory used by processes inside a lock's gate (they or an ancestor hold its lock)"
);
family!(
    GPU_UNGATED,
    "devlock_gpu_memory_ungated_bytes",
    ["gpu"],
    "Memory used by processes outside every gate (status's NOT GATED)"
);
family!(
    GPU_PROCESSES,
    "devlock_gpu_processes",
    ["gpu", "gated"],
    "Compute processes on each GPU, inside a gate or not (NaN when the source cannot list them)"
);
family!(
    GPU_UTILIZATION,
    "devlock_gpu_utilization_ratio",
    ["gpu"],
    "Each GPU's utilisation, from 0 to 1"
);
family!(
    GPU_BUDGETED,
    "devlock_gpu_memory_budgeted_bytes",
    ["gpu"],
    "The memory budgets (--mem) held on gpu:N, each the larger of its budget and its use"
);
family!(
    GPU_ROOM,
    "devlock_gpu_memory_room_bytes",
    ["gpu"],
    "Room left on gpu:N for a new budget, before its headroom (0 while it or gpu is held whole)"
);
family!(
    MIG_TOTAL,
    "devlock_mig_memory_total_bytes",
    ["gpu", "mig"],
    "Each MIG instance's memory; mig is its resource name"
);
family!(
    MIG_USED,
    "devlock_mig_memory_used_bytes",
    ["gpu", "mig"],
    "Each MIG instance's memory in use"
);
family!(
    DEVICE_STATUS,
    "devlock_device_status",
    ["status"],
    "1 for what the GPU probe found (ok: devices listed; unknown: a source failed or timed out; none: no source), 0 for the others"
);
family!(
    DEVICE_SOURCE,
    "devlock_device_source_info",
    ["source"],
    "The GPU source that answered (nvml, nvidia-smi, amd-smi, drm-fdinfo); absent when none did"
);
