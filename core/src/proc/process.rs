//! Processes as `/proc` shows them: start times (pid plus start time name
//! one process), parents and descendants, users, command lines, whether one
//! is stopped, and the boot id.

use std::collections::HashMap;
use std::fs;
use std::io::Read;

use super::{read_small, read_small_bytes};

/// The fields of `/proc/PID/stat` devlock uses, from one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `R`, `S`, `D`, `Z`, ... (field 3).
    pub state: char,
    /// Parent pid (field 4).
    pub ppid: u32,
    /// Process group (field 5).
    pub pgrp: u32,
    /// Start time in clock ticks since boot (field 22). Together with the pid
    /// this names one process for the life of the machine, so a recycled pid
    /// is not mistaken for the process a record describes.
    pub start: u64,
}

/// The pid of every process listed under `root` (`/proc`, or a copy of
/// its shape in tests), as the listing goes; an entry gone meanwhile is
/// simply not there.
pub fn pids_in(root: &std::path::Path) -> std::io::Result<impl Iterator<Item = u32> + use<>> {
    Ok(fs::read_dir(root)?
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok()))
}

/// The pid of every process `/proc` lists now; none if it cannot be listed.
pub fn pids() -> impl Iterator<Item = u32> {
    pids_in(std::path::Path::new("/proc")).into_iter().flatten()
}

pub fn stat(pid: u32) -> Option<Stat> {
    let text = read_small(format!("/proc/{pid}/stat"))?;
    Some(Stat {
        state: stat_field(&text, 3)?.chars().next()?,
        ppid: stat_field(&text, 4)?.parse().ok()?,
        pgrp: stat_field(&text, 5)?.parse().ok()?,
        start: stat_field(&text, 22)?.parse().ok()?,
    })
}

/// Start time of a process in clock ticks since boot (see [`Stat::start`]).
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|s| s.start)
}

/// Parent pid.
pub(crate) fn parent_pid(pid: u32) -> Option<u32> {
    stat(pid).map(|s| s.ppid)
}

/// The ancestors of `pid`, nearest first, each with its stat, up to but not
/// including init (at most 64: a loop in /proc cannot hang a caller).
pub fn ancestors(pid: u32) -> impl Iterator<Item = (u32, Stat)> {
    let mut next = parent_pid(pid);
    std::iter::from_fn(move || {
        let parent = next.filter(|&p| p > 1)?;
        let stat = stat(parent)?;
        next = Some(stat.ppid);
        Some((parent, stat))
    })
    .take(64)
}

/// Field `n` (1-based, as in proc(5)) of a stat line; the command name may hold
/// spaces and parentheses, so counting starts after its last `)`.
pub(super) fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(n.checked_sub(3)?)
}

