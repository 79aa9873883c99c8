//! Small pieces of text shown to people: short durations, ordinals, and the
//! fitting of a line to a terminal's width. The sanitiser and the other
//! words the core uses too live in [`crate::show`].

use std::time::Duration;

/// A duration as people read it at a glance: `12s`, `1m12s`, `5m03s`,
/// `2h05m`, `3d04h`. Rounded down to what the unit shows.
pub(crate) fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// `seconds` as a duration that never panics: NaN and negative are zero,
/// anything past [`Duration::MAX`] is that (`Duration::from_secs_f64`
/// panics on both, and a sum of figures read from a file can be either).
pub(crate) fn seconds(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds).unwrap_or(if seconds > 0.0 {
        Duration::MAX
    } else {
        Duration::ZERO
    })
}

/// The last moment RFC 3339 can write: 9999-12-31T23:59:59.999Z.
const LAST_RFC3339_MS: u64 = 253_402_300_799_999;

/// `ms` since the epoch in UTC, `2026-11-30T08:00:00Z`; a time past the
/// year 9999 as the last second of it (humantime's formatting fails there,
/// and `to_string` on it panics).
pub(crate) fn utc_seconds(ms: u64) -> String {
    humantime::format_rfc3339_seconds(utc(ms)).to_string()
}

/// [`utc_seconds`] with milliseconds: `2026-11-30T08:00:00.250Z`.
pub(crate) fn utc_millis(ms: u64) -> String {
    humantime::format_rfc3339_millis(utc(ms)).to_string()
}

fn utc(ms: u64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + Duration::from_millis(ms.min(LAST_RFC3339_MS))
}

/// `1st`, `2nd`, `3rd`, `4th`, `11th`, `21st`.
pub(crate) fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// The columns `text` may take on a terminal, counted high: one for
/// printable ASCII, two for anything else (CJK and emoji take two, and
/// so do "ambiguous" characters like `·` in some locales). Controls are
/// gone already ([`sanitize`](crate::show::sanitize)). A line measured so never wraps.
pub fn columns(text: &str) -> usize {
    text.chars().map(|c| if c.is_ascii() { 1 } else { 2 }).sum()
}

/// `text` cut to at most `width` [`columns`], ending in `…` when cut.
pub(crate) fn clip_to(text: &str, width: usize) -> String {
    if columns(text) <= width {
        return text.to_owned();
    }
    const MORE: char = '…';
    let mut out = String::new();
    let mut used = 0;
    for c in text.chars() {
        let w = if c.is_ascii() { 1 } else { 2 };
        if used + w + 2 > width {
            break;
        }
        out.push(c);
        used += w;
    }
    if used + 2 <= width {
        out.push(MORE);
    }
    out
}

/// One line of at most `width` columns from `parts`: when too wide, the
/// parts marked shrinkable give way first (clipped, or left out when
/// little of them would be left), in order; then the line itself is cut.
pub(crate) fn fit(parts: &[(&str, bool)], width: usize) -> String {
    let mut parts: Vec<(String, bool)> = parts.iter().map(|(p, s)| (p.to_string(), *s)).collect();
    let total = |parts: &[(String, bool)]| parts.iter().map(|(p, _)| columns(p)).sum::<usize>();
    for i in 0..parts.len() {
        let over = total(&parts).saturating_sub(width);
        if over == 0 {
            break;
        }
        if !parts[i].1 {
            continue;
        }
        let left = columns(&parts[i].0).saturating_sub(over);
        parts[i].0 = if left < 8 {
            String::new()
        } else {
            clip_to(&parts[i].0, left)
        };
    }
    let line: String = parts.into_iter().map(|(p, _)| p).collect();
    clip_to(&line, width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_short_and_rounded_down() {
        let cases = [
            (0, "0s"),
            (59, "59s"),
            (72, "1m12s"),
            (303, "5m03s"),
            (7500, "2h05m"),
            (273_600, "3d04h"),
        ];
        for (secs, want) in cases {
            assert_eq!(short_duration(Duration::from_secs(secs)), want);
        }
    }

    #[test]
    fn figures_from_files_never_panic_a_formatter() {
        assert_eq!(seconds(f64::NAN), Duration::ZERO);
        assert_eq!(seconds(-1.0), Duration::ZERO);
        assert_eq!(seconds(2e22), Duration::MAX);
        assert_eq!(seconds(1.5), Duration::from_millis(1500));
        assert!(short_duration(Duration::MAX).ends_with('h'));
        assert_eq!(utc_seconds(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_millis(1500), "1970-01-01T00:00:01.500Z");
        assert_eq!(utc_seconds(u64::MAX), "9999-12-31T23:59:59Z");
        assert_eq!(utc_millis(LAST_RFC3339_MS + 1), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn ordinals() {
        let got: Vec<_> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101].map(ordinal).into();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"
            ]
        );
    }

    #[test]
    fn lines_fit_their_width_counted_high() {
        assert_eq!(columns("ab·"), 4);
        assert_eq!(clip_to("abcdef", 6), "abcdef");
        assert_eq!(clip_to("abcdefgh", 6), "abcd…");
        assert!(columns(&clip_to("日本語のテキスト", 7)) <= 7);
        let parts = [
            ("devlock: r · waiting 3s", false),
            (
                " for a-very-long-step-name (pid 4242, alice), held 5m",
                true,
            ),
            (" · 2nd in line", false),
        ];
        for width in [10, 30, 40, 60, 200] {
            let line = fit(&parts, width);
            assert!(columns(&line) <= width, "{width}: {line}");
        }
        assert!(
            fit(&parts, 45).ends_with(" · 2nd in line"),
            "{}",
            fit(&parts, 45)
        );
        assert_eq!(
            fit(&parts, 200),
            "devlock: r · waiting 3s for a-very-long-step-name (pid 4242, alice), held 5m · 2nd in line"
        );
    }
}
