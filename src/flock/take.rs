//! Taking locks in line: a queue ticket, the turn, the kernel lock, and a
//! check that the path still names the locked file. Shared by the command
//! line (with a waiting display) and the library (quietly).

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;
use std::sync::mpsc;

use anyhow::Result;

use crate::exit::{ExitCode, coded};
use crate::flock::dir::ScratchDir;
use crate::flock::file::{LockFile, TryLock};
use crate::flock::queue::{Agreement, Ticket};
use crate::flock::record::Record;
use crate::flock::registration::{Kind, Registration};
use crate::interrupt::Stop;
pub(crate) use crate::request::Request;
use crate::resource::Resource;
use crate::status::model as status;
use crate::supervise::Received;
use crate::sys::procfs::{self, LockTable};
use crate::wait_display::{self as wait, WaitPlan, Waited};

/// A lock we hold.
#[derive(Debug)]
pub struct Held {
    pub request: Request,
    pub lock: LockFile,
    /// The semaphore slot (from 1) and its lock file.
    pub slot: Option<(u64, LockFile)>,
    /// Kept while holding: exclusively, the place in line, so the line
    /// behind waits for us; always, the agreement on the slot count.
    ticket: Option<Ticket>,
    /// A shared holder's label (there is no single record in a shared file).
    label_file: Option<Registration>,
    /// Whether the lock file may hold our record (decided once, at the
    /// first label), and whether one was written (to clear on release).
    record_ok: std::cell::OnceCell<bool>,
    wrote: std::cell::Cell<bool>,
}

impl Held {
    /// Descriptors the command must inherit to keep holding (and a shared
    /// holder's registration, so its label lives as long as the hold).
    pub fn inheritable_fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.lock.file().as_raw_fd()];
        fds.extend(self.slot.as_ref().map(|(_, l)| l.file().as_raw_fd()));
        fds.extend(self.label_file.as_ref().map(Registration::fd));
        fds
    }

    /// Whether the holder record goes into the lock file itself.
    pub fn owns_record(&self) -> bool {
        self.request.exclusive && self.request.slots == 0
    }

    /// The lock files this hold keeps, with the path each was opened at:
    /// the lock, and the slot's.
    pub fn files(&self) -> impl Iterator<Item = &LockFile> {
        std::iter::once(&self.lock).chain(self.slot.as_ref().map(|(_, l)| l))
    }

    /// Writes the holder's label, now naming the running command: into the
    /// lock file for an exclusive hold, into the registration for a shared
    /// one. A lock file that holds anything but a devlock record is held
    /// without one (and the run says so once).
    pub fn label(&self, record: &Record) {
        let mut record = record.clone();
        record.ticket = self.ticket.as_ref().map(|t| t.number);
        record.slot = self.slot.as_ref().map(|(s, _)| *s);
        record.via = self.request.via.as_ref().map(Resource::to_string);
        if self.owns_record() {
            let ok = *self
                .record_ok
                .get_or_init(|| match self.lock.may_hold_record() {
                    Ok(()) => true,
                    Err(why) => {
                        crate::flock::trust::note_line(why);
                        false
                    }
                });
            // A label only: a failure to write it must not stop the work.
            if ok && record.write_to(self.lock.file()).is_ok() {
                self.wrote.set(true);
            }
        } else if let Some(label) = &self.label_file {
            let _ = label.rewrite(&record);
        }
    }
}

impl Drop for Held {
    /// Release clears the label before the lock goes (the kernel drops it
    /// when the last descriptor closes): no step outlives the hold. The
    /// file itself stays, so nobody can slip in on a fresh one.
    fn drop(&mut self) {
        if self.wrote.get() {
            let _ = self.lock.file().set_len(0);
        }
    }
}

/// What taking one request came to.
// A handful per run, moved rarely: boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Taken {
    Held(Held),
    /// An inherited descriptor already holds it: we run inside its holder.
    /// The file is open (not locked by us) only to name the lock.
    Inherited(LockFile),
}