/// Whether `pid` is the very process that had `start` as its start time.
pub fn is_same_process(pid: u32, start: Option<u64>) -> bool {
    match (start_time(pid), start) {
        (Some(now), Some(then)) => now == then,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Real uid of a live process, from `/proc/PID/status` (readable for every user).
pub fn uid_of(pid: u32) -> Option<u32> {
    let status = read_small(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Short command name of a live process (`/proc/PID/comm`).
pub fn comm_of(pid: u32) -> Option<String> {
    Some(
        read_small(format!("/proc/{pid}/comm"))?
            .trim_end()
            .to_owned(),
    )
}

/// The command line of a live process, read now (so `hidepid` is
/// respected); `None` when it cannot be read or is empty (a zombie, a
/// kernel thread). Each argument is cleaned of control and format
/// characters.
pub(crate) fn cmdline_of(pid: u32) -> Option<Vec<String>> {
    let mut file = fs::File::open(format!("/proc/{pid}/cmdline")).ok()?;
    let mut buf = Vec::with_capacity(256);
    file.by_ref().take(8 * 1024).read_to_end(&mut buf).ok()?;
    let args: Vec<String> = buf
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| crate::show::clean(&String::from_utf8_lossy(a)))
        .collect();
    (!args.is_empty()).then_some(args)
}

/// How `pid`, started at `start`, ended, as a wait status, while it is a
/// zombie not yet reaped (field 52 of its stat line; a zombie's pid cannot
/// be reused, and the start time tells it from one reused before).
pub fn zombie_exit_status(pid: u32, start: u64) -> Option<i32> {
    let text = read_small(format!("/proc/{pid}/stat"))?;
    let zombie = stat_field(&text, 3)? == "Z";
    let same = stat_field(&text, 22)?.parse::<u64>().ok()? == start;
    (zombie && same)
        .then(|| stat_field(&text, 52)?.parse().ok())
        .flatten()
}

/// Whether `pid` has ended and waits to be reaped.
pub(crate) fn is_zombie(pid: u32) -> bool {
    stat(pid).is_some_and(|s| s.state == 'Z')
}

/// Whether a live process is stopped (`T`, by a signal, or `t`, by a tracer).
pub fn is_stopped(pid: u32) -> bool {
    stat(pid).is_some_and(|s| matches!(s.state, 'T' | 't'))
}

/// The boot id, which tells records written before the last reboot apart.
pub(crate) fn boot_id() -> Option<String> {
    Some(
        read_small("/proc/sys/kernel/random/boot_id")?
            .trim()
            .to_owned(),
    )
}

/// User name for a uid, or the number when the passwd database has none.
/// `/etc/passwd` is read first, directly; NSS (`getpwuid_r`: nscd, LDAP,
/// sssd) is asked only for a uid that file does not name. NSS faults some
/// 0.4 MiB of libc (its files module, stdio, their neighbours) into every
/// waiting devlock whose line names the holder's user: 2.4 MiB resident
/// against 2.0 without it (bench/run, section 5). Cached: a lookup can cost
/// a round of NSS.
pub fn user_name(uid: u32) -> String {
    static NAMES: std::sync::Mutex<Option<HashMap<u32, String>>> = std::sync::Mutex::new(None);
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    names
        .get_or_insert_with(|| {
            read_small_bytes("/etc/passwd")
                .map(|text| local_users(&text))
                .unwrap_or_default()
        })
        .entry(uid)
        .or_insert_with(
            || match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
                Ok(Some(user)) => user.name,
                _ => uid.to_string(),
            },
        )
        .clone()
}

/// The names passwd(5) text gives uids: the first line for a uid wins, as
/// in NSS's files lookup. A line cut short (the read is bounded) is not
/// read, nor NIS's `+`/`-` lines, which NSS's compat module expands. Read
/// as bytes, line by line: a byte that is not UTF-8 (a comment field in
/// Latin-1, a character the bound cut) voids only its own line, and a uid
/// whose first line has a name that is not UTF-8 is left to NSS.
fn local_users(text: &[u8]) -> HashMap<u32, String> {
    let whole = text
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(&[][..], |end| &text[..end]);
    let mut users: HashMap<u32, Option<String>> = HashMap::new();
    for line in whole.split(|&b| b == b'\n') {
        let mut fields = line.split(|&b| b == b':');
        let (Some(name), Some(_password), Some(uid)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if name.is_empty() || name.starts_with(b"+") || name.starts_with(b"-") {
            continue;
        }
        let Some(uid) = std::str::from_utf8(uid)
            .ok()
            .and_then(|u| u.parse::<u32>().ok())
        else {
            continue;
        };
        users
            .entry(uid)
            .or_insert_with(|| String::from_utf8(name.to_vec()).ok());
    }
    users
        .into_iter()
        .filter_map(|(uid, name)| Some((uid, name?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_lines_name_uids_and_a_line_cut_short_names_nobody() {
        let text = "root:x:0:0:root:/root:/bin/bash\n\
                    +nis::::::\n\
                    alice:x:1000:1000::/home/alice:/bin/sh\n\
                    alias:x:1000:1000::/home/alias:/bin/sh\n\
                    broken line\n\
                    :x:7:7::/:/bin/sh\n\
                    cut:x:10";
        let users = local_users(text.as_bytes());
        assert_eq!(users.get(&0).map(String::as_str), Some("root"));
        assert_eq!(users.get(&1000).map(String::as_str), Some("alice"));
        // A nameless line, and the last, cut short: "10" is not its uid.
        assert_eq!(users.get(&7), None);
        assert_eq!(users.get(&10), None);
        assert_eq!(users.len(), 2);
    }

    #[test]
    fn a_byte_that_is_not_utf8_voids_only_its_line() {
        let text = b"root:x:0:0:r\xe9my:/root:/bin/sh\n\xff:x:5:5::/:/bin/sh\nnot:x:5:5::/:/bin/sh\nbob:x:9:9::/:/bin/sh\n";
        let users = local_users(text);
        assert_eq!(users.get(&0).map(String::as_str), Some("root"));
        assert_eq!(users.get(&9).map(String::as_str), Some("bob"));
        // Uid 5's first line names it in bytes that are not UTF-8: NSS's.
        assert_eq!(users.get(&5), None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever the file holds, in any bytes: no panic, and every name
        /// read is a whole line's first field, never empty, never a NIS
        /// entry.
        #[test]
        fn any_passwd_bytes_name_only_what_whole_lines_say(
            text in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::prelude::any::<u8>(),
                    proptest::prelude::Just(b':'),
                    proptest::prelude::Just(b'\n'),
                    proptest::prelude::Just(b'7'),
                ],
                0..600,
            )
        ) {
            for (uid, name) in local_users(&text) {
                proptest::prop_assert!(!name.is_empty() && !name.starts_with(['+', '-']));
                let says = |line: &[u8]| {
                    let mut fields = line.split(|&b| b == b':');
                    fields.next() == Some(name.as_bytes())
                        && fields.nth(1).and_then(|u| std::str::from_utf8(u).ok()?.parse::<u32>().ok())
                            == Some(uid)
                };
                proptest::prop_assert!(text.split(|&b| b == b'\n').any(says), "{uid} {name:?}");
            }
        }
    }

    #[test]
    fn a_uid_in_etc_passwd_is_named_and_one_nowhere_is_its_number() {
        assert_eq!(user_name(0), "root");
        let nobody = u32::MAX - 7;
        assert_eq!(user_name(nobody), nobody.to_string());
    }
}
