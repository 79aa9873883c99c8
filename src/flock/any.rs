//! `--any`: the first of several candidates that is or becomes free, each
//! waited for in its own line, racing on threads of their own.

use std::sync::Mutex;
use std::sync::mpsc;

use anyhow::Result;

use crate::exit::ExitCode;
use crate::flock::dir::ScratchDir;
use crate::flock::file::LockFile;
use crate::flock::nesting::inside_holder;
use crate::flock::take::{Attempt, Context, Entry, Pending, Taken, blocking, register, watch};
use crate::interrupt::Stop;
use crate::request::Request;
use crate::resource::Resource;
use crate::status::model as status;
use crate::sys::signal::Thread;
use crate::wait_display::Waited;

/// Takes `count` of `candidates` (sorted), the first that are or become
/// free, in line with everyone else waiting for them. Picks are made in
/// name order, each from the candidates after the last pick that leave
/// enough for the rest, so holding one while waiting for another never goes
/// against the global lock order, and cannot deadlock. A member's group is
/// taken (shared) with the member, by the candidate that wins, and once.
pub(crate) fn take_any(
    ctx: &Context,
    candidates: &[Request],
    count: usize,
    pending: &mut Pending,
) -> Result<Vec<Taken>> {
    let mut taken: Vec<Taken> = Vec::new();
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
                    })
                    .collect();
                unit.push(candidate.clone());
                unit
            })
            .collect();
        let (index, took, waited) = take_first(ctx, &units)?;
        pending.add(waited)?;
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
    /// the first lock that is not.
    fn join(ctx: &Context, requests: &[Request]) -> Result<Unit> {
        let mut unit = Unit {
            requests: requests.to_vec(),
            held: Vec::new(),
            waiting: None,
        };
        for request in requests {
            let mut entry = Entry::join(ctx.dir, request)?;
            if matches!(entry.try_now(ctx.dir)?, Attempt::Taken(None)) {
                unit.held.push(entry);
            } else {
                unit.waiting = Some(entry);
                break;
            }
        }
        Ok(unit)
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

    fn into_taken(self, ctx: &Context) -> Vec<Taken> {
        self.held
            .into_iter()
            .map(|entry| Taken::Held(entry.into_held(ctx, None)))
            .collect()
    }
}

fn take_first(ctx: &Context, units: &[Vec<Request>]) -> Result<(usize, Vec<Taken>, Waited)> {
    let mut joined = Vec::new();
    for requests in units {
        let unit = Unit::join(ctx, requests)?;
        if unit.complete() {
            return Ok((joined.len(), unit.into_taken(ctx), Waited::default()));
        }
        joined.push(unit);
    }
    for (i, unit) in joined.iter().enumerate() {
        if let Some(member) = unit.member_entry()
            && inside_holder(&member.lock, &member.request)?
        {
            let lock = member.lock.try_clone()?;
            return Ok((i, vec![Taken::Inherited(lock)], Waited::default()));
        }
    }
    let names: Vec<String> = units
        .iter()
        .map(|u| u.last().expect("a member").name.to_string())
        .collect();
    if ctx.no_wait {
        // Each candidate's lock and what stands in its way, out of line
        // first so that we are not among those ahead.
        let locks: Vec<(String, Resource, LockFile)> = joined
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
                    entry.lock.try_clone().ok()?,
                ))
            })
            .collect();
        drop(joined);
        let each: Vec<(String, status::ResourceView)> = locks
            .into_iter()
            .map(|(label, resource, lock)| (label, status::describe(&lock, ctx.dir, &resource)))
            .collect();
        let code = ctx.plan.map_or(ExitCode::Busy, |p| p.conflict_code);
        return Err(crate::messages::all_busy(&names, &each, code));
    }
    let registrations = joined
        .iter()
        .filter_map(|u| {
            let entry = u.waiting.as_ref()?;
            Some(register(ctx, &entry.request, entry.ticket.number))
        })
        .collect();
    let label = format!("any of {}", names.join(" "));
    let shows = ctx.shows();
    let watches = if shows {
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
    } else {
        Vec::new()
    };
    let ((index, unit), waited) = blocking(ctx, label, watches, registrations, false, |stop| {
        first_of(joined, stop, |unit, stop| unit.block(ctx.dir, stop))
    })?;
    Ok((index, unit.into_taken(ctx), waited))
}

/// Runs one blocking job per item in its own thread; the first to succeed
/// wins and the others are interrupted and dropped (which leaves their lines
/// and lets go of anything they took in the meantime).
pub(crate) fn first_of<I: Send, T: Send>(
    items: Vec<I>,
    outer: &Stop,
    job: impl Fn(I, &Stop) -> Result<T> + Sync,
) -> Result<(usize, T)> {
    crate::interrupt::install();
    let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
    let stops: Vec<Stop> = items.iter().map(|_| Stop::default()).collect();
    let threads: Mutex<Vec<Option<Thread>>> = Mutex::new(vec![None; items.len()]);
    let started = std::sync::Barrier::new(items.len() + 1);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (index, item) in items.into_iter().enumerate() {
            let tx = tx.clone();
            let stop = stops[index].clone();
            let (job, threads, started) = (&job, &threads, &started);
            handles.push(scope.spawn(move || {
                crate::interrupt::unblock_here();
                crate::interrupt::let_job_stops_in_here();
                threads.lock().unwrap()[index] = Some(Thread::current());
                started.wait();
                let result = {
                    // However the job ends, a panic included, so that the
                    // decider's stop never waits for it forever.
                    let _finished = stop.finished_on_drop();
                    job(item, &stop)
                };
                let _ = tx.send((index, result));
            }));
        }
        started.wait();
        drop(tx);
        // This thread sleeps in no lock call while its racers do: a stop of
        // the outer wait (a library's cancel or timeout) must reach them.
        let _adopted = outer.adopt(
            stops
                .iter()
                .cloned()
                .zip(
                    threads
                        .lock()
                        .unwrap()
                        .iter()
                        .map(|t| t.expect("every thread said who it is")),
                )
                .collect(),
        );
        // A job stop must reach a thread asleep in a lock call, not this one.
        let mask = crate::interrupt::keep_job_stops_off_here();
        let mut winner = None;
        let mut first_error = None;
        // Wait for the first success (or for every job to fail).
        while let Ok((index, result)) = rx.recv() {
            match result {
                Ok(value) => {
                    winner = Some((index, value));
                    break;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
            if !outer.keep_waiting() {
                break;
            }
        }
        for (stop, thread) in stops.iter().zip(threads.lock().unwrap().iter()) {
            stop.stop(thread.expect("every thread said who it is"));
        }
        crate::interrupt::restore(&mask);
        // Late winners are dropped here, releasing what they took.
        drop(rx);
        for handle in handles {
            let _ = handle.join();
        }
        match (winner, first_error) {
            (Some(w), _) => Ok(w),
            (None, Some(e)) => Err(e),
            (None, None) => Err(anyhow::anyhow!("interrupted")),
        }
    })
}
