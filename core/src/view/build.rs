//! One lock file's view: its holders from the kernel's table, its line of
//! waiters, its agreements and the locks that are not devlock's.

use super::*;

/// The view of one lock file: holders from the kernel's table, labelled by
/// the lock file's record (an exclusive holder) or by registrations (shared
/// holders), the line of waiters, and locks that are not devlock's.
/// `asker` says who asks (see [`Asker`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn build_view(
    resource: &Resource,
    file: Option<&std::fs::File>,
    id: FileId,
    queue: Option<FileId>,
    dir: &ScratchDir,
    table: &LockTable,
    registered: Vec<Waiter>,
    now: SystemTime,
    asker: Asker,
) -> ResourceView {
    let mut view = free_view(resource);
    view.lock = Some(id);
    let (holds, waiting) = sort_registered(registered, &mut view);
    let line = queue
        .map(|q| crate::flock::queue::line_view(table, q))
        .unwrap_or_default();
    if queue.is_some() {
        let path = dir
            .path()
            .join(crate::flock::queue::queue_name(&resource.file_name()));
        view.foreign_locks = line
            .foreign
            .iter()
            .map(|l| foreign_lock(&path, l, table))
            .collect();
    }
    let mut kernel_holders: Vec<_> = table.holders(id).cloned().collect();
    let in_line_for_members = drop_places_in_line(&mut kernel_holders, dir, resource, table);
    let read = match file {
        Some(f) if !kernel_holders.is_empty() => record::read_from(f),
        _ => ReadRecord::Empty,
    };
    if read == ReadRecord::Unreadable {
        view.record = Some("unreadable");
    }
    let record = read.valid();
    view.holders = holders_of(id, &kernel_holders, record.as_ref(), &holds, now, table);
    if view.holders.is_empty() && proc::container::in_child_pid_namespace() {
        // /proc/locks here leaves out every holder outside this namespace,
        // and nothing else shows them: ask the lock itself, shared, for an
        // instant (see `probe_from_inside`).
        match file.map(probe_from_inside) {
            Some(true) => view
                .holders
                .push(invisible_holder("outside this container or PID namespace")),
            Some(false) => {}
            None => view.state = State::Unknown,
        }
    }
    let holder_tickets = holder_tickets(&mut view, record.as_ref(), &holds, queue, table);
    let blocked: Vec<u32> = table.blocked(id).map(|l| l.pid).collect();
    if asker.waiters {
        view.waiters = waiter_views(
            &waiting,
            &blocked,
            &line.tickets,
            &holder_tickets,
            queue,
            table,
            now,
        );
    }
    if let Some(q) = queue {
        let agreements = Agreements {
            queue: q,
            found: &line.agreements,
            own: asker.agreement,
            in_line_for_members: &in_line_for_members,
        };
        sort_agreements(&mut view, dir, resource, table, agreements);
    }
    slot_strangers(&mut view, dir, resource, table, &kernel_holders, now);
    add_leases(&mut view, table, id);
    if !view.holders.is_empty() {
        view.state = if view.holders.iter().all(|h| h.exclusive) {
            State::Held
        } else {
            State::Shared
        };
    }
    note_stale_record(&mut view, record);
    view
}

/// The places in line the holders stand for: a budget holder's place marks
/// it starting while the kernel shows it still locked by it; a settled
/// one's place is no longer the holder's.
fn holder_tickets(
    view: &mut ResourceView,
    record: Option<&Record>,
    holds: &[Record],
    queue: Option<FileId>,
    table: &LockTable,
) -> Vec<u64> {
    for holder in view.holders.iter_mut().filter(|h| h.mem_mib.is_some()) {
        // Kernel truth: the place its record names is still locked, by it.
        holder.starting = Some(match (holder.ticket, holder.pid, queue) {
            (Some(t), Some(pid), Some(q)) => crate::flock::queue::holds_place(table, q, t, pid),
            _ => false,
        });
    }
    // A budget holder that the kernel shows not holding its place any more
    // (its job started) explains no lock on that byte: anyone may lock it,
    // and that lock is a place in line of its own, not the holder's.
    let settled: Vec<u64> = view
        .holders
        .iter()
        .filter(|h| h.starting == Some(false))
        .filter_map(|h| h.ticket)
        .collect();
    record
        .into_iter()
        .chain(holds.iter())
        .filter_map(|r| r.ticket)
        .filter(|t| !settled.contains(t))
        .collect()
}

