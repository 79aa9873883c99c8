//! Taking locks in line: a queue ticket, the turn, the kernel lock, and a
//! check that the path still names the locked file. Shared by the command
//! line (with a waiting display) and the library (quietly).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;
use std::sync::mpsc;

use anyhow::Result;

use crate::exit::{ExitCode, coded};
use crate::interrupt::Stop;
use crate::lockfile::{LockFile, TryLock};
use crate::procfs::{self, LockTable};
use crate::queue::Ticket;
use crate::record::Record;
use crate::resource::Resource;
use crate::scratch::ScratchDir;
use crate::status;
use crate::supervise::Received;
use crate::wait::{self, WaitPlan, Waited};
use crate::waiters::{Kind, Registration};

/// One lock to take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub name: Resource,
    pub exclusive: bool,
    /// For a group taken shared on behalf of a member: the member.
    pub via: Option<Resource>,
    /// Semaphore size (`--slots`), 0 for a plain lock.
    pub slots: u64,
}

/// A lock we hold.
#[derive(Debug)]
pub struct Held {
    pub request: Request,
    pub lock: LockFile,
    /// The semaphore slot (from 1) and its lock file.
    pub slot: Option<(u64, LockFile)>,
    /// Kept while holding exclusively, so the line behind waits for us.
    ticket: Option<Ticket>,
    /// A shared holder's label (there is no single record in a shared file).
    label_file: Option<Registration>,
}

impl Held {
    /// Descriptors the command must inherit to keep holding.
    pub fn inheritable_fds(&self) -> Vec<RawFd> {
        let mut fds = vec![self.lock.file().as_raw_fd()];
        fds.extend(self.slot.as_ref().map(|(_, l)| l.file().as_raw_fd()));
        fds
    }

    /// Whether the holder record goes into the lock file itself.
    pub fn owns_record(&self) -> bool {
        self.request.exclusive && self.lock.is_writable()
    }

