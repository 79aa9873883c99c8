//! Who holds each lock and who waits, from the kernel's lock table first and
//! the records only as labels.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::devices::{self, DeviceInfo, DeviceView};
use crate::lockfile::LockFile;
use crate::procfs::{self, FileId, LockTable};
use crate::record::{self, ReadRecord, Record};
use crate::resource::Resource;
use crate::scratch::ScratchDir;
use crate::waiters::{self, Kind, Waiter};

/// One process holding a lock, as far as it can be told.
#[derive(Debug, Clone, Serialize)]
pub struct Holder {
    /// The step the record names, when a record matches the kernel's holder.
    pub step: Option<String>,
    /// The process the kernel names (or that shares the lock through an
    /// inherited descriptor when that one is gone); `None` when nobody can tell.
    pub pid: Option<u32>,
    /// Every live process known to hold it (devlock and its command).
    pub pids: Vec<u32>,
    pub user: Option<String>,
    /// RFC 3339, from the record.
    pub since: Option<String>,
    pub held_for_ms: Option<u64>,
    pub command: Option<Vec<String>>,
    pub exclusive: bool,
    /// For a group held on behalf of a member: the member.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// The semaphore slot held (`--slots`), from 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<u64>,
    /// For a GPU resource: the device memory of the holder's processes and
    /// each device's utilisation, so a hung holder shows at a glance.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<HolderDevice>,
    /// How the label was found: `record` (matched the kernel), `no-record`
    /// (a holder that wrote none, such as plain flock), `inherited` (the
    /// devlock that took it is gone; its command or a descendant holds it),
    /// `unknown` (held, but no visible process owns it).
    pub source: &'static str,
}

/// A holder's footprint on one GPU.
#[derive(Debug, Clone, Serialize)]
pub struct HolderDevice {
    pub index: u32,
    pub used_mib: Option<u64>,
    pub utilization_pct: Option<u32>,
}

/// A registered (or kernel-visible) waiter.
#[derive(Debug, Clone, Serialize)]
pub struct WaiterView {
    pub step: Option<String>,
    pub pid: u32,
    pub user: Option<String>,
    pub since: Option<String>,
    pub waiting_for_ms: Option<u64>,
    /// 1 for the longest waiter.
    pub position: usize,
}

