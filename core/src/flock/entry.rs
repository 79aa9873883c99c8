//! What one request is on its way to a hold: the [`Context`] a take waits
//! in, an [`Entry`] (its place in line and its lock file), the [`Held`] lock
//! and how it lets go, and what a take came to ([`Taken`]).

use std::os::fd::{AsFd, BorrowedFd};

use anyhow::Result;

use crate::flock::dir::ScratchDir;
use crate::flock::file::{LockFile, TryLock};
use crate::flock::queue::{Blocked, Ticket};
use crate::flock::record::Record;
use crate::flock::registration::{Kind, Registration};
use crate::flock::slots::{self, Slot};
use crate::flock::wait::{Observer, Wait, Watch};
use crate::interrupt::Stop;
use crate::proc::locks::LockTable;
use crate::request::Request;
use crate::resource::Resource;

/// A lock we hold.
#[derive(Debug)]
pub struct Held {
    pub request: Request,
    /// What the hold keeps, let go in the order [`Held`]'s `Drop` gives.
    keep: Option<Keep>,
    /// Whether the lock file may hold our record (decided at the first
    /// label, and withdrawn for good once the file holds anything else),
    /// and whether one was written (to clear on release).
    record_ok: std::cell::OnceCell<std::cell::Cell<bool>>,
    wrote: std::cell::Cell<bool>,
    /// What the lock file holds, as far as we know: what was there at the
    /// first label, then what we wrote. Every write and the cut on release
    /// first check that it still holds exactly this.
    expect: std::cell::RefCell<Vec<u8>>,
    /// A memory budget (`--mem`), MiB: its registration says so.
    mem_mib: Option<u64>,
    /// The directory is one made for locks, where an exclusive holder's
    /// record goes into the lock file ([`ScratchDir::records_in_lock_files`]).
    in_lock_dir: bool,
}

/// The parts of a hold.
#[derive(Debug)]
struct Keep {
    lock: LockFile,
    slot: Option<Slot>,
    /// Kept while holding: exclusively, the place in line, so the line
    /// behind waits for us; always, the agreement on the slot count.
    ticket: Option<Ticket>,
    /// A shared holder's label (there is no single record in a shared
    /// file), and an exclusive holder's outside a directory made for locks.
    label_file: Option<Registration>,
}

impl Held {
    fn new(
        request: Request,
        lock: LockFile,
        slot: Option<Slot>,
        ticket: Option<Ticket>,
        label_file: Option<Registration>,
        in_lock_dir: bool,
    ) -> Held {
        Held {
            request,
            keep: Some(Keep {
                lock,
                slot,
                ticket,
                label_file,
            }),
            record_ok: std::cell::OnceCell::new(),
            wrote: std::cell::Cell::new(false),
            expect: std::cell::RefCell::new(Vec::new()),
            mem_mib: None,
            in_lock_dir,
        }
    }

    /// A memory budget's hold (`--mem`): the lock shared, labelled by a
    /// registration that carries the budget, and the place in line kept
    /// until [`Held::step_aside`] (the job is starting).
    pub(crate) fn budget(
        request: Request,
        lock: LockFile,
        ticket: Ticket,
        label: Registration,
        mem_mib: u64,
    ) -> Held {
        let mut held = Held::new(request, lock, None, Some(ticket), Some(label), true);
        held.mem_mib = Some(mem_mib);
        held
    }

    /// Lets the line behind move on while keeping the hold (a budget's job
    /// has started).
    pub fn step_aside(&self) {
        if let Some(ticket) = &self.keep().ticket {
            let _ = ticket.step_aside();
        }
    }