/// How a run waits: shared by all its requests.
pub struct Context<'a> {
    pub dir: &'a ScratchDir,
    /// The label registrations and holds carry.
    pub step: String,
    pub no_wait: bool,
    /// The display and deadline of the command line; `None` waits quietly.
    pub plan: Option<&'a WaitPlan>,
    /// Lets another thread stop a quiet wait (the library's timeout).
    pub stop: Stop,
}

/// What a try without waiting came to.
enum Attempt {
    /// Taken, with the semaphore slot if any.
    Taken(Option<(u64, LockFile)>),
    Busy,
}

impl Context<'_> {
    /// A fresh record for this process; built only when a label is written,
    /// so an uncontended take reads nothing it does not need.
    pub fn record(&self) -> Record {
        Record::for_this_process(&self.step)
    }
}

/// A request at the front of its line or about to wait in it.
struct Entry {
    request: Request,
    lock: LockFile,
    ticket: Ticket,
}

impl Entry {
    fn join(dir: &ScratchDir, request: &Request) -> Result<Entry> {
        let lock = LockFile::open(dir, &request.name.file_name())?;
        Entry::join_with(dir, request, lock)
    }

    /// Joins the line with a lock file already open (the fast path's).
    fn join_with(dir: &ScratchDir, request: &Request, lock: LockFile) -> Result<Entry> {
        let name = request.name.file_name();
        let ticket = Ticket::take(
            dir,
            &name,
            request.slots,
            &|| in_use(&lock),
            request.name.as_str(),
        )?;
        Ok(Entry {
            request: request.clone(),
            lock,
            ticket,
        })
    }

    /// Takes the lock without waiting, if nobody is ahead and it is free.
    fn try_now(&mut self, dir: &ScratchDir) -> Result<Attempt> {
        let attempt = self.try_now_in_line(dir)?;
        if matches!(attempt, Attempt::Taken(_)) {
            self.step_aside_if_shared();
        }
        Ok(attempt)
    }

    /// A shared hold lets the line move on at once: the next reader may join
    /// in, and a writer behind waits for the lock itself. (Keeping the place
    /// would make even this run's own next take wait for it.)
    fn step_aside_if_shared(&self) {
        if !self.request.exclusive || self.request.slots > 0 {
            let _ = self.ticket.step_aside();
        }
    }

    fn try_now_in_line(&mut self, dir: &ScratchDir) -> Result<Attempt> {
        if self.ticket.has_anyone_ahead()? {
            return Ok(Attempt::Busy);
        }
        if self.request.slots > 0 {
            for slot in 1..=self.request.slots {
                let slot_lock = LockFile::open(dir, &slot_file(&self.request.name, slot))?;
                if slot_lock.try_lock(true)? == TryLock::Taken {
                    if self.lock.try_lock(false)? == TryLock::Taken {
                        return Ok(Attempt::Taken(Some((slot, slot_lock))));
                    }
                    return Ok(Attempt::Busy);
                }
            }
            return Ok(Attempt::Busy);
        }
        Ok(
            match self.lock.try_lock_at_path(dir, self.request.exclusive)? {
                true => Attempt::Taken(None),
                false => Attempt::Busy,
            },
        )
    }

    /// Sleeps for the turn and the lock. Every sleep is a kernel call that
    /// `stop` can interrupt.
    fn block(mut self, dir: &ScratchDir, stop: &Stop) -> Result<(Entry, Option<(u64, LockFile)>)> {
        let keep = || stop.keep_waiting();
        self.ticket.wait_turn(&keep)?;
        let slot = if self.request.slots > 0 {
            let (slot, slot_lock) = wait_for_slot(dir, &self.request, stop)?;
            self.lock.lock(false, &keep)?;
            Some((slot, slot_lock))
        } else {
            self.lock.lock_at_path(dir, self.request.exclusive, &keep)?;
            None
        };
        self.step_aside_if_shared();
        Ok((self, slot))
    }

