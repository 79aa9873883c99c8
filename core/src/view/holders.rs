//! The holders of one lock and the waiters in its line, labelled by records
//! and registrations, and the views a busy message and a waiting line ask for.

use super::*;

/// The holders of one locked file. For each process the kernel lists:
/// it holds the lock unless it is gone, its start time contradicts a record
/// naming it (its pid was reused), or its descriptors (when this user may
/// read them) show no such lock; then whoever shares the lock through a
/// descriptor it passed down holds it, as far as this user can see.
pub fn holders_of(
    id: FileId,
    kernel_holders: &[proc::lock_entry::KernelLock],
    record: Option<&Record>,
    holds: &[Record],
    now: SystemTime,
    table: &LockTable,
) -> Vec<Holder> {
    kernel_holders
        .iter()
        .map(|lock| {
            let taker = lock.pid;
            // An exclusive holder's record is in the lock file, or (outside
            // a directory made for locks) in its registration.
            let registered = holds.iter().find(|r| r.pid == taker);
            let recorded = if lock.exclusive {
                record.filter(|r| r.pid == taker).or(registered)
            } else {
                registered
            };
            let alive = proc::process::start_time(taker).is_some();
            // The kernel's table names the pid that took the lock; the
            // process with that pid now is believed to hold it only where
            // its descriptors (or its tag) say so: a pid can be reused
            // within the clock tick a record's start time names.
            let holding = if alive { proc::locks::holds_now(table, taker, id) } else { None };
            // A devlock holder is its command (chain-loaded): where this
            // user cannot read its descriptors, the record that names it by
            // pid and start time says it holds.
            let holding = holding.or_else(|| recorded.filter(|r| r.names(taker)).map(|_| true));
            if holding == Some(true) {
                let r = recorded.filter(|r| r.names(taker));
                let mut pids = vec![taker];
                let child = r.and_then(|r| {
                    let c = r.child?;
                    let descends = proc::process::ancestors(c).any(|(p, _)| p == taker);
                    (descends && r.names_child(c)).then_some(c)
                });
                pids.extend(child);
                return match r {
                    Some(r) => labelled(r, pids, child, HolderSource::Record, lock.exclusive, now),
                    None => bare(pids, None, HolderSource::NoRecord, lock.exclusive),
                };
            }
            // The taker is gone, or no longer holds it, or this user cannot
            // tell: whoever shares the lock through a descriptor it passed
            // down holds it, as far as this user can see.
            let mut pids: Vec<u32> = table
                .sharers(id, taker)
                .into_iter()
                .filter(|&p| p != taker)
                .collect();
            // The recorded command first, then whatever it started.
            if let Some(c) = recorded.and_then(|r| r.child)
                && let Some(at) = pids.iter().position(|&p| p == c)
            {
                pids[..=at].rotate_right(1);
            }
            if pids.is_empty() {
                let note = match (alive, holding) {
                    (false, _) => "the process that took it is gone, and what holds it now is not visible to this user".to_owned(),
                    (true, Some(false)) => format!(
                        "taken by pid {taker}, which is alive but no longer holds it; what holds it now is open in no process this user can see (a descriptor passed on, over a unix socket, say)"
                    ),
                    (true, _) => format!(
                        "taken by pid {taker}, whose descriptors this user cannot see: whether that process still holds it, or its pid went to another since, is not known"
                    ),
                };
                let mut unknown = invisible_holder(&note);
                unknown.exclusive = lock.exclusive;
                return unknown;
            }
            let child = recorded
                .and_then(|r| r.child.filter(|c| pids.contains(c) && r.names_child(*c)));
            // A chain-loaded holder's record names the command itself: what
            // it started and left holding carries the hold's label once that
            // command is gone (its pid may belong to another process since).
            match (recorded, child) {
                (Some(r), Some(c)) => labelled(r, pids, Some(c), HolderSource::Inherited, lock.exclusive, now),
                (Some(r), None) if r.child.is_none() && !(alive && r.names(taker)) => {
                    labelled(r, pids, None, HolderSource::Inherited, lock.exclusive, now)
                }
                _ => bare(pids, None, HolderSource::Inherited, lock.exclusive),
            }
        })
        .collect()
}

/// A holder as the kernel shows it, without a label.
/// A holder as the kernel shows it, without a label: the one constructor
/// (labels, devices and notes are added to what it makes). Who it is comes
/// from `/proc` now: the user of the first pid, its command line (or that
/// of `command_of`) and name, and whether any of them is stopped.
pub(super) fn bare(
    pids: Vec<u32>,
    command_of: Option<u32>,
    source: HolderSource,
    exclusive: bool,
) -> Holder {
    let first = pids.first().copied();
    Holder {
        step: None,
        pid: first,
        user: first
            .and_then(proc::process::uid_of)
            .map(proc::process::user_name)
            .map(|u| clean(&u)),
        command: command_of.or(first).and_then(proc::process::cmdline_of),
        name: first.and_then(proc::process::comm_of).map(|c| clean(&c)),
        stopped: pids.iter().any(|&p| proc::process::is_stopped(p)),
        pids,
        since: None,
        held_for_ms: None,
        exclusive,
        via: None,
        slot: None,
        devices: Vec::new(),
        source,
        note: None,
        watch_gone: false,
        mem_mib: None,
        used_mib: None,
        starting: None,
        over_budget: None,
        over_mib: None,
        idle_for_ms: None,
        kept_for_ms: None,
        kept_mib: None,
        kept_gpu: None,
        ticket: None,
        container: first.and_then(proc::container::container_of),
    }
}

