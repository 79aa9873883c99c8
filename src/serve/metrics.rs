//! `/metrics`: a snapshot in the Prometheus text exposition format (version
//! 0.0.4), which every Prometheus, agent and `promtool check metrics` reads.
//!
//! Conventions (prometheus.io's "Metric and label naming"): every name
//! starts `devlock_`; values are in base units, named as suffixes (bytes,
//! seconds, a `_ratio` from 0 to 1); every family is a gauge, as each is a
//! reading of now (counters would need a history devlock does not keep);
//! `_info` families carry text as labels with the value 1. Every family's
//! HELP and TYPE are written whether or not it has samples, so the list is
//! the same on every machine. A value status gives as null is NaN here,
//! never 0. Label values are status's own text (sanitised, then escaped);
//! `user` is empty where status cannot tell, `pid` likewise. Samples whose
//! labels cannot be told apart (two holders no visible process owns) are
//! one sample, the larger value. devlock-serve(1) lists the families.
//!
//! No label is named `instance` or `job`: Prometheus sets those itself.
//! Families of the usage records (idle time), once they exist, are written
//! by [`render`] after the GPUs', from the [`Snapshot`].

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::gpu::device::{Device, DeviceReport};
use crate::resource::Resource;
use crate::serve::snapshot::Snapshot;
use crate::show::sanitize;
use crate::view::{ResourceView, State};

/// The `Content-Type` of this format.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const MIB: f64 = 1024.0 * 1024.0;

/// One family: its name, its help, its label names.
struct Family {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
}

