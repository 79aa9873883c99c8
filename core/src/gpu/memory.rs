//! Device memory for `--mem` budgets: a GPU's total as the probe reports it,
//! what each budget holder's process tree measurably uses on it, what is used
//! outside every budget, and whether a new budget fits.

use std::time::Duration;

use crate::gpu::device::{Device, DeviceReport};
use crate::proc;

/// One budget held on a device, as its registration labels it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// Its step, for messages.
    pub step: String,
    /// The budget, MiB.
    pub mem_mib: u64,
    /// The processes whose trees are the holder's (devlock and its command).
    pub roots: Vec<u32>,
}

/// A budget with what its job was measured using.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    pub budget: Budget,
    pub used_mib: u64,
}

impl Measured {
    /// What it takes of the device: its budget, or more if it uses more.
    pub(crate) fn takes_mib(&self) -> u64 {
        self.budget.mem_mib.max(self.used_mib)
    }
}

/// A device's memory, split by the budgets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Room {
    pub index: u32,
    pub total_mib: u64,
    pub budgets: Vec<Measured>,
    /// What the budget holders' processes use, measured.
    pub used_inside_mib: u64,
    /// What everything else on the device uses: the device's use less the
    /// budget holders' (so memory the probe names no process for counts).
    pub used_outside_mib: u64,
}

impl Room {
    /// What the budgets take: each its budget, or its use where larger.
    pub fn budgeted_mib(&self) -> u64 {
        self.budgets.iter().map(Measured::takes_mib).sum()
    }

    /// What is left for a new budget before the headroom.
    pub(crate) fn free_mib(&self) -> u64 {
        self.total_mib
            .saturating_sub(self.budgeted_mib())
            .saturating_sub(self.used_outside_mib)
    }

    /// Whether `ask` MiB more, with `headroom` MiB kept free, fit.
    pub(crate) fn admits(&self, ask: u64, headroom: u64) -> bool {
        self.budgeted_mib() + self.used_outside_mib + ask + headroom <= self.total_mib
    }
}

/// The device with this index, or why `--mem` cannot learn its memory (a
/// reason for exit 69).
pub(crate) fn device(report: &DeviceReport, index: u32) -> Result<&Device, String> {
    let device = match report {
        DeviceReport::NoInfo => {
            return Err(format!(
                "--mem needs gpu:{index}'s memory, but no nvidia-smi was found; to try budgets \
                 without a GPU, set DEVLOCK_NVIDIA_SMI to contrib/fake-gpu/nvidia-smi of a devlock \
                 checkout (README: \"Try it without a GPU\")"
            ));
        }
        DeviceReport::Unknown { reason } => {
            return Err(format!(
                "--mem needs gpu:{index}'s memory, which cannot be learned: {reason}"
            ));
        }
        DeviceReport::Devices(devices) => devices.iter().find(|d| d.index == index),
    };
    let device = device.ok_or_else(|| {
        format!("--mem: gpu:{index} names GPU {index}, which nvidia-smi does not list")
    })?;
    if device.memory_total_mib.is_none_or(|t| t == 0) {
        return Err(format!(
            "--mem needs gpu:{index}'s memory, but nvidia-smi does not report its total"
        ));
    }
    Ok(device)
}

/// Asks the probe, within `timeout`.
pub(crate) fn probe(timeout: Duration) -> DeviceReport {
    crate::gpu::gate::probe(timeout, &[])
}

/// Whether `pid` is one of `roots` or descends from one.
fn under(pid: u32, roots: &[u32]) -> bool {
    roots.contains(&pid) || proc::process::ancestors(pid).any(|(p, _)| roots.contains(&p))
}

/// What the processes under `roots` use on the device, measured (a process
/// whose use the probe cannot say counts nothing).
pub(crate) fn tree_use(device: &Device, roots: &[u32]) -> u64 {
    device
        .processes
        .iter()
        .filter(|p| under(p.pid, roots))
        .filter_map(|p| p.used_mib)
        .sum()
}

/// Which of `budgets` a process's use counts for: the nearest budget holder
/// among the process and its ancestors, so a budget taken inside another's
/// tree (a `devlock --mem` started from a Python block that holds one) is
/// counted once, for the inner budget, not for both.
fn owner(pid: u32, budgets: &[Budget]) -> Option<usize> {
    std::iter::once(pid)
        .chain(proc::process::ancestors(pid).map(|(p, _)| p))
        .find_map(|p| budgets.iter().position(|b| b.roots.contains(&p)))
}

