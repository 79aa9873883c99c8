//! Requests that wait on several locks at once (`--any`), for the status
//! table: each is one row naming its locks, not a row in every line.

use crate::show::sanitize;
use crate::view::{StatusReport, WaiterSource, WaiterView};

/// One request that waits on several locks at once (`--any`): one row for
/// all of them, after the locks' own rows, in place of a row under each.
#[derive(Debug)]
pub struct Request<'a> {
    pub waiter: &'a WaiterView,
    /// The locks it waits on, short: `gpu:0-3`, `gpu:0,2`, `a,b`.
    pub resources: String,
}

impl Request<'_> {
    pub fn is(&self, w: &WaiterView) -> bool {
        w.source == WaiterSource::Registration && w.pid == self.waiter.pid
    }
}

/// The registered waiters found in the line of more than one lock shown,
/// in the order of their first row. A devlock waits on one lock at a time
/// but with `--any`, so a pid in two lines is one request.
pub fn waits_on_several(report: &StatusReport) -> Vec<Request<'_>> {
    let mut found: Vec<(&WaiterView, Vec<&str>)> = Vec::new();
    for res in &report.resources {
        for w in res
            .waiters
            .iter()
            .filter(|w| w.source == WaiterSource::Registration && w.pid.is_some())
        {
            match found.iter_mut().find(|(f, _)| f.pid == w.pid) {
                Some((_, names)) => names.push(&res.name),
                None => found.push((w, vec![&res.name])),
            }
        }
    }
    found
        .into_iter()
        .filter(|(_, names)| names.len() > 1)
        .map(|(waiter, names)| Request {
            waiter,
            resources: short_list(&names),
        })
        .collect()
}

/// Names listed short: GPUs in runs (`gpu:0-3,6`), the rest by name.
fn short_list(names: &[&str]) -> String {
    let mut gpus: Vec<u32> = Vec::new();
    let mut others: Vec<&str> = Vec::new();
    for name in names {
        match name
            .strip_prefix("gpu:")
            .and_then(|n| n.parse::<u32>().ok())
        {
            Some(index) => gpus.push(index),
            None => others.push(name),
        }
    }
    gpus.sort_unstable();
    gpus.dedup();
    let mut runs: Vec<String> = Vec::new();
    let mut at = 0;
    while at < gpus.len() {
        let mut end = at;
        while end + 1 < gpus.len() && gpus[end + 1] == gpus[end] + 1 {
            end += 1;
        }
        runs.push(match end - at {
            0 => gpus[at].to_string(),
            _ => format!("{}-{}", gpus[at], gpus[end]),
        });
        at = end + 1;
    }
    let mut parts: Vec<String> = Vec::new();
    if !runs.is_empty() {
        parts.push(format!("gpu:{}", runs.join(",")));
    }
    parts.extend(others.iter().map(|o| sanitize(o)));
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::short_list;

    #[test]
    fn gpus_are_listed_in_runs_and_the_rest_by_name() {
        assert_eq!(short_list(&["gpu:0", "gpu:1", "gpu:2", "gpu:3"]), "gpu:0-3");
        assert_eq!(short_list(&["gpu:3", "gpu:0", "gpu:2"]), "gpu:0,2-3");
        assert_eq!(short_list(&["gpu:0", "gpu:2", "gpu:5"]), "gpu:0,2,5");
        assert_eq!(short_list(&["a", "gpu:1", "b\u{1b}"]), "gpu:1,a,b?");
        assert_eq!(
            short_list(&["gpu:1:1g.10gb:gi1.ci0", "gpu:1"]),
            "gpu:1,gpu:1:1g.10gb:gi1.ci0"
        );
    }
}