    /// The place in line's descriptor (the queue file), which the command
    /// inherits after the lock's: it keeps the agreement on the slot count
    /// as long as the hold.
    pub fn line_fd(&self) -> Option<BorrowedFd<'_>> {
        self.keep().ticket.as_ref().map(Ticket::fd)
    }

    /// Whether this hold keeps its place in line until a budget's watch
    /// steps aside (else it steps aside as its command starts).
    pub fn is_budget(&self) -> bool {
        self.mem_mib.is_some()
    }

    fn keep(&self) -> &Keep {
        self.keep
            .as_ref()
            .expect("a hold keeps its parts until dropped")
    }

    /// The lock file held.
    pub fn lock(&self) -> &LockFile {
        &self.keep().lock
    }

    /// The semaphore slot held, with `--slots`.
    pub fn slot(&self) -> Option<&Slot> {
        self.keep().slot.as_ref()
    }

    /// Descriptors the command must inherit to keep holding (and a shared
    /// holder's registration, so its label lives as long as the hold).
    pub fn inheritable_fds(&self) -> Vec<BorrowedFd<'_>> {
        let keep = self.keep();
        let mut fds = vec![keep.lock.file().as_fd()];
        fds.extend(keep.slot.as_ref().map(|s| s.lock.file().as_fd()));
        fds.extend(keep.label_file.as_ref().map(Registration::fd));
        fds
    }

    /// Whether this hold's lock file is devlock's alone, as far as it can
    /// tell: in a directory made for locks, and (an exclusive hold's)
    /// carrying its record, not somebody's data. Otherwise the command may
    /// use the file itself (and may wait for this very hold).
    pub fn labelled(&self) -> bool {
        self.in_lock_dir
            && (!self.owns_record() || self.record_ok.get().is_some_and(std::cell::Cell::get))
    }

    /// Whether the holder record goes into the lock file itself.
    fn owns_record(&self) -> bool {
        self.request.exclusive && self.request.slots == 0 && self.in_lock_dir
    }

    /// The lock files this hold keeps, with the path each was opened at:
    /// the lock, and the slot's.
    pub fn files(&self) -> impl Iterator<Item = &LockFile> {
        let keep = self.keep();
        std::iter::once(&keep.lock).chain(keep.slot.as_ref().map(|s| &s.lock))
    }

    /// Writes the holder's label, now naming the running command: into the
    /// lock file for an exclusive hold, into the registration for a shared
    /// one. A lock file that holds anything but a devlock record is held
    /// without one: the first label returns the warning that says so.
    pub fn label(&self, record: &Record) -> Option<String> {
        let keep = self.keep();
        let mut record = record.clone();
        record.ticket = keep.ticket.as_ref().map(|t| t.number);
        record.slot = keep.slot.as_ref().map(|s| s.number);
        record.via = self.request.via.as_ref().map(Resource::to_string);
        record.mem_mib = self.mem_mib;
        if self.mem_mib.is_none() {
            record.over_mib = None;
        }
        let mut note = None;
        if self.owns_record() {
            let mut fresh = false;
            let ok = self
                .record_ok
                .get_or_init(|| match keep.lock.may_hold_record() {
                    Ok(now) => {
                        *self.expect.borrow_mut() = now;
                        fresh = true;
                        std::cell::Cell::new(true)
                    }
                    Err(why) => {
                        note = Some(why);
                        std::cell::Cell::new(false)
                    }
                });
            if ok.get() {
                let mut expect = self.expect.borrow_mut();
                // (Read just now, at the first label.)
                if fresh || keep.lock.holds_exactly(&expect) {
                    // A label only: a failure to write it must not stop the work.
                    if record
                        .write_over(keep.lock.file(), expect.len() as u64)
                        .is_ok()
                    {
                        *expect = record.to_bytes();
                        self.wrote.set(true);
                    }
                } else {
                    // Somebody else wrote into it since (the command, when
                    // it uses the same file): theirs from now on.
                    ok.set(false);
                    self.wrote.set(false);
                    note = Some(format!(
                        "{} was written by someone else during this hold; devlock no longer \
                         writes into it (nor clears it on release)",
                        crate::show::show_path(keep.lock.path())
                    ));
                }
            }
        } else if let Some(label) = &keep.label_file {
            let _ = label.rewrite(&record);
        }
        note
    }
}

impl Held {
    /// In a forked child of the taker: closes this process's copies of the
    /// hold's descriptors and nothing else. The record, the place in line and
    /// a shared holder's label stay with the taker (and the lock with
    /// whoever still has a descriptor to it).
    pub fn close_copy(mut self) {
        self.wrote.set(false);
        if let Some(Keep {
            lock,
            slot,
            ticket,
            label_file,
        }) = self.keep.take()
        {
            drop((lock, slot, ticket));
            if let Some(label) = label_file {
                label.close_copy();
            }
        }
    }
}

impl Drop for Held {
    /// Lets go in this order, each step for a reason:
    ///
    /// 1. The record is cleared while the lock is still ours: no step
    ///    outlives the hold (the file itself stays, so nobody can slip in
    ///    on a fresh one).
    /// 2. The lock file and then the slot are closed. The kernel drops a
    ///    lock when its last descriptor closes; the command's closed when it
    ///    exited, so this is the release.
    /// 3. Only then the place in line (and the agreement on the slot
    ///    count): the next in line wakes when it goes, and must find the
    ///    lock free rather than sleep again behind a holder that is
    ///    leaving; and nobody ever sees the lock held through the line
    ///    without the agreement that says how it is used.
    /// 4. A shared holder's label last: it names the hold as long as the
    ///    hold is there.
    fn drop(&mut self) {
        let Some(keep) = self.keep.take() else {
            return;
        };
        // Only what we wrote is cut: a file that holds anything else now
        // is somebody's data.
        if self.wrote.get() && keep.lock.holds_exactly(&self.expect.borrow()) {
            let _ = keep.lock.file().set_len(0);
        }
        let Keep {
            lock,
            slot,
            ticket,
            label_file,
        } = keep;
        drop(lock);
        drop(slot);
        drop(ticket);
        drop(label_file);
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

/// How a take waits: shared by all its requests.
pub struct Context<'a> {
    pub dir: &'a ScratchDir,
    /// The label registrations and holds carry.
    pub step: String,
    pub no_wait: bool,
    /// Lets another thread stop a wait (the library's cancel and timeout).
    pub stop: Stop,
    /// Who shows the waits: the command line's display, the library's
    /// board, or nobody.
    pub observer: &'a dyn Observer,
}

/// What a try without waiting came to.
pub(crate) enum Attempt {
    /// Taken, with the semaphore slot if any.
    Taken(Option<Slot>),
    Busy,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("dir", &self.dir)
            .field("step", &self.step)
            .field("no_wait", &self.no_wait)
            .finish_non_exhaustive()
    }
}

