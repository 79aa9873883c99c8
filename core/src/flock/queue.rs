//! The line in front of each lock: first come, first served, built on
//! open-file-description byte-range locks so every wait is a kernel sleep,
//! and so that nothing in the file is ever read: whatever anyone writes into
//! a queue file changes nothing.
//!
//! flock(2) wakes all waiters at once and lets any of them win, and a
//! newcomer can take a lock at the instant it is released. So each lock file
//! `R.lock` has a queue file `.R.queue`. A request write-locks one byte at
//! `SLOT_BASE + ticket` for as long as it waits (and, if exclusive, holds),
//! its ticket one past the highest byte anyone holds (found with F_OFD_GETLK
//! queries, no counter, no header lock). Its turn comes when no earlier
//! ticket's byte is locked any more: one blocking read-lock over all of them,
//! which the kernel grants once the last earlier request has finished or
//! died. A dead waiter's bytes vanish with it, so it never blocks the line,
//! and an empty line starts again at ticket 1.
//!
//! The semaphore size everyone agreed on (`--slots N`, 0 for a plain lock)
//! is a read lock on the byte `AGREE_BASE + N`, held by every request in line
//! and every holder that came through the line: the agreement lives exactly
//! as long as someone uses the resource, and a request that finds another
//! size held refuses. Two requests with different sizes that arrive together
//! both lock before they look, so at least one sees the other.

use std::fs::File;
use std::io;

use anyhow::{Context, Result};

use crate::flock::dir::ScratchDir;
use crate::flock::file::LockFile;
use crate::proc::lock_entry::{FileId, RangeLock};
use crate::proc::locks::LockTable;

mod blocked;
pub(crate) use blocked::Blocked;
use blocked::blocked;

/// Where the agreement bytes start: `AGREE_BASE + N` for `--slots N`.
const AGREE_BASE: i64 = 4096;
/// One past the last agreement byte (`--slots` is a u16).
const AGREE_END: i64 = AGREE_BASE + (1 << 16);
/// Where ticket bytes start; anything past the agreement bytes would do.
const SLOT_BASE: i64 = 1 << 20;
/// Highest ticket handed out. Tickets restart at 1 whenever the line is
/// empty, so only a lock that is not devlock's can push them this far.
pub(crate) const MAX_TICKET: u64 = 1 << 32;
/// How many taken bytes a request steps over before it gives up: far more
/// than requests that could arrive at the same instant.
const MAX_STEPS: usize = 1000;

/// A place in line. Dropping it leaves the line and the agreement.
#[derive(Debug)]
pub(crate) struct Ticket {
    file: File,
    /// The queue file, for messages.
    path: std::path::PathBuf,
    pub number: u64,
    /// Slot count everyone in line or holding uses (ours, if nobody else's).
    #[cfg(test)]
    pub agreed_slots: u64,
}

/// The queue file's name for a lock file's name.
pub fn queue_name(lock_name: &str) -> String {
    let base = lock_name.strip_suffix(".lock").unwrap_or(lock_name);
    format!(".{base}.queue")
}

/// What a request found about the size others use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Agreement {
    /// Nobody in line or holding through the line says.
    None,
    /// Someone in line or holding uses the resource with this many slots (0:
    /// as a plain lock).
    Slots(u64),
}