    /// Turns a taken entry into a hold.
    fn into_held(self, ctx: &Context, slot: Option<(u64, LockFile)>) -> Held {
        hold(ctx, self.request, self.lock, Some(self.ticket), slot)
    }
}

/// A hold: an exclusive holder keeps its place so the line behind waits; a
/// shared holder steps aside so the line moves on, and labels itself in a
/// registration, as a shared lock file has no room for everyone's record.
/// Both keep the agreement on the slot count their ticket holds.
fn hold(
    ctx: &Context,
    request: Request,
    lock: LockFile,
    ticket: Option<Ticket>,
    slot: Option<(u64, LockFile)>,
) -> Held {
    let held = |request, lock, slot, ticket, label_file| Held {
        request,
        lock,
        slot,
        ticket,
        label_file,
        record_ok: std::cell::OnceCell::new(),
        wrote: std::cell::Cell::new(false),
    };
    if request.exclusive && request.slots == 0 {
        return held(request, lock, slot, ticket, None);
    }
    let number = ticket.as_ref().map(|t| t.number);
    if let Some(ticket) = &ticket {
        let _ = ticket.step_aside();
    }
    let mut record = ctx.record();
    record.ticket = number;
    record.slot = slot.as_ref().map(|(s, _)| *s);
    record.via = request.via.as_ref().map(Resource::to_string);
    let label = Registration::create(ctx.dir, &request.name, &record, Kind::Hold).ok();
    held(request, lock, slot, ticket, label)
}

/// What the uncontended take came to.
enum Fast {
    Held(LockFile),
    /// Busy, or someone in line: the lock file, when it was opened, for
    /// the slow path to use.
    No(Option<LockFile>),
}

/// The uncontended take: nobody in line and the lock free, without joining
/// the line at all.
fn take_if_nobody_waits(dir: &ScratchDir, request: &Request) -> Result<Fast> {
    let name = request.name.file_name();
    if request.slots > 0 || !crate::flock::queue::line_is_empty(dir, &name)? {
        return Ok(Fast::No(None));
    }
    let mut lock = LockFile::open(dir, &name)?;
    Ok(match lock.try_lock_at_path(dir, request.exclusive)? {
        true => Fast::Held(lock),
        false => Fast::No(Some(lock)),
    })
}

/// Takes one request: at once when free, else waiting in line.
pub fn take(ctx: &Context, request: &Request) -> Result<(Taken, Waited)> {
    let opened = match take_if_nobody_waits(ctx.dir, request)? {
        Fast::Held(lock) => {
            let held = hold(ctx, request.clone(), lock, None, None);
            return Ok((Taken::Held(held), Waited::default()));
        }
        Fast::No(opened) => opened,
    };
    let open_lock = |opened: Option<LockFile>| match opened {
        Some(lock) => Ok(lock),
        None => LockFile::open(ctx.dir, &request.name.file_name()),
    };
    if ctx.no_wait && request.slots == 0 {
        // Without joining the line: a failing -n must never hold a place
        // in it, not even while it words its message.
        let lock = open_lock(opened)?;
        if let Agreement::Slots(agreed @ 1..) =
            crate::flock::queue::agreement(ctx.dir, &request.name.file_name())?
        {
            return Err(coded(
                ExitCode::Usage,
                format!(
                    "{} is in use with --slots {agreed}, but this asks for it as a plain lock; \
                     everyone must use a resource the same way",
                    request.name
                ),
            ));
        }
        inside_holder(&lock, request)?;
        if inherited(&lock, request.exclusive) == Inherited::Yes {
            return Ok((Taken::Inherited(lock), Waited::default()));
        }
        return Err(busy(ctx.dir, request, &lock, ctx.plan));
    }
    let mut entry = Entry::join_with(ctx.dir, request, open_lock(opened)?)?;
    if let Attempt::Taken(slot) = entry.try_now(ctx.dir)? {
        return Ok((Taken::Held(entry.into_held(ctx, slot)), Waited::default()));
    }
    if inside_holder(&entry.lock, request)? {
        return Ok((Taken::Inherited(entry.lock), Waited::default()));
    }
    if ctx.no_wait {
        let Entry { lock, ticket, .. } = entry;
        // Out of line before looking, so we are not among those ahead.
        drop(ticket);
        return Err(busy(ctx.dir, request, &lock, ctx.plan));
    }
    let registration = register(ctx, request, entry.ticket.number);
    let label = label_of(request);
    let shows = ctx.plan.is_some_and(|p| !p.quiet);
    let watches = shows
        .then(|| watch(ctx.dir, request, &entry))
        .flatten()
        .into_iter()
        .collect();
    // A semaphore's slots are raced on threads of their own.
    let lazy = request.slots == 0;
    let ((entry, slot), waited) =
        blocking(ctx, label, watches, vec![registration], lazy, |stop| {
            entry.block(ctx.dir, stop)
        })?;
    Ok((Taken::Held(entry.into_held(ctx, slot)), waited))
}

