//! What the kernel says about locks and processes, read from `/proc`: the
//! lock tables ([`locks`]), what processes' descriptors hold ([`fdinfo`]),
//! processes ([`process`]) and containers ([`container`]). Everything here
//! is a fresh reading, with no `unsafe`.

pub(crate) mod container;
pub mod fdinfo;
pub mod lock_entry;
pub mod locks;
pub mod process;

use std::fs;
use std::io::Read;
use std::path::Path;

/// An OS error as words, without Rust's `(os error N)`.
pub fn os_text(err: &std::io::Error) -> String {
    match err.raw_os_error() {
        Some(code) => nix::errno::Errno::from_raw(code).desc().to_owned(),
        None => err.to_string(),
    }
}

/// Reads a small `/proc` file in one bounded read.
fn read_small(path: impl AsRef<Path>) -> Option<String> {
    String::from_utf8(read_small_bytes(path)?).ok()
}

/// [`read_small`]'s bytes, for a file one bad byte must not void whole
/// (`/etc/passwd`, whose comment fields may be in any encoding, and whose
/// bound may cut a character in two).
fn read_small_bytes(path: impl AsRef<Path>) -> Option<Vec<u8>> {
    let mut file = fs::File::open(path).ok()?;
    // One read is the whole of a small /proc file: the kernel fills the
    // buffer from its one rendering, and only a file that fills it needs
    // the reads after it.
    let mut first = [0u8; 2048];
    let n = file.read(&mut first).ok()?;
    let mut buf = first[..n].to_vec();
    if n == first.len() {
        file.by_ref().take(62 * 1024).read_to_end(&mut buf).ok()?;
    }
    Some(buf)
}

#[cfg(test)]
mod tests {
    use super::container::*;
    use super::lock_entry::*;
    use super::locks::*;
    use super::process::*;

    #[test]
    fn containers_are_named_from_their_cgroup() {
        let id = "1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b";
        for (cgroup, want) in [
            (
                format!("0::/system.slice/docker-{id}.scope\n"),
                Some("docker 1a2b3c4d5e6f"),
            ),
            (
                format!("12:pids:/docker/{id}\n0::/\n"),
                Some("docker 1a2b3c4d5e6f"),
            ),
            (
                format!("0::/machine.slice/libpod-{id}.scope/container\n"),
                Some("podman 1a2b3c4d5e6f"),
            ),
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-{id}.scope\n"
                ),
                Some("kubernetes 1a2b3c4d5e6f"),
            ),
            (
                format!("11:cpu:/kubepods/burstable/pod0b1c/{id}\n"),
                Some("kubernetes 1a2b3c4d5e6f"),
            ),
            (
                "0::/lxc.payload.web1/init.scope\n".to_owned(),
                Some("lxc web1"),
            ),
            (
                "0::/user.slice/user-1000.slice/session-2.scope\n".to_owned(),
                None,
            ),
            ("0::/system.slice/docker-xyz.scope\n".to_owned(), None),
            ("0::/\n".to_owned(), None),
        ] {
            assert_eq!(container_in_cgroup(&cgroup).as_deref(), want, "{cgroup}");
        }
        assert_eq!(
            container_of(std::process::id()),
            None,
            "we share our own namespace"
        );
        assert_eq!(local_pid(std::process::id()), Some(std::process::id()));
    }

    #[test]
    fn parses_granted_and_blocked_flock_lines() {
        let text = "1: FLOCK  ADVISORY  WRITE 3023 fe:00:10010754 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 3050 fe:00:10010754 0 EOF\n\
                    2: POSIX  ADVISORY  WRITE 99 08:01:7 0 EOF\n\
                    3: FLOCK  ADVISORY  READ 12 103:1f:42 0 EOF\n";
        let locks = parse_locks(text);
        assert_eq!(locks.len(), 3);
        assert_eq!(
            locks[0],
            KernelLock {
                file: FileId {
                    major: 0xfe,
                    minor: 0,
                    ino: 10010754
                },
                pid: 3023,
                exclusive: true,
                blocked: false,
            }
        );
        assert!(locks[1].blocked);
        assert_eq!(
            locks[2].file,
            FileId {
                major: 0x103,
                minor: 0x1f,
                ino: 42
            }
        );
        assert!(!locks[2].exclusive);
        let table = LockTable::from_locks(locks);
        let file = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10010754,
        };
        assert!(table.is_locked(file));
        assert_eq!(
            table.blocked(file).map(|l| l.pid).collect::<Vec<_>>(),
            [3050]
        );
    }

    #[test]
    fn parses_byte_range_lines_with_their_ranges() {
        let text = "1: OFDLCK ADVISORY  WRITE -1 08:01:7 1048577 1048577\n\
                    2: POSIX  ADVISORY  READ 99 08:01:7 0 EOF\n\
                    3: -> OFDLCK ADVISORY  READ -1 08:01:7 1048577 1048580\n\
                    4: FLOCK  ADVISORY  WRITE 3 08:01:7 0 EOF\n";
        let ranges = parse_range_locks(text);
        assert_eq!(ranges.len(), 3);
        assert_eq!((ranges[0].pid, ranges[0].ofd), (None, true));
        assert!(ranges[0].is_byte(1_048_577));
        assert_eq!((ranges[1].pid, ranges[1].end), (Some(99), None));
        assert_eq!(ranges[1].range_text(), "0-EOF");
        assert!(ranges[2].blocked && !ranges[2].exclusive);
        assert_eq!(parse_locks(text).len(), 1);
    }

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let stat = "42 (a) b (c)) S 7 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0";
        assert_eq!(stat_field(stat, 4), Some("7"));
        assert_eq!(stat_field(stat, 22), Some("987654"));
    }

    #[test]
    fn own_process_is_recognised_and_a_wrong_start_time_is_not() {
        let me = std::process::id();
        let start = start_time(me);
        assert!(start.is_some());
        assert!(is_same_process(me, start));
        assert!(!is_same_process(me, start.map(|s| s + 1)));
        assert_eq!(uid_of(me), Some(nix::unistd::getuid().as_raw()));
    }
}