pub(super) fn labelled(
    r: &Record,
    pids: Vec<u32>,
    child: Option<u32>,
    source: HolderSource,
    exclusive: bool,
    now: SystemTime,
) -> Holder {
    let mut holder = bare(pids, child, source, exclusive);
    holder.step = Some(clean(&r.step));
    holder.since = Some(humantime::format_rfc3339_seconds(r.since()).to_string());
    holder.held_for_ms = Some(elapsed_ms(r.since(), now));
    holder.via = r.via.as_deref().map(clean);
    holder.slot = r.slot;
    holder.ticket = r.ticket;
    if let Some(mem) = r.mem_mib {
        holder.mem_mib = Some(mem);
        holder.over_budget = Some(r.over_mib.is_some());
        holder.over_mib = r.over_mib;
    }
    holder.idle_for_ms = r
        .idle_since_ms
        .map(|t| elapsed_ms(std::time::UNIX_EPOCH + Duration::from_millis(t), now));
    holder.watch_gone = r.watcher_gone();
    if let Some(t) = r.kept_ms {
        holder.kept_for_ms = Some(elapsed_ms(
            std::time::UNIX_EPOCH + Duration::from_millis(t),
            now,
        ));
        holder.kept_mib = r.kept_mib;
        holder.kept_gpu = r.kept_gpu;
    }
    holder
}

pub(super) fn waiter_views(
    waiting: &[Waiter],
    blocked: &[u32],
    tickets: &[u64],
    holder_tickets: &[u64],
    queue: Option<FileId>,
    table: &LockTable,
    now: SystemTime,
) -> Vec<WaiterView> {
    let mut views: Vec<WaiterView> = waiting
        .iter()
        .map(|w| WaiterView {
            step: Some(clean(&w.record.step)),
            pid: Some(w.record.pid),
            user: proc::process::uid_of(w.record.pid)
                .map(proc::process::user_name)
                .map(|u| clean(&u)),
            since: Some(humantime::format_rfc3339_seconds(w.record.since()).to_string()),
            waiting_for_ms: Some(elapsed_ms(w.record.since(), now)),
            position: 0,
            ticket: w.record.ticket,
            stopped: proc::process::is_stopped(w.record.pid),
            source: WaiterSource::Registration,
            mem_mib: w.record.mem_mib,
        })
        .collect();
    // Places in line nobody registered: a devlock between its ticket and its
    // registration, or a lock that is not devlock's. Its owner, if visible.
    let known: Vec<u64> = views
        .iter()
        .filter_map(|v| v.ticket)
        .chain(holder_tickets.iter().copied())
        .collect();
    let unexplained: Vec<u64> = tickets
        .iter()
        .copied()
        .filter(|t| !known.contains(t))
        .collect();
    if !unexplained.is_empty() {
        let owners = queue
            .map(|q| table.range_lock_owners(q))
            .unwrap_or_default();
        for t in unexplained {
            let at = (1u64 << 20) + t;
            let pid = owners
                .iter()
                .find(|(_, l)| l.is_byte(at) && l.exclusive)
                .map(|(p, _)| *p);
            views.push(WaiterView {
                step: None,
                pid,
                user: pid
                    .and_then(proc::process::uid_of)
                    .map(proc::process::user_name)
                    .map(|u| clean(&u)),
                since: None,
                waiting_for_ms: None,
                position: 0,
                ticket: Some(t),
                stopped: pid.is_some_and(proc::process::is_stopped),
                source: WaiterSource::Unregistered,
                mem_mib: None,
            });
        }
    }
    views.sort_by_key(|v| v.ticket.unwrap_or(u64::MAX));
    for &pid in blocked {
        if !views.iter().any(|v| v.pid == Some(pid)) {
            views.push(WaiterView {
                step: None,
                pid: Some(pid),
                user: proc::process::uid_of(pid)
                    .map(proc::process::user_name)
                    .map(|u| clean(&u)),
                since: None,
                waiting_for_ms: None,
                position: 0,
                ticket: None,
                stopped: proc::process::is_stopped(pid),
                source: WaiterSource::Flock,
                mem_mib: None,
            });
        }
    }
    for (i, view) in views.iter_mut().enumerate() {
        view.position = i + 1;
    }
    views
}