macro_rules! family {
    ($id:ident, $name:literal, [$($label:literal),*], $help:literal) => {
        const $id: Family = Family { name: $name, help: $help, labels: &[$($label),*] };
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

/// The families' samples, written in family order.
#[derive(Default)]
struct Exposition {
    text: String,
}

impl Exposition {
    fn family(&mut self, family: &Family, samples: Vec<(Vec<String>, f64)>) {
        let _ = writeln!(self.text, "# HELP {} {}", family.name, family.help);
        let _ = writeln!(self.text, "# TYPE {} gauge", family.name);
        let mut seen: HashMap<Vec<String>, usize> = HashMap::new();
        let mut kept: Vec<(Vec<String>, f64)> = Vec::new();
        for (labels, value) in samples {
            debug_assert_eq!(labels.len(), family.labels.len(), "{}", family.name);
            match seen.get(&labels) {
                Some(&at) => {
                    let old = &mut kept[at].1;
                    if old.is_nan() || value > *old {
                        *old = value;
                    }
                }
                None => {
                    seen.insert(labels.clone(), kept.len());
                    kept.push((labels, value));
                }
            }
        }
        for (labels, value) in kept {
            self.text.push_str(family.name);
            if !labels.is_empty() {
                self.text.push('{');
                for (i, (name, value)) in family.labels.iter().zip(&labels).enumerate() {
                    if i > 0 {
                        self.text.push(',');
                    }
                    let _ = write!(self.text, "{name}=\"{}\"", escape(value));
                }
                self.text.push('}');
            }
            let _ = writeln!(self.text, " {}", number(value));
        }
    }
}

/// A label value as the format quotes it.
fn escape(value: &str) -> String {
    sanitize(value)
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn number(value: f64) -> String {
    // An empty sum of f64 is -0.0, which would print `-0`: zero has no sign.
    if value == 0.0 {
        "0".to_owned()
    } else if value.is_nan() {
        "NaN".to_owned()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        format!("{value}")
    }
}

fn bytes(mib: Option<u64>) -> f64 {
    mib.map_or(f64::NAN, |m| m as f64 * MIB)
}

fn seconds(ms: Option<u64>) -> f64 {
    ms.map_or(f64::NAN, |ms| ms as f64 / 1000.0)
}

fn flag(on: bool) -> f64 {
    if on { 1.0 } else { 0.0 }
}

fn text(value: Option<&str>) -> String {
    value.unwrap_or_default().to_owned()
}

fn pid(value: Option<u32>) -> String {
    value.map(|p| p.to_string()).unwrap_or_default()
}

/// The whole exposition of `snapshot`.
pub(crate) fn render(snapshot: &Snapshot) -> String {
    let report = &snapshot.report;
    let mut out = Exposition::default();
    out.family(
        &BUILD_INFO,
        vec![(vec![env!("CARGO_PKG_VERSION").to_owned()], 1.0)],
    );
    out.family(
        &STATUS_DURATION,
        vec![(vec![], snapshot.took.as_secs_f64())],
    );
    let at = snapshot
        .at
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(f64::NAN, |d| d.as_secs_f64());
    out.family(&STATUS_TIMESTAMP, vec![(vec![], at)]);
    out.family(&DIR_MANAGED, vec![(vec![], flag(report.trust.managed))]);
    let mut issues: Vec<&str> = Vec::new();
    for issue in report
        .trust
        .issues
        .iter()
        .chain(report.resources.iter().flat_map(|r| r.trust.issues.iter()))
    {
        if !issues.contains(&issue.path.as_str()) {
            issues.push(&issue.path);
        }
    }
    out.family(&TRUST_ISSUES, vec![(vec![], issues.len() as f64)]);
    locks(&mut out, &report.resources);
    gpus(&mut out, &report.resources, report.device_info.as_ref());
    // Every GPU the probe lists (0 when nothing held it) and every GPU the
    // records name.
    let mut indices: Vec<u32> = report
        .device_info
        .as_ref()
        .map_or(&[][..], DeviceReport::devices)
        .iter()
        .map(|d| d.index)
        .chain(snapshot.history.keys().copied())
        .collect();
    indices.sort_unstable();
    indices.dedup();
    out.family(
        &GPU_HELD_DAY,
        indices
            .into_iter()
            .map(|i| {
                let held = snapshot.history.get(&i).map_or(0, |day| day.held_ms);
                (vec![i.to_string()], held as f64 / 1000.0)
            })
            .collect(),
    );
    let status = match &report.device_info {
        Some(DeviceReport::Devices(_)) => "ok",
        Some(DeviceReport::Unknown { .. }) => "unknown",
        Some(DeviceReport::NoInfo) | None => "none",
    };
    out.family(
        &DEVICE_STATUS,
        ["ok", "unknown", "none"]
            .iter()
            .map(|s| (vec![(*s).to_owned()], flag(*s == status)))
            .collect(),
    );
    out.family(
        &DEVICE_SOURCE,
        report
            .device_source
            .iter()
            .filter_map(|s| serde_json::to_value(s).ok())
            .filter_map(|v| v.as_str().map(|s| (vec![s.to_owned()], 1.0)))
            .collect(),
    );
    out.text
}

fn state_name(state: State) -> &'static str {
    match state {
        State::Free => "free",
        State::Held => "held",
        State::Shared => "shared",
        State::Unknown => "unknown",
    }
}

fn locks(out: &mut Exposition, resources: &[ResourceView]) {
    const STATES: [State; 4] = [State::Free, State::Held, State::Shared, State::Unknown];
    out.family(
        &LOCK_STATE,
        resources
            .iter()
            .flat_map(|r| {
                STATES.iter().map(move |s| {
                    (
                        vec![r.name.clone(), state_name(*s).to_owned()],
                        flag(r.state == *s),
                    )
                })
            })
            .collect(),
    );
    out.family(
        &LOCK_HOLDERS,
        resources
            .iter()
            .map(|r| (vec![r.name.clone()], r.holders.len() as f64))
            .collect(),
    );
    out.family(
        &LOCK_WAITERS,
        resources
            .iter()
            .map(|r| (vec![r.name.clone()], r.waiters.len() as f64))
            .collect(),
    );
    let holders = || {
        resources
            .iter()
            .flat_map(|r| r.holders.iter().map(move |h| (r, h)))
    };
    let who = |r: &ResourceView, h: &crate::view::Holder| {
        vec![
            r.name.clone(),
            text(h.step.as_deref()),
            text(h.user.as_deref()),
            pid(h.pid),
        ]
    };
    out.family(
        &HOLDER_HELD,
        holders()
            .map(|(r, h)| {
                let mut labels = who(r, h);
                labels.push(text(h.via.as_deref()));
                (labels, seconds(h.held_for_ms))
            })
            .collect(),
    );
    out.family(
        &WAITER_WAITING,
        resources
            .iter()
            .flat_map(|r| r.waiters.iter().map(move |w| (r, w)))
            .map(|(r, w)| {
                (
                    vec![
                        r.name.clone(),
                        text(w.step.as_deref()),
                        text(w.user.as_deref()),
                        pid(w.pid),
                        w.position.to_string(),
                    ],
                    seconds(w.waiting_for_ms),
                )
            })
            .collect(),
    );
    out.family(
        &HOLDER_BUDGET,
        holders()
            .filter_map(|(r, h)| Some((who(r, h), bytes(Some(h.mem_mib?)))))
            .collect(),
    );
    out.family(
        &HOLDER_OVER_BUDGET,
        holders()
            .filter_map(|(r, h)| Some((who(r, h), flag(h.over_budget?))))
            .collect(),
    );
    out.family(
        &HOLDER_IDLE,
        holders()
            .filter_map(|(r, h)| Some((who(r, h), h.idle_for_ms? as f64 / 1000.0)))
            .collect(),
    );
    out.family(
        &HOLDER_GPU_USED,
        holders()
            .flat_map(|(r, h)| {
                h.devices.iter().map(move |d| {
                    let mut labels = who(r, h);
                    labels.push(d.index.to_string());
                    (labels, bytes(d.used_mib))
                })
            })
            .collect(),
    );
}

fn gpus(out: &mut Exposition, resources: &[ResourceView], info: Option<&DeviceReport>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_duplicates_are_one_sample() {
        let mut out = Exposition::default();
        out.family(
            &LOCK_HOLDERS,
            vec![
                (vec!["a\"b\\c".to_owned()], 1.0),
                (vec!["x".to_owned()], f64::NAN),
                (vec!["x".to_owned()], 3.0),
                (vec!["x".to_owned()], 2.0),
            ],
        );
        assert_eq!(
            out.text,
            "# HELP devlock_lock_holders Holders of each lock (a devlock and its command are one holder; a request waiting for a member is no holder of its group)\n\
             # TYPE devlock_lock_holders gauge\n\
             devlock_lock_holders{resource=\"a\\\"b\\\\c\"} 1\n\
             devlock_lock_holders{resource=\"x\"} 3\n"
        );
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(85_520_809_984.0), "85520809984");
        assert_eq!(number(0.97), "0.97");
        assert_eq!(number(-0.0), "0");
        assert_eq!(number([0.0f64; 0].iter().sum()), "0", "an empty sum");
    }

    /// Every family defined above.
    const ALL: &[&Family] = &[
        &BUILD_INFO,
        &STATUS_DURATION,
        &STATUS_TIMESTAMP,
        &DIR_MANAGED,
        &TRUST_ISSUES,
        &LOCK_STATE,
        &LOCK_HOLDERS,
        &LOCK_WAITERS,
        &HOLDER_HELD,
        &WAITER_WAITING,
        &HOLDER_BUDGET,
        &HOLDER_OVER_BUDGET,
        &HOLDER_IDLE,
        &GPU_HELD_DAY,
        &HOLDER_GPU_USED,
        &GPU_INFO,
        &GPU_TOTAL,
        &GPU_USED,
        &GPU_GATED,
        &GPU_UNGATED,
        &GPU_PROCESSES,
        &GPU_UTILIZATION,
        &GPU_BUDGETED,
        &GPU_ROOM,
        &MIG_TOTAL,
        &MIG_USED,
        &DEVICE_STATUS,
        &DEVICE_SOURCE,
    ];

    /// The families and labels as the exposition writes them.
    fn families() -> Vec<(&'static str, &'static [&'static str])> {
        let snapshot = Snapshot {
            report: crate::view::StatusReport {
                dir: "/run/lock/devlock".to_owned(),
                trust: Default::default(),
                resources: Vec::new(),
                device_info: None,
                devices: Vec::new(),
                device_source: None,
                hide_idle: false,
            },
            at: std::time::SystemTime::now(),
            took: std::time::Duration::ZERO,
            history: Default::default(),
            users: Default::default(),
            idle_ceiling: None,
        };
        let text = render(&snapshot);
        let mut found = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default();
                let family = ALL
                    .iter()
                    .find(|f| f.name == name)
                    .unwrap_or_else(|| panic!("{name} is not in ALL"));
                found.push((family.name, family.labels));
            }
        }
        found
    }

    #[test]
    fn every_family_and_label_is_documented_in_the_man_page() {
        // The metrics' reference is devlock-serve(1)'s METRICS (the README
        // points there): each family with exactly its labels, in order.
        let man = include_str!("../../doc/man/serve-metrics.roff");
        let written = families();
        assert_eq!(written.len(), ALL.len(), "every family is written");
        for (name, labels) in written {
            let entry = if labels.is_empty() {
                format!(".B {name}\n")
            } else {
                format!(".B {name}{{{}}}\n", labels.join(","))
            };
            assert!(man.contains(&entry), "devlock-serve(1) lacks {entry:?}");
        }
    }
}