impl Context<'_> {
    /// Whether a wait gathers handles for whoever shows it.
    pub(crate) fn shows(&self) -> bool {
        self.observer.shows()
    }

    /// A fresh record for this process; built only when a label is written,
    /// so an uncontended take reads nothing it does not need.
    pub(crate) fn record(&self) -> Record {
        Record::for_this_process(&self.step)
    }
}

/// A request at the front of its line or about to wait in it.
pub(crate) struct Entry {
    pub(crate) request: Request,
    pub(crate) lock: LockFile,
    pub(crate) ticket: Ticket,
}

impl Entry {
    pub(crate) fn join(dir: &ScratchDir, request: &Request) -> Result<Entry> {
        let lock = LockFile::open(dir, &request.name.file_name())?;
        Entry::join_with(dir, request, lock)
    }

    /// Joins the line with a lock file already open (the fast path's). A
    /// line that a lock nobody vouches for keeps shut is busy (exit 75).
    pub(crate) fn join_with(dir: &ScratchDir, request: &Request, lock: LockFile) -> Result<Entry> {
        match Entry::join_or_blocked(dir, request, lock)? {
            Ok(entry) => Ok(entry),
            Err((blocked, _)) => Err(blocked.into_busy()),
        }
    }

    /// Joins the line, or says which lock keeps it shut for now (and gives
    /// the lock file back), for a caller that waits until it is gone.
    pub(crate) fn join_or_blocked(
        dir: &ScratchDir,
        request: &Request,
        lock: LockFile,
    ) -> Result<std::result::Result<Entry, (Blocked, LockFile)>> {
        let name = request.name.file_name();
        let taken = Ticket::take(
            dir,
            &name,
            request.slots,
            &|| plain_devlock_holds(dir, &lock, &request.name),
            &|pid| devlock_of(dir, &lock, &request.name, pid),
            request.name.as_str(),
        );
        match taken {
            Ok(ticket) => Ok(Ok(Entry {
                request: request.clone(),
                lock,
                ticket,
            })),
            Err(e) => match e.downcast::<Blocked>() {
                Ok(blocked) => Ok(Err((blocked, lock))),
                Err(e) => Err(e),
            },
        }
    }

