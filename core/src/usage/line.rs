//! What a usage line may say, and the one way a reader takes it in: parsed,
//! then every number, time and list checked against the bounds below and
//! every text clipped and cleaned. A usage file is written by its user, so
//! `report` (root's too) and `serve` read it as hostile input: a line
//! outside a bound is refused whole (the reader skips and counts it), never
//! used, so nothing it holds can overflow a sum, fail a formatter or size
//! an allocation.

use std::fmt;

use super::{Line, MAX_LINE, Measured, Start};
use crate::names::MAX_GPU_INDEX;

/// Most entries of a line's `resources` or `gpus`: more than a machine has.
pub(crate) const MAX_LIST: usize = 64;

/// How far past the reader's clock a time may be: another host's clock, in
/// records put together. A later time is refused (a hold cannot have ended
/// in the future), which also keeps every time formattable (RFC 3339 ends
/// with the year 9999) and a job's length within the time since the epoch.
pub(crate) const MAX_AHEAD_MS: u64 = 24 * 3_600_000;

/// Largest memory figure (a budget, a peak): 1 PiB, in MiB.
pub(crate) const MAX_MIB: u64 = 1 << 30;

/// Largest GPU-seconds figure (sampled, computing, idle): 64 GPUs for a
/// hundred years, so that a sum over any number of lines stays finite.
pub(crate) const MAX_GPU_S: f64 = 64.0 * 100.0 * 366.0 * 86_400.0;

/// Largest pid Linux hands out (`PID_MAX_LIMIT`).
pub(crate) const MAX_PID: u32 = 4 * 1024 * 1024;

/// Longest step kept, in bytes (as the lock record keeps it).
pub(crate) const MAX_STEP: usize = 256;

/// Longest job id, boot id, host name or front end kept, in bytes.
pub(crate) const MAX_ID: usize = 64;

/// Why a line was refused: what the reader's note says of the first one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused(pub &'static str);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// `raw` (one line, without its newline) as a [`Line`] within every bound,
/// its texts cleaned, as read at `now_ms`; or why not.
pub(crate) fn parse(raw: &[u8], now_ms: u64) -> Result<Line, Refused> {
    if raw.len() > MAX_LINE {
        return Err(Refused("longer than 16 KiB"));
    }
    // serde_json refuses invalid UTF-8, numbers out of their type's range
    // and nesting past 128 levels; the lists it fills are sized by the
    // line, at most 16 KiB.
    let mut line: Line =
        serde_json::from_slice(raw).map_err(|_| Refused("not a usage line (JSON)"))?;
    let latest = now_ms.saturating_add(MAX_AHEAD_MS);
    match &mut line {
        Line::Start(start) => check_start(start, latest)?,
        Line::Progress {
            job,
            at_ms,
            measured,
            ..
        } => {
            clean(job, MAX_ID);
            check_time(*at_ms, latest)?;
            check_measured(measured)?;
        }
        Line::End {
            job,
            end_ms,
            measured,
            ..
        } => {
            clean(job, MAX_ID);
            check_time(*end_ms, latest)?;
            check_measured(measured)?;
        }
    }
    Ok(line)
}

fn check_start(start: &mut Start, latest: u64) -> Result<(), Refused> {
    clean(&mut start.job, MAX_ID);
    clean(&mut start.step, MAX_STEP);
    clean(&mut start.from, MAX_ID);
    for text in [&mut start.boot_id, &mut start.host].into_iter().flatten() {
        clean(text, MAX_ID);
    }
    if start.resources.is_empty() || start.resources.len() > MAX_LIST {
        return Err(Refused("resources: none, or more than 64"));
    }
    if !start
        .resources
        .iter()
        .all(|r| crate::resource::Resource::parse(r.as_ref()).is_ok())
    {
        return Err(Refused("resources: not a resource name"));
    }
    check_gpus(&start.gpus)?;
    if start.pid == 0 || start.pid > MAX_PID {
        return Err(Refused("pid: not a Linux pid"));
    }
    check_time(start.start_ms, latest)?;
    // The wait began after the epoch.
    if start.waited_ms > start.start_ms {
        return Err(Refused("waited_ms: longer than since the epoch"));
    }
    if start.mem_mib.is_some_and(|m| m > MAX_MIB) {
        return Err(Refused("mem_mib: over 1 PiB"));
    }
    if start
        .idle_timeout_s
        .is_some_and(|s| s > u64::from(u32::MAX))
    {
        return Err(Refused("idle_timeout_s: over 136 years"));
    }
    Ok(())
}

fn check_measured(measured: &Measured) -> Result<(), Refused> {
    check_gpus(&measured.gpus)?;
    if measured.peak_mib.is_some_and(|m| m > MAX_MIB) {
        return Err(Refused("peak_mib: over 1 PiB"));
    }
    let figures = [
        measured.sampled_gpu_s,
        measured.busy_gpu_s,
        measured.idle_gpu_s,
    ];
    if !figures.iter().all(|s| (0.0..=MAX_GPU_S).contains(s)) {
        return Err(Refused(
            "GPU-seconds: negative or over 64 GPUs for 100 years",
        ));
    }
    Ok(())
}

