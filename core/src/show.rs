//! The words the core gives things without drawing anything: the one
//! sanitiser for every text that came from a file or another process, a
//! path and a duration as a message shows them, a file's kind in words.

use std::time::Duration;

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

/// Unicode format characters (category Cf) and the line and paragraph
/// separators (Zl, Zp), as inclusive ranges: bidi overrides and isolates
/// (U+202A-U+202E, U+2066-U+2069), marks (U+200E, U+200F, U+061C), zero-width
/// characters and U+FEFF among them. Any of them can reorder or hide what a
/// terminal shows.
const FORMAT_CHARS: &[(u32, u32)] = &[
    (0xAD, 0xAD),
    (0x600, 0x605),
    (0x61C, 0x61C),
    (0x6DD, 0x6DD),
    (0x70F, 0x70F),
    (0x890, 0x891),
    (0x8E2, 0x8E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x2028, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
];

/// Whether `c` could steer a terminal: a control character (Cc: C0, DEL,
/// C1, where escape sequences start) or a format or separator character.
pub fn is_unsafe_char(c: char) -> bool {
    let n = c as u32;
    c.is_control()
        || FORMAT_CHARS
            .binary_search_by(|&(lo, hi)| {
                if hi < n {
                    std::cmp::Ordering::Less
                } else if lo > n {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .is_ok()
}

/// Text from a file or another process with every control, format and
/// separator character replaced by `?`, unclipped: what the JSON output and
/// every other view carries.
pub fn clean(text: &str) -> String {
    text.chars()
        .map(|c| if is_unsafe_char(c) { '?' } else { c })
        .collect()
}

/// A path as a message shows it: [`clean`] (a file name may hold any byte
/// but `/` and NUL, escapes included), never clipped.
pub fn show_path(path: &std::path::Path) -> String {
    clean(&path.to_string_lossy())
}

/// [`clean`], and clipped to a table cell or a message.
pub fn sanitize(text: &str) -> String {
    const MAX_CHARS: usize = 80;
    let mut out = clean(&text.chars().take(MAX_CHARS).collect::<String>());
    if text.chars().nth(MAX_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// What a file of mode `mode` is, in words.
pub fn kind_of(mode: u32) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "regular file",
        libc::S_IFDIR => "directory",
        libc::S_IFLNK => "symbolic link",
        libc::S_IFIFO => "FIFO",
        libc::S_IFSOCK => "socket",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        _ => "file of unknown type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_never_reach_the_terminal() {
        assert_eq!(sanitize("a\x1b[2Jb\x07\u{9b}c\n"), "a?[2Jb??c?");
        assert!(sanitize(&"x".repeat(500)).chars().count() <= 81);
    }

    #[test]
    fn format_characters_never_reach_the_terminal() {
        for c in [
            '\u{202A}',
            '\u{202B}',
            '\u{202C}',
            '\u{202D}',
            '\u{202E}',
            '\u{2066}',
            '\u{2067}',
            '\u{2068}',
            '\u{2069}',
            '\u{200E}',
            '\u{200F}',
            '\u{061C}',
            '\u{FEFF}',
            '\u{200B}',
            '\u{2028}',
            '\u{2029}',
            '\u{00AD}',
            '\u{E0041}',
        ] {
            assert_eq!(clean(&format!("a{c}b")), "a?b", "U+{:04X}", c as u32);
        }
        assert_eq!(clean("gpu é 日本 ✓"), "gpu é 日本 ✓", "ordinary text stays");
        assert!(FORMAT_CHARS.windows(2).all(|w| w[0].1 < w[1].0), "sorted");
    }
}