impl Ticket {
    /// Joins the line for `lock_name` with a request for `slots` slots (0
    /// for a plain lock). Fails with a usage error when a devlock the
    /// kernel backs (`devlock_of(pid)`: a process this user can see, whose
    /// record or registration names it by pid and start time) uses another
    /// size, or for a semaphore when `plain_holder` says a devlock holds the
    /// lock plainly. A lock nobody can vouch for on a byte that matters (an
    /// agreement byte, the ticket bytes to the end) is occupancy, as a
    /// holder's would be: a [`Blocked`] error, for the caller to wait on
    /// or to report as busy.
    pub(crate) fn take(
        dir: &ScratchDir,
        lock_name: &str,
        slots: u64,
        plain_holder: &dyn Fn() -> bool,
        devlock_of: &dyn Fn(u32) -> bool,
        resource: &str,
    ) -> Result<Ticket> {
        // A separate open per ticket: OFD locks belong to the open file
        // description, and two tickets of one process must not merge.
        let queue = LockFile::open(dir, &queue_name(lock_name))?;
        let path = queue.path().to_owned();
        let id = queue.id();
        let file = queue.into_file();
        let agree_at = AGREE_BASE + slots.min(u64::from(u16::MAX)) as i64;
        if let Err(e) = set_lock(&file, libc::F_RDLCK, agree_at, 1, false) {
            return Err(blocked(resource, &path, id, file, agree_at, 1, Some(e)));
        }
        match other_agreement(&file, Some(slots)) {
            Some(theirs) if agreement_is_devlocks(id, theirs, devlock_of) => {
                return Err(slots_mismatch(resource, theirs, slots));
            }
            Some(theirs) => {
                // Ours goes before waiting: two requests each waiting for
                // the other's byte would wait for ever.
                let _ = set_lock(&file, libc::F_UNLCK, agree_at, 1, false);
                let at = AGREE_BASE + theirs as i64;
                return Err(blocked(resource, &path, id, file, at, 1, None));
            }
            // Nobody else agrees with us either, yet a devlock holds the
            // lock without the line: a plain holder.
            None if slots > 0 && !shares_agreement(&file, agree_at) && plain_holder() => {
                return Err(slots_mismatch(resource, 0, slots));
            }
            None => {}
        }
        let number = match take_number(&file) {
            Ok(number) => number,
            Err(at) => {
                let _ = set_lock(&file, libc::F_UNLCK, agree_at, 1, false);
                let at = SLOT_BASE + at.min(MAX_TICKET) as i64;
                return Err(blocked(resource, &path, id, file, at, 0, None));
            }
        };
        Ok(Ticket {
            file,
            path,
            number,
            #[cfg(test)]
            agreed_slots: slots,
        })
    }

    /// Whether an earlier ticket is still in line (or holding).
    pub(crate) fn has_anyone_ahead(&self) -> Result<bool> {
        anyone_ahead(&self.file, self.number).with_context(|| {
            format!(
                "looking for earlier places in line in {}",
                self.path.display()
            )
        })
    }

    /// Sleeps until every earlier ticket has left the line. Returns early
    /// with `Interrupted` when a signal arrives and `keep_waiting` says stop.
    pub(crate) fn wait_turn(&self, keep_waiting: &dyn Fn() -> bool) -> Result<()> {
        self.sleep_for_turn(keep_waiting).with_context(|| {
            format!(
                "waiting for place {} in line in {}",
                self.number,
                self.path.display()
            )
        })
    }