    /// Writes the holder's label, now naming the running command: into the
    /// lock file for an exclusive hold, into the registration for a shared one.
    pub fn label(&self, record: &Record) {
        let mut record = record.clone();
        record.ticket = self.ticket.as_ref().map(|t| t.number);
        record.slot = self.slot.as_ref().map(|(s, _)| *s);
        record.via = self.request.via.as_ref().map(Resource::to_string);
        if self.owns_record() {
            // A label only: a failure to write it must not stop the work.
            let _ = record.write_to(self.lock.file());
        } else if let Some(label) = &self.label_file {
            let _ = label.rewrite(&record);
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
    pub command: Vec<String>,
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
        Record::for_this_process(&self.step, &self.command)
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
        let name = request.name.file_name();
        let lock = LockFile::open(dir, &name)?;
        let ticket = Ticket::take(dir, &name, request.slots, &|| in_use(&lock))?;
        if ticket.agreed_slots != request.slots {
            let theirs = match ticket.agreed_slots {
                0 => "as a plain lock".to_owned(),
                n => format!("with --slots {n}"),
            };
            let ours = match request.slots {
                0 => "as a plain lock".to_owned(),
                n => format!("with --slots {n}"),
            };
            return Err(coded(
                ExitCode::Usage,
                format!(
                    "{} is in use {theirs}, but this asks for it {ours}; everyone must use a resource the same way",
                    request.name
                ),
            ));
        }
        Ok(Entry {
            request: request.clone(),
            lock,
            ticket,
        })
    }

    /// Takes the lock without waiting, if nobody is ahead and it is free.
    fn try_now(&mut self, dir: &ScratchDir) -> Result<Attempt> {
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
        loop {
            match self.lock.try_lock(self.request.exclusive)? {
                TryLock::Busy => return Ok(Attempt::Busy),
                TryLock::Taken if self.lock.still_at_path(dir) => return Ok(Attempt::Taken(None)),
                TryLock::Taken => self.lock = LockFile::open(dir, &self.request.name.file_name())?,
            }
        }
    }

    /// Sleeps for the turn and the lock. Every sleep is a kernel call that
    /// `stop` can interrupt.
    fn block(mut self, dir: &ScratchDir, stop: &Stop) -> Result<(Entry, Option<(u64, LockFile)>)> {
        let keep = || stop.keep_waiting();
        self.ticket.wait_turn(&keep)?;
        let slot = if self.request.slots > 0 {
            let (slot, slot_lock) = wait_for_slot(dir, &self.request, stop)?;
            self.lock.lock_interruptible(false, &keep)?;
            Some((slot, slot_lock))
        } else {
            loop {
                self.lock
                    .lock_interruptible(self.request.exclusive, &keep)?;
                if self.lock.still_at_path(dir) {
                    break;
                }
                self.lock = LockFile::open(dir, &self.request.name.file_name())?;
            }
            None
        };
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
fn hold(
    ctx: &Context,
    request: Request,
    lock: LockFile,
    ticket: Option<Ticket>,
    slot: Option<(u64, LockFile)>,
) -> Held {
    if request.exclusive && request.slots == 0 {
        return Held {
            request,
            lock,
            slot,
            ticket,
            label_file: None,
        };
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
    Held {
        request,
        lock,
        slot,
        ticket: None,
        label_file: label,
    }
}

/// The uncontended take: nobody in line and the lock free, without joining
/// the line at all.
fn take_if_nobody_waits(dir: &ScratchDir, request: &Request) -> Result<Option<LockFile>> {
    let name = request.name.file_name();
    if request.slots > 0 || !crate::queue::line_is_empty(dir, &name)? {
        return Ok(None);
    }
    let mut lock = LockFile::open(dir, &name)?;
    loop {
        match lock.try_lock(request.exclusive)? {
            TryLock::Taken if lock.still_at_path(dir) => return Ok(Some(lock)),
            TryLock::Taken => lock = LockFile::open(dir, &name)?,
            TryLock::Busy => return Ok(None),
        }
    }
}

/// Takes one request: at once when free, else waiting in line.
pub fn take(ctx: &Context, request: &Request) -> Result<(Taken, Waited)> {
    if let Some(lock) = take_if_nobody_waits(ctx.dir, request)? {
        let held = hold(ctx, request.clone(), lock, None, None);
        return Ok((Taken::Held(held), Waited::default()));
    }
    let mut entry = Entry::join(ctx.dir, request)?;
    if let Attempt::Taken(slot) = entry.try_now(ctx.dir)? {
        return Ok((Taken::Held(entry.into_held(ctx, slot)), Waited::default()));
    }
    if held_by_inheritance(&entry.lock) {
        return Ok((Taken::Inherited(entry.lock), Waited::default()));
    }
    if ctx.no_wait {
        return Err(busy(ctx.dir, &request.name, &entry.lock, ctx.plan));
    }
    let registration = register(ctx, &request.name, entry.ticket.number);
    let label = request.name.to_string();
    let shows = ctx.plan.is_some_and(|p| !p.quiet);
    let watch = shows
        .then(|| watch(ctx.dir, &request.name, &entry))
        .flatten();
    let ((entry, slot), waited) = blocking(ctx, label, watch, vec![registration], |stop| {
        entry.block(ctx.dir, stop)
    })?;
    Ok((Taken::Held(entry.into_held(ctx, slot)), waited))
}

/// Takes `count` of `candidates` (sorted), the first that are or become
/// free, in line with everyone else waiting for them. Picks are made in
/// name order, each from the candidates after the last pick that leave
/// enough for the rest, so holding one while waiting for another never goes
/// against the global lock order, and cannot deadlock.
pub fn take_any(
    ctx: &Context,
    candidates: &[Request],
    count: usize,
    pending: &mut Pending,
) -> Result<Vec<Taken>> {
    let mut taken = Vec::new();
    let mut start = 0;
    for pick in 0..count {
        let window = &candidates[start..candidates.len() - (count - 1 - pick)];
        let (index, one, waited) = take_first(ctx, window)?;
        pending.add(waited);
        taken.push(one);
        start += index + 1;
    }
    Ok(taken)
}

/// Waits that are over, and what their helpers caught as they ended.
#[derive(Debug, Default)]
pub struct Pending {
    last: Waited,
    signal: Option<Received>,
}

impl Pending {
    /// Notes a finished wait; the one before it is settled now (its display
    /// must be gone before the next wait shows its own).
    pub fn add(&mut self, waited: Waited) {
        let before = std::mem::replace(&mut self.last, waited);
        self.signal = self.signal.or(before.settle());
    }

    /// Whether the last wait's display must be cleared before the command starts.
    pub fn must_settle_before_spawn(&self) -> bool {
        self.last.must_settle_before_spawn()
    }

    /// Settles everything; a stopping signal that arrived as the locks were
    /// taken, for the command to hear.
    pub fn settle(self) -> Option<Received> {
        self.signal.or(self.last.settle())
    }
}

fn take_first(ctx: &Context, window: &[Request]) -> Result<(usize, Taken, Waited)> {
    let mut entries = Vec::new();
    for request in window {
        let mut entry = Entry::join(ctx.dir, request)?;
        match entry.try_now(ctx.dir)? {
            Attempt::Taken(slot) => {
                return Ok((
                    entries.len(),
                    Taken::Held(entry.into_held(ctx, slot)),
                    Waited::default(),
                ));
            }
            Attempt::Busy => entries.push(entry),
        }
    }
    if let Some(i) = entries.iter().position(|e| held_by_inheritance(&e.lock)) {
        return Ok((
            i,
            Taken::Inherited(entries.swap_remove(i).lock),
            Waited::default(),
        ));
    }
    let names: Vec<String> = window.iter().map(|r| r.name.to_string()).collect();
    if ctx.no_wait {
        return Err(coded(
            ctx.plan.map_or(ExitCode::Busy, |p| p.conflict_code),
            format!("all of {} are busy", names.join(", ")),
        ));
    }
    let registrations = entries
        .iter()
        .map(|e| register(ctx, &e.request.name, e.ticket.number))
        .collect();
    let label = format!("any of {}", names.join(" "));
    let ((index, (entry, slot)), waited) = blocking(ctx, label, None, registrations, |stop| {
        first_of(entries, stop, |entry, stop| entry.block(ctx.dir, stop))
    })?;
    Ok((index, Taken::Held(entry.into_held(ctx, slot)), waited))
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
        lock.lock_interruptible(true, &|| stop.keep_waiting())?;
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
    watch: Option<wait::Watch>,
    registrations: Vec<Option<Registration>>,
    block: impl FnOnce(&Stop) -> Result<T>,
) -> Result<(T, Waited)> {
    match ctx.plan {
        Some(plan) => wait::wait_for(label, watch, registrations, plan, || block(&ctx.stop)),
        None => {
            let result = block(&ctx.stop);
            drop(registrations);
            Ok((result?, Waited::default()))
        }
    }
}

/// Handles of its own for the waiting display (not needed when it shows nothing).
fn watch(dir: &ScratchDir, resource: &Resource, entry: &Entry) -> Option<wait::Watch> {
    Some(wait::Watch {
        dir: dir.try_clone().ok()?,
        resource: resource.clone(),
        lock: entry.lock.try_clone().ok()?,
        ticket: Some(entry.ticket.number),
    })
}

fn register(ctx: &Context, resource: &Resource, ticket: u64) -> Option<Registration> {
    let mut record = ctx.record();
    record.ticket = Some(ticket);
    record.since_ms = crate::record::now_ms();
    Registration::create(ctx.dir, resource, &record, Kind::Wait).ok()
}

fn busy(
    dir: &ScratchDir,
    resource: &Resource,
    lock: &LockFile,
    plan: Option<&WaitPlan>,
) -> anyhow::Error {
    let view = status::describe(lock, dir, resource);
    let who = if view.holders.is_empty() && !view.waiters.is_empty() {
        format!(": {} already waiting in line", view.waiters.len())
    } else {
        wait::holder_phrase(&view)
    };
    coded(
        plan.map_or(ExitCode::Busy, |p| p.conflict_code),
        format!("{resource} is busy{who}"),
    )
}

/// Whether the lock is held by anyone, from the kernel's table.
fn in_use(lock: &LockFile) -> bool {
    LockTable::read().is_ok_and(|t| t.is_locked(lock.id()))
}

/// Whether this process already holds the lock through a descriptor it
/// inherited (we run inside a command that devlock or flock started). Asked
/// of the kernel, not of an environment variable a script may have copied:
/// a descriptor on the same file whose `/proc/self/fdinfo` shows a lock.
pub fn held_by_inheritance(lock: &LockFile) -> bool {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    let own = lock.file().as_raw_fd();
    fds.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<RawFd>().ok())
        .filter(|&fd| fd != own && same_file(fd, lock))
        .any(|fd| {
            procfs::locks_of_fd("self", &fd.to_string())
                .iter()
                .any(|l| l.file == lock.id() && !l.blocked)
        })
}

fn same_file(fd: RawFd, lock: &LockFile) -> bool {
    // SAFETY: fstat fills a plain struct; a closed fd just fails.
    let mut st = unsafe { std::mem::zeroed::<libc::stat>() };
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0;
    ok && procfs::FileId::from_metadata(st.st_dev, st.st_ino) == lock.id()
}