/// A GPU list as the writer makes it: at most [`MAX_LIST`], in increasing
/// order (so no GPU twice), each a GPU index `gpu:N` may name.
fn check_gpus(gpus: &[u32]) -> Result<(), Refused> {
    let ordered = gpus.windows(2).all(|w| w[0] < w[1]);
    if gpus.len() > MAX_LIST || !ordered || gpus.iter().any(|&g| g > MAX_GPU_INDEX) {
        return Err(Refused(
            "gpus: more than 64, repeated, out of order or past 65535",
        ));
    }
    Ok(())
}

fn check_time(ms: u64, latest: u64) -> Result<(), Refused> {
    if ms > latest {
        return Err(Refused("a time more than a day ahead of this clock"));
    }
    Ok(())
}

/// `text` cut to at most `max` bytes (at a character's boundary), every
/// control and format character replaced ([`crate::show::clean`]).
fn clean(text: &mut String, max: usize) {
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    // Printable ASCII, as honest texts are, needs no look at each character.
    let printable = text.bytes().all(|b| (b' '..=b'~').contains(&b));
    if !printable && text.chars().any(crate::show::is_unsafe_char) {
        *text = crate::show::clean(text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// 2026-12-01T00:00:00Z.
    const NOW: u64 = 1_796_083_200_000;

    /// An honest start line with `fields` put in (replacing those there).
    fn start_json(fields: serde_json::Value) -> String {
        let mut doc = serde_json::json!({
            "event": "start", "v": 1, "job": "b-1-2", "resources": ["gpu:0"], "gpus": [0],
            "step": "train", "pid": 10, "pid_start": 5, "start_ms": NOW - 1000,
            "waited_ms": 1000, "from": "cli",
        });
        for (key, value) in fields.as_object().unwrap() {
            doc[key] = value.clone();
        }
        doc.to_string()
    }

    #[test]
    fn an_honest_line_passes_unchanged() {
        let raw = start_json(serde_json::json!({}));
        let Line::Start(start) = parse(raw.as_bytes(), NOW).unwrap() else {
            panic!("a start line")
        };
        assert_eq!(start.step, "train");
        assert_eq!(start.gpus, [0]);
        // What the writer writes, the reader takes.
        let written = serde_json::to_vec(&Line::Start(start.clone())).unwrap();
        assert_eq!(parse(&written, NOW).unwrap(), Line::Start(start));
    }

    #[test]
    fn each_bound_refuses_its_line() {
        let big = u64::MAX;
        let far = 253_402_300_800_000u64; // 10000-01-01
        let end = |fields: &str| {
            format!("{{\"event\":\"end\",\"v\":1,\"job\":\"j\",\"how\":\"exit\",{fields}}}")
        };
        let cases = [
            (start_json(json!({ "waited_ms": big })), "waited_ms"),
            (start_json(json!({ "waited_ms": NOW })), "waited_ms"),
            (start_json(json!({ "start_ms": far })), "a day ahead"),
            (start_json(json!({ "gpus": [0, 0] })), "gpus"),
            (start_json(json!({ "gpus": [1, 0] })), "gpus"),
            (start_json(json!({ "gpus": [70000] })), "gpus"),
            (
                start_json(json!({ "gpus": (0..65).collect::<Vec<u32>>() })),
                "gpus",
            ),
            (start_json(json!({ "resources": ["../etc"] })), "resources"),
            (start_json(json!({ "resources": [] })), "resources"),
            (start_json(json!({ "pid": 0 })), "pid"),
            (start_json(json!({ "mem_mib": big })), "mem_mib"),
            (
                start_json(json!({ "idle_timeout_s": big })),
                "idle_timeout_s",
            ),
            (end(&format!("\"end_ms\":{far}")), "a day ahead"),
            (end("\"end_ms\":1,\"busy_gpu_s\":1e300"), "GPU-seconds"),
            (end("\"end_ms\":1,\"idle_gpu_s\":-1"), "GPU-seconds"),
            (end("\"end_ms\":1,\"peak_mib\":1099511627777"), "peak_mib"),
            (end("\"end_ms\":1,\"gpus\":[3,3]"), "gpus"),
            (end("\"end_ms\":1,\"sampled_gpu_s\":1e400"), "JSON"),
            (end("\"end_ms\":1,\"peak_mib\":1e3"), "JSON"),
            (end("\"end_ms\":-1"), "JSON"),
        ];
        for (raw, why) in cases {
            let refused = parse(raw.as_bytes(), NOW).expect_err(&raw);
            assert!(refused.0.contains(why), "{raw}: {refused}");
        }
        assert!(parse(&[b'{'; MAX_LINE + 1], NOW).is_err());
        assert!(parse(b"{\"event\":\"start\"\xff}", NOW).is_err());
    }

    #[test]
    fn texts_are_clipped_and_cleaned() {
        let step = format!("a\u{1b}[2J\u{202e}{}", "é".repeat(400));
        let raw = start_json(serde_json::json!({ "step": step }));
        let Line::Start(start) = parse(raw.as_bytes(), NOW).unwrap() else {
            panic!("a start line")
        };
        assert!(start.step.len() <= MAX_STEP, "{}", start.step.len());
        assert!(start.step.starts_with("a?[2J?é"), "{}", start.step);
    }

    /// A JSON value from a few adversarial leaves and shapes.
    fn value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_map(serde_json::Value::from),
            Just(serde_json::Value::from(u64::MAX)),
            Just(serde_json::Value::from(253_402_300_800_000u64)),
            ".{0,40}".prop_map(serde_json::Value::from),
            Just(serde_json::Value::from("gpu:0")),
        ];
        leaf.prop_recursive(3, 64, 16, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..16).prop_map(serde_json::Value::from),
                prop::collection::vec(0u32..4, 0..9000).prop_map(serde_json::Value::from),
            ]
        })
    }

    const FIELDS: &[&str] = &[
        "v",
        "job",
        "resources",
        "gpus",
        "step",
        "pid",
        "pid_start",
        "boot_id",
        "host",
        "start_ms",
        "waited_ms",
        "mem_mib",
        "idle_timeout_s",
        "from",
        "at_ms",
        "end_ms",
        "how",
        "code",
        "signal",
        "samples",
        "peak_mib",
        "sampled_gpu_s",
        "busy_gpu_s",
        "idle_gpu_s",
    ];

    /// A line: an honest one of each kind with some fields replaced by
    /// adversarial values, then maybe cut short or given stray bytes.
    fn line() -> impl Strategy<Value = Vec<u8>> {
        let honest = prop_oneof![
            Just(start_json(serde_json::json!({}))),
            Just(format!(
                "{{\"event\":\"progress\",\"v\":1,\"job\":\"b-1-2\",\"at_ms\":{NOW},\"gpus\":[0],\"samples\":3,\"busy_gpu_s\":1.5}}"
            )),
            Just(format!(
                "{{\"event\":\"end\",\"v\":1,\"job\":\"b-1-2\",\"end_ms\":{NOW},\"how\":\"signal\",\"signal\":9,\"peak_mib\":100}}"
            )),
        ];
        let edits = prop::collection::vec((prop::sample::select(FIELDS), value()), 0..4);
        let damage = prop_oneof![
            4 => Just(None),
            1 => (any::<prop::sample::Index>(), prop::collection::vec(any::<u8>(), 0..8))
                .prop_map(Some),
        ];
        (honest, edits, damage).prop_map(|(honest, edits, damage)| {
            let mut doc: serde_json::Value = serde_json::from_str(&honest).unwrap();
            for (field, value) in edits {
                doc[field] = value;
            }
            let mut bytes = serde_json::to_vec(&doc).unwrap();
            if let Some((at, stray)) = damage {
                let at = at.index(bytes.len() + 1);
                bytes.truncate(at);
                bytes.extend(stray);
            }
            bytes
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// No line panics the parser, and whatever it takes is within
        /// every bound.
        #[test]
        fn every_line_taken_is_within_bounds(raw in line()) {
            let Ok(line) = parse(&raw, NOW) else {
                return Ok(());
            };
            let latest = NOW + MAX_AHEAD_MS;
            let (job, measured) = match &line {
                Line::Start(s) => {
                    prop_assert!(s.start_ms <= latest && s.waited_ms <= s.start_ms);
                    prop_assert!(!s.resources.is_empty() && s.resources.len() <= MAX_LIST);
                    prop_assert!(s.gpus.len() <= MAX_LIST);
                    prop_assert!(s.gpus.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(s.step.len() <= MAX_STEP && s.from.len() <= MAX_ID);
                    prop_assert!(!s.step.chars().any(crate::show::is_unsafe_char));
                    prop_assert!(s.mem_mib.is_none_or(|m| m <= MAX_MIB));
                    (&s.job, None)
                }
                Line::Progress { job, at_ms, measured, .. } => {
                    prop_assert!(*at_ms <= latest);
                    (job, Some(measured))
                }
                Line::End { job, end_ms, measured, .. } => {
                    prop_assert!(*end_ms <= latest);
                    (job, Some(measured))
                }
            };
            prop_assert!(job.len() <= MAX_ID);
            if let Some(m) = measured {
                prop_assert!(m.gpus.len() <= MAX_LIST);
                for s in [m.sampled_gpu_s, m.busy_gpu_s, m.idle_gpu_s] {
                    prop_assert!(s.is_finite() && (0.0..=MAX_GPU_S).contains(&s));
                }
            }
        }

        /// Bytes that are no line at all are refused, never a panic.
        #[test]
        fn random_bytes_never_panic(raw in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse(&raw, NOW);
        }
    }
}
