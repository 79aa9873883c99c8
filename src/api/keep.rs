//! A library hold that outlives its block while the device is still busy
//! ([`Hold::release_when_device_free`], [`Kept`]): one driver query at the
//! block's end; when the driver still lists this process (or one it started)
//! on the hold's GPUs, the hold goes to a keeper thread, started only then,
//! that asks the driver again at a bounded rate and lets go once it no
//! longer lists them. Nothing runs while the block runs.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::api::hold::{Hold, StillUsed};
use crate::gpu::device::DeviceReport;
use crate::gpu::gate::gpu_indices;
use crate::resource::Resource;
use crate::sys::signal::{self, SigSet};

/// The keeper's first look after the block's end; each look after doubles
/// the wait, up to [`LAST_LOOK`]: a device freed soon after the block is let
/// go soon, and a hold kept for hours costs one query every few seconds.
const FIRST_LOOK: Duration = Duration::from_millis(250);
const LAST_LOOK: Duration = Duration::from_secs(2);
/// A slow source (a cold `nvidia-smi`) is asked at most once per this many
/// times what one query costs: under 5 % of a core, whatever the source.
const COST_FACTOR: u32 = 20;

/// A hold kept past its block's end, held by a keeper thread until the
/// driver no longer lists this process on its GPUs. Dropping the handle
/// changes nothing: the keeper goes on.
#[derive(Debug, Clone)]
pub struct Kept {
    shared: Arc<Shared>,
    line: String,
}

#[derive(Debug)]
struct Shared {
    hold: Mutex<Option<Hold>>,
    wake: Condvar,
    pid: u32,
}

impl Hold {
    /// Lets go now when the device is free; else keeps the hold until it is.
    ///
    /// One driver query (NVML, else `nvidia-smi`, else AMD's source, within
    /// the hold's probe timeout): when it lists this process, or a process
    /// descending from it, on a GPU of the hold (`gpu`, `gpu:N`, a MIG
    /// instance), the hold is kept: its labels say so (status, `-n` and
    /// `Busy` name it: `block ended 3m ago, still 19.8 GiB on gpu:0`; it
    /// counts as idle), and a keeper thread asks the driver again, every
    /// 250 ms at first and every 2 s at most (less often for a slow source),
    /// and lets go as soon as it lists none of them. Released now instead:
    /// a hold without GPUs, a hold that took nothing of its own, a forked
    /// child's copy, and when no driver answers (no GPU source, or an error:
    /// the block's end as before).
    pub fn release_when_device_free(self) -> Option<Kept> {
        if !self.asks_the_driver() {
            return None;
        }
        let me = std::process::id();
        let gpus = self.gpu_resources();
        let report = crate::gpu::source::probe(self.probe_timeout()).report;
        let used = still_used(&report, &gpus, me)?;
        let ended_ms = crate::flock::record::now_ms();
        self.mark_kept(Some((ended_ms, used)));
        let line = crate::messages::busy::kept_after_block(
            &self.resources().join(" "),
            used.mib,
            used.gpu,
        );
        let shared = Arc::new(Shared {
            hold: Mutex::new(Some(self)),
            wake: Condvar::new(),
            pid: me,
        });
        let keeper = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("devlock-keep".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                signal::block(&SigSet::all());
                keep(&keeper, &gpus, ended_ms, used);
            });
        if spawned.is_err() {
            // Nobody to watch the device: the block's end, as before.
            drop(shared.take());
            return None;
        }
        Some(Kept { shared, line })
    }
}

impl Hold {
    /// Whether [`Hold::release_when_device_free`] asks the driver (else it
    /// lets go at once): a hold of this process that took a GPU of its own.
    pub fn asks_the_driver(&self) -> bool {
        !self.is_nested() && self.pid() == std::process::id() && !self.gpu_resources().is_empty()
    }
}

impl Kept {
    /// What the library says once about it: why it is kept, and the remedies.
    pub fn line(&self) -> &str {
        &self.line
    }

    /// Whether it is still kept (the keeper has not let go).
    pub fn is_held(&self) -> bool {
        self.shared.lock().is_some()
    }

    /// Takes the hold back from the keeper, which stops (a new block of this
    /// process over the same devices runs inside it: taking the lock again
    /// would wait for itself). `None` once the keeper has let go.
    pub fn take_back(&self) -> Option<Hold> {
        let hold = self.shared.take()?;
        hold.mark_kept(None);
        Some(hold)
    }

    /// Lets go now.
    pub fn release(&self) {
        drop(self.shared.take());
    }

