//! Sizes and durations as the command line and the library write them, and
//! the defaults of the sizes and durations the core applies.

use std::time::Duration;

/// The device memory `--mem` leaves unbudgeted, when --mem-headroom is not
/// given: the CUDA context of each process and the driver's own take a few
/// hundred MiB each, and an estimate is seldom exact.
pub const DEFAULT_MEM_HEADROOM_MIB: u64 = 2048;

/// How long a newly admitted `--mem` job may be the one starting on its
/// device, when --settle is not given.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(30);

/// The memory a process outside the gate may hold before --require-idle
/// refuses, when --idle-threshold is not given.
pub const DEFAULT_IDLE_THRESHOLD_MIB: u64 = 256;

/// A memory size in MiB: `256`, `256MiB`, `1GiB`, `1.5G`.
pub fn parse_mib(text: &str) -> Result<u64, String> {
    let lower = text.trim().to_ascii_lowercase();
    let split = lower
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(lower.len());
    let (number, unit) = lower.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("not a size: {text:?} (try 256MiB or 1GiB)"))?;
    let scale = match unit.trim() {
        "" | "m" | "mb" | "mib" => 1.0,
        "g" | "gb" | "gib" => 1024.0,
        "k" | "kb" | "kib" => 1.0 / 1024.0,
        _ => return Err(format!("unknown size unit in {text:?} (use MiB or GiB)")),
    };
    Ok((number * scale).round() as u64)
}

/// A duration: `90s`, `10m`, `1h30m`, `250ms`, or a bare number of seconds
/// (`10`, `1.5`), as `flock -w 10` and `timeout 10` take it.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    let bare = !trimmed.is_empty()
        && trimmed.chars().all(|c| c.is_ascii_digit() || c == '.')
        && trimmed.chars().filter(|&c| c == '.').count() <= 1
        && trimmed != ".";
    if bare {
        return trimmed
            .parse::<f64>()
            .ok()
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
            .ok_or_else(|| format!("{trimmed} seconds is out of range (try 90s, 10m or 1h30m)"));
    }
    humantime::parse_duration(trimmed).map_err(|_| {
        "not a duration (try 90, 90s, 10m or 1h30m; a bare number is seconds)".to_owned()
    })
}
