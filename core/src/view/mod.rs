//! Who holds each lock and who waits, from the kernel's lock table first and
//! the records only as labels: users come from the kernel (the uid of the
//! live process), commands are read live from `/proc`, and a record or a
//! registration is believed only where the kernel backs it.

mod build;
mod gather;
mod holders;
pub mod requests;

use build::*;
pub use gather::gather;
use gather::*;
use holders::*;
pub use holders::{describe, describe_holders, describe_in_line, holders_of};

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
use crate::proc::lock_entry::{FileId, RangeLock};
use crate::proc::locks::LockTable;
use crate::resource::Resource;
use crate::show::clean;

/// Lets go of what a look kept and of the memory it used, for a process
/// that looks once and then sleeps (a waiting line): the shared scan of
/// every process's descriptors, and the heap's free pages, both as large as
/// the line is long (a megabyte behind 500 others), which the exec that
/// ends the take would otherwise unmap on the hand-off's path.
pub fn forget_look() {
    crate::proc::fdinfo::forget_shared_scan();
    crate::sys::process::give_back_free_heap();
}

/// A lock's state, as status says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
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
pub enum HolderSource {
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
pub enum WaiterSource {
    /// A devlock in line, by its registration.
    Registration,
    /// Blocked in flock(2) without a registration (util-linux flock).
    Flock,
    /// A place in line that no registration explains.
    Unregistered,
}

/// What a lock that devlock did not take on a queue file does to devlock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Effect {
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
    pub fn words(self) -> &'static str {
        match self {
            Effect::BlocksTheLine => "blocks the line",
            Effect::BlocksTheSlotAgreement => "blocks the slot agreement",
            Effect::None => "none",
        }
    }
}

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
pub struct ResourceMemory {
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
pub struct OutsideUse {
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
pub struct HolderDevice {
    pub index: u32,
    pub used_mib: Option<u64>,
    pub utilization_pct: Option<u32>,
}

/// A registered (or kernel-visible) waiter.
#[derive(Debug, Clone, Serialize)]
pub struct WaiterView {
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
pub struct StaleRecord {
    pub step: String,
    pub pid: u32,
    pub since: String,
}

/// A lock on one of the resource's files that devlock did not take.
#[derive(Debug, Clone, Serialize)]
pub struct ForeignLock {
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
pub struct Conflict {
    pub pid: u32,
    pub user: Option<String>,
    pub step: String,
    pub since: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResourceView {
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
pub struct StatusReport {
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
