//! `--mem SIZE` on `gpu:N`: a memory budget, held as a lock held.
//!
//! A budget holder takes `gpu:N.lock` shared (and `gpu` shared, as every
//! member does), so a request for the whole device (no `--mem`, or `gpu`)
//! and plain `flock gpu:N.lock` exclude every budget holder, and the kernel
//! frees a budget the instant its holder (devlock and every process that
//! inherited the lock) is gone. Its budget is labelled in its own shared
//! hold's registration (`.gpu:N@PID.K.hold`, `mem_mib`), believed only as
//! status believes one (its flock held by the very process it names) and
//! only while that process holds `gpu:N.lock` per `/proc/locks`: a forged
//! registration can only ever be its forger's own budget.
//!
//! Admission goes through the fair line of `gpu:N` like any other request,
//! so no request overtakes an earlier one still waiting. Only the request at
//! the front looks: it is admitted when the holders' budgets (each its
//! budget, or what its job measurably uses where more), the memory used on
//! the device outside them (the probe's device figure less the holders'
//! use), its own budget and the headroom fit in the device's total. Once
//! admitted it takes the lock shared, registers, and keeps its place in
//! line while its job starts ([`Monitor`]): the next budget on the device is
//! looked at only once this one's memory stopped growing, or `--settle`
//! passed. A front request that does not fit sleeps in the kernel: one
//! thread per budget holder blocks in flock(2) on that holder's
//! registration (granted when the holder is gone), beside a timer that
//! looks again every [`REPROBE_EVERY`] (memory outside the gate may come
//! or go); everyone behind it sleeps on its place in line.
//!
//! [`admit`] is the admission (the take and its wait for room), [`watch`]
//! the watch of a budget's job while it runs.

pub(crate) mod admit;
pub mod watch;

use std::time::{Duration, Instant};

use crate::gpu::memory;

/// How often a front request that does not fit looks at the device again
/// when no budget holder leaves first. A look is one probe (two nvidia-smi
/// runs: tens of milliseconds of CPU on a real driver, a few on the fake),
/// a read of `/proc/locks` and of the directory; between looks the waiting
/// devlock sleeps in the kernel.
pub(crate) const REPROBE_EVERY: Duration = Duration::from_secs(5);

/// How often a starting job's memory is sampled: three samples in a row
/// within [`settle_delta`] of each other, once it uses any, and it has
/// settled.
pub(crate) const SAMPLE_STARTING: Duration = Duration::from_secs(1);

/// How often a settled job's memory is sampled, for the over-budget watch.
pub(crate) const SAMPLE_HELD: Duration = Duration::from_secs(5);

/// What a budget request asks for.
#[derive(Debug, Clone)]
pub struct Ask {
    pub index: u32,
    pub mem_mib: u64,
    pub headroom_mib: u64,
    pub probe_timeout: Duration,
    /// What the probe said as the run started (its check of the size), and
    /// when: the first look uses it while it is [`FRESH`], so an
    /// uncontended budget costs one probe, not two.
    pub seen: Option<(Instant, crate::gpu::device::DeviceReport)>,
}

/// How long a probe's answer stands for the first look.
const FRESH: Duration = Duration::from_millis(250);

impl Ask {
    /// The device now: the run's first answer while fresh, else a probe.
    pub(crate) fn probe(&self) -> crate::gpu::device::DeviceReport {
        match &self.seen {
            Some((at, report)) if at.elapsed() < FRESH => report.clone(),
            _ => memory::probe(self.probe_timeout),
        }
    }
}

/// What a budget's job learns: `DEVLOCK_MEM_MIB`, and for JAX
/// `XLA_PYTHON_CLIENT_MEM_FRACTION`, the budget's share of the device
/// (rounded down, so the job stays within it), unless the caller set it.
pub fn job_env(mem: u64, total: u64) -> Vec<(&'static str, String)> {
    let mut env = vec![("DEVLOCK_MEM_MIB", mem.to_string())];
    if std::env::var_os("XLA_PYTHON_CLIENT_MEM_FRACTION").is_none() && total > 0 {
        let thousandths = mem.saturating_mul(1000) / total;
        env.push((
            "XLA_PYTHON_CLIENT_MEM_FRACTION",
            format!("{}.{:03}", thousandths / 1000, thousandths % 1000),
        ));
    }
    env
}

/// How close three samples must be for a starting job to count as settled:
/// 1/50 of its budget, at least 128 MiB (allocators grow in chunks).
pub(crate) fn settle_delta(mem_mib: u64) -> u64 {
    (mem_mib / 50).max(128)
}