    /// Takes the lock without waiting, if nobody is ahead and it is free.
    pub(crate) fn try_now(&mut self, dir: &ScratchDir) -> Result<Attempt> {
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
            let Some(slot) = slots::try_any(dir, &self.request)? else {
                return Ok(Attempt::Busy);
            };
            if self.lock.try_lock(false)? == TryLock::Taken {
                return Ok(Attempt::Taken(Some(slot)));
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
    pub(crate) fn block(self, dir: &ScratchDir, stop: &Stop) -> Result<(Entry, Option<Slot>)> {
        self.block_calling(dir, stop, &|| {})
    }

    /// [`Entry::block`], calling `on_wake` each time a lock call is
    /// interrupted and the wait is not being stopped (before the
    /// observer's hook: a registration due is made before a line shows).
    pub(crate) fn block_calling(
        mut self,
        dir: &ScratchDir,
        stop: &Stop,
        on_wake: &dyn Fn(),
    ) -> Result<(Entry, Option<Slot>)> {
        let keep = || {
            if !stop.stopping() {
                on_wake();
            }
            stop.keep_waiting()
        };
        self.ticket.wait_turn(&keep)?;
        let slot = if self.request.slots > 0 {
            let slot = slots::wait_for_slot(dir, &self.request, stop)?;
            self.lock.lock(false, &keep)?;
            Some(slot)
        } else {
            self.lock.lock_at_path(dir, self.request.exclusive, &keep)?;
            None
        };
        self.step_aside_if_shared();
        Ok((self, slot))
    }

    /// Turns a taken entry into a hold.
    pub(crate) fn into_held(self, ctx: &Context, slot: Option<Slot>) -> Held {
        hold(ctx, self.request, self.lock, Some(self.ticket), slot)
    }
}

/// A hold: an exclusive holder keeps its place so the line behind waits; a
/// shared holder steps aside so the line moves on, and labels itself in a
/// registration, as a shared lock file has no room for everyone's record
/// (so does an exclusive holder outside a directory made for locks, whose
/// lock file may be the command's).
/// Both keep the agreement on the slot count their ticket holds.
pub(crate) fn hold(
    ctx: &Context,
    request: Request,
    lock: LockFile,
    ticket: Option<Ticket>,
    slot: Option<Slot>,
) -> Held {
    let exclusive = request.exclusive && request.slots == 0;
    let in_lock_dir = !exclusive || ctx.dir.records_in_lock_files();
    if exclusive && in_lock_dir {
        return Held::new(request, lock, slot, ticket, None, true);
    }
    let number = ticket.as_ref().map(|t| t.number);
    if let (false, Some(ticket)) = (exclusive, &ticket) {
        let _ = ticket.step_aside();
    }
    let mut record = ctx.record();
    record.ticket = number;
    record.slot = slot.as_ref().map(|s| s.number);
    record.via = request.via.as_ref().map(Resource::to_string);
    let label = Registration::create(ctx.dir, &request.name, &record, Kind::Hold).ok();
    Held::new(request, lock, slot, ticket, label, in_lock_dir)
}

/// Handles of its own for the waiting display (not needed when it shows nothing).
pub(crate) fn watch(dir: &ScratchDir, request: &Request, entry: &Entry) -> Option<Watch> {
    Some(Watch {
        dir: dir.try_clone().ok()?,
        resource: request.name.clone(),
        lock: entry.lock.try_clone().ok()?,
        ticket: Some(entry.ticket.number),
        agreement: Some(request.slots),
        label: request.label(),
        room: None,
    })
}

/// A waiter's registration for its place `ticket`, whose wait started at
/// `since_ms` (a plain take registers late, see `late`); dropping it ends
/// it.
pub(crate) fn register(
    ctx: &Context,
    request: &Request,
    ticket: u64,
    since_ms: u64,
) -> Option<Registration> {
    let mut record = ctx.record();
    record.ticket = Some(ticket);
    record.since_ms = since_ms;
    record.via = request.via.as_ref().map(Resource::to_string);
    Registration::create(ctx.dir, &request.name, &record, Kind::Wait).ok()
}

/// Whether a devlock holds the lock plainly (exclusively, not through the
/// line's agreement), as the kernel backs it: the kernel's holder is the
/// process the lock file's record (or, outside a directory made for locks,
/// its registration) names, and the kernel shows it holding (see
/// [`devlock_of`]). Another user's holder, whose
/// descriptors this user cannot read, is vouched for by nobody: a request
/// then waits for the lock as for any holder.
fn plain_devlock_holds(dir: &ScratchDir, lock: &LockFile, resource: &Resource) -> bool {
    let Ok(table) = LockTable::read() else {
        return false;
    };
    table
        .holders(lock.id())
        .any(|l| l.exclusive && devlock_of(dir, lock, resource, l.pid))
}

/// Whether `pid` is a devlock using `resource`, by the kernel's word: the
/// lock file's record names it (pid and start time) and its descriptors
/// show it holding the lock file, or a registration of `resource` names it
/// that the kernel shows flocked by that very process.
pub(crate) fn devlock_of(dir: &ScratchDir, lock: &LockFile, resource: &Resource, pid: u32) -> bool {
    if crate::flock::record::read_from(lock.file())
        .valid()
        .is_some_and(|r| r.names(pid))
        && crate::proc::fdinfo::holds_flock(pid, lock.id()) == Some(true)
    {
        return true;
    }
    let Ok(table) = LockTable::read() else {
        return false;
    };
    let names = dir.entries().unwrap_or_default();
    crate::flock::registration::live_registrations(dir, &names, &table, |r, p| {
        p == pid && r == resource
    })
    .iter()
    .any(|w| w.believed && w.record.pid == pid)
}

/// Runs `block` on this thread through the context's observer, and returns
/// what it came to.
pub(crate) fn blocking<T>(
    ctx: &Context,
    wait: Wait,
    block: impl FnOnce(&Stop) -> Result<T>,
) -> Result<T> {
    let mut block = Some(block);
    let mut out = None;
    ctx.observer.wait(wait, &ctx.stop, &mut || {
        let block = block.take().expect("a wait runs its block once");
        out = Some(block(&ctx.stop)?);
        Ok(())
    })?;
    Ok(out.expect("the observer ran the wait"))
}