/// The device's memory, split by `budgets`.
pub(crate) fn room(device: &Device, budgets: Vec<Budget>) -> Room {
    let mut used = vec![0u64; budgets.len()];
    for process in &device.processes {
        if let (Some(i), Some(mib)) = (owner(process.pid, &budgets), process.used_mib) {
            used[i] += mib;
        }
    }
    let budgets: Vec<Measured> = budgets
        .into_iter()
        .zip(used)
        .map(|(budget, used_mib)| Measured { used_mib, budget })
        .collect();
    let used_inside_mib = budgets.iter().map(|m| m.used_mib).sum();
    let all_roots: Vec<u32> = budgets
        .iter()
        .flat_map(|m| m.budget.roots.iter().copied())
        .collect();
    let used_outside_mib = match device.memory_used_mib {
        Some(used) => used.saturating_sub(used_inside_mib),
        None => device
            .processes
            .iter()
            .filter(|p| !under(p.pid, &all_roots))
            .filter_map(|p| p.used_mib)
            .sum(),
    };
    Room {
        index: device.index,
        total_mib: device.memory_total_mib.unwrap_or(0),
        budgets,
        used_inside_mib,
        used_outside_mib,
    }
}

/// A size for messages: `20 GiB`, `20.5 GiB`, `512 MiB`.
pub fn size(mib: u64) -> String {
    if mib < 1024 {
        return format!("{mib} MiB");
    }
    if mib.is_multiple_of(1024) {
        return format!("{} GiB", mib / 1024);
    }
    format!("{:.1} GiB", mib as f64 / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::device::DeviceProcess;

    fn device(used: Option<u64>, processes: &[(u32, u64)]) -> Device {
        Device {
            index: 0,
            uuid: "GPU-x".into(),
            name: "H200".into(),
            memory_used_mib: used,
            memory_total_mib: Some(81920),
            utilization_pct: None,
            processes: processes
                .iter()
                .map(|&(pid, mib)| DeviceProcess {
                    pid,
                    name: "p".into(),
                    used_mib: Some(mib),
                    gating: None,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn budgets_take_the_larger_of_budget_and_use_and_the_rest_is_outside() {
        let me = std::process::id();
        let d = device(Some(30_000), &[(me, 25_000), (4_000_000, 5_000)]);
        let budgets = vec![
            Budget {
                step: "a".into(),
                mem_mib: 20_480,
                roots: vec![me],
            },
            Budget {
                step: "b".into(),
                mem_mib: 20_480,
                roots: vec![3_999_999],
            },
        ];
        let room = room(&d, budgets);
        assert_eq!(room.used_inside_mib, 25_000);
        assert_eq!(room.used_outside_mib, 5_000);
        assert_eq!(room.budgeted_mib(), 25_000 + 20_480);
        assert_eq!(room.free_mib(), 81_920 - 45_480 - 5_000);
        assert!(room.admits(room.free_mib() - 2048, 2048));
        assert!(!room.admits(room.free_mib() - 2047, 2048));
        // Without the device's own figure, the processes outside count.
        let unknown = super::room(&device(None, &[(4_000_000, 7)]), Vec::new());
        assert_eq!(unknown.used_outside_mib, 7);
    }

    #[test]
    fn a_budget_inside_another_budgets_tree_is_counted_once() {
        // The outer budget is our parent's (a Python block, say), the inner
        // one ours (a devlock --mem it started): our use is the inner's.
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        let d = device(Some(10_240), &[(me, 10_240)]);
        let budgets = vec![
            Budget {
                step: "outer".into(),
                mem_mib: 20_480,
                roots: vec![parent],
            },
            Budget {
                step: "inner".into(),
                mem_mib: 10_240,
                roots: vec![me],
            },
        ];
        let room = room(&d, budgets);
        assert_eq!(room.budgets[0].used_mib, 0);
        assert_eq!(room.budgets[1].used_mib, 10_240);
        assert_eq!(room.used_inside_mib, 10_240);
        assert_eq!(room.budgeted_mib(), 20_480 + 10_240);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(size(20_480), "20 GiB");
        assert_eq!(size(20_992), "20.5 GiB");
        assert_eq!(size(512), "512 MiB");
    }
}
