//! Admission of a budget: the look at the front of the line (the holders'
//! budgets and what they use, the memory used outside the gate), the take
//! when it fits, and the kernel sleep until something changes when it does
//! not; `--any --mem` over every candidate's line.

use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};

use super::{Ask, REPROBE_EVERY};
use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Context, Entry, Held, Taken, blocking, register, watch};
use crate::flock::file::open_read_only;
use crate::flock::in_the_way::InTheWay;
use crate::flock::nesting::inside_holder;
use crate::flock::race::first_of;
use crate::flock::record::Record;
use crate::flock::registration::{self, Kind, Registration};
use crate::flock::wait::{RoomNote, Wait};
use crate::gpu::memory::{self, Budget, Room};
use crate::interrupt::Stop;
use crate::proc::lock_entry::FileId;
use crate::proc::locks::LockTable;
use crate::request::Request;
use crate::resource::Resource;
use crate::sys::fs::{Flock, flock};

/// What the front of the line saw.
struct Look {
    room: Room,
    /// The believed holders' registration names, to sleep on.
    holders: Vec<String>,
}

/// The believed budget holders of `resource`: registrations whose flock is
/// held by the process they name, which holds the lock shared too.
fn holders(
    dir: &ScratchDir,
    resource: &Resource,
    lock: FileId,
    table: &LockTable,
) -> Result<Vec<(String, Record)>> {
    let lock_holders: Vec<u32> = table
        .holders(lock)
        .filter(|l| !l.exclusive)
        .map(|l| l.pid)
        .collect();
    let mut found = Vec::new();
    for name in dir.entries()? {
        if !matches!(registration::parse_name(&name), Some((r, Kind::Hold, _)) if &r == resource) {
            continue;
        }
        let live =
            registration::live_waiters(dir, std::slice::from_ref(&name), table, |r| r == resource);
        for waiter in live {
            if waiter.believed
                && waiter.record.mem_mib.is_some()
                && lock_holders.contains(&waiter.record.pid)
            {
                found.push((name.clone(), waiter.record));
            }
        }
    }
    Ok(found)
}

/// The processes whose trees are a holder's. Its command counts only where
/// it is the holder's own, as status has it: a descendant of the devlock
/// the record names, or (that devlock gone) the process the kernel showed
/// holding the registration ([`registration::live_waiters`]). Else anyone
/// could label a budget of 1 MiB with another holder's job as its "child",
/// and every later look would count that job's memory twice.
fn roots(record: &Record) -> Vec<u32> {
    let alive = record.names(record.pid);
    let mut roots: Vec<u32> = alive.then_some(record.pid).into_iter().collect();
    roots.extend(record.child.filter(|&c| {
        record.names_child(c)
            && (!alive || crate::proc::process::ancestors(c).any(|(p, _)| p == record.pid))
    }));
    roots
}

/// Looks at the device and its budgets; `Err` says why its memory cannot
/// be learned.
fn look(dir: &ScratchDir, resource: &Resource, lock: FileId, ask: &Ask) -> Result<Look, String> {
    let table = LockTable::read().map_err(|e| format!("reading /proc/locks: {e}"))?;
    let found = holders(dir, resource, lock, &table).map_err(|e| format!("{e:#}"))?;
    let report = ask.probe();
    let device = memory::device(&report, ask.index)?;
    let budgets = found
        .iter()
        .map(|(_, r)| Budget {
            step: r.step.clone(),
            mem_mib: r.mem_mib.unwrap_or(0),
            roots: roots(r),
        })
        .collect();
    Ok(Look {
        room: memory::room(device, budgets),
        holders: found.into_iter().map(|(name, _)| name).collect(),
    })
}

fn figures(resource: &Resource, room: &Room, ask: &Ask) -> RoomNote {
    RoomNote::Figures {
        resource: resource.clone(),
        room: room.clone(),
        ask_mib: ask.mem_mib,
        headroom_mib: ask.headroom_mib,
    }
}

