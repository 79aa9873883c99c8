//! Reading the usage directory back: each user's files, counted for the
//! user the kernel says owns them, their lines joined into one [`Job`] per
//! hold, and the end of a hold whose devlock died observed here.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::fcntl::OFlag;

use super::{How, Line, MAX_LINE, Measured, Start};

/// Largest usage file read (a file is rotated at [`super::ROTATE_AT`]).
const MAX_FILE: u64 = 64 * 1024 * 1024;

/// What became of a hold, as far as its lines say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Its end line says how.
    Recorded,
    /// No end line, and its holder still runs: counted up to now.
    Running,
    /// No end line and the holder is gone (devlock was killed, or the
    /// machine went down): counted up to its last progress line (or its
    /// start), a lower bound.
    ObservedLater,
}

/// One hold.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    /// The owner of the file its lines are in.
    pub uid: u32,
    pub start: Start,
    pub end_ms: u64,
    pub ending: Ending,
    pub how: Option<How>,
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub measured: Measured,
}

/// Every job in `dir`, and notes on what was skipped and why. The
/// directory is reached as [`super::open_dir`] reaches it: through another
/// user's directory or link nothing is read, and the note says whose it
/// is; a directory another user owns is read, with a note that its records
/// may be incomplete (they can remove any).
pub(crate) fn jobs(dir: &Path, now_ms: u64) -> std::io::Result<(Vec<Job>, Vec<String>)> {
    let (dir_fd, st) = match super::open_dir(dir, false) {
        Ok(found) => found,
        Err(super::Unusable::Missing) => {
            return Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        }
        Err(super::Unusable::Refused(why)) => {
            return Ok((Vec::new(), vec![format!("no records read: {why}")]));
        }
    };
    let mut notes = Vec::new();
    if let Some(why) = super::distrust(dir, &st) {
        notes.push(format!("{why}: records may be missing"));
    }
    let mut names = names(&dir_fd)?;
    names.sort();
    let mut jobs: Vec<Job> = Vec::new();
    let mut index: HashMap<(u32, String), usize> = HashMap::new();
    let mut unreadable = 0usize;
    for name in names {
        let Some(named_uid) = uid_of_name(&name) else {
            continue;
        };
        // Judged before it is opened (a FIFO or a device is never opened,
        // another user's private file is named as what it is), and again
        // through the descriptor.
        let judged = nix::sys::stat::fstatat(
            &dir_fd,
            name.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        );
        let Ok(looked) = judged else {
            continue;
        };
        if let Some(why) = untrusted_file(&looked, named_uid) {
            notes.push(format!("{name}: skipped: {why}"));
            continue;
        }
        let c_name = CString::new(name.as_str()).expect("a file name has no NUL");
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let fd = match crate::sys::fs::openat(dir_fd.as_fd(), &c_name, flags, 0) {
            Ok(fd) => fd,
            Err(e) => {
                notes.push(format!("{name}: skipped: {}", crate::proc::os_text(&e)));
                continue;
            }
        };
        let Ok(st) = nix::sys::stat::fstat(&fd) else {
            continue;
        };
        if let Some(why) = untrusted_file(&st, named_uid) {
            notes.push(format!("{name}: skipped: {why}"));
            continue;
        }
        let mut text = Vec::new();
        let _ = std::fs::File::from(fd)
            .take(MAX_FILE)
            .read_to_end(&mut text);
        for raw in text.split(|&b| b == b'\n') {
            if raw.is_empty() {
                continue;
            }
            let line = (raw.len() <= MAX_LINE)
                .then(|| serde_json::from_slice::<Line>(raw).ok())
                .flatten();
            let Some(line) = line else {
                unreadable += 1;
                continue;
            };
            add(&mut jobs, &mut index, st.st_uid, line);
        }
    }
    if unreadable > 0 {
        notes.push(format!("{unreadable} unreadable lines skipped"));
    }
    for job in &mut jobs {
        if job.ending == Ending::Recorded {
            continue;
        }
        if holder_alive(&job.start) {
            job.ending = Ending::Running;
            job.end_ms = now_ms.max(job.start.start_ms);
        }
    }
    Ok((jobs, notes))
}