/// What lines call a request: its resource, or for a group taken shared on
/// a member's behalf, the member and its group (what the user asked for,
/// and what stands in the way).
fn label_of(request: &Request) -> String {
    match &request.via {
        Some(member) => format!("{member} (its group {})", request.name),
        None => request.name.to_string(),
    }
}

/// Whether we run inside a job that holds the lock already (then the take
/// passes through); an error when that job holds it only shared and this
/// asks for it exclusively, which would wait for itself forever.
fn inside_holder(lock: &LockFile, request: &Request) -> Result<bool> {
    match inherited(lock, request.exclusive) {
        Inherited::Yes => Ok(true),
        Inherited::No => Ok(false),
        Inherited::OnlyShared(pid) => Err(coded(
            ExitCode::Busy,
            format!(
                "{} is held only shared by the job this runs in (pid {pid}); taking it \
                 exclusively inside that job would wait for itself",
                request.name
            ),
        )),
    }
}

/// Takes `count` of `candidates` (sorted), the first that are or become
/// free, in line with everyone else waiting for them. Picks are made in
/// name order, each from the candidates after the last pick that leave
/// enough for the rest, so holding one while waiting for another never goes
/// against the global lock order, and cannot deadlock. A member's group is
/// taken (shared) with the member, by the candidate that wins, and once.
pub fn take_any(
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
                let group = candidate.name.group().filter(|g| !groups_held.contains(g));
                let mut unit: Vec<Request> = group
                    .map(|g| Request {
                        name: g,
                        exclusive: false,
                        via: Some(candidate.name.clone()),
                        slots: 0,
                    })
                    .into_iter()
                    .collect();
                unit.push(candidate.clone());
                unit
            })
            .collect();
        let (index, took, waited) = take_first(ctx, &units)?;
        pending.add(waited)?;
        groups_held.extend(window[index].name.group());
        taken.extend(took);
        start += index + 1;
    }
    Ok(taken)
}

/// Waits that are over, and what their helpers caught as they ended.
#[derive(Debug, Default)]
pub struct Pending {
    last: Waited,
}

impl Pending {
    /// Notes a finished wait; the one before it is settled now (its display
    /// must be gone before the next wait shows its own).
    /// A stopping signal caught then ends the run: nothing has started.
    pub fn add(&mut self, waited: Waited) -> Result<()> {
        let before = std::mem::replace(&mut self.last, waited);
        match before.settle() {
            Some(sig) => Err(crate::supervise::stopped_before_start(sig)),
            None => Ok(()),
        }
    }

    /// Whether the last wait's display must be cleared before the command starts.
    pub fn must_settle_before_spawn(&self) -> bool {
        self.last.must_settle_before_spawn()
    }

