//! Who holds each lock and who waits, from the kernel's lock table first and
//! the records only as labels: users come from the kernel (the uid of the
//! live process), commands are read live from `/proc`, and a record or a
//! registration is believed only where the kernel backs it.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::flock::dir::ScratchDir;
use crate::flock::file::LockFile;
use crate::flock::record::{self, ReadRecord, Record};
use crate::flock::registration::{self as waiters, Kind, Waiter};
use crate::flock::trust::{self, Trust};
use crate::gpu::device::{Device, DeviceReport};
use crate::gpu::gate as devices;
use crate::proc;
use crate::proc::locks::{FileId, LockTable, RangeLock};
use crate::resource::Resource;
use crate::text::clean;

/// A lock's state, as status says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum State {
    /// Nobody holds it, as far as status can tell.
    Free,
    /// Held exclusively.
    Held,
    /// Held shared (by one or more).
    Shared,
    /// Status cannot tell: the lock file cannot be opened and the kernel's
    /// table cannot show its holders, or the path is not a regular file.
    Unknown,
}

/// How a holder was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum HolderSource {
    /// The kernel's holder, labelled by a record that names it.
    Record,
    /// The kernel's holder, without a record that names it (plain flock).
    NoRecord,
    /// The process that took it is gone or no longer holds it; these hold
    /// it through an inherited descriptor.
    Inherited,
    /// Held, but no process this user can see owns it.
    Unknown,
}

/// How a waiter was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum WaiterSource {
    /// A devlock in line, by its registration.
    Registration,
    /// Blocked in flock(2) without a registration (util-linux flock).
    Flock,
    /// A place in line that no registration explains.
    Unregistered,
}

/// What a lock that devlock did not take on a queue file does to devlock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum Effect {
    /// It covers every ticket from some place on: nobody can join the line.
    #[serde(rename = "blocks the line")]
    BlocksTheLine,
    /// It covers the slot agreement bytes.
    #[serde(rename = "blocks the slot agreement")]
    BlocksTheSlotAgreement,
    /// Nothing.
    #[serde(rename = "none")]
    None,
}

impl Effect {
    /// The words the warnings use.
    pub(crate) fn words(self) -> &'static str {
        match self {
            Effect::BlocksTheLine => "blocks the line",
            Effect::BlocksTheSlotAgreement => "blocks the slot agreement",
            Effect::None => "none",
        }
    }
}

/// One process holding a lock, as far as it can be told.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Holder {
    /// The step the record names, when a record matches the kernel's holder.
    pub step: Option<String>,
    /// The process the kernel names (or that shares the lock through an
    /// inherited descriptor when that one is gone); `None` when nobody can tell.
    pub pid: Option<u32>,
    /// Every live process known to hold it (devlock and its command).
    pub pids: Vec<u32>,
    /// From the kernel: the owner of the first of `pids`.
    pub user: Option<String>,
    /// RFC 3339, from the record.
    pub since: Option<String>,
    pub held_for_ms: Option<u64>,
    /// The command line, read now from `/proc` (the command devlock runs,
    /// else the holding process); null when it cannot be read (`hidepid`).
    pub command: Option<Vec<String>>,
    /// The holding process's short name (`/proc/PID/comm`).
    pub name: Option<String>,
    pub exclusive: bool,
    /// For a group held on behalf of a member: the member.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// The semaphore slot held (`--slots`), from 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<u64>,
    /// A process of the holder is stopped (SIGSTOP, Ctrl-Z): it keeps the
    /// lock and does no work.
    pub stopped: bool,
    /// For a GPU resource: the device memory of the holder's processes and
    /// each device's utilisation, so a hung holder shows at a glance.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<HolderDevice>,
    /// How the holder was found: `record` (the kernel's holder, labelled by
    /// a record that names it), `no-record` (the kernel's holder, without a
    /// record that names it: plain flock, say), `inherited` (the process
    /// that took it is gone or no longer holds it; these processes hold it
    /// through an inherited descriptor), `unknown` (held, but no visible
    /// process owns it).
    pub source: HolderSource,
    /// Why an `unknown` holder cannot be seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// The hold's watcher (usage sampling, idle policy, budget watch) is
    /// gone: the job runs on, holding, unwatched.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub watch_gone: bool,
    /// A memory budget held (`--mem`), MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u64>,
    /// With a budget: what its processes use on the device, measured now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used_mib: Option<u64>,
    /// With a budget: its job is the one starting on the device (it still
    /// holds its place in line, per the kernel), so the next waits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub starting: Option<bool>,
    /// With a budget: its holder found it over budget by more than a tenth.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_budget: Option<bool>,
    /// What the holder measured when it went over.
    #[serde(skip)]
    pub over_mib: Option<u64>,
    /// How long its GPUs have computed nothing for its job, as its holder
    /// sampled them (a label from its record).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_for_ms: Option<u64>,
    /// A library hold kept past its block's end while its process still
    /// uses the device: how long ago the block ended, and what it still
    /// used there at its last look (from its record).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_for_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_mib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_gpu: Option<u32>,
    /// The place in line its record names.
    #[serde(skip)]
    pub ticket: Option<u64>,
    /// The container (or PID namespace below this one) the holder runs in,
    /// e.g. `docker 1a2b3c4d5e6f, pid 7 there`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// A GPU resource's memory as the budgets split it (`--mem`): its device's
