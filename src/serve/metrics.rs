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

use crate::gpu::device::DeviceReport;
use crate::serve::snapshot::Snapshot;
use crate::show::sanitize;

mod families;
mod gpus;
mod locks;

use families::{
    BUILD_INFO, DEVICE_SOURCE, DEVICE_STATUS, DIR_MANAGED, Family, GPU_HELD_DAY, STATUS_DURATION,
    STATUS_TIMESTAMP, TRUST_ISSUES,
};
use gpus::gpus;
use locks::locks;

/// The `Content-Type` of this format.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const MIB: f64 = 1024.0 * 1024.0;

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

#[cfg(test)]
mod tests {
    use super::families::*;
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