/// A record whose process is gone or does not hold the lock.
#[derive(Debug, Clone, Serialize)]
pub struct StaleRecord {
    pub step: String,
    pub pid: u32,
    pub since: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResourceView {
    pub name: String,
    /// `free`, `held` or `shared`.
    pub state: &'static str,
    /// The semaphore size everyone in line agreed on (`--slots`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<u64>,
    pub holders: Vec<Holder>,
    pub waiters: Vec<WaiterView>,
    /// Present when the lock file's record is torn or not ours.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_record: Option<StaleRecord>,
    /// The lock file, as the kernel names it.
    #[serde(skip)]
    pub lock: Option<FileId>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StatusReport {
    pub dir: String,
    pub resources: Vec<ResourceView>,
    /// What the driver says (absent when devices were not asked about).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_info: Option<DeviceInfo>,
    /// The devices, flat, for scripts (empty when unknown or absent).
    pub devices: Vec<DeviceView>,
    /// The table leaves out idle locks (neither held nor waited for), and
    /// counts them in one line; JSON always lists everything.
    #[serde(skip)]
    pub hide_idle: bool,
}

/// Reads the state of `wanted` resources (all in the directory when empty),
/// and of the GPUs when `probe_timeout` is given.
pub fn gather(
    dir_path: &std::path::Path,
    wanted: &[Resource],
    probe_timeout: Option<Duration>,
) -> Result<StatusReport> {
    let mut report = StatusReport {
        dir: dir_path.display().to_string(),
        resources: Vec::new(),
        device_info: None,
        devices: Vec::new(),
        hide_idle: false,
    };
    let Some(dir) = ScratchDir::open(dir_path)? else {
        report.resources = wanted.iter().map(free_view).collect();
        if let Some(timeout) = probe_timeout {
            add_devices(&mut report, timeout, Vec::new());
        }
        return Ok(report);
    };
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
    let table = LockTable::read().context("reading /proc/locks")?;
    let now = SystemTime::now();
    let mut all_waiters: HashMap<Resource, Vec<Waiter>> = HashMap::new();
    let filter: Option<std::collections::HashSet<&Resource>> =
        (!wanted.is_empty()).then(|| resources.iter().collect());
    for waiter in waiters::live_waiters(&dir, &names, &table, |r| {
        filter.as_ref().is_none_or(|f| f.contains(r))
    }) {
        all_waiters
            .entry(waiter.resource.clone())
            .or_default()
            .push(waiter);
    }
    let mut sharers = Sharers::default();
    for resource in &resources {
        let waiting = all_waiters.remove(resource).unwrap_or_default();
        let mut view = view_of(&dir, resource, &table, waiting, now, &mut sharers);
        label_from_members(&dir, &names, resource, &mut view, now);
        report.resources.push(view);
    }
    if let Some(timeout) = probe_timeout {
        // Every GPU lock gates its devices, shown or not.
        let mut gates = Vec::new();
        for name in &names {
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
                None => view_of(&dir, &resource, &table, Vec::new(), now, &mut sharers),
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
        add_devices(&mut report, timeout, gates);
    }
    Ok(report)
}

fn add_devices(report: &mut StatusReport, timeout: Duration, gates: Vec<devices::Gate>) {
    let info = devices::probe(timeout, &gates);
    let all: Vec<u32> = info.devices().iter().map(|d| d.index).collect();
    for view in &mut report.resources {
        let Ok(resource) = view.name.parse::<Resource>() else {
            continue;
        };
        let Some(indices) = devices::gpu_indices(&resource, &all) else {
            continue;
        };
        for holder in view.holders.iter_mut().filter(|h| h.via.is_none()) {
            holder.devices = indices
                .iter()
                .filter_map(|i| info.devices().iter().find(|d| d.index == *i))
                .map(|d| HolderDevice {
                    index: d.index,
                    used_mib: d
                        .processes
                        .iter()
                        .filter(|p| p.gate.as_deref() == Some(view.name.as_str()))
                        .map(|p| p.used_mib)
                        .sum(),
                    utilization_pct: d.utilization_pct,
                })
                .collect();
        }
    }
    report.devices = info.devices().to_vec();
    report.device_info = Some(info);
}

fn free_view(resource: &Resource) -> ResourceView {
    ResourceView {
        name: resource.to_string(),
        state: "free",
        holders: Vec::new(),
        waiters: Vec::new(),
        record: None,
        stale_record: None,
        lock: None,
        slots: None,
    }
}

fn view_of(
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    registered: Vec<Waiter>,
    now: SystemTime,
    sharers: &mut Sharers,
) -> ResourceView {
    let Ok(file) = waiters::open_read_only(dir, &resource.file_name()) else {
        return free_view(resource);
    };
    let Ok(meta) = file.metadata() else {
        return free_view(resource);
    };
    let id = FileId::from_metadata(
        std::os::unix::fs::MetadataExt::dev(&meta),
        std::os::unix::fs::MetadataExt::ino(&meta),
    );
    let mut view = build_view(resource, &file, id, table, registered, now, sharers);
    view.slots = crate::queue::agreed_slots(dir, &resource.file_name()).filter(|n| *n > 0);
    view
}

/// The view of one lock file: holders from the kernel's table, labelled by
/// the lock file's record (an exclusive holder) or by registrations (shared
/// holders), and the line of waiters.
fn build_view(
    resource: &Resource,
    file: &std::fs::File,
    id: FileId,
    table: &LockTable,
    registered: Vec<Waiter>,
    now: SystemTime,
    sharers: &mut Sharers,
) -> ResourceView {
    let mut view = free_view(resource);
    view.lock = Some(id);
    let (holds, waiting): (Vec<Waiter>, Vec<Waiter>) =
        registered.into_iter().partition(|w| w.kind == Kind::Hold);
    // A blocked waiter in /proc/locks without a registration: plain flock,
    // or a devlock between registering and blocking.
    let blocked: Vec<u32> = table.blocked(id).map(|l| l.pid).collect();
    view.waiters = waiter_views(&waiting, &blocked, now);
    let kernel_holders: Vec<_> = table.holders(id).cloned().collect();
    if kernel_holders.is_empty() {
        return view;
    }
    let read = record::read_from(file);
    if read == ReadRecord::Unreadable {
        view.record = Some("unreadable");
    }
    let record = read.valid();
    let holds: Vec<Record> = holds.into_iter().map(|h| h.record).collect();
    view.holders = holders_of(id, &kernel_holders, record.as_ref(), &holds, now, sharers);
    view.state = if view.holders.iter().all(|h| h.exclusive) {
        "held"
    } else {
        "shared"
    };
    if let Some(record) = record
        && !view
            .holders
            .iter()
            .any(|h| h.source == "record" || h.source == "inherited")
    {
        view.stale_record = Some(StaleRecord {
            step: record.step.clone(),
            pid: record.pid,
            since: humantime::format_rfc3339_seconds(record.since()).to_string(),
        });
    }
    view
}

/// The holders of one locked file.
pub fn holders_of(
    id: FileId,
    kernel_holders: &[procfs::KernelLock],
    record: Option<&Record>,
    holds: &[Record],
    now: SystemTime,
    sharers: &mut Sharers,
) -> Vec<Holder> {
    kernel_holders
        .iter()
        .map(|lock| {
            let matching = if lock.exclusive {
                record.filter(|r| r.pid == lock.pid)
            } else {
                holds.iter().find(|r| r.pid == lock.pid)
            };
            if let Some(r) = matching {
                let live: Vec<u32> = r.live_pids().collect();
                if !live.is_empty() {
                    let source = if live.contains(&r.pid) {
                        "record"
                    } else {
                        "inherited"
                    };
                    return labelled(r, live, source, lock.exclusive, now);
                }
            }
            // Alive but not the recorded process (no record, another
            // holder's record, or a recycled pid): the kernel's word only.
            if procfs::start_time(lock.pid).is_some() {
                return Holder {
                    step: None,
                    pid: Some(lock.pid),
                    pids: vec![lock.pid],
                    user: procfs::uid_of(lock.pid).map(procfs::user_name),
                    since: None,
                    held_for_ms: None,
                    command: procfs::comm_of(lock.pid).map(|c| vec![c]),
                    exclusive: lock.exclusive,
                    via: None,
                    slot: None,
                    devices: Vec::new(),
                    source: "no-record",
                };
            }
            // The process that took the lock is gone, yet the lock is held:
            // something that inherited the descriptor still runs.
            let pids = sharers.of(id);
            match matching {
                Some(r) if !pids.is_empty() => labelled(r, pids, "inherited", lock.exclusive, now),
                _ => Holder {
                    step: None,
                    pid: pids.first().copied(),
                    user: pids
                        .first()
                        .and_then(|p| procfs::uid_of(*p))
                        .map(procfs::user_name),
                    pids,
                    since: None,
                    held_for_ms: None,
                    command: None,
                    exclusive: lock.exclusive,
                    via: None,
                    slot: None,
                    devices: Vec::new(),
                    source: "unknown",
                },
            }
        })
        .collect()
}

fn labelled(
    r: &Record,
    pids: Vec<u32>,
    source: &'static str,
    exclusive: bool,
    now: SystemTime,
) -> Holder {
    Holder {
        step: Some(r.step.clone()),
        pid: pids.first().copied(),
        user: pids
            .first()
            .and_then(|p| procfs::uid_of(*p))
            .map(procfs::user_name)
            .or_else(|| Some(procfs::user_name(r.uid))),
        pids,
        since: Some(humantime::format_rfc3339_seconds(r.since()).to_string()),
        held_for_ms: Some(elapsed_ms(r.since(), now)),
        command: Some(r.command.clone()),
        exclusive,
        via: r.via.clone(),
        slot: r.slot,
        devices: Vec::new(),
        source,
    }
}

fn waiter_views(waiting: &[Waiter], blocked: &[u32], now: SystemTime) -> Vec<WaiterView> {
    let mut views: Vec<WaiterView> = waiting
        .iter()
        .map(|w| WaiterView {
            step: Some(w.record.step.clone()),
            pid: w.record.pid,
            user: Some(procfs::user_name(w.record.uid)),
            since: Some(humantime::format_rfc3339_seconds(w.record.since()).to_string()),
            waiting_for_ms: Some(elapsed_ms(w.record.since(), now)),
            position: 0,
        })
        .collect();
    for &pid in blocked {
        if !views.iter().any(|v| v.pid == pid) {
            views.push(WaiterView {
                step: None,
                pid,
                user: procfs::uid_of(pid).map(procfs::user_name),
                since: None,
                waiting_for_ms: None,
                position: 0,
            });
        }
    }
    for (i, view) in views.iter_mut().enumerate() {
        view.position = i + 1;
    }
    views
}

fn elapsed_ms(since: SystemTime, now: SystemTime) -> u64 {
    now.duration_since(since)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

/// Processes sharing locks through inherited descriptors, found by one scan of
/// `/proc/*/fdinfo` the first time anyone asks.
#[derive(Debug, Default)]
pub struct Sharers {
    scanned: Option<HashMap<FileId, Vec<u32>>>,
}

impl Sharers {
    fn of(&mut self, id: FileId) -> Vec<u32> {
        // One scan answers for every file: it reads all processes anyway.
        let map = self.scanned.get_or_insert_with(procfs::all_flock_holders);
        map.get(&id).cloned().unwrap_or_default()
    }
}

/// A group's lock held through a descriptor that a member's command
/// inherited from a devlock that is gone has no label left (the group's
/// was that devlock's registration), but the member's lock file still
/// labels the same processes: the group's holder gets that label, marked
/// as inherited through the member.
fn label_from_members(
    dir: &ScratchDir,
    names: &[String],
    group: &Resource,
    view: &mut ResourceView,
    now: SystemTime,
) {
    if !view
        .holders
        .iter()
        .any(|h| h.source == "unknown" && !h.pids.is_empty())
    {
        return;
    }
    let prefix = format!("{group}:");
    let members: Vec<(Resource, Record)> = names
        .iter()
        .filter_map(|name| Resource::from_file_name(name))
        .filter(|member| member.as_str().starts_with(&prefix))
        .filter_map(|member| {
            let file = waiters::open_read_only(dir, &member.file_name()).ok()?;
            Some((member, record::read_from(&file).valid()?))
        })
        .collect();
    for holder in view.holders.iter_mut().filter(|h| h.source == "unknown") {
        let found = members
            .iter()
            .find(|(_, record)| record.live_pids().any(|pid| holder.pids.contains(&pid)));
        if let Some((member, record)) = found {
            let mut labelled = labelled(
                record,
                holder.pids.clone(),
                "inherited",
                holder.exclusive,
                now,
            );
            labelled.via = Some(member.to_string());
            *holder = labelled;
        }
    }
}

/// Who holds a lock we have open, without its waiters (for the waiting
/// line): the kernel's holders, labelled by the record, and by the shared
/// holders' registrations only when the lock is shared.
pub fn describe_holders(lock: &LockFile, dir: &ScratchDir, resource: &Resource) -> ResourceView {
    let table = LockTable::read().unwrap_or_default();
    let shared = table.holders(lock.id()).any(|l| !l.exclusive);
    let registered = if shared {
        let names = dir.entries().unwrap_or_default();
        waiters::live_waiters(dir, &names, &table, |r| r == resource)
            .into_iter()
            .filter(|w| w.kind == Kind::Hold)
            .collect()
    } else {
        Vec::new()
    };
    let mut view = view_now(lock, resource, &table, registered);
    view.waiters.clear();
    if view.holders.iter().any(|h| h.source == "unknown") {
        let names = dir.entries().unwrap_or_default();
        label_from_members(dir, &names, resource, &mut view, SystemTime::now());
    }
    view
}

/// The state of one resource whose lock file we have open (for the busy
/// message).
pub fn describe(lock: &LockFile, dir: &ScratchDir, resource: &Resource) -> ResourceView {
    let table = LockTable::read().unwrap_or_default();
    let names = dir.entries().unwrap_or_default();
    let registered = waiters::live_waiters(dir, &names, &table, |r| r == resource);
    let mut view = view_now(lock, resource, &table, registered);
    label_from_members(dir, &names, resource, &mut view, SystemTime::now());
    view
}

/// One open lock's view as of now, on its own (no other lock shares labels).
fn view_now(
    lock: &LockFile,
    resource: &Resource,
    table: &LockTable,
    registered: Vec<waiters::Waiter>,
) -> ResourceView {
    build_view(
        resource,
        lock.file(),
        lock.id(),
        table,
        registered,
        SystemTime::now(),
        &mut Sharers::default(),
    )
}