/// Takes a budget on `request` (`gpu:N`, shared): at once when it is first
/// in line and fits, else in line (or, with `-n`, not at all).
pub(crate) fn take(ctx: &Context, request: &Request, ask: &Ask) -> Result<Taken> {
    // A stranger's lock that keeps the line shut is waited out (or named,
    // with -n) as a plain take does.
    let lock = crate::flock::file::LockFile::open(ctx.dir, &request.name.file_name())?;
    let mut entry = crate::flock::take::join_waiting(ctx, request, lock)?;
    if inside_holder(&entry.lock, request)? {
        return Ok(Taken::Inherited(entry.lock));
    }
    let resource = &request.name;
    // What the waiting line and a timeout say until the wait looks again:
    // the figures of the look made at the front, should it find no room (a
    // deadline may pass before the wait's own first look, on a busy machine).
    let mut figures_seen = RoomNote::Nothing;
    if !entry.ticket.has_anyone_ahead()? {
        let seen = look(ctx.dir, resource, entry.lock.id(), ask).map_err(crate::error::device)?;
        if seen.room.admits(ask.mem_mib, ask.headroom_mib) {
            if entry.lock.try_lock_at_path(ctx.dir, false)? {
                return Ok(Taken::Held(admit(ctx, entry, ask)?));
            }
        } else if ctx.no_wait {
            let Entry { lock, ticket, .. } = entry;
            drop(ticket);
            return Err(InTheWay::NoRoom {
                figures: vec![figures(resource, &seen.room, ask)],
                lock: Some((request.clone(), Arc::new(lock))),
                names: Vec::new(),
            }
            .busy());
        } else {
            figures_seen = figures(resource, &seen.room, ask);
        }
    }
    if ctx.no_wait {
        let Entry { lock, ticket, .. } = entry;
        // Out of line before looking, so we are not among those ahead.
        drop(ticket);
        return Err(InTheWay::Lock {
            request: request.clone(),
            lock: Arc::new(lock),
            budget: true,
            group: None,
        }
        .busy());
    }
    let room_text = Arc::new(Mutex::new(figures_seen));
    let registration = register_asking(ctx, request, entry.ticket.number, ask.mem_mib);
    let shows = ctx.shows();
    let watches = shows
        .then(|| watch(ctx.dir, request, &entry))
        .flatten()
        .map(|mut w| {
            w.room = Some(room_text.clone());
            w
        })
        .into_iter()
        .collect();
    let wait = Wait {
        label: request.label(),
        watches,
        registrations: vec![registration],
        // Not lazy: the wait for room is no lock call an alarm could interrupt.
        lazy: false,
    };
    let entry = blocking(ctx, wait, |stop| {
        let keep = || stop.keep_waiting();
        entry.ticket.wait_turn(&keep)?;
        loop {
            let holders = match look(ctx.dir, resource, entry.lock.id(), ask) {
                Ok(seen) if seen.room.admits(ask.mem_mib, ask.headroom_mib) => break,
                Ok(seen) => {
                    set(&room_text, figures(resource, &seen.room, ask));
                    seen.holders
                }
                Err(why) => {
                    set(&room_text, RoomNote::Said(format!("{resource}: {why}")));
                    Vec::new()
                }
            };
            sleep_for_room(ctx.dir, &holders, REPROBE_EVERY, stop)
                .with_context(|| format!("waiting for room on {resource}"))?;
        }
        entry.lock.lock_at_path(ctx.dir, false, &keep)?;
        Ok(entry)
    })?;
    Ok(Taken::Held(admit(ctx, entry, ask)?))
}

/// A waiter's registration that names the budget it asks for.
fn register_asking(
    ctx: &Context,
    request: &Request,
    ticket: u64,
    mem_mib: u64,
) -> Option<Registration> {
    let registration = register(ctx, request, ticket, crate::flock::record::now_ms())?;
    let mut record = ctx.record();
    record.ticket = Some(ticket);
    record.mem_mib = Some(mem_mib);
    let _ = registration.rewrite(&record);
    Some(registration)
}

fn set(text: &Mutex<RoomNote>, value: RoomNote) {
    *text.lock().unwrap_or_else(|e| e.into_inner()) = value;
}

/// The budget registered: from now on every later look counts it.
fn admit(ctx: &Context, entry: Entry, ask: &Ask) -> Result<Held> {
    let mut record = ctx.record();
    record.ticket = Some(entry.ticket.number);
    record.mem_mib = Some(ask.mem_mib);
    // Without its registration nobody would count the budget: no hold.
    let label = Registration::create(ctx.dir, &entry.request.name, &record, Kind::Hold)?;
    Ok(Held::budget(
        entry.request,
        entry.lock,
        entry.ticket,
        label,
        ask.mem_mib,
    ))
}