/// The registrations of one lock, sorted: shared holds (labels), believed
/// waits, and believed lost places (conflicts, put in the view).
fn sort_registered(registered: Vec<Waiter>, view: &mut ResourceView) -> (Vec<Record>, Vec<Waiter>) {
    let mut holds = Vec::new();
    let mut waiting = Vec::new();
    for w in registered {
        match w.kind {
            Kind::Hold => holds.push(w.record),
            _ if !w.believed => {}
            Kind::Wait => waiting.push(w),
            Kind::Lost => view.conflicts.push(Conflict {
                pid: w.record.pid,
                user: proc::process::uid_of(w.record.pid)
                    .map(proc::process::user_name)
                    .map(|u| clean(&u)),
                step: clean(&w.record.step),
                since: humantime::format_rfc3339_seconds(w.record.since()).to_string(),
            }),
        }
    }
    (holds, waiting)
}

/// The agreement bytes in one lock's line, and what vouches for them.
struct Agreements<'a> {
    queue: FileId,
    /// The slot counts agreed on in the line.
    found: &'a [u64],
    /// The asker's own agreement (see [`Asker`]).
    own: Option<u64>,
    /// The pids whose places in this group's line are for a member.
    in_line_for_members: &'a [u32],
}

/// Sorts the agreement bytes of a line: a devlock's sets the slot count
/// shown, a stranger's is named in the view.
fn sort_agreements(
    view: &mut ResourceView,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    agreements: Agreements<'_>,
) {
    // Each agreement byte on its own: a stranger's beside a devlock's
    // is named, and the devlock's size still counted. A waiter's own
    // byte needs no look at the owners. (All decided on the view as the
    // kernel shows it, before any stranger is added to it.)
    let mut vouched = Vec::new();
    let mut strangers = Vec::new();
    for &n in agreements.found {
        if agreements.own == Some(n) {
            vouched.push(n);
            continue;
        }
        let owners = agreement_owners(table, agreements.queue, n);
        // A member's waiter joins the group's line too.
        if agreement_vouched(view, &owners)
            || owners
                .iter()
                .any(|p| agreements.in_line_for_members.contains(p))
        {
            vouched.push(n);
        } else {
            strangers.push((n, owners));
        }
    }
    for (n, owners) in strangers {
        stranger_agreement(view, dir, resource, agreements.queue, n, &owners, table);
    }
    view.slots = vouched.into_iter().find(|&n| n > 0);
}

/// Every open of the lock file for writing waits for a file lease on it:
/// the resource is in use, by whoever holds the lease.
fn add_leases(view: &mut ResourceView, table: &LockTable, id: FileId) {
    for lease in table.leases(id).iter().filter(|l| !l.blocked) {
        // Every open of the lock file for writing waits for it: the
        // resource is in use, by whoever holds the lease.
        let pids = if proc::process::start_time(lease.pid).is_some() {
            vec![lease.pid]
        } else {
            Vec::new()
        };
        let mut holder = bare(pids, None, HolderSource::NoRecord, true);
        holder.note = Some("a file lease on the lock file, not devlock's".to_owned());
        view.holders.push(holder);
    }
}

/// A valid record no holder stands for is shown as stale.
fn note_stale_record(view: &mut ResourceView, record: Option<Record>) {
    if let Some(record) = record
        && !view.holders.iter().any(|h| {
            h.source == HolderSource::Record
                || (h.source == HolderSource::Inherited && h.step.is_some())
        })
    {
        view.stale_record = Some(StaleRecord {
            step: clean(&record.step),
            pid: record.pid,
            since: humantime::format_rfc3339_seconds(record.since()).to_string(),
        });
    }
}