    /// In a forked child: closes the child's copies of the hold's
    /// descriptors (the parent's keeper decides; a child must not keep the
    /// lock past it). Does nothing where the keeper's lock was held at the
    /// fork.
    pub fn forget_in_child(&self) {
        if std::process::id() == self.shared.pid {
            return;
        }
        if let Ok(mut hold) = self.shared.hold.try_lock() {
            // Hold's Drop in another process closes its copies only.
            drop(hold.take());
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Option<Hold>> {
        self.hold.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the hold out (to let go of it outside the lock) and wakes the
    /// keeper, which then ends.
    fn take(&self) -> Option<Hold> {
        let hold = self.lock().take();
        self.wake.notify_all();
        hold
    }
}

/// The keeper: looks until the driver no longer lists the process tree (or
/// cannot say), or the idle policy reclaims the hold, then lets go.
fn keep(shared: &Shared, gpus: &[Resource], ended_ms: u64, mut last: StillUsed) {
    let me = shared.pid;
    let mut wait = FIRST_LOOK;
    loop {
        let timeout = {
            let guard = shared.lock();
            let (guard, _) = shared
                .wake
                .wait_timeout(guard, wait)
                .unwrap_or_else(|e| e.into_inner());
            let Some(hold) = guard.as_ref() else { return };
            if hold.stopped_idle().is_some() {
                // The idle policy reclaims it (its record says so).
                drop(guard);
                drop(shared.take());
                return;
            }
            hold.probe_timeout()
        };
        let asked = Instant::now();
        let report = crate::gpu::source::probe(timeout).report;
        let cost = asked.elapsed();
        wait = (wait * 2)
            .min(LAST_LOOK)
            .max(cost.saturating_mul(COST_FACTOR));
        let guard = shared.lock();
        let Some(hold) = guard.as_ref() else { return };
        match still_used(&report, gpus, me) {
            Some(used) if used != last => {
                hold.mark_kept(Some((ended_ms, used)));
                last = used;
            }
            Some(_) => {}
            None => {
                drop(guard);
                drop(shared.take());
                return;
            }
        }
    }
}

/// What `me` and the processes descending from it use on the GPUs of
/// `resources`, as `report` lists them: the GPU where they use the most;
/// `None` when the driver lists none of them there, or cannot say.
pub(crate) fn still_used(
    report: &DeviceReport,
    resources: &[Resource],
    me: u32,
) -> Option<StillUsed> {
    let DeviceReport::Devices(devices) = report else {
        return None;
    };
    let all: Vec<u32> = devices.iter().map(|d| d.index).collect();
    let gpus: Vec<u32> = resources
        .iter()
        .filter_map(|r| gpu_indices(r, &all))
        .flatten()
        .collect();
    let mut found: Option<StillUsed> = None;
    for device in devices.iter().filter(|d| gpus.contains(&d.index)) {
        // A MIG GPU lists a process on the whole GPU and on its instance:
        // each pid once.
        let mut pids: Vec<(u32, Option<u64>)> = Vec::new();
        for p in device
            .processes
            .iter()
            .chain(device.mig_instances.iter().flat_map(|i| &i.processes))
        {
            if p.pid != 0 && !pids.iter().any(|(q, _)| *q == p.pid) && ours(p.pid, me) {
                pids.push((p.pid, p.used_mib));
            }
        }
        if pids.is_empty() {
            continue;
        }
        let mib = pids
            .iter()
            .filter_map(|(_, m)| *m)
            .reduce(u64::saturating_add);
        let here = StillUsed {
            gpu: device.index,
            mib,
        };
        if found.is_none_or(|f| here.mib.unwrap_or(0) > f.mib.unwrap_or(0)) {
            found = Some(here);
        }
    }
    found
}

/// Whether `pid` is `me` or descends from it.
fn ours(pid: u32, me: u32) -> bool {
    pid == me || crate::proc::process::ancestors(pid).any(|(p, _)| p == me)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::device::{Device, DeviceProcess};

    fn device(index: u32, processes: &[(u32, Option<u64>)]) -> Device {
        Device {
            index,
            processes: processes
                .iter()
                .map(|&(pid, used_mib)| DeviceProcess {
                    pid,
                    used_mib,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_this_process_tree_on_the_holds_gpus_keeps_it() {
        let me = std::process::id();
        let child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let stranger = 4_000_000;
        let report = DeviceReport::Devices(vec![
            device(0, &[(stranger, Some(9_000)), (me, Some(512))]),
            device(1, &[(me, Some(100)), (child.id(), Some(2_000))]),
        ]);
        let gpu0 = [Resource::parse(std::ffi::OsStr::new("gpu:0")).unwrap()];
        assert_eq!(
            still_used(&report, &gpu0, me),
            Some(StillUsed {
                gpu: 0,
                mib: Some(512)
            })
        );
        // A child it started counts; the GPU where the tree uses the most.
        let all = [Resource::parse(std::ffi::OsStr::new("gpu")).unwrap()];
        assert_eq!(
            still_used(&report, &all, me),
            Some(StillUsed {
                gpu: 1,
                mib: Some(2_100)
            })
        );
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
        let gpu2 = [Resource::parse(std::ffi::OsStr::new("gpu:2")).unwrap()];
        assert_eq!(still_used(&report, &gpu2, me), None);
        let strangers_only = DeviceReport::Devices(vec![device(0, &[(stranger, None)])]);
        assert_eq!(still_used(&strangers_only, &gpu0, me), None);
        for nothing in [
            DeviceReport::NoInfo,
            DeviceReport::Unknown {
                reason: "NVML: GPU is lost".into(),
            },
        ] {
            assert_eq!(still_used(&nothing, &gpu0, me), None);
        }
        // Listed without a figure: still kept, memory unknown.
        let unknown = DeviceReport::Devices(vec![device(0, &[(me, None)])]);
        assert_eq!(
            still_used(&unknown, &gpu0, me),
            Some(StillUsed { gpu: 0, mib: None })
        );
    }
}
