//! A lock devlock did not take in front of a line: what it is and whose,
//! as the busy or the waiting line names it, and whether it is still there.

use std::fs::File;
use std::io;

use super::{AGREE_BASE, get_lock};
use crate::proc::lock_entry::{FileId, RangeLock};

/// A lock devlock did not take (or cannot vouch for) that keeps a request
/// out of the line: it stands for the resource being in use, as a holder
/// does. The request reports it as busy (`-n`) or waits until it is gone
/// ([`Blocked::still_there`]) and joins again.
#[derive(Debug)]
pub(crate) struct Blocked {
    file: File,
    start: i64,
    len: i64,
    /// The resource whose line it shuts.
    resource: String,
    /// The lock's owner, where the kernel names one.
    pid: Option<u32>,
    /// `r is busy: ...`, naming the lock and its owner.
    message: String,
    /// The part after `is busy: `, for a waiting line.
    pub words: String,
}

impl std::fmt::Display for Blocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Blocked {}

impl Blocked {
    /// Whether a lock is still where this one was (one query).
    pub(crate) fn still_there(&self) -> bool {
        !matches!(get_lock(&self.file, self.start, self.len), Ok(None))
    }

    /// The error a request that may not wait ends with: the same typed
    /// busy as a holder's (`-q`, `--conflict-exit-code`, `devlock.Busy`).
    pub(crate) fn into_busy(self) -> anyhow::Error {
        crate::error::Busy::stranger(&self.resource, self.pid, self.message)
    }
}

/// The error for a line that a lock devlock did not take makes unusable
/// for now, naming the lock and, as far as this user can see, its owner.
pub(super) fn blocked(
    resource: &str,
    path: &std::path::Path,
    id: FileId,
    file: File,
    at: i64,
    len: i64,
    err: Option<io::Error>,
) -> anyhow::Error {
    let lock = get_lock(&file, at, 1).ok().flatten();
    let pid = lock.filter(|l| l.l_pid > 0).map(|l| l.l_pid as u32);
    let what = match lock {
        Some(l) => {
            let range = RangeLock {
                file: id,
                pid: (l.l_pid > 0).then_some(l.l_pid as u32),
                ofd: l.l_pid <= 0,
                exclusive: l.l_type == libc::F_WRLCK as libc::c_short,
                blocked: false,
                start: l.l_start as u64,
                end: (l.l_len > 0).then(|| (l.l_start + l.l_len - 1) as u64),
            };
            let single = range.end == Some(range.start);
            let agreement = match range.start.checked_sub(AGREE_BASE as u64) {
                Some(0) if single => ", the agreement of a plain lock".to_owned(),
                Some(n) if single && n < 1 << 16 => format!(", the agreement of --slots {n}"),
                _ => String::new(),
            };
            format!(
                "a lock that is not devlock's on bytes {} of {}{agreement} ({})",
                range.range_text(),
                path.display(),
                owner_words(&range)
            )
        }
        None => match err {
            Some(e) => format!("{}: {}", path.display(), crate::proc::os_text(&e)),
            None => format!("locks on {}", path.display()),
        },
    };
    let words = format!("its line is blocked by {what}");
    anyhow::Error::new(Blocked {
        file,
        start: at,
        len,
        resource: resource.to_owned(),
        pid,
        message: format!("{resource} is busy: {words}"),
        words,
    })
}

/// `pid 4242, alice`, or why it cannot be said.
fn owner_words(lock: &RangeLock) -> String {
    let owners: Vec<u32> = match lock.pid {
        Some(pid) => vec![pid],
        None => crate::proc::fdinfo::range_lock_owners(lock.file)
            .into_iter()
            .filter(|(_, l)| l.start == lock.start && l.end == lock.end)
            .map(|(pid, _)| pid)
            .collect(),
    };
    if owners.is_empty() {
        return format!("held by {}", crate::proc::fdinfo::unseen_owner());
    }
    owners
        .iter()
        .map(|&pid| {
            let user = crate::proc::process::uid_of(pid)
                .map_or("user unknown".to_owned(), crate::proc::process::user_name);
            format!("pid {pid}, {}", crate::show::sanitize(&user))
        })
        .collect::<Vec<_>>()
        .join("; ")
}
