//! `--any`: the first of several candidates that is or becomes free, each
//! waited for in its own line, racing on threads of their own.

use anyhow::Result;

use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Attempt, Context, Entry, Taken, blocking, register, watch};
use crate::flock::file::Leased;
use crate::flock::file::LockFile;
use crate::flock::in_the_way::InTheWay;
use crate::flock::nesting::inside_holder;
use crate::flock::queue::Blocked;
use crate::flock::race::first_of;
use crate::flock::wait::{Wait, Watch};
use crate::interrupt::Stop;
use crate::request::Request;
use crate::resource::Resource;

/// Takes `count` of `candidates` (sorted), the first that are or become
/// free, in line with everyone else waiting for them. Picks are made in
/// name order, each from the candidates after the last pick that leave
/// enough for the rest, so holding one while waiting for another never goes
/// against the global lock order, and cannot deadlock. A member's group is
/// taken (shared) with the member, by the candidate that wins, and once.
/// Each lock comes with its resource.
pub(crate) fn take_any(
    ctx: &Context,
    candidates: &[Request],
    count: usize,
) -> Result<Vec<(Resource, Taken)>> {
    let mut taken = Vec::new();
    let mut groups_held: Vec<Resource> = Vec::new();
    let mut start = 0;
    for pick in 0..count {
        let window = &candidates[start..candidates.len() - (count - 1 - pick)];
        let units: Vec<Vec<Request>> = window
            .iter()
            .map(|candidate| {
                let mut unit: Vec<Request> = candidate
                    .name
                    .held_shared()
                    .into_iter()
                    .filter(|g| !groups_held.contains(g))
                    .map(|g| Request {
                        name: g,
                        exclusive: false,
                        via: Some(candidate.name.clone()),
                        slots: 0,
                        for_group: false,
                    })
                    .collect();
                unit.push(candidate.clone());
                unit
            })
            .collect();
        let (index, took) = take_first(ctx, &units)?;
        ctx.observer.took()?;
        groups_held.extend(window[index].name.held_shared());
        taken.extend(took);
        start += index + 1;
    }
    Ok(taken)
}

/// One candidate of an `--any`: its group's shared lock (if needed) and the
/// member, taken in that order. A later lock's line is joined only once the
/// earlier lock is held: a place in the member's line while still waiting
/// for the group would be holding a later lock while waiting for an earlier
/// one, which is how deadlocks start.
struct Unit {
    requests: Vec<Request>,
    held: Vec<Entry>,
    /// The lock being waited for, with its place in line.
    waiting: Option<Entry>,
}

impl Unit {
    /// Takes what of the unit is free now, in order, and joins the line of
    /// the first lock that is not; `Err` inside when a lock nobody vouches
    /// for keeps a line shut (what of the unit was taken is let go).
    fn join(ctx: &Context, requests: &[Request]) -> Result<std::result::Result<Unit, Blocked>> {
        let mut unit = Unit {
            requests: requests.to_vec(),
            held: Vec::new(),
            waiting: None,
        };
        for request in requests {
            let lock = LockFile::open(ctx.dir, &request.name.file_name())?;
            let mut entry = match Entry::join_or_blocked(ctx.dir, request, lock)? {
                Ok(entry) => entry,
                Err((blocked, _)) => return Ok(Err(blocked)),
            };
            if matches!(entry.try_now(ctx.dir)?, Attempt::Taken(None)) {
                unit.held.push(entry);
            } else {
                unit.waiting = Some(entry);
                break;
            }
        }
        Ok(Ok(unit))
    }

    fn complete(&self) -> bool {
        self.held.len() == self.requests.len()
    }

    /// Sleeps for the rest of the unit, one lock after the other.
    fn block(mut self, dir: &ScratchDir, stop: &Stop) -> Result<Unit> {
        if let Some(entry) = self.waiting.take() {
            self.held.push(entry.block(dir, stop)?.0);
        }
        while self.held.len() < self.requests.len() {
            let request = &self.requests[self.held.len()];
            let entry = Entry::join(dir, request)?;
            self.held.push(entry.block(dir, stop)?.0);
        }
        Ok(self)
    }

    /// The member's lock file, once its line has been joined.
    fn member_entry(&self) -> Option<&Entry> {
        let entry = self.waiting.as_ref().or(self.held.last())?;
        (entry.request == *self.requests.last()?).then_some(entry)
    }

    fn into_taken(self, ctx: &Context) -> Vec<(Resource, Taken)> {
        self.held
            .into_iter()
            .map(|entry| {
                (
                    entry.request.name.clone(),
                    Taken::Held(entry.into_held(ctx, None)),
                )
            })
            .collect()
    }
}