    /// Settles everything; a stopping signal that arrived as the locks were
    /// taken, for the command to hear.
    pub fn settle(self) -> Option<Received> {
        self.last.settle()
    }
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
        let why: Vec<String> = locks
            .iter()
            .map(|(label, resource, lock)| {
                let view = status::describe(lock, ctx.dir, resource);
                let why = wait::in_the_way(&view, &view.waiters);
                format!("{label} {}", why.trim_start_matches(": "))
                    .trim_end()
                    .to_owned()
            })
            .collect();
        return Err(crate::exit::busy(
            ctx.plan.map_or(ExitCode::Busy, |p| p.conflict_code),
            format!("all of {} are busy: {}", names.join(", "), why.join("; ")),
        ));
    }
    let registrations = joined
        .iter()
        .filter_map(|u| {
            let entry = u.waiting.as_ref()?;
            Some(register(ctx, &entry.request, entry.ticket.number))
        })
        .collect();
    let label = format!("any of {}", names.join(" "));
    let shows = ctx.plan.is_some_and(|p| !p.quiet);
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
fn first_of<I: Send, T: Send>(
    items: Vec<I>,
    outer: &Stop,
    job: impl Fn(I, &Stop) -> Result<T> + Sync,
) -> Result<(usize, T)> {
    crate::interrupt::install();
    let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
    let stops: Vec<Stop> = items.iter().map(|_| Stop::default()).collect();
    let threads: Mutex<Vec<Option<libc::pthread_t>>> = Mutex::new(vec![None; items.len()]);
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
                // SAFETY: pthread_self is always safe.
                threads.lock().unwrap()[index] = Some(unsafe { libc::pthread_self() });
                started.wait();
                let result = job(item, &stop);
                stop.mark_finished();
                let _ = tx.send((index, result));
            }));
        }
        started.wait();
        drop(tx);
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

/// Waits for any free slot of a semaphore, without polling.
fn wait_for_slot(dir: &ScratchDir, request: &Request, stop: &Stop) -> Result<(u64, LockFile)> {
    let slots: Vec<(u64, LockFile)> = (1..=request.slots)
        .map(|s| Ok((s, LockFile::open(dir, &slot_file(&request.name, s))?)))
        .collect::<Result<_>>()?;
    for (s, lock) in &slots {
        if lock.try_lock(true)? == TryLock::Taken {
            let s = *s;
            let lock = slots.into_iter().find(|(n, _)| *n == s).unwrap().1;
            return Ok((s, lock));
        }
    }
    let (_, taken) = first_of(slots, stop, |(s, lock), stop| {
        lock.lock(true, &|| stop.keep_waiting())?;
        Ok((s, lock))
    })?;
    Ok(taken)
}

/// A semaphore slot's lock file: a dot file, never a resource of its own.
pub fn slot_file(resource: &Resource, slot: u64) -> String {
    format!(".{resource}.slot{slot}")
}

/// Runs `block` on this thread; with a plan, beside the waiting display,
/// the deadline and the signal watch of the command line.
fn blocking<T>(
    ctx: &Context,
    label: String,
    watches: Vec<wait::Watch>,
    registrations: Vec<Option<Registration>>,
    lazy: bool,
    block: impl FnOnce(&Stop) -> Result<T>,
) -> Result<(T, Waited)> {
    match ctx.plan {
        Some(plan) => {
            // What another user could break is said before a long wait, not
            // only once the wait is over.
            crate::flock::trust::flush(plan.quiet);
            // Waited for on this thread, in lock calls a signal interrupts:
            // the display may start late.
            let lazy = lazy.then_some(&ctx.stop);
            wait::wait_for(label, watches, registrations, plan, lazy, || {
                block(&ctx.stop)
            })
        }
        None => {
            let result = block(&ctx.stop);
            drop(registrations);
            Ok((result?, Waited::default()))
        }
    }
}