/// Why a usage file named for `named_uid` (its fstat `st`) is not counted,
/// if it is not: only a regular file with one link that the user it is
/// named for owns is that user's.
fn untrusted_file(st: &libc::stat, named_uid: u32) -> Option<String> {
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_nlink != 1 {
        return Some("not a regular file with one link".to_owned());
    }
    (st.st_uid != named_uid).then(|| {
        format!(
            "owned by {}, not by the user it is named for ({}); its lines are counted for nobody",
            crate::proc::process::user_name(st.st_uid),
            crate::proc::process::user_name(named_uid)
        )
    })
}

/// `UID.jsonl`, `UID.TAG.jsonl` or either's `.old`: the uid it is named
/// for.
fn uid_of_name(name: &str) -> Option<u32> {
    let stem = name
        .strip_suffix(".jsonl")
        .or_else(|| name.strip_suffix(".jsonl.old"))?;
    parse_stem(stem).map(|(uid, _)| uid)
}

/// A usage file's stem, `UID` or `UID.TAG` (TAG sixteen lowercase hex
/// digits): the uid, and whether it is tagged.
pub(super) fn parse_stem(stem: &str) -> Option<(u32, bool)> {
    let (uid, tag) = match stem.split_once('.') {
        Some((uid, tag)) => (uid, Some(tag)),
        None => (stem, None),
    };
    if uid.is_empty() || !uid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if let Some(tag) = tag
        && (tag.len() != 16 || !tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
    {
        return None;
    }
    Some((uid.parse().ok()?, tag.is_some()))
}

/// The names in the directory open as `dir` (read through the descriptor,
/// never by path again); names that are not UTF-8 are no usage file's.
pub(super) fn names(dir: &OwnedFd) -> std::io::Result<Vec<String>> {
    let mut listing = nix::dir::Dir::from_fd(dir.try_clone()?)?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        if let Ok(name) = entry?.file_name().to_str()
            && !matches!(name, "." | "..")
        {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

fn add(jobs: &mut Vec<Job>, index: &mut HashMap<(u32, String), usize>, uid: u32, line: Line) {
    match line {
        Line::Start(start) => {
            let key = (uid, start.job.clone());
            if index.contains_key(&key) {
                return;
            }
            index.insert(key, jobs.len());
            jobs.push(Job {
                uid,
                end_ms: start.start_ms,
                ending: Ending::ObservedLater,
                how: None,
                code: None,
                signal: None,
                measured: Measured::default(),
                start,
            });
        }
        Line::Progress {
            job,
            at_ms,
            measured,
            ..
        } => {
            if let Some(&i) = index.get(&(uid, job)) {
                let j = &mut jobs[i];
                if j.ending != Ending::Recorded && at_ms >= j.end_ms {
                    j.end_ms = at_ms;
                    j.measured = measured;
                }
            }
        }
        Line::End {
            job,
            end_ms,
            how,
            code,
            signal,
            measured,
            ..
        } => {
            if let Some(&i) = index.get(&(uid, job)) {
                let j = &mut jobs[i];
                if j.ending != Ending::Recorded {
                    j.ending = Ending::Recorded;
                    j.end_ms = end_ms.max(j.start.start_ms);
                    j.how = Some(how);
                    j.code = code;
                    j.signal = signal;
                    j.measured = measured;
                }
            }
        }
    }
}

/// Whether the holder a start line names still runs here: this host, this
/// boot, the pid with the same start time.
fn holder_alive(start: &Start) -> bool {
    if start.host.is_some() && start.host != super::host() {
        return false;
    }
    let this_boot = match (&start.boot_id, crate::proc::process::boot_id()) {
        (Some(then), Some(now)) => *then == now,
        _ => true,
    };
    this_boot && crate::proc::process::start_time(start.pid) == Some(start.pid_start)
}

#[cfg(test)]
mod names_tests {
    use super::*;

    #[test]
    fn usage_files_are_named_for_a_uid_with_an_optional_random_tag() {
        for (name, uid) in [
            ("1000.jsonl", Some(1000)),
            ("1000.jsonl.old", Some(1000)),
            ("0.0123456789abcdef.jsonl", Some(0)),
            ("7.0123456789abcdef.jsonl.old", Some(7)),
            ("1000.0123456789ABCDEF.jsonl", None),
            ("1000.0123456789abcde.jsonl", None),
            ("1000.0123456789abcdef0.jsonl", None),
            ("1000..jsonl", None),
            (".jsonl", None),
            ("+1.jsonl", None),
            ("99999999999.jsonl", None),
            ("1000.jsonl.old.old", None),
            ("1000.json", None),
        ] {
            assert_eq!(uid_of_name(name), uid, "{name}");
        }
    }
}
