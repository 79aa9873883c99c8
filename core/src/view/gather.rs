//! The gathering of status's report: every lock in the directory (or the
//! ones asked for), looked at again while a place in line is unregistered,
//! and the GPUs with the gates on them.

use super::*;

/// A devlock takes its place in line before it registers (a plain take
/// once it has waited [`REGISTER_AFTER`]): a place nobody registered is
/// looked at again, a few times over a little more than that, before it is
/// shown as one (a stranger's lock stays; a devlock in between registers).
/// Not once the look has taken [`UNREGISTERED_WITHIN`]: each look reads
/// the descriptors again, and a stranger who makes them many and holds a
/// place in line would have status pay for them five times.
///
/// [`REGISTER_AFTER`]: crate::flock::late::REGISTER_AFTER
pub(super) const UNREGISTERED_TRIES: usize = 5;
pub(super) const UNREGISTERED_PAUSE: Duration = Duration::from_millis(50);
// The looks span more than a plain waiter's wait before it registers, by
// half as much again (its while counts from its place in line, which the
// look may find an instant after it was taken, and a busy machine is late).
const _: () = assert!(
    UNREGISTERED_PAUSE.as_millis() * (UNREGISTERED_TRIES as u128 - 1)
        >= crate::flock::late::REGISTER_AFTER.as_millis() * 3 / 2
);
pub(super) const UNREGISTERED_WITHIN: Duration = Duration::from_secs(1);

/// Whether a look that found a place nobody registered is taken again.
pub(super) fn look_again(attempt: usize, started: std::time::Instant) -> bool {
    attempt < UNREGISTERED_TRIES && started.elapsed() < UNREGISTERED_WITHIN
}

pub(super) fn has_unregistered(view: &ResourceView) -> bool {
    view.waiters
        .iter()
        .any(|w| w.source == WaiterSource::Unregistered)
}

/// Reads the state of `wanted` resources (all in the directory when empty),
/// and of the GPUs when `probe_timeout` is given.
pub fn gather(
    dir_path: &std::path::Path,
    wanted: &[Resource],
    probe_timeout: Option<Duration>,
) -> Result<StatusReport> {
    let mut report = StatusReport {
        dir: crate::show::show_path(dir_path),
        trust: Trust::default(),
        resources: Vec::new(),
        device_info: None,
        devices: Vec::new(),
        device_source: None,
        hide_idle: false,
    };
    let Some(dir) = ScratchDir::open(dir_path)? else {
        report.trust.safe = true;
        report.resources = wanted
            .iter()
            .map(|r| ResourceView {
                unknown_name: Some(never_used(&report.dir)),
                ..free_view(r)
            })
            .collect();
        if let Some(timeout) = probe_timeout {
            add_devices(&mut report, timeout, Vec::new());
        }
        return Ok(report);
    };
    report.trust = trust::of_dir(&dir);
    let names = dir.entries()?;
    let mut resources: Vec<Resource> = if wanted.is_empty() {
        names
            .iter()
            .filter_map(|n| Resource::from_file_name(n))
            .collect()
    } else {
        wanted.to_vec()
    };
    resources.sort();
    resources.dedup();
    let filter: Option<std::collections::HashSet<&Resource>> =
        (!wanted.is_empty()).then(|| resources.iter().collect());
    let dir_managed = report.trust.managed;
    let mut table;
    let mut now;
    let mut attempt = 0;
    let started = std::time::Instant::now();
    loop {
        table = LockTable::read().context("reading /proc/locks")?;
        now = SystemTime::now();
        let names = dir.entries()?;
        let mut all_waiters: HashMap<Resource, Vec<Waiter>> = HashMap::new();
        for waiter in waiters::live_waiters(&dir, &names, &table, |r| {
            filter.as_ref().is_none_or(|f| f.contains(r))
        }) {
            all_waiters
                .entry(waiter.resource.clone())
                .or_default()
                .push(waiter);
        }
        report.resources.clear();
        for resource in &resources {
            let registered = all_waiters.remove(resource).unwrap_or_default();
            let mut view = view_of(&dir, resource, &table, registered, now);
            if !names.contains(&resource.file_name()) {
                view.unknown_name = Some(never_used(&crate::show::show_path(dir.path())));
            }
            view.trust = trust::of_resource(&dir, &names, resource, dir_managed);
            label_from_members(&dir, resource, &table, &mut view, now);
            report.resources.push(view);
        }
        attempt += 1;
        if !look_again(attempt, started) || !report.resources.iter().any(has_unregistered) {
            break;
        }
        std::thread::sleep(UNREGISTERED_PAUSE);
    }
    if let Some(timeout) = probe_timeout {
        let gates = device_gates(&dir, &names, &report, &table, now);
        add_devices(&mut report, timeout, gates);
    }
    Ok(report)
}

