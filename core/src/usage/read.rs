//! Reading the usage directory back: each user's files, counted for the
//! user the kernel says owns them, each line taken in within its bounds
//! ([`line::parse`]) or skipped and counted, the lines joined into one
//! [`Job`] per hold, and the end of a hold whose devlock died observed here.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::fcntl::OFlag;

use super::{How, Line, Measured, Start, line};

/// Largest usage file read (a file is rotated at [`super::ROTATE_AT`]).
const MAX_FILE: u64 = 64 * 1024 * 1024;

/// What became of a hold, as far as its lines say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
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
pub struct Job {
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
pub fn jobs(dir: &Path, now_ms: u64) -> std::io::Result<(Vec<Job>, Vec<String>)> {
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
        notes.extend(add_file(
            &mut jobs, &mut index, st.st_uid, &name, &text, now_ms,
        ));
    }
    let here = Here::now();
    for job in &mut jobs {
        if job.ending == Ending::Recorded {
            continue;
        }
        if here.runs(&job.start) {
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
    let mut names = Vec::new();
    crate::sys::listing::each_entry(std::os::fd::AsFd::as_fd(dir), |name, _| {
        names.push(name.to_owned());
    })?;
    Ok(names)
}

/// Adds the lines of one file (`name`, owned by `uid`) to `jobs`, each
/// taken in by [`line::parse`] as read at `now_ms`; a note naming the file
/// when it skipped any, with the first one's number and why.
fn add_file(
    jobs: &mut Vec<Job>,
    index: &mut HashMap<(u32, String), usize>,
    uid: u32,
    name: &str,
    text: &[u8],
    now_ms: u64,
) -> Option<String> {
    let mut skipped = 0usize;
    let mut first = None;
    for (number, raw) in text.split(|&b| b == b'\n').enumerate() {
        if raw.is_empty() {
            continue;
        }
        match line::parse(raw, now_ms) {
            Ok(line) => add(jobs, index, uid, line),
            Err(why) => {
                skipped += 1;
                first.get_or_insert((number + 1, why));
            }
        }
    }
    let (number, why) = first?;
    Some(format!(
        "{name}: {skipped} {} skipped, unreadable or out of bounds (line {number}: {why})",
        if skipped == 1 { "line" } else { "lines" }
    ))
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

/// This host and boot, looked up once per read: whether a start line's
/// holder still runs here.
struct Here {
    host: Option<String>,
    boot_id: Option<String>,
}

impl Here {
    fn now() -> Here {
        Here {
            host: super::host(),
            boot_id: crate::proc::process::boot_id(),
        }
    }

    /// Whether the holder `start` names still runs here: this host, this
    /// boot, the pid with the same start time.
    fn runs(&self, start: &Start) -> bool {
        if start.host.is_some() && start.host != self.host {
            return false;
        }
        let this_boot = match (&start.boot_id, &self.boot_id) {
            (Some(then), Some(now)) => then == now,
            _ => true,
        };
        this_boot && crate::proc::process::start_time(start.pid) == Some(start.pid_start)
    }
}

#[cfg(any(test, feature = "testing"))]
impl Job {
    /// A job `uid` held on `gpus` from `start_ms` to `end_ms`, as its step,
    /// ended by an exit: for the tests of what is made of jobs.
    pub fn for_test(uid: u32, start_ms: u64, end_ms: u64, gpus: Vec<u32>, step: &str) -> Job {
        Job {
            uid,
            start: Start {
                v: super::VERSION,
                job: format!("j-{start_ms}-{end_ms}"),
                resources: vec![crate::gpu::gate::GPU_GROUP.into()],
                gpus,
                step: step.into(),
                pid: 1,
                pid_start: 1,
                boot_id: None,
                host: None,
                start_ms,
                waited_ms: 0,
                mem_mib: None,
                idle_timeout_s: None,
                from: "cli".into(),
            },
            end_ms,
            ending: Ending::Recorded,
            how: Some(How::Exit),
            code: Some(0),
            signal: None,
            measured: Measured::default(),
        }
    }
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