/// Handles of its own for the waiting display (not needed when it shows nothing).
fn watch(dir: &ScratchDir, request: &Request, entry: &Entry) -> Option<wait::Watch> {
    Some(wait::Watch {
        dir: dir.try_clone().ok()?,
        resource: request.name.clone(),
        lock: entry.lock.try_clone().ok()?,
        ticket: Some(entry.ticket.number),
        label: label_of(request),
    })
}

fn register(ctx: &Context, request: &Request, ticket: u64) -> Option<Registration> {
    let mut record = ctx.record();
    record.ticket = Some(ticket);
    record.since_ms = crate::flock::record::now_ms();
    record.via = request.via.as_ref().map(Resource::to_string);
    Registration::create(ctx.dir, &request.name, &record, Kind::Wait).ok()
}

/// `gpu:0 is busy: held by train (pid 4242, alice) for 5m03s`, naming
/// whoever is in the way: the holders, and those already in line (who
/// would go first), such as a request for the whole group queued ahead.
fn busy(
    dir: &ScratchDir,
    request: &Request,
    lock: &LockFile,
    plan: Option<&WaitPlan>,
) -> anyhow::Error {
    let view = status::describe(lock, dir, &request.name);
    let who = wait::busy_phrase(&view);
    let what = match &request.via {
        Some(member) => format!("{member} is busy, through its group {}", request.name),
        None => format!("{} is busy", request.name),
    };
    crate::exit::busy(
        plan.map_or(ExitCode::Busy, |p| p.conflict_code),
        format!("{what}{who}"),
    )
}

/// Whether the lock is held by anyone, from the kernel's table.
fn in_use(lock: &LockFile) -> bool {
    LockTable::read().is_ok_and(|t| t.is_locked(lock.id()))
}

/// Whether the work we run inside already holds a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inherited {
    No,
    /// Held in a mode that covers the request: run under it.
    Yes,
    /// Held, but only shared while the request is exclusive: waiting would
    /// wait for ourselves.
    OnlyShared(u32),
}

/// Whether the job we run inside already holds the lock, asked of the
/// kernel rather than of an environment variable a script may have copied:
/// a descriptor we inherited (not close-on-exec, so not one of ours) on the
/// same file whose `/proc/self/fdinfo` shows a granted lock. An ancestor
/// that holds the lock without having passed the descriptor down does not
/// count: it may hold it for other work (a thread of a service), and then
/// passing through would let two holders in. The waiting line says so.
pub fn inherited(lock: &LockFile, exclusive: bool) -> Inherited {
    let mut found = Inherited::No;
    for held_exclusive in inherited_modes(lock) {
        if held_exclusive || !exclusive {
            return Inherited::Yes;
        }
        found = Inherited::OnlyShared(std::process::id());
    }
    found
}

/// The modes (true for exclusive) in which descriptors we inherited hold the
/// lock.
fn inherited_modes(lock: &LockFile) -> Vec<bool> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let mut modes = Vec::new();
    for fd in fds.flatten() {
        let Some(name) = fd.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        // The cheap test first: most of our descriptors are close-on-exec.
        if !inheritable(&name) {
            continue;
        }
        let same = std::fs::metadata(fd.path())
            .is_ok_and(|m| procfs::FileId::from_metadata(m.dev(), m.ino()) == lock.id());
        if !same {
            continue;
        }
        modes.extend(
            procfs::locks_of_fd("self", &name)
                .iter()
                .filter(|l| l.file == lock.id() && !l.blocked)
                .map(|l| l.exclusive),
        );
    }
    modes
}

/// Whether one of our descriptors survives exec (so it came from our parent:
/// devlock's own lock files are close-on-exec until it starts the command).
fn inheritable(fd: &str) -> bool {
    let Ok(fd) = fd.parse::<RawFd>() else {
        return false;
    };
    // SAFETY: F_GETFD on a descriptor number; a closed one just fails.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags >= 0 && flags & libc::FD_CLOEXEC == 0
}