/// The first unit that is or becomes complete: its index and its locks.
fn take_first(ctx: &Context, units: &[Vec<Request>]) -> Result<(usize, Vec<(Resource, Taken)>)> {
    let (joined, joined_units) = match join_units(ctx, units)? {
        Joining::Complete(index, unit) => return Ok((index, unit.into_taken(ctx))),
        Joining::Joined(joined, joined_units) => (joined, joined_units),
    };
    let index_of = |i: usize| {
        units
            .iter()
            .position(|u| std::ptr::eq(u, joined_units[i]))
            .expect("one of the units")
    };
    let units: Vec<Vec<Request>> = joined_units.iter().map(|u| (*u).clone()).collect();
    let units = &units[..];
    for (i, unit) in joined.iter().enumerate() {
        if let Some(member) = unit.member_entry()
            && inside_holder(&member.lock, &member.request)?
        {
            let lock = member.lock.try_clone()?;
            let name = member.request.name.clone();
            return Ok((index_of(i), vec![(name, Taken::Inherited(lock))]));
        }
    }
    let names: Vec<String> = units
        .iter()
        .map(|u| u.last().expect("a member").name.to_string())
        .collect();
    if ctx.no_wait {
        return Err(all_busy(joined, units, names));
    }
    let registrations = joined
        .iter()
        .filter_map(|u| {
            let entry = u.waiting.as_ref()?;
            Some(register(
                ctx,
                &entry.request,
                entry.ticket.number,
                crate::flock::record::now_ms(),
            ))
        })
        .collect();
    let wait = Wait {
        label: format!("any of {}", names.join(" ")),
        watches: if ctx.shows() {
            watches(ctx, &joined, units)
        } else {
            Vec::new()
        },
        registrations,
        lazy: false,
    };
    let (index, unit) = blocking(ctx, wait, |stop| {
        first_of(joined, stop, None, |unit, stop| unit.block(ctx.dir, stop))?
            .ok_or_else(|| anyhow::anyhow!("interrupted"))
    })?;
    Ok((index_of(index), unit.into_taken(ctx)))
}

/// What joining every candidate's line came to: one taken at once (its
/// index), or those in line with the requests each stands for.
enum Joining<'a> {
    Complete(usize, Unit),
    Joined(Vec<Unit>, Vec<&'a Vec<Request>>),
}

/// Joins each candidate's line, stopping at the first taken at once.
fn join_units<'a>(ctx: &Context, units: &'a [Vec<Request>]) -> Result<Joining<'a>> {
    // A candidate whose line a stranger's lock (or whose file a lease)
    // keeps shut is passed over while another can be joined: one stranger
    // cannot shut `--any`. Where every line is shut, the first is named
    // (busy, exit 75).
    let mut joined = Vec::new();
    let mut joined_units: Vec<&Vec<Request>> = Vec::new();
    let mut first_shut = None;
    for (index, requests) in units.iter().enumerate() {
        let unit = match Unit::join(ctx, requests) {
            Ok(Ok(unit)) => unit,
            Ok(Err(blocked)) => {
                first_shut.get_or_insert_with(|| blocked.into_busy());
                continue;
            }
            Err(e) if e.is::<Leased>() => {
                let leased = e.downcast::<Leased>().expect("checked");
                let member = requests.last().expect("a member").name.to_string();
                first_shut.get_or_insert_with(|| leased.into_busy(&member));
                continue;
            }
            Err(e) => return Err(e),
        };
        if unit.complete() {
            return Ok(Joining::Complete(index, unit));
        }
        joined.push(unit);
        joined_units.push(requests);
    }
    if joined.is_empty()
        && let Some(shut) = first_shut
    {
        return Err(shut);
    }
    Ok(Joining::Joined(joined, joined_units))
}

/// `-n`: each candidate's lock and what stands in its way, out of line
/// first so that we are not among those ahead.
fn all_busy(joined: Vec<Unit>, units: &[Vec<Request>], names: Vec<String>) -> anyhow::Error {
    let locks: Vec<(String, Resource, std::sync::Arc<LockFile>)> = joined
        .iter()
        .zip(units)
        .filter_map(|(unit, requests)| {
            let entry = unit.waiting.as_ref()?;
            let member = requests.last().expect("a member");
            let label = if entry.request.name == member.name {
                member.name.to_string()
            } else {
                format!("{} (its group {})", member.name, entry.request.name)
            };
            Some((
                label,
                entry.request.name.clone(),
                std::sync::Arc::new(entry.lock.try_clone().ok()?),
            ))
        })
        .collect();
    drop(joined);
    InTheWay::Any { names, each: locks }.busy()
}

/// What the waiting display watches: each candidate in line, under the
/// member's name.
fn watches(ctx: &Context, joined: &[Unit], units: &[Vec<Request>]) -> Vec<Watch> {
    joined
        .iter()
        .zip(units)
        .filter_map(|(unit, requests)| {
            let entry = unit.waiting.as_ref()?;
            let mut watch = watch(ctx.dir, &entry.request, entry)?;
            let member = &requests.last().expect("a member").name;
            if *member != entry.request.name {
                watch.label = format!("{member} (its group {})", entry.request.name);
            }
            Some(watch)
        })
        .collect()
}