/// Every GPU lock gates its devices, shown or not: the gates of all the
/// locks in the directory, with the holders the report (or a look of its
/// own, for a lock not shown) found.
fn device_gates(
    dir: &ScratchDir,
    names: &[String],
    report: &StatusReport,
    table: &LockTable,
    now: SystemTime,
) -> Vec<devices::Gate> {
    let mut gates = Vec::new();
    for name in names {
        let Some(resource) = Resource::from_file_name(name) else {
            continue;
        };
        if devices::gpu_indices(&resource, &[]).is_none() {
            continue;
        }
        let view = match report
            .resources
            .iter()
            .find(|v| v.name == resource.as_str())
        {
            Some(view) => view.clone(),
            None => view_of(dir, &resource, table, Vec::new(), now),
        };
        if let Some(lock) = view.lock {
            let holder_pids = view
                .holders
                .iter()
                .flat_map(|h| h.pids.iter().copied())
                .collect();
            gates.push(devices::Gate {
                resource,
                lock,
                holder_pids,
            });
        }
    }
    gates
}

pub(super) fn add_devices(report: &mut StatusReport, timeout: Duration, gates: Vec<devices::Gate>) {
    let probed = devices::probe_sourced(timeout, &gates);
    report.device_source = probed.source;
    let info = probed.report;
    let all: Vec<u32> = info.devices().iter().map(|d| d.index).collect();
    let listed = matches!(info, DeviceReport::Devices(_));
    // A device held whole (its lock or its group's, exclusively, without a
    // budget) has no room for a budget: a `--mem` taker waits for it.
    let whole = |v: &ResourceView| v.holders.iter().any(|h| h.exclusive && h.mem_mib.is_none());
    let held_whole: Vec<String> = report
        .resources
        .iter()
        .filter(|v| whole(v))
        .map(|v| v.name.clone())
        .collect();
    for view in &mut report.resources {
        let Ok(resource) = view.name.parse::<Resource>() else {
            continue;
        };
        // A GPU the driver answered without: a typo, or a device gone.
        if listed
            && let Some(index) = resource.gpu_index()
            && !all.contains(&index)
        {
            view.unknown_name = Some(no_such_gpu(index, &all));
        }
        let Some(indices) = devices::gpu_indices(&resource, &all) else {
            continue;
        };
        view.in_use_outside = outside_uses(&resource, &indices, info.devices());
        for holder in view.holders.iter_mut().filter(|h| h.via.is_none()) {
            holder.devices = indices
                .iter()
                .filter_map(|i| info.devices().iter().find(|d| d.index == *i))
                .map(|d| HolderDevice {
                    index: d.index,
                    used_mib: d
                        .processes
                        .iter()
                        .filter(|p| p.gate() == Some(view.name.as_str()))
                        .map(|p| p.used_mib)
                        .sum(),
                    utilization_pct: d.utilization_pct,
                })
                .collect();
        }
        if let Some(index) = resource.gpu_index()
            && let Some(device) = info.devices().iter().find(|d| d.index == index)
            && device.memory_total_mib.is_some()
        {
            let (holders, budgets): (Vec<usize>, Vec<_>) = view
                .holders
                .iter()
                .enumerate()
                .filter_map(|(i, h)| {
                    let budget = crate::gpu::memory::Budget {
                        step: h.step.clone().unwrap_or_default(),
                        mem_mib: h.mem_mib?,
                        roots: h.pids.clone(),
                    };
                    Some((i, budget))
                })
                .unzip();
            // Each budget's use as admission counts it (a process counts for
            // its nearest budget holder only), measured once.
            let room = crate::gpu::memory::room(device, budgets);
            for (&i, measured) in holders.iter().zip(&room.budgets) {
                let h = &mut view.holders[i];
                h.used_mib = Some(measured.used_mib);
                // Its own use, not that of everyone inside the gate.
                for d in h.devices.iter_mut().filter(|d| d.index == index) {
                    d.used_mib = Some(measured.used_mib);
                }
            }
            view.memory = Some(ResourceMemory {
                index,
                total_mib: room.total_mib,
                budgets_mib: room.budgeted_mib(),
                used_inside_mib: room.used_inside_mib,
                used_outside_mib: room.used_outside_mib,
                room_mib: if held_whole.contains(&view.name)
                    || resource
                        .held_shared()
                        .iter()
                        .any(|g| held_whole.iter().any(|w| w == g.as_str()))
                {
                    0
                } else {
                    room.free_mib()
                },
            });
        }
    }
    report.devices = info.devices().to_vec();
    report.device_info = Some(info);
}