/// total, the sum of the budgets (each its budget, or its use where more),
/// what the budget holders use, what everything else uses, and the room
/// left for a new budget (before its headroom).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResourceMemory {
    pub index: u32,
    pub total_mib: u64,
    pub budgets_mib: u64,
    pub used_inside_mib: u64,
    pub used_outside_mib: u64,
    pub room_mib: u64,
}

/// A process using a GPU outside every gate, as far as this user can see
/// it: a `pid` of 0 is outside this PID namespace, and `user` is `None`
/// where `/proc` does not show it (another user's process under `hidepid`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct OutsideUse {
    pub index: u32,
    pub pid: u32,
    pub name: String,
    pub user: Option<String>,
    pub used_mib: Option<u64>,
}

impl OutsideUse {
    fn of(index: u32, p: &crate::gpu::device::DeviceProcess) -> OutsideUse {
        OutsideUse {
            index,
            pid: p.pid,
            // Whatever its user named it: cleaned, as every text here.
            name: clean(&p.name),
            user: p.user().map(clean),
            used_mib: p.used_mib,
        }
    }
}

/// A holder's footprint on one GPU.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct HolderDevice {
    pub index: u32,
    pub used_mib: Option<u64>,
    pub utilization_pct: Option<u32>,
}

/// A registered (or kernel-visible) waiter.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct WaiterView {
    pub step: Option<String>,
    /// Null for a place in line whose owner this user cannot see.
    pub pid: Option<u32>,
    pub user: Option<String>,
    pub since: Option<String>,
    pub waiting_for_ms: Option<u64>,
    /// 1 for the longest waiter.
    pub position: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ticket: Option<u64>,
    /// Stopped (SIGSTOP): it keeps its place and everyone behind it waits.
    pub stopped: bool,
    /// `registration` (a devlock in line), `flock` (blocked in flock(2)
    /// without a registration: plain flock), `unregistered` (a place in
    /// line that no registration explains).
    pub source: WaiterSource,
    /// The memory budget it asks for (`--mem`), MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u64>,
}

/// A record whose process is gone or does not hold the lock.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct StaleRecord {
    pub step: String,
    pub pid: u32,
    pub since: String,
}

/// A lock on one of the resource's files that devlock did not take.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ForeignLock {
    pub path: String,
    /// Bytes, `1048577-EOF` style.
    pub range: String,
    pub exclusive: bool,
    /// Its owner, as far as this user can see (OFD locks name no pid).
    pub pid: Option<u32>,
    pub user: Option<String>,
    /// What it does to devlock: `blocks the line`, `blocks the slot
    /// agreement`, or `none`.
    pub effect: Effect,
}