/// Sleeps until one of the holders registered as `names` is gone (its
/// registration's flock is granted), `every` has passed, or `stop` says
/// stop. Each holder is waited for on a thread of its own, in flock(2).
fn sleep_for_room(
    dir: &ScratchDir,
    names: &[String],
    every: Duration,
    stop: &Stop,
) -> std::io::Result<()> {
    sleep_for_change(dir, names, &[], every, stop)
}

/// What a waiting budget sleeps on: a holder's registration, or the turn of
/// a place in line (`--any`: a candidate not yet at the front).
enum Wake<'a> {
    Gone(File),
    Turn(&'a crate::flock::queue::Ticket),
}

/// [`sleep_for_room`], also waking when one of `turns` comes.
fn sleep_for_change(
    dir: &ScratchDir,
    names: &[String],
    turns: &[&crate::flock::queue::Ticket],
    every: Duration,
    stop: &Stop,
) -> std::io::Result<()> {
    crate::interrupt::install();
    let mut wakes: Vec<Wake> = names
        .iter()
        .filter_map(|n| open_read_only(dir, n).ok())
        .map(Wake::Gone)
        .collect();
    if wakes.len() < names.len() {
        // One has gone already: look again now.
        return Ok(());
    }
    wakes.extend(turns.iter().map(|t| Wake::Turn(t)));
    if wakes.is_empty() {
        // Only the clock to wait for (memory outside the gate): a kernel
        // sleep that a caught signal (a job stop, Ctrl-Z) cuts short, as it
        // would a lock call.
        crate::sys::signal::wait(&crate::sys::signal::SigSet::empty(), Some(every));
        if !stop.keep_waiting() {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        return Ok(());
    }
    // Any of them ending (a holder gone, a turn come) is a change to look at.
    let raced = first_of(wakes, stop, Some(every), |wake, mine| {
        let keep = || mine.keep_waiting() && stop.keep_waiting();
        match wake {
            Wake::Gone(file) => loop {
                match flock(&file, Flock::Shared, false) {
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted && keep() => {}
                    _ => break,
                }
            },
            Wake::Turn(ticket) => {
                let _ = ticket.wait_turn(&keep);
            }
        }
        Ok(())
    });
    drop(raced);
    if !stop.keep_waiting() {
        return Err(std::io::ErrorKind::Interrupted.into());
    }
    Ok(())
}

/// `--any --mem`: the first candidate, in name order, that admits the
/// budget. Every candidate's line is joined; each at the front of its line
/// is looked at, and the first that fits is taken; the others' lines are
/// left. Nothing is held while waiting but places in line (and the group
/// `gpu`, shared, which every candidate needs and which comes first in the
/// lock order).
pub(crate) fn take_any(
    ctx: &Context,
    candidates: &[(Request, Ask)],
) -> Result<Vec<(Resource, Taken)>> {
    let mut taken = Vec::new();
    if let Some(group) = candidates.first().and_then(|(r, _)| r.name.group()) {
        let request = Request {
            name: group.clone(),
            exclusive: false,
            via: Some(candidates[0].0.name.clone()),
            slots: 0,
            for_group: false,
        };
        let took = crate::flock::take::take(ctx, &request)?;
        ctx.observer.took()?;
        taken.push((group, took));
    }
    let mut entries = Vec::new();
    for (request, _) in candidates {
        let entry = Entry::join(ctx.dir, request)?;
        if inside_holder(&entry.lock, request)? {
            taken.push((request.name.clone(), Taken::Inherited(entry.lock)));
            return Ok(taken);
        }
        entries.push(entry);
    }
    let rooms: Vec<Arc<Mutex<RoomNote>>> = candidates.iter().map(|_| Arc::default()).collect();
    let (index, mut entries) = match first_fit(ctx, &mut entries, candidates, &rooms, None)? {
        Some(i) => (i, entries),
        None if ctx.no_wait => {
            drop(entries);
            return Err(no_room_on_any(&rooms, candidates));
        }
        None => wait_for_fit(ctx, entries, candidates, &rooms)?,
    };
    ctx.observer.took()?;
    let entry = entries.swap_remove(index);
    // The others' lines are left here.
    drop(entries);
    let name = entry.request.name.clone();
    taken.push((name, Taken::Held(admit(ctx, entry, &candidates[index].1)?)));
    Ok(taken)
}

/// One look at every front: the first that fits, if any; with `stop`,
/// sleeps until something changes when none does. What stands in each
/// candidate's way goes to its `rooms` line.
fn first_fit(
    ctx: &Context,
    entries: &mut [Entry],
    candidates: &[(Request, Ask)],
    rooms: &[Arc<Mutex<RoomNote>>],
    stop: Option<&Stop>,
) -> Result<Option<usize>> {
    let mut asleep_on = Vec::new();
    for (i, (entry, (request, ask))) in entries.iter_mut().zip(candidates).enumerate() {
        if entry.ticket.has_anyone_ahead()? {
            set(&rooms[i], RoomNote::Nothing);
            continue;
        }
        match look(ctx.dir, &request.name, entry.lock.id(), ask) {
            Ok(seen) if seen.room.admits(ask.mem_mib, ask.headroom_mib) => {
                if entry.lock.try_lock_at_path(ctx.dir, false)? {
                    return Ok(Some(i));
                }
                set(
                    &rooms[i],
                    RoomNote::Said(format!("{}: held whole", request.name)),
                );
            }
            Ok(seen) => {
                set(&rooms[i], figures(&request.name, &seen.room, ask));
                asleep_on.extend(seen.holders);
            }
            Err(why) => set(
                &rooms[i],
                RoomNote::Said(format!("{}: {why}", request.name)),
            ),
        }
    }
    let Some(stop) = stop else {
        return Ok(None);
    };
    let behind: Vec<&crate::flock::queue::Ticket> = entries
        .iter()
        .filter(|e| e.ticket.has_anyone_ahead().unwrap_or(false))
        .map(|e| &e.ticket)
        .collect();
    sleep_for_change(ctx.dir, &asleep_on, &behind, REPROBE_EVERY, stop)
        .context("waiting for room on any of the candidates")?;
    Ok(None)
}

/// `-n`: no candidate has room, each with what stands in its way.
fn no_room_on_any(rooms: &[Arc<Mutex<RoomNote>>], candidates: &[(Request, Ask)]) -> anyhow::Error {
    let each: Vec<RoomNote> = rooms
        .iter()
        .zip(candidates)
        .map(
            |(room, (request, _))| match room.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                RoomNote::Nothing => {
                    RoomNote::Said(format!("{}: others ahead in line", request.name))
                }
                note => note,
            },
        )
        .collect();
    InTheWay::NoRoom {
        figures: each,
        lock: None,
        names: candidates.iter().map(|(r, _)| r.name.to_string()).collect(),
    }
    .busy()
}