/// A request waiting for a member (`gpu:0`, or with `--any` each of
/// `gpu:0`..`gpu:3`) holds the member's group (`gpu`, and a MIG instance's
/// GPU too) shared meanwhile, once per member it waits on, so that a taker
/// of the whole group waits behind it: a place in line, not a hold. The
/// kernel lists those shared locks among the group's holders, where they
/// read as holders (to a user who cannot see the waiter's descriptors, as
/// unknown ones). A believed registration of a wait on a member (the kernel
/// shows its very process holding it, by its descriptors or its tag) takes
/// one such shared lock of its process out, per member waited on: the
/// waiter is shown as the member's waiter, for every user. Returns the
/// pids whose places were taken out.
pub(super) fn drop_places_in_line(
    kernel_holders: &mut Vec<proc::lock_entry::KernelLock>,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
) -> Vec<u32> {
    if kernel_holders.iter().all(|l| l.exclusive) {
        return Vec::new();
    }
    let names = dir.entries().unwrap_or_default();
    let mut waits: HashMap<u32, usize> = HashMap::new();
    for w in waiters::live_waiters(dir, &names, table, |r| r.held_shared().contains(resource)) {
        if w.kind == Kind::Wait && w.believed {
            *waits.entry(w.record.pid).or_default() += 1;
        }
    }
    let mut dropped = Vec::new();
    kernel_holders.retain(|l| match waits.get_mut(&l.pid) {
        Some(n) if *n > 0 && !l.exclusive => {
            *n -= 1;
            dropped.push(l.pid);
            false
        }
        _ => true,
    });
    dropped
}

/// Whether a devlock in the view vouches for an agreement whose byte
/// `owners` hold ([`agreement_owners`]): one of them is one of the holders
/// and waiters shown, or, where this user cannot see owners, somebody is
/// shown at all.
pub(super) fn agreement_vouched(view: &ResourceView, owners: &[u32]) -> bool {
    if owners.is_empty() {
        return !view.holders.is_empty()
            || view
                .waiters
                .iter()
                .any(|w| w.source == WaiterSource::Registration);
    }
    let ours: Vec<u32> = view
        .holders
        .iter()
        .flat_map(|h| h.pids.iter().copied())
        .chain(view.waiters.iter().filter_map(|w| w.pid))
        .collect();
    owners.iter().any(|p| ours.contains(p))
}

/// The processes this user can see holding the agreement byte of `n` slots.
pub(super) fn agreement_owners(table: &LockTable, queue: FileId, n: u64) -> Vec<u32> {
    let at = 4096 + n;
    table
        .range_lock_owners(queue)
        .into_iter()
        .filter(|(_, l)| l.ofd && !l.exclusive && !l.blocked && l.is_byte(at))
        .map(|(pid, _)| pid)
        .collect()
}

/// An agreement on the slot count that no devlock in the view vouches for
/// ([`agreement_vouched`]) is a stranger's lock on a byte that matters:
/// named as a lock that is not devlock's, and for a count of slots, as the
/// resource held (by the first of `owners`, or by somebody this user cannot
/// see), never `free` with a count nobody uses.
pub(super) fn stranger_agreement(
    view: &mut ResourceView,
    dir: &ScratchDir,
    resource: &Resource,
    queue: FileId,
    n: u64,
    owners: &[u32],
    table: &LockTable,
) {
    let at = 4096 + n;
    let lock = RangeLock {
        file: queue,
        pid: None,
        ofd: true,
        exclusive: false,
        blocked: false,
        start: at,
        end: Some(at),
    };
    let path = dir
        .path()
        .join(crate::flock::queue::queue_name(&resource.file_name()));
    let mut foreign = foreign_lock(&path, &lock, table);
    foreign.effect = Effect::BlocksTheSlotAgreement;
    if !view.foreign_locks.iter().any(|f| f.range == foreign.range) {
        view.foreign_locks.push(foreign);
    }
    if n > 0 && view.holders.is_empty() {
        const NOTE: &str = "a lock that is not devlock's on the slot agreement";
        let mut holder = match owners.first() {
            Some(pid) => bare(vec![*pid], None, HolderSource::NoRecord, true),
            None => invisible_holder(NOTE),
        };
        holder.note = Some(NOTE.to_owned());
        view.holders.push(holder);
    }
}