/// The processes outside every gate on what `resource` stands for: its
/// MIG instance's, or its GPUs'.
pub(super) fn outside_uses(
    resource: &Resource,
    indices: &[u32],
    devices: &[Device],
) -> Vec<OutsideUse> {
    let mut uses = Vec::new();
    for device in devices.iter().filter(|d| indices.contains(&d.index)) {
        let processes = match resource.mig_parent() {
            Some(_) => device
                .mig_instances
                .iter()
                .find(|i| i.name.as_deref() == Some(resource.as_str()))
                .map_or(&[][..], |i| &i.processes),
            None => &device.processes,
        };
        uses.extend(
            processes
                .iter()
                .filter(|p| !p.gated())
                .map(|p| OutsideUse::of(device.index, p)),
        );
    }
    uses
}

pub(super) fn free_view(resource: &Resource) -> ResourceView {
    ResourceView {
        name: resource.to_string(),
        state: State::Free,
        holders: Vec::new(),
        waiters: Vec::new(),
        record: None,
        stale_record: None,
        foreign_locks: Vec::new(),
        conflicts: Vec::new(),
        trust: Trust {
            safe: true,
            ..Trust::default()
        },
        lock: None,
        slots: None,
        memory: None,
        unknown_name: None,
        in_use_outside: Vec::new(),
    }
}

pub(super) fn view_of(
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    registered: Vec<Waiter>,
    now: SystemTime,
) -> ResourceView {
    // The file's identity from the directory, not from an open: a lock
    // file its owner made private (mode 0600, util-linux flock under umask
    // 077) cannot be opened, but its locks are in the kernel's table.
    let lock_name = resource.file_name();
    let Ok(st) = nix::sys::stat::fstatat(
        dir.fd(),
        lock_name.as_str(),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    ) else {
        return free_view(resource);
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        // Nobody can use it through devlock (exit 74), and what it does for
        // others is not ours to say: not "free".
        let mut view = free_view(resource);
        view.state = State::Unknown;
        return view;
    }
    let id = FileId::from_metadata(st.st_dev, st.st_ino);
    let file = crate::flock::file::open_checked(dir, &lock_name)
        .ok()
        .filter(|(_, m)| m.ino() == st.st_ino && m.dev() == st.st_dev)
        .map(|(f, _)| f);
    let queue = queue_id(dir, &lock_name);
    let mut view = build_view(
        resource,
        file.as_ref(),
        id,
        queue,
        dir,
        table,
        registered,
        now,
        Asker::STATUS,
    );
    if file.is_none() {
        view.record = Some("private");
    }
    view
}

/// The queue file's identity, when it is there and a regular file.
pub(super) fn queue_id(dir: &ScratchDir, lock_name: &str) -> Option<FileId> {
    let st = nix::sys::stat::fstatat(
        dir.fd(),
        crate::flock::queue::queue_name(lock_name).as_str(),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .ok()?;
    (st.st_mode & libc::S_IFMT == libc::S_IFREG)
        .then(|| FileId::from_metadata(st.st_dev, st.st_ino))
}

// Status's own words for a name it flags (messages.rs words status's
// types, so these live here).
/// Why status flags a name nothing has used: `never used in DIR (no lock
/// file)`.
pub(super) fn never_used(dir: &str) -> String {
    format!("never used in {}: no lock file", crate::show::sanitize(dir))
}

/// Why status flags `gpu:N` the driver does not list: `the driver lists
/// no GPU 7 (it lists gpu:0 to gpu:3)`.
pub(super) fn no_such_gpu(index: u32, listed: &[u32]) -> String {
    let list = match (listed.iter().min(), listed.iter().max()) {
        (Some(lo), Some(hi)) if listed.len() as u32 == hi - lo + 1 => {
            format!("gpu:{lo} to gpu:{hi}")
        }
        _ if listed.is_empty() => "none".to_owned(),
        _ => listed
            .iter()
            .map(|i| format!("gpu:{i}"))
            .collect::<Vec<_>>()
            .join(", "),
    };
    format!("the driver lists no GPU {index}, only {list}")
}