/// Waits in every candidate's line, shown, until one fits.
fn wait_for_fit(
    ctx: &Context,
    mut entries: Vec<Entry>,
    candidates: &[(Request, Ask)],
    rooms: &[Arc<Mutex<RoomNote>>],
) -> Result<(usize, Vec<Entry>)> {
    let registrations = entries
        .iter()
        .zip(candidates)
        .map(|(e, (_, ask))| register_asking(ctx, &e.request, e.ticket.number, ask.mem_mib))
        .collect();
    let watches = if ctx.shows() {
        entries
            .iter()
            .zip(rooms)
            .filter_map(|(e, room)| {
                let mut w = watch(ctx.dir, &e.request, e)?;
                w.room = Some(room.clone());
                Some(w)
            })
            .collect()
    } else {
        Vec::new()
    };
    let names: Vec<String> = candidates.iter().map(|(r, _)| r.name.to_string()).collect();
    let wait = Wait {
        label: format!("any of {}", names.join(" ")),
        watches,
        registrations,
        lazy: false,
    };
    blocking(ctx, wait, |stop| {
        loop {
            if let Some(i) = first_fit(ctx, &mut entries, candidates, rooms, Some(stop))? {
                break Ok((i, entries));
            }
            if !stop.keep_waiting() {
                break Err(anyhow::Error::from(std::io::Error::from(
                    std::io::ErrorKind::Interrupted,
                )));
            }
        }
    })
}