    /// The wait itself: for the nearest earlier place still held, alone
    /// (one byte), and then for the next nearest, until none is left. A
    /// release wakes only the one request right behind it, not the whole
    /// line (a wait over every earlier byte would be woken by each release
    /// of the one it first found in its way, every waiter at once).
    fn sleep_for_turn(&self, keep_waiting: &dyn Fn() -> bool) -> io::Result<()> {
        loop {
            if !keep_waiting() {
                return Err(io::ErrorKind::Interrupted.into());
            }
            let Some(ahead) = nearest_ahead(&self.file, self.number)? else {
                return Ok(());
            };
            let at = SLOT_BASE + ahead as i64;
            match set_lock(&self.file, libc::F_RDLCK, at, 1, true) {
                Ok(()) => set_lock(&self.file, libc::F_UNLCK, at, 1, false)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted && keep_waiting() => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The queue file's descriptor: the place and the agreement.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.file)
    }

    /// Lets the next request go while this one keeps what it took (a shared
    /// holder admits the readers behind it; a writer behind still waits for
    /// the lock itself). The agreement stays.
    pub(crate) fn step_aside(&self) -> io::Result<()> {
        set_lock(
            &self.file,
            libc::F_UNLCK,
            SLOT_BASE + self.number as i64,
            1,
            false,
        )
    }
}

/// The size someone else in line or holding uses, if it is not `ours`:
/// a single-byte read lock on an agreement byte other than ours. Locks of
/// other shapes there are not devlock's and say nothing.
fn other_agreement(file: &File, ours: Option<u64>) -> Option<u64> {
    let mut ranges = match ours {
        Some(n) => {
            let at = AGREE_BASE + n as i64;
            vec![(AGREE_BASE, at - 1), (at + 1, AGREE_END - 1)]
        }
        None => vec![(AGREE_BASE, AGREE_END - 1)],
    };
    // Bounded: a stranger's thousands of locks cost a bounded number of queries.
    for _ in 0..64 {
        let (lo, hi) = ranges.pop()?;
        if lo > hi {
            continue;
        }
        let Some(found) = get_lock(file, lo, hi - lo + 1).ok()? else {
            continue;
        };
        if found.l_len == 1 && found.l_type == libc::F_RDLCK as libc::c_short {
            return Some((found.l_start - AGREE_BASE) as u64);
        }
        // Something else: look on either side of it.
        ranges.push((lo, found.l_start - 1));
        if found.l_len > 0 {
            ranges.push((found.l_start + found.l_len, hi));
        }
    }
    None
}

/// Whether someone else holds the agreement byte we hold.
fn shares_agreement(file: &File, at: i64) -> bool {
    get_lock(file, at, 1).is_ok_and(|l| l.is_some())
}

/// Takes the byte one past the highest one anyone holds; on a race (or a
/// stranger's lock) it steps past the lock in the way. `Err` names the
/// ticket at which it gave up.
fn take_number(file: &File) -> std::result::Result<u64, u64> {
    let mut candidate = highest_taken(file)? + 1;
    for _ in 0..MAX_STEPS {
        if candidate > MAX_TICKET {
            return Err(candidate);
        }
        match set_lock(file, libc::F_WRLCK, SLOT_BASE + candidate as i64, 1, false) {
            Ok(()) => return Ok(candidate),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {}
            Err(_) => return Err(candidate),
        }
        match get_lock(file, SLOT_BASE + candidate as i64, 1) {
            // Gone already: try the same byte again.
            Ok(None) => {}
            Ok(Some(found)) if found.l_len > 0 => {
                let next = (found.l_start + found.l_len - SLOT_BASE) as u64;
                candidate = next.max(candidate + 1);
            }
            _ => return Err(candidate),
        }
    }
    Err(candidate)
}

/// The highest ticket whose byte someone holds (0 when nobody does): an
/// exponential then a binary search over "is anything locked from here to
/// the end", a few dozen queries at most whatever is in the file.
fn highest_taken(file: &File) -> std::result::Result<u64, u64> {
    let taken_from = |t: u64| -> std::result::Result<bool, u64> {
        get_lock(file, SLOT_BASE + t as i64, 0)
            .map(|l| l.is_some())
            .map_err(|_| t)
    };
    if !taken_from(1)? {
        return Ok(0);
    }
    let (mut lo, mut hi) = (1u64, 2u64);
    while taken_from(hi)? {
        if hi >= MAX_TICKET {
            return Err(hi);
        }
        lo = hi;
        hi = (hi * 2).min(MAX_TICKET);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if taken_from(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// The highest earlier ticket whose byte someone holds (a write lock, as
/// places in line are; read locks say nothing), `None` when there is none:
/// a binary search over "is anything held from here up to our own place",
/// a few queries for any line.
fn nearest_ahead(file: &File, number: u64) -> io::Result<Option<u64>> {
    let held_from = |from: u64| -> io::Result<bool> {
        let len = number as i64 - from as i64;
        Ok(
            crate::sys::fs::ofd_conflict(file, libc::F_RDLCK, SLOT_BASE + from as i64, len)?
                .is_some(),
        )
    };
    if number <= 1 || !held_from(1)? {
        return Ok(None);
    }
    // Something is held in [lo, number): find the highest such byte.
    let (mut lo, mut hi) = (1u64, number - 1);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if held_from(mid)? {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(Some(lo))
}

fn anyone_ahead(file: &File, number: u64) -> io::Result<bool> {
    if number <= 1 {
        return Ok(false);
    }
    // A read probe: only write locks (places in line) count.
    Ok(
        crate::sys::fs::ofd_conflict(file, libc::F_RDLCK, SLOT_BASE + 1, number as i64 - 1)?
            .is_some(),
    )
}

/// `gpu is in use with --slots 2, but this asks for it as a plain lock; ...`
pub fn slots_mismatch(resource: &str, theirs: u64, ours: u64) -> anyhow::Error {
    let how = |n: u64| match n {
        0 => "as a plain lock".to_owned(),
        n => format!("with --slots {n}"),
    };
    crate::error::usage(format!(
        "{resource} is in use {}, but this asks for it {}; everyone must use a resource the same way",
        how(theirs),
        how(ours)
    ))
}

/// Whether the read lock on agreement byte `theirs` is a devlock's that
/// the kernel backs: some process this user can see holds it (its fdinfo)
/// and `devlock_of` vouches for that process.
fn agreement_is_devlocks(queue: FileId, theirs: u64, devlock_of: &dyn Fn(u32) -> bool) -> bool {
    let at = (AGREE_BASE as u64) + theirs;
    let vouched = |scan: &crate::proc::fdinfo::FdScan| {
        scan.ranges
            .get(&queue)
            .into_iter()
            .flatten()
            .filter(|(_, l)| l.ofd && !l.exclusive && !l.blocked && l.is_byte(at))
            .any(|(pid, _)| devlock_of(*pid))
    };
    // A scan shared with an earlier question may predate the lock: one
    // made now decides before the lock is called a stranger's.
    vouched(&crate::proc::fdinfo::fd_scan())
        || vouched(&crate::proc::fdinfo::fd_scan_within(
            std::time::Duration::ZERO,
        ))
}

/// Whether nobody is in line for `lock_name` and nobody uses it as a
/// semaphore, asked without joining the line: the cheap check that lets an
/// uncontended plain take skip the ticket. One query. A request that arrives
/// just after this check takes a ticket, finds nobody ahead, and waits for
/// the lock itself; one that was in line before it still holds its byte,
/// which this check sees. A queue file of the wrong type is an error.
pub(crate) fn line_is_empty(dir: &ScratchDir, lock_name: &str) -> Result<bool> {
    let Some(file) = open_queue(dir, lock_name)? else {
        return Ok(true);
    };
    // From the first agreement byte past "plain" to the end of the file.
    let found = get_lock(&file, AGREE_BASE + 1, 0).with_context(|| {
        format!(
            "looking whether anyone is in line in {}",
            dir.path().join(queue_name(lock_name)).display()
        )
    })?;
    Ok(found.is_none())
}

/// The size someone in line or holding through the line uses, read without
/// joining the line (status, and `-n`).
pub(crate) fn agreement(dir: &ScratchDir, lock_name: &str) -> Result<Agreement> {
    let Some(file) = open_queue(dir, lock_name)? else {
        return Ok(Agreement::None);
    };
    Ok(match other_agreement(&file, None) {
        Some(n) => Agreement::Slots(n),
        None => Agreement::None,
    })
}

/// What a request that may not join the line says of agreement byte `n`
/// held by others (`-n` of a plain lock): a usage error when a devlock the
/// kernel backs (`devlock_of`) holds it, else busy, naming the lock.
pub(crate) fn agreement_error(
    dir: &ScratchDir,
    lock_name: &str,
    n: u64,
    ours: u64,
    devlock_of: &dyn Fn(u32) -> bool,
    resource: &str,
) -> Result<anyhow::Error> {
    let Some(file) = open_queue(dir, lock_name)? else {
        return Ok(slots_mismatch(resource, n, ours));
    };
    let id = crate::proc::lock_entry::FileId::from_metadata(
        std::os::unix::fs::MetadataExt::dev(&file.metadata()?),
        std::os::unix::fs::MetadataExt::ino(&file.metadata()?),
    );
    if agreement_is_devlocks(id, n, devlock_of) {
        return Ok(slots_mismatch(resource, n, ours));
    }
    let path = dir.path().join(queue_name(lock_name));
    let at = AGREE_BASE + n.min(u64::from(u16::MAX)) as i64;
    let err = blocked(resource, &path, id, file, at, 1, None);
    Ok(match err.downcast::<Blocked>() {
        Ok(b) => b.into_busy(),
        Err(e) => e,
    })
}

/// The queue file opened for queries, `None` when there is none yet.
fn open_queue(dir: &ScratchDir, lock_name: &str) -> Result<Option<File>> {
    match crate::flock::file::open_read_only(dir, &queue_name(lock_name)) {
        Ok(file) => Ok(Some(file)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(crate::flock::file::unusable(
            &dir.path().join(queue_name(lock_name)),
            e,
        )),
    }
}

/// How many tickets before `number` are still in line (or holding), for the
/// waiting line's "2nd in line". The kernel reports one conflicting lock per
/// query, so the range is split around each one found: two queries per
/// request ahead, and no file of anyone else's to open.
pub fn count_ahead(dir: &ScratchDir, lock_name: &str, number: u64) -> io::Result<usize> {
    let file = crate::flock::file::open_read_only(dir, &queue_name(lock_name))?;
    let mut count = 0;
    let mut ranges = vec![(SLOT_BASE + 1, SLOT_BASE + number as i64 - 1)];
    while let Some((lo, hi)) = ranges.pop() {
        if lo > hi || count >= 10_000 {
            continue;
        }
        let Some(probe) = crate::sys::fs::ofd_conflict(&file, libc::F_RDLCK, lo, hi - lo + 1)?
        else {
            continue;
        };
        count += 1;
        ranges.push((lo, probe.l_start - 1));
        if probe.l_len > 0 {
            ranges.push((probe.l_start + probe.l_len, hi));
        }
    }
    Ok(count)
}

/// What the kernel's table says about one queue file, sorted for status:
/// the places in line (single write-locked ticket bytes, by number), the
/// agreement, and every lock that is not devlock's.
#[derive(Debug, Default)]
pub(crate) struct LineView {
    pub tickets: Vec<u64>,
    /// Every agreement byte held, as slot counts (more than one where a
    /// stranger holds another size's beside the devlocks'), in order.
    pub agreements: Vec<u64>,
    pub foreign: Vec<RangeLock>,
}

/// Reads a queue file's line from the kernel's table, by its file id.
pub(crate) fn line_view(table: &LockTable, queue: FileId) -> LineView {
    let mut view = LineView::default();
    for lock in table.ranges(queue) {
        if lock.blocked {
            // Requests, not holds: a waiter's wait for its turn, or a
            // stranger's wait, which blocks nobody.
            continue;
        }
        let start = lock.start as i64;
        let single = lock.end == Some(lock.start);
        let ticket = start - SLOT_BASE;
        if lock.ofd && lock.exclusive && single && ticket >= 1 && ticket as u64 <= MAX_TICKET {
            view.tickets.push(ticket as u64);
        } else if lock.ofd && !lock.exclusive && single && (AGREE_BASE..AGREE_END).contains(&start)
        {
            view.agreements.push((start - AGREE_BASE) as u64);
        } else if lock.ofd && !lock.exclusive && start > SLOT_BASE {
            // A waiter's read lock over the tickets before its own, held
            // for an instant as its turn comes.
        } else {
            view.foreign.push(lock.clone());
        }
    }
    view.tickets.sort_unstable();
    view.tickets.dedup();
    view.agreements.sort_unstable();
    view.agreements.dedup();
    view
}

/// Whether place `ticket` in line is held by `pid`: a budget holder is
/// still starting while its own place is held. Tickets restart at 1 once
/// the line empties, so the number alone may be another's now; OFD locks
/// name no pid in `/proc/locks`, so `pid`'s own descriptors are asked
/// (its fdinfo), and only where they cannot be read does a place held by
/// anyone count.
pub(crate) fn holds_place(table: &LockTable, queue: FileId, ticket: u64, pid: u32) -> bool {
    let at = SLOT_BASE as u64 + ticket;
    let place = |l: &RangeLock| !l.blocked && l.exclusive && l.start == at && l.end == Some(at);
    match table.range_locks_of(pid, queue) {
        Some(own) => own.iter().any(place),
        None => table.ranges(queue).iter().any(|l| l.ofd && place(l)),
    }
}

/// The first lock (of another open file description) that would conflict
/// with a write lock on `[start, start + len)` (`len` 0: to the end).
fn get_lock(file: &File, start: i64, len: i64) -> io::Result<Option<libc::flock>> {
    crate::sys::fs::ofd_conflict(file, libc::F_WRLCK, start, len)
}

fn set_lock(file: &File, kind: libc::c_int, start: i64, len: i64, wait: bool) -> io::Result<()> {
    crate::sys::fs::ofd_lock(file, kind, start, len, wait)
}

#[cfg(test)]
mod tests;
