//! Small pieces of text shown to people: short durations, ordinals, and
//! sanitising of text that came from records.

use std::time::Duration;

/// A duration as people read it at a glance: `12s`, `1m12s`, `5m03s`,
/// `2h05m`, `3d04h`. Rounded down to what the unit shows.
pub fn short_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// A duration given in a message: `5s`, `250ms`, `1.5s`.
pub fn human_duration(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// `1st`, `2nd`, `3rd`, `4th`, `11th`, `21st`.
pub fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// Text from a record or another process, made safe for a terminal: control
/// characters (escape sequences start with one) become `?`, and it is clipped.
pub fn sanitize(text: &str) -> String {
    const MAX_CHARS: usize = 80;
    let mut out: String = text
        .chars()
        .take(MAX_CHARS)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if text.chars().nth(MAX_CHARS).is_some() {
        out.push('…');
    }
    out
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
    fn escapes_never_reach_the_terminal() {
        assert_eq!(sanitize("a\x1b[2Jb\x07\u{9b}c\n"), "a?[2Jb??c?");
        assert!(sanitize(&"x".repeat(500)).chars().count() <= 81);
    }
}