pub(super) fn elapsed_ms(since: SystemTime, now: SystemTime) -> u64 {
    now.duration_since(since)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

/// A group's holder that holds it only through an inherited descriptor
/// and has no label of its own (its devlock is gone, and so is the shared
/// hold's registration that labelled it) takes the label of a member's
/// holder that is the same processes: `train`, inherited, via `gpu:0`.
/// Only a label the member's own file backs is taken (its record names a
/// process the kernel lists for that very file, pid and start time), and
/// only for processes the kernel shows holding both files; pid, user and
/// command stay the kernel's.
pub(super) fn label_from_members(
    dir: &ScratchDir,
    group: &Resource,
    table: &LockTable,
    view: &mut ResourceView,
    now: SystemTime,
) {
    let unlabelled =
        |h: &Holder| h.source == HolderSource::Inherited && h.step.is_none() && !h.pids.is_empty();
    if !view.holders.iter().any(unlabelled) {
        return;
    }
    let names = dir.entries().unwrap_or_default();
    let prefix = format!("{group}:");
    let mut labelled: Vec<(Resource, Holder)> = Vec::new();
    for member in names
        .iter()
        .filter_map(|name| Resource::from_file_name(name))
        .filter(|member| member.as_str().starts_with(&prefix))
    {
        let registered = waiters::live_waiters(dir, &names, table, |r| r == &member);
        let member_view = view_of(dir, &member, table, registered, now);
        labelled.extend(
            member_view
                .holders
                .into_iter()
                .filter(|h| {
                    h.step.is_some()
                        && matches!(h.source, HolderSource::Record | HolderSource::Inherited)
                })
                .map(|h| (member.clone(), h)),
        );
    }
    for holder in view.holders.iter_mut().filter(|h| unlabelled(h)) {
        let found = labelled
            .iter()
            .find(|(_, h)| h.pids.iter().any(|pid| holder.pids.contains(pid)));
        if let Some((member, from)) = found {
            holder.step = from.step.clone();
            holder.since = from.since.clone();
            holder.held_for_ms = from.held_for_ms;
            holder.via = Some(member.to_string());
        }
    }
}

/// Who holds a lock we have open, without its registered waiters (for the
/// waiting line): the kernel's holders, labelled by the record, and by the shared
/// holders' registrations only when the lock is shared.
pub fn describe_holders(
    lock: &LockFile,
    dir: &ScratchDir,
    resource: &Resource,
    own_agreement: Option<u64>,
) -> ResourceView {
    let table = LockTable::read().unwrap_or_default();
    let held = table.is_locked(lock.id());
    let shared = table.holders(lock.id()).any(|l| !l.exclusive);
    // The registrations are read only when they matter: a shared hold's
    // labels (or an exclusive one's outside a directory made for locks),
    // or, when nobody holds it, to tell the places in line ahead
    // that no devlock registered (a stranger's lock) from those it did.
    let registered = if shared || !held || !dir.records_in_lock_files() {
        let names = dir.entries().unwrap_or_default();
        waiters::live_waiters(dir, &names, &table, |r| r == resource)
            .into_iter()
            .filter(|w| w.kind != Kind::Lost)
            .collect()
    } else {
        Vec::new()
    };
    // Held: no waiter is shown, so none is looked for.
    let asker = Asker {
        agreement: own_agreement,
        waiters: !held,
    };
    let mut view = view_now(lock, dir, resource, &table, registered, asker);
    view.waiters
        .retain(|w| w.source == WaiterSource::Unregistered);
    label_from_members(dir, resource, &table, &mut view, SystemTime::now());
    view
}

/// The state of one resource whose lock file we have open (for the busy
/// message).
pub fn describe(lock: &LockFile, dir: &ScratchDir, resource: &Resource) -> ResourceView {
    describe_in_line(lock, dir, resource, None)
}

/// [`describe`], asked by a waiter in that line that agreed on
/// `own_agreement` slots (see [`build_view`]). A waiter (`own_agreement`
/// given) takes one look: it looks again for nothing, as its own place and
/// those behind it may be younger than a registration (the waiters ahead
/// started before it, and register long before its line first names them);
/// it must not sleep outside its lock call, nor past its deadline.
pub fn describe_in_line(
    lock: &LockFile,
    dir: &ScratchDir,
    resource: &Resource,
    own_agreement: Option<u64>,
) -> ResourceView {
    let mut attempt = 0;
    let started = std::time::Instant::now();
    loop {
        let table = LockTable::read().unwrap_or_default();
        let names = dir.entries().unwrap_or_default();
        let registered = waiters::live_waiters(dir, &names, &table, |r| r == resource);
        let asker = Asker {
            agreement: own_agreement,
            waiters: true,
        };
        let mut view = view_now(lock, dir, resource, &table, registered, asker);
        attempt += 1;
        let patient = own_agreement.is_none() && look_again(attempt, started);
        if !patient || !has_unregistered(&view) {
            label_from_members(dir, resource, &table, &mut view, SystemTime::now());
            return view;
        }
        std::thread::sleep(UNREGISTERED_PAUSE);
    }
}

/// One open lock's view as of now, on its own (no other lock shares labels).
pub(super) fn view_now(
    lock: &LockFile,
    dir: &ScratchDir,
    resource: &Resource,
    table: &LockTable,
    registered: Vec<waiters::Waiter>,
    asker: Asker,
) -> ResourceView {
    build_view(
        resource,
        Some(lock.file()),
        lock.id(),
        queue_id(dir, &resource.file_name()),
        dir,
        table,
        registered,
        SystemTime::now(),
        asker,
    )
}