/// A holder whose lock file was renamed or removed while it held it: it
/// still holds the old file, so another holder may be in beside it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Conflict {
    pub pid: u32,
    pub user: Option<String>,
    pub step: String,
    pub since: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ResourceView {
    pub name: String,
    /// `free`, `held`, `shared`, or `unknown` (the lock file cannot be
    /// opened and the kernel's table cannot show its holders).
    pub state: State,
    /// The semaphore size everyone in line agreed on (`--slots`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<u64>,
    pub holders: Vec<Holder>,
    pub waiters: Vec<WaiterView>,
    /// Present when the lock file's contents are not a record devlock
    /// believes (`unreadable`: torn, foreign or absurd; `private`: the file
    /// cannot be opened by this user).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_record: Option<StaleRecord>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub foreign_locks: Vec<ForeignLock>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub conflicts: Vec<Conflict>,
    pub trust: Trust,
    /// For `gpu:N` with the device's memory known: how the budgets split it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<ResourceMemory>,
    /// Why the name is likely a typo: nothing has used it here (no lock
    /// file), or it is a `gpu:N` the driver does not list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unknown_name: Option<String>,
    /// For a GPU resource: the processes on its device(s) outside every
    /// gate. The device is in use whatever the lock's state: a free lock
    /// with any of these is shown as in use, never as free.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub in_use_outside: Vec<OutsideUse>,
    /// The lock file, as the kernel names it.
    #[serde(skip)]
    pub lock: Option<FileId>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct StatusReport {
    pub dir: String,
    /// Whether another user could rename or replace the directory's files.
    pub trust: Trust,
    pub resources: Vec<ResourceView>,
    /// What the driver says (absent when devices were not asked about).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_info: Option<DeviceReport>,
    /// The devices, flat, for scripts (empty when unknown or absent).
    pub devices: Vec<Device>,
    /// Which source answered for the devices (`nvml`, `nvidia-smi`);
    /// absent when none was asked or none is installed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_source: Option<crate::gpu::source::Source>,
    /// The table leaves out idle locks (neither held nor waited for), and
    /// counts them in one line; JSON always lists everything.
    #[serde(skip)]
    pub hide_idle: bool,
}

/// A devlock takes its place in line a moment before it registers: a place
/// nobody registered is looked at again, a few times, before it is shown as
/// one (a stranger's lock stays; a devlock in between registers). Not once
/// the look has taken [`UNREGISTERED_WITHIN`]: each look reads the
/// descriptors again, and a stranger who makes them many and holds a place
/// in line would have status pay for them four times.
const UNREGISTERED_TRIES: usize = 4;
const UNREGISTERED_PAUSE: Duration = Duration::from_millis(5);
const UNREGISTERED_WITHIN: Duration = Duration::from_secs(1);

/// Whether a look that found a place nobody registered is taken again.
fn look_again(attempt: usize, started: std::time::Instant) -> bool {
    attempt < UNREGISTERED_TRIES && started.elapsed() < UNREGISTERED_WITHIN
}

fn has_unregistered(view: &ResourceView) -> bool {
    view.waiters
        .iter()
        .any(|w| w.source == WaiterSource::Unregistered)
}

/// Reads the state of `wanted` resources (all in the directory when empty),
/// and of the GPUs when `probe_timeout` is given.
pub(crate) fn gather(
    dir_path: &std::path::Path,
    wanted: &[Resource],
    probe_timeout: Option<Duration>,
) -> Result<StatusReport> {
    let mut report = StatusReport {
        dir: crate::text::show_path(dir_path),
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
                view.unknown_name = Some(never_used(&crate::text::show_path(dir.path())));
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
                None => view_of(&dir, &resource, &table, Vec::new(), now),
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
fn outside_uses(resource: &Resource, indices: &[u32], devices: &[Device]) -> Vec<OutsideUse> {
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

fn free_view(resource: &Resource) -> ResourceView {
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

fn view_of(
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
fn queue_id(dir: &ScratchDir, lock_name: &str) -> Option<FileId> {
    let st = nix::sys::stat::fstatat(
        dir.fd(),
        crate::flock::queue::queue_name(lock_name).as_str(),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .ok()?;
    (st.st_mode & libc::S_IFMT == libc::S_IFREG)
        .then(|| FileId::from_metadata(st.st_dev, st.st_ino))
}

/// The view of one lock file: holders from the kernel's table, labelled by
/// the lock file's record (an exclusive holder) or by registrations (shared
/// holders), the line of waiters, and locks that are not devlock's.
/// `asker` says who asks (see [`Asker`]).
#[allow(clippy::too_many_arguments)]
fn build_view(
    resource: &Resource,
    file: Option<&std::fs::File>,
    id: FileId,
    queue: Option<FileId>,
    dir: &ScratchDir,
    table: &LockTable,
    registered: Vec<Waiter>,
    now: SystemTime,
    asker: Asker,
) -> ResourceView {
    let mut view = free_view(resource);
    view.lock = Some(id);
    let mut holds = Vec::new();
    let mut waiting = Vec::new();
    for w in registered {
        match w.kind {
            Kind::Hold => holds.push(w.record),
            _ if !w.believed => {}
            Kind::Wait => waiting.push(w),
            Kind::Lost => view.conflicts.push(Conflict {
                pid: w.record.pid,
                user: proc::process::uid_of(w.record.pid)
                    .map(proc::process::user_name)
                    .map(|u| clean(&u)),
                step: clean(&w.record.step),
                since: humantime::format_rfc3339_seconds(w.record.since()).to_string(),
            }),
        }
    }
    let line = queue
        .map(|q| crate::flock::queue::line_view(table, q))
        .unwrap_or_default();
    if queue.is_some() {
        let path = dir
            .path()
            .join(crate::flock::queue::queue_name(&resource.file_name()));
        view.foreign_locks = line
            .foreign
            .iter()
            .map(|l| foreign_lock(&path, l, table))
            .collect();
    }
    let mut kernel_holders: Vec<_> = table.holders(id).cloned().collect();
    let in_line_for_members = drop_places_in_line(&mut kernel_holders, dir, resource, table);
    let read = match file {
        Some(f) if !kernel_holders.is_empty() => record::read_from(f),
        _ => ReadRecord::Empty,
    };
    if read == ReadRecord::Unreadable {
        view.record = Some("unreadable");
    }
    let record = read.valid();
    view.holders = holders_of(id, &kernel_holders, record.as_ref(), &holds, now, table);
    if view.holders.is_empty() && proc::container::in_child_pid_namespace() {
        // /proc/locks here leaves out every holder outside this namespace,
        // and nothing else shows them: ask the lock itself, shared, for an
        // instant (see `probe_from_inside`).
        match file.map(probe_from_inside) {
            Some(true) => view
                .holders
                .push(invisible_holder("outside this container or PID namespace")),
            Some(false) => {}
            None => view.state = State::Unknown,
        }
    }
    for holder in view.holders.iter_mut().filter(|h| h.mem_mib.is_some()) {
        // Kernel truth: the place its record names is still locked, by it.
        holder.starting = Some(match (holder.ticket, holder.pid, queue) {
            (Some(t), Some(pid), Some(q)) => crate::flock::queue::holds_place(table, q, t, pid),
            _ => false,
        });
    }
    // A budget holder that the kernel shows not holding its place any more
    // (its job started) explains no lock on that byte: anyone may lock it,
    // and that lock is a place in line of its own, not the holder's.
    let settled: Vec<u64> = view
        .holders
        .iter()
        .filter(|h| h.starting == Some(false))
        .filter_map(|h| h.ticket)
        .collect();
    let holder_tickets: Vec<u64> = record
        .iter()
        .chain(holds.iter())
        .filter_map(|r| r.ticket)
        .filter(|t| !settled.contains(t))
        .collect();
    let blocked: Vec<u32> = table.blocked(id).map(|l| l.pid).collect();
    if asker.waiters {
        view.waiters = waiter_views(
            &waiting,
            &blocked,
            &line.tickets,
            &holder_tickets,
            queue,
            table,
            now,
        );
    }
    if let Some(q) = queue {
        // Each agreement byte on its own: a stranger's beside a devlock's
        // is named, and the devlock's size still counted. A waiter's own
        // byte needs no look at the owners. (All decided on the view as the
        // kernel shows it, before any stranger is added to it.)
        let mut vouched = Vec::new();
        let mut strangers = Vec::new();
        for &n in &line.agreements {
            if asker.agreement == Some(n) {
                vouched.push(n);
                continue;
            }
            let owners = agreement_owners(table, q, n);
            // A member's waiter joins the group's line too.
            if agreement_vouched(&view, &owners)
                || owners.iter().any(|p| in_line_for_members.contains(p))
            {
                vouched.push(n);
            } else {
                strangers.push((n, owners));
            }
        }
        for (n, owners) in strangers {
            stranger_agreement(&mut view, dir, resource, q, n, &owners, table);
        }
        view.slots = vouched.into_iter().find(|&n| n > 0);
    }
    slot_strangers(&mut view, dir, resource, table, &kernel_holders, now);
    for lease in table.leases(id).iter().filter(|l| !l.blocked) {
        // Every open of the lock file for writing waits for it: the
        // resource is in use, by whoever holds the lease.
        let pids = if proc::process::start_time(lease.pid).is_some() {
            vec![lease.pid]
        } else {
            Vec::new()
        };
        let mut holder = bare(pids, None, HolderSource::NoRecord, true);
        holder.note = Some("a file lease on the lock file, not devlock's".to_owned());
        view.holders.push(holder);
    }
    if !view.holders.is_empty() {
        view.state = if view.holders.iter().all(|h| h.exclusive) {
            State::Held
        } else {
            State::Shared
        };
    }
    if let Some(record) = record
        && !view.holders.iter().any(|h| {
            h.source == HolderSource::Record
                || (h.source == HolderSource::Inherited && h.step.is_some())
        })
    {
        view.stale_record = Some(StaleRecord {
            step: clean(&record.step),
            pid: record.pid,
            since: humantime::format_rfc3339_seconds(record.since()).to_string(),
        });
    }
    view
}

/// A request waiting for a member (`gpu:0`, or with `--any` each of
/// `gpu:0`..`gpu:3`) holds the member's group (`gpu`, and a MIG instance's
/// GPU too) shared meanwhile, once per member it waits on, so that a taker
/// of the whole group waits behind it: a place in line, not a hold. The
/// kernel lists those shared locks among the group's holders, where they
/// read as holders (to a user who cannot see the waiter's descriptors, as
/// unknown ones). A believed registration of a wait on a member (the kernel
/// shows its very process holding it, by its descriptors or its tag) takes
/// one such shared lock of its process out, per member waited on: the
/// waiter is shown as the member's waiter, for every user. Returns the
/// pids whose places were taken out.
fn drop_places_in_line(
    kernel_holders: &mut Vec<proc::locks::KernelLock>,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
) -> Vec<u32> {
    if kernel_holders.iter().all(|l| l.exclusive) {
        return Vec::new();
    }
    let names = dir.entries().unwrap_or_default();
    let mut waits: HashMap<u32, usize> = HashMap::new();
    for w in waiters::live_waiters(dir, &names, table, |r| r.held_shared().contains(resource)) {
        if w.kind == Kind::Wait && w.believed {
            *waits.entry(w.record.pid).or_default() += 1;
        }
    }
    let mut dropped = Vec::new();
    kernel_holders.retain(|l| match waits.get_mut(&l.pid) {
        Some(n) if *n > 0 && !l.exclusive => {
            *n -= 1;
            dropped.push(l.pid);
            false
        }
        _ => true,
    });
    dropped
}

/// Whether a devlock in the view vouches for an agreement whose byte
/// `owners` hold ([`agreement_owners`]): one of them is one of the holders
/// and waiters shown, or, where this user cannot see owners, somebody is
/// shown at all.
fn agreement_vouched(view: &ResourceView, owners: &[u32]) -> bool {
    if owners.is_empty() {
        return !view.holders.is_empty()
            || view
                .waiters
                .iter()
                .any(|w| w.source == WaiterSource::Registration);
    }
    let ours: Vec<u32> = view
        .holders
        .iter()
        .flat_map(|h| h.pids.iter().copied())
        .chain(view.waiters.iter().filter_map(|w| w.pid))
        .collect();
    owners.iter().any(|p| ours.contains(p))
}

/// The processes this user can see holding the agreement byte of `n` slots.
fn agreement_owners(table: &LockTable, queue: FileId, n: u64) -> Vec<u32> {
    let at = 4096 + n;
    table
        .range_lock_owners(queue)
        .into_iter()
        .filter(|(_, l)| l.ofd && !l.exclusive && !l.blocked && l.is_byte(at))
        .map(|(pid, _)| pid)
        .collect()
}

/// An agreement on the slot count that no devlock in the view vouches for
/// ([`agreement_vouched`]) is a stranger's lock on a byte that matters:
/// named as a lock that is not devlock's, and for a count of slots, as the
/// resource held (by the first of `owners`, or by somebody this user cannot
/// see), never `free` with a count nobody uses.
fn stranger_agreement(
    view: &mut ResourceView,
    dir: &ScratchDir,
    resource: &Resource,
    queue: FileId,
    n: u64,
    owners: &[u32],
    table: &LockTable,
) {
    let at = 4096 + n;
    let lock = RangeLock {
        file: queue,
        pid: None,
        ofd: true,
        exclusive: false,
        blocked: false,
        start: at,
        end: Some(at),
    };
    let path = dir
        .path()
        .join(crate::flock::queue::queue_name(&resource.file_name()));
    let mut foreign = foreign_lock(&path, &lock, table);
    foreign.effect = Effect::BlocksTheSlotAgreement;
    if !view.foreign_locks.iter().any(|f| f.range == foreign.range) {
        view.foreign_locks.push(foreign);
    }
    if n > 0 && view.holders.is_empty() {
        const NOTE: &str = "a lock that is not devlock's on the slot agreement";
        let mut holder = match owners.first() {
            Some(pid) => bare(vec![*pid], None, HolderSource::NoRecord, true),
            None => invisible_holder(NOTE),
        };
        holder.note = Some(NOTE.to_owned());
        view.holders.push(holder);
    }
}

/// How many slot files status looks at past the agreed count: a stranger's
/// flock on one that no `--slots` run uses now is found all the same.
const SLOT_FILES_LOOKED_AT: u64 = 64;

/// Flocks on the resource's slot files (`.R.slotK`) taken by processes that
/// do not hold `R.lock` too (a devlock slot holder holds both): plain
/// `flock` on a slot file, which takes that slot as a holder would. Shown
/// as holders of their slot, as the kernel names them.
fn slot_strangers(
    view: &mut ResourceView,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    lock_holders: &[proc::locks::KernelLock],
    now: SystemTime,
) {
    let takers: Vec<u32> = lock_holders.iter().map(|l| l.pid).collect();
    let last = view.slots.unwrap_or(0).max(SLOT_FILES_LOOKED_AT);
    for number in 1..=last {
        let name = crate::flock::slots::slot_file(resource, number);
        let Ok(st) = nix::sys::stat::fstatat(
            dir.fd(),
            name.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) else {
            // Slot files are made in order: the first missing ends them.
            break;
        };
        let id = FileId::from_metadata(st.st_dev, st.st_ino);
        let theirs: Vec<proc::locks::KernelLock> = table
            .holders(id)
            .filter(|l| !takers.contains(&l.pid))
            .cloned()
            .collect();
        for mut holder in holders_of(id, &theirs, None, &[], now, table) {
            holder.slot = Some(number);
            if holder.note.is_none() {
                holder.note = Some(format!("a flock on {name} that is not devlock's"));
            }
            view.holders.push(holder);
        }
    }
}

/// Inside a child PID namespace only: whether someone outside holds the
/// lock exclusively, asked with a non-blocking shared lock released at once.
/// For the few microseconds it is held, an exclusive `-n` taker elsewhere
/// would find the lock busy; nothing else can see holders outside, and
/// without asking status would say `free` of a held lock. Shared holders
/// outside stay invisible (a shared probe is granted beside them).
fn probe_from_inside(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // A second open: a lock on `file` itself would be ours to keep.
    let Ok(fd) = std::fs::File::open(format!("/proc/self/fd/{}", file.as_raw_fd())) else {
        return false;
    };
    use crate::sys::fs::{Flock, flock};
    let taken = flock(&fd, Flock::Shared, true).is_ok();
    if taken {
        let _ = flock(&fd, Flock::Unlock, false);
    }
    !taken
}

/// A holder nobody can see: held, but no visible process owns it.
fn invisible_holder(note: &str) -> Holder {
    let mut holder = bare(Vec::new(), None, HolderSource::Unknown, true);
    holder.note = Some(note.to_owned());
    holder
}

fn foreign_lock(path: &std::path::Path, lock: &RangeLock, table: &LockTable) -> ForeignLock {
    let pid = lock.pid.or_else(|| {
        table
            .range_lock_owners(lock.file)
            .into_iter()
            .find(|(_, l)| {
                l.start == lock.start && l.end == lock.end && l.exclusive == lock.exclusive
            })
            .map(|(pid, _)| pid)
    });
    let covers = |lo: u64, hi: u64| lock.start <= hi && lock.end.is_none_or(|e| e >= lo);
    let effect = if !lock.exclusive && !lock.ofd {
        Effect::None
    } else if covers(4096, 4096 + 65535) {
        Effect::BlocksTheSlotAgreement
    } else if lock.exclusive && covers(1 << 20, u64::MAX) {
        Effect::BlocksTheLine
    } else {
        Effect::None
    };
    ForeignLock {
        path: crate::text::show_path(path),
        range: lock.range_text(),
        exclusive: lock.exclusive,
        pid,
        user: pid
            .and_then(proc::process::uid_of)
            .map(proc::process::user_name)
            .map(|u| clean(&u)),
        effect,
    }
}

/// The holders of one locked file. For each process the kernel lists:
/// it holds the lock unless it is gone, its start time contradicts a record
/// naming it (its pid was reused), or its descriptors (when this user may
/// read them) show no such lock; then whoever shares the lock through a
/// descriptor it passed down holds it, as far as this user can see.
pub(crate) fn holders_of(
    id: FileId,
    kernel_holders: &[proc::locks::KernelLock],
    record: Option<&Record>,
    holds: &[Record],
    now: SystemTime,
    table: &LockTable,
) -> Vec<Holder> {
    kernel_holders
        .iter()
        .map(|lock| {
            let taker = lock.pid;
            // An exclusive holder's record is in the lock file, or (outside
            // a directory made for locks) in its registration.
            let registered = holds.iter().find(|r| r.pid == taker);
            let recorded = if lock.exclusive {
                record.filter(|r| r.pid == taker).or(registered)
            } else {
                registered
            };
            let alive = proc::process::start_time(taker).is_some();
            // The kernel's table names the pid that took the lock; the
            // process with that pid now is believed to hold it only where
            // its descriptors (or its tag) say so: a pid can be reused
            // within the clock tick a record's start time names.
            let holding = if alive { proc::locks::holds_now(table, taker, id) } else { None };
            // A devlock holder is its command (chain-loaded): where this
            // user cannot read its descriptors, the record that names it by
            // pid and start time says it holds.
            let holding = holding.or_else(|| recorded.filter(|r| r.names(taker)).map(|_| true));
            if holding == Some(true) {
                let r = recorded.filter(|r| r.names(taker));
                let mut pids = vec![taker];
                let child = r.and_then(|r| {
                    let c = r.child?;
                    let descends = proc::process::ancestors(c).any(|(p, _)| p == taker);
                    (descends && r.names_child(c)).then_some(c)
                });
                pids.extend(child);
                return match r {
                    Some(r) => labelled(r, pids, child, HolderSource::Record, lock.exclusive, now),
                    None => bare(pids, None, HolderSource::NoRecord, lock.exclusive),
                };
            }
            // The taker is gone, or no longer holds it, or this user cannot
            // tell: whoever shares the lock through a descriptor it passed
            // down holds it, as far as this user can see.
            let mut pids: Vec<u32> = table
                .sharers(id, taker)
                .into_iter()
                .filter(|&p| p != taker)
                .collect();
            // The recorded command first, then whatever it started.
            if let Some(c) = recorded.and_then(|r| r.child)
                && let Some(at) = pids.iter().position(|&p| p == c)
            {
                pids[..=at].rotate_right(1);
            }
            if pids.is_empty() {
                let note = match (alive, holding) {
                    (false, _) => "the process that took it is gone, and what holds it now is not visible to this user".to_owned(),
                    (true, Some(false)) => format!(
                        "taken by pid {taker}, which is alive but no longer holds it; what holds it now is open in no process this user can see (a descriptor passed on, over a unix socket, say)"
                    ),
                    (true, _) => format!(
                        "taken by pid {taker}, whose descriptors this user cannot see: whether that process still holds it, or its pid went to another since, is not known"
                    ),
                };
                let mut unknown = invisible_holder(&note);
                unknown.exclusive = lock.exclusive;
                return unknown;
            }
            let child = recorded
                .and_then(|r| r.child.filter(|c| pids.contains(c) && r.names_child(*c)));
            // A chain-loaded holder's record names the command itself: what
            // it started and left holding carries the hold's label once that
            // command is gone (its pid may belong to another process since).
            match (recorded, child) {
                (Some(r), Some(c)) => labelled(r, pids, Some(c), HolderSource::Inherited, lock.exclusive, now),
                (Some(r), None) if r.child.is_none() && !(alive && r.names(taker)) => {
                    labelled(r, pids, None, HolderSource::Inherited, lock.exclusive, now)
                }
                _ => bare(pids, None, HolderSource::Inherited, lock.exclusive),
            }
        })
        .collect()
}

/// A holder as the kernel shows it, without a label.
/// A holder as the kernel shows it, without a label: the one constructor
/// (labels, devices and notes are added to what it makes). Who it is comes
/// from `/proc` now: the user of the first pid, its command line (or that
/// of `command_of`) and name, and whether any of them is stopped.
fn bare(pids: Vec<u32>, command_of: Option<u32>, source: HolderSource, exclusive: bool) -> Holder {
    let first = pids.first().copied();
    Holder {
        step: None,
        pid: first,
        user: first
            .and_then(proc::process::uid_of)
            .map(proc::process::user_name)
            .map(|u| clean(&u)),
        command: command_of.or(first).and_then(proc::process::cmdline_of),
        name: first.and_then(proc::process::comm_of).map(|c| clean(&c)),
        stopped: pids.iter().any(|&p| proc::process::is_stopped(p)),
        pids,
        since: None,
        held_for_ms: None,
        exclusive,
        via: None,
        slot: None,
        devices: Vec::new(),
        source,
        note: None,
        watch_gone: false,
        mem_mib: None,
        used_mib: None,
        starting: None,
        over_budget: None,
        over_mib: None,
        idle_for_ms: None,
        kept_for_ms: None,
        kept_mib: None,
        kept_gpu: None,
        ticket: None,
        container: first.and_then(proc::container::container_of),
    }
}

fn labelled(
    r: &Record,
    pids: Vec<u32>,
    child: Option<u32>,
    source: HolderSource,
    exclusive: bool,
    now: SystemTime,
) -> Holder {
    let mut holder = bare(pids, child, source, exclusive);
    holder.step = Some(clean(&r.step));
    holder.since = Some(humantime::format_rfc3339_seconds(r.since()).to_string());
    holder.held_for_ms = Some(elapsed_ms(r.since(), now));
    holder.via = r.via.as_deref().map(clean);
    holder.slot = r.slot;
    holder.ticket = r.ticket;
    if let Some(mem) = r.mem_mib {
        holder.mem_mib = Some(mem);
        holder.over_budget = Some(r.over_mib.is_some());
        holder.over_mib = r.over_mib;
    }
    holder.idle_for_ms = r
        .idle_since_ms
        .map(|t| elapsed_ms(std::time::UNIX_EPOCH + Duration::from_millis(t), now));
    holder.watch_gone = r.watcher_gone();
    if let Some(t) = r.kept_ms {
        holder.kept_for_ms = Some(elapsed_ms(
            std::time::UNIX_EPOCH + Duration::from_millis(t),
            now,
        ));
        holder.kept_mib = r.kept_mib;
        holder.kept_gpu = r.kept_gpu;
    }
    holder
}

fn waiter_views(
    waiting: &[Waiter],
    blocked: &[u32],
    tickets: &[u64],
    holder_tickets: &[u64],
    queue: Option<FileId>,
    table: &LockTable,
    now: SystemTime,
) -> Vec<WaiterView> {
    let mut views: Vec<WaiterView> = waiting
        .iter()
        .map(|w| WaiterView {
            step: Some(clean(&w.record.step)),
            pid: Some(w.record.pid),
            user: proc::process::uid_of(w.record.pid)
                .map(proc::process::user_name)
                .map(|u| clean(&u)),
            since: Some(humantime::format_rfc3339_seconds(w.record.since()).to_string()),
            waiting_for_ms: Some(elapsed_ms(w.record.since(), now)),
            position: 0,
            ticket: w.record.ticket,
            stopped: proc::process::is_stopped(w.record.pid),
            source: WaiterSource::Registration,
            mem_mib: w.record.mem_mib,
        })
        .collect();
    // Places in line nobody registered: a devlock between its ticket and its
    // registration, or a lock that is not devlock's. Its owner, if visible.
    let known: Vec<u64> = views
        .iter()
        .filter_map(|v| v.ticket)
        .chain(holder_tickets.iter().copied())
        .collect();
    let unexplained: Vec<u64> = tickets
        .iter()
        .copied()
        .filter(|t| !known.contains(t))
        .collect();
    if !unexplained.is_empty() {
        let owners = queue
            .map(|q| table.range_lock_owners(q))
            .unwrap_or_default();
        for t in unexplained {
            let at = (1u64 << 20) + t;
            let pid = owners
                .iter()
                .find(|(_, l)| l.is_byte(at) && l.exclusive)
                .map(|(p, _)| *p);
            views.push(WaiterView {
                step: None,
                pid,
                user: pid
                    .and_then(proc::process::uid_of)
                    .map(proc::process::user_name)
                    .map(|u| clean(&u)),
                since: None,
                waiting_for_ms: None,
                position: 0,
                ticket: Some(t),
                stopped: pid.is_some_and(proc::process::is_stopped),
                source: WaiterSource::Unregistered,
                mem_mib: None,
            });
        }
    }
    views.sort_by_key(|v| v.ticket.unwrap_or(u64::MAX));
    for &pid in blocked {
        if !views.iter().any(|v| v.pid == Some(pid)) {
            views.push(WaiterView {
                step: None,
                pid: Some(pid),
                user: proc::process::uid_of(pid)
                    .map(proc::process::user_name)
                    .map(|u| clean(&u)),
                since: None,
                waiting_for_ms: None,
                position: 0,
                ticket: None,
                stopped: proc::process::is_stopped(pid),
                source: WaiterSource::Flock,
                mem_mib: None,
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

/// A group's holder that holds it only through an inherited descriptor
/// and has no label of its own (its devlock is gone, and so is the shared
/// hold's registration that labelled it) takes the label of a member's
/// holder that is the same processes: `train`, inherited, via `gpu:0`.
/// Only a label the member's own file backs is taken (its record names a
/// process the kernel lists for that very file, pid and start time), and
/// only for processes the kernel shows holding both files; pid, user and
/// command stay the kernel's.
fn label_from_members(
    dir: &ScratchDir,
    group: &Resource,
    table: &LockTable,
    view: &mut ResourceView,
    now: SystemTime,
) {
    let unlabelled =
        |h: &Holder| h.source == HolderSource::Inherited && h.step.is_none() && !h.pids.is_empty();
    if !view.holders.iter().any(unlabelled) {
        return;
    }
    let names = dir.entries().unwrap_or_default();
    let prefix = format!("{group}:");
    let mut labelled: Vec<(Resource, Holder)> = Vec::new();
    for member in names
        .iter()
        .filter_map(|name| Resource::from_file_name(name))
        .filter(|member| member.as_str().starts_with(&prefix))
    {
        let registered = waiters::live_waiters(dir, &names, table, |r| r == &member);
        let member_view = view_of(dir, &member, table, registered, now);
        labelled.extend(
            member_view
                .holders
                .into_iter()
                .filter(|h| {
                    h.step.is_some()
                        && matches!(h.source, HolderSource::Record | HolderSource::Inherited)
                })
                .map(|h| (member.clone(), h)),
        );
    }
    for holder in view.holders.iter_mut().filter(|h| unlabelled(h)) {
        let found = labelled
            .iter()
            .find(|(_, h)| h.pids.iter().any(|pid| holder.pids.contains(pid)));
        if let Some((member, from)) = found {
            holder.step = from.step.clone();
            holder.since = from.since.clone();
            holder.held_for_ms = from.held_for_ms;
            holder.via = Some(member.to_string());
        }
    }
}

/// Who holds a lock we have open, without its registered waiters (for the
/// waiting line): the kernel's holders, labelled by the record, and by the shared
/// holders' registrations only when the lock is shared.
pub(crate) fn describe_holders(
    lock: &LockFile,
    dir: &ScratchDir,
    resource: &Resource,
    own_agreement: Option<u64>,
) -> ResourceView {
    let table = LockTable::read().unwrap_or_default();
    let held = table.is_locked(lock.id());
    let shared = table.holders(lock.id()).any(|l| !l.exclusive);
    // The registrations are read only when they matter: a shared hold's
    // labels (or an exclusive one's outside a directory made for locks),
    // or, when nobody holds it, to tell the places in line ahead
    // that no devlock registered (a stranger's lock) from those it did.
    let registered = if shared || !held || !dir.records_in_lock_files() {
        let names = dir.entries().unwrap_or_default();
        waiters::live_waiters(dir, &names, &table, |r| r == resource)
            .into_iter()
            .filter(|w| w.kind != Kind::Lost)
            .collect()
    } else {
        Vec::new()
    };
    // Held: no waiter is shown, so none is looked for.
    let asker = Asker {
        agreement: own_agreement,
        waiters: !held,
    };
    let mut view = view_now(lock, dir, resource, &table, registered, asker);
    view.waiters
        .retain(|w| w.source == WaiterSource::Unregistered);
    label_from_members(dir, resource, &table, &mut view, SystemTime::now());
    view
}

/// The state of one resource whose lock file we have open (for the busy
/// message).
pub(crate) fn describe(lock: &LockFile, dir: &ScratchDir, resource: &Resource) -> ResourceView {
    describe_in_line(lock, dir, resource, None)
}

/// [`describe`], asked by a waiter in that line that agreed on
/// `own_agreement` slots (see [`build_view`]).
pub(crate) fn describe_in_line(
    lock: &LockFile,
    dir: &ScratchDir,
    resource: &Resource,
    own_agreement: Option<u64>,
) -> ResourceView {
    let mut attempt = 0;
    let started = std::time::Instant::now();
    loop {
        let table = LockTable::read().unwrap_or_default();
        let names = dir.entries().unwrap_or_default();
        let registered = waiters::live_waiters(dir, &names, &table, |r| r == resource);
        let asker = Asker {
            agreement: own_agreement,
            waiters: true,
        };
        let mut view = view_now(lock, dir, resource, &table, registered, asker);
        attempt += 1;
        if !look_again(attempt, started) || !has_unregistered(&view) {
            label_from_members(dir, resource, &table, &mut view, SystemTime::now());
            return view;
        }
        std::thread::sleep(UNREGISTERED_PAUSE);
    }
}

/// One open lock's view as of now, on its own (no other lock shares labels).
fn view_now(
    lock: &LockFile,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    registered: Vec<waiters::Waiter>,
    asker: Asker,
) -> ResourceView {
    build_view(
        resource,
        Some(lock.file()),
        lock.id(),
        queue_id(dir, &resource.file_name()),
        dir,
        table,
        registered,
        SystemTime::now(),
        asker,
    )
}

/// Who asks for a view, so that it looks for no more than is shown.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asker {
    /// The slot count a waiter asking about its own line agreed on: that
    /// agreement byte is its own, vouched for without the scan of every
    /// process's descriptors that a stranger's needs (a waiting line looks
    /// every second).
    pub agreement: Option<u64>,
    /// Whether the waiters are shown (a holder's waiting line shows none).
    pub waiters: bool,
}

impl Asker {
    /// `status` and the busy messages: everything, believed of nobody.
    const STATUS: Asker = Asker {
        agreement: None,
        waiters: true,
    };
}

// Status's own words for a name it flags (messages.rs words status's
// types, so these live here).
/// Why status flags a name nothing has used: `never used in DIR (no lock
/// file)`.
fn never_used(dir: &str) -> String {
    format!("never used in {}: no lock file", crate::text::sanitize(dir))
}

/// Why status flags `gpu:N` the driver does not list: `the driver lists
/// no GPU 7 (it lists gpu:0 to gpu:3)`.
fn no_such_gpu(index: u32, listed: &[u32]) -> String {
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