/// How many slot files status looks at past the agreed count: a stranger's
/// flock on one that no `--slots` run uses now is found all the same.
pub(super) const SLOT_FILES_LOOKED_AT: u64 = 64;

/// Flocks on the resource's slot files (`.R.slotK`) taken by processes that
/// do not hold `R.lock` too (a devlock slot holder holds both): plain
/// `flock` on a slot file, which takes that slot as a holder would. Shown
/// as holders of their slot, as the kernel names them.
pub(super) fn slot_strangers(
    view: &mut ResourceView,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    lock_holders: &[proc::lock_entry::KernelLock],
    now: SystemTime,
) {
    let takers: Vec<u32> = lock_holders.iter().map(|l| l.pid).collect();
    let last = view.slots.unwrap_or(0).max(SLOT_FILES_LOOKED_AT);
    for number in 1..=last {
        let name = crate::flock::slots::slot_file(resource, number);
        let Ok(st) = nix::sys::stat::fstatat(
            dir.fd(),
            name.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) else {
            // Slot files are made in order: the first missing ends them.
            break;
        };
        let id = FileId::from_metadata(st.st_dev, st.st_ino);
        let theirs: Vec<proc::lock_entry::KernelLock> = table
            .holders(id)
            .filter(|l| !takers.contains(&l.pid))
            .cloned()
            .collect();
        for mut holder in holders_of(id, &theirs, None, &[], now, table) {
            holder.slot = Some(number);
            if holder.note.is_none() {
                holder.note = Some(format!("a flock on {name} that is not devlock's"));
            }
            view.holders.push(holder);
        }
    }
}

/// Inside a child PID namespace only: whether someone outside holds the
/// lock exclusively, asked with a non-blocking shared lock released at once.
/// For the few microseconds it is held, an exclusive `-n` taker elsewhere
/// would find the lock busy; nothing else can see holders outside, and
/// without asking status would say `free` of a held lock. Shared holders
/// outside stay invisible (a shared probe is granted beside them).
pub(super) fn probe_from_inside(file: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // A second open: a lock on `file` itself would be ours to keep.
    let Ok(fd) = std::fs::File::open(format!("/proc/self/fd/{}", file.as_raw_fd())) else {
        return false;
    };
    use crate::sys::fs::{Flock, flock};
    let taken = flock(&fd, Flock::Shared, true).is_ok();
    if taken {
        let _ = flock(&fd, Flock::Unlock, false);
    }
    !taken
}

/// A holder nobody can see: held, but no visible process owns it.
pub(super) fn invisible_holder(note: &str) -> Holder {
    let mut holder = bare(Vec::new(), None, HolderSource::Unknown, true);
    holder.note = Some(note.to_owned());
    holder
}

pub(super) fn foreign_lock(
    path: &std::path::Path,
    lock: &RangeLock,
    table: &LockTable,
) -> ForeignLock {
    let pid = lock.pid.or_else(|| {
        table
            .range_lock_owners(lock.file)
            .into_iter()
            .find(|(_, l)| {
                l.start == lock.start && l.end == lock.end && l.exclusive == lock.exclusive
            })
            .map(|(pid, _)| pid)
    });
    let covers = |lo: u64, hi: u64| lock.start <= hi && lock.end.is_none_or(|e| e >= lo);
    let effect = if !lock.exclusive && !lock.ofd {
        Effect::None
    } else if covers(4096, 4096 + 65535) {
        Effect::BlocksTheSlotAgreement
    } else if lock.exclusive && covers(1 << 20, u64::MAX) {
        Effect::BlocksTheLine
    } else {
        Effect::None
    };
    ForeignLock {
        path: crate::show::show_path(path),
        range: lock.range_text(),
        exclusive: lock.exclusive,
        pid,
        user: pid
            .and_then(proc::process::uid_of)
            .map(proc::process::user_name)
            .map(|u| clean(&u)),
        effect,
    }
}
