//! Taking one request in line: the uncontended take that skips the line,
//! then a queue ticket, the turn, the kernel lock, and a check that the path
//! still names the locked file. Shared by the command line and the library;
//! a wait is shown by the context's observer, a busy lock returned typed.

use anyhow::Result;

use crate::flock::dir::ScratchDir;
use crate::flock::entry::{Attempt, Context, Entry, Taken, blocking, hold, register, watch};
use crate::flock::file::{Leased, LockFile};
use crate::flock::in_the_way::InTheWay;
use crate::flock::late::Late;
use crate::flock::nesting::{Inherited, inherited, inside_holder};
use crate::flock::queue::Agreement;
use crate::flock::wait::Wait;
use crate::request::Request;

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

/// Takes one request: at once when free, else waiting in line. A file
/// lease on one of its files (which makes every open for writing wait) is
/// the resource in use: `-n` says busy, naming it; anyone else waits for
/// it to break, shown and bounded like any wait, and keeps the file open
/// meanwhile so that the lease cannot be taken again before its turn.
pub(crate) fn take(ctx: &Context, request: &Request) -> Result<Taken> {
    let mut breakers = Vec::new();
    loop {
        let leased = match take_unleased(ctx, request) {
            Err(e) if e.is::<Leased>() => e.downcast::<Leased>().expect("checked"),
            taken => return taken,
        };
        if ctx.no_wait || breakers.len() > 16 {
            return Err(leased.into_busy(request.name.as_str()));
        }
        let room = std::sync::Arc::new(std::sync::Mutex::new(crate::flock::wait::RoomNote::Said(
            format!("{}: {}", request.name, leased.words),
        )));
        let watches = stranger_watch(ctx, request, room).into_iter().collect();
        let wait = Wait {
            label: request.label(),
            watches,
            registrations: Vec::new(),
            lazy: false,
        };
        let opened = blocking(ctx, wait, |stop| {
            leased
                .break_it(ctx.dir, &|| stop.keep_waiting())
                .map_err(|e| {
                    anyhow::Error::from(e).context(format!("waiting for {}", request.name))
                })
        })?;
        ctx.observer.took()?;
        breakers.extend(opened);
    }
}

/// A watch for a wait on something that is not devlock's, described by
/// `room` (the waiting line shows it, and a timeout says it).
fn stranger_watch(
    ctx: &Context,
    request: &Request,
    room: std::sync::Arc<std::sync::Mutex<crate::flock::wait::RoomNote>>,
) -> Option<crate::flock::wait::Watch> {
    if !ctx.shows() {
        return None;
    }
    let lock = LockFile::open_to_look(ctx.dir, &request.name.file_name()).ok()?;
    Some(crate::flock::wait::Watch {
        dir: ctx.dir.try_clone().ok()?,
        resource: request.name.clone(),
        lock,
        ticket: None,
        agreement: None,
        label: request.label(),
        room: Some(room),
    })
}

fn take_unleased(ctx: &Context, request: &Request) -> Result<Taken> {
    let opened = match take_if_nobody_waits(ctx.dir, request)? {
        Fast::Held(lock) => {
            let held = hold(ctx, request.clone(), lock, None, None);
            return Ok(Taken::Held(held));
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
            // A devlock the kernel backs uses it with slots: a usage
            // error; a lock nobody vouches for: busy, naming it.
            return Err(crate::flock::queue::agreement_error(
                ctx.dir,
                &request.name.file_name(),
                agreed,
                0,
                &|pid| crate::flock::entry::devlock_of(ctx.dir, &lock, &request.name, pid),
                request.name.as_str(),
            )?);
        }
        inside_holder(&lock, request)?;
        if inherited(&lock, request.exclusive) == Inherited::Yes {
            return Ok(Taken::Inherited(lock));
        }
        return Err(busy(request, lock));
    }
    // The kernel shows the request from here on: a late registration's
    // while, and its record's wait, count from here.
    let (joined, since_ms) = (std::time::Instant::now(), crate::flock::record::now_ms());
    let mut entry = join_waiting(ctx, request, open_lock(opened)?)?;
    if let Attempt::Taken(slot) = entry.try_now(ctx.dir)? {
        return Ok(Taken::Held(entry.into_held(ctx, slot)));
    }
    if inside_holder(&entry.lock, request)? {
        return Ok(Taken::Inherited(entry.lock));
    }
    if ctx.no_wait {
        let Entry { lock, ticket, .. } = entry;
        // Out of line before looking, so we are not among those ahead.
        drop(ticket);
        return Err(busy(request, lock));
    }
    let ticket = entry.ticket.number;
    let make = || register(ctx, request, ticket, since_ms);
    let label = request.label();
    let shows = ctx.shows();
    let watches = shows
        .then(|| watch(ctx.dir, request, &entry))
        .flatten()
        .into_iter()
        .collect();
    // A semaphore's slots are raced on threads of their own.
    let lazy = request.slots == 0;
    let wait = Wait {
        label,
        watches,
        registrations: Vec::new(),
        lazy,
    };
    // Named by its registration once the wait has lasted a while (see
    // `late`), and by the kernel from its first instant: its place in
    // line, and once at the front its flock(2) wait. A semaphore's wait
    // races on other threads, where no alarm reaches: it registers at once.
    let taken = blocking(ctx, wait, |stop| match lazy {
        true => {
            let late = Late::arm(joined, &make);
            entry.block_calling(ctx.dir, stop, &|| late.on_wake())
        }
        false => {
            let _registration = make();
            entry.block(ctx.dir, stop)
        }
    });
    let (entry, slot) = taken?;
    Ok(Taken::Held(entry.into_held(ctx, slot)))
}

/// How often a request kept out of the line by a lock nobody vouches for
/// looks whether it is gone (no lock call can sleep until a stranger's lock
/// of any shape goes, and the look also sees a devlock take its place).
const BLOCKED_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Joins the line. While a lock devlock cannot vouch for keeps it shut (on
/// an agreement byte, or on the ticket bytes to the end), the resource is
/// in use as if a job held it: `-n` says busy, naming the lock, and
/// otherwise the request waits until it is gone, shown, bounded by `-w`
/// and ended by a stopping signal like any wait.
pub(crate) fn join_waiting(ctx: &Context, request: &Request, lock: LockFile) -> Result<Entry> {
    let mut lock = lock;
    loop {
        let (blocked, back) = match Entry::join_or_blocked(ctx.dir, request, lock)? {
            Ok(entry) => return Ok(entry),
            Err(blocked) => blocked,
        };
        if ctx.no_wait {
            return Err(blocked.into_busy());
        }
        lock = back;
        let room = std::sync::Arc::new(std::sync::Mutex::new(crate::flock::wait::RoomNote::Said(
            format!("{}: {}", request.name, blocked.words),
        )));
        let watches = ctx
            .shows()
            .then(|| {
                Some(crate::flock::wait::Watch {
                    dir: ctx.dir.try_clone().ok()?,
                    resource: request.name.clone(),
                    lock: lock.try_clone().ok()?,
                    ticket: None,
                    agreement: None,
                    label: request.label(),
                    room: Some(room),
                })
            })
            .flatten()
            .into_iter()
            .collect();
        let wait = Wait {
            label: request.label(),
            watches,
            registrations: Vec::new(),
            lazy: false,
        };
        blocking(ctx, wait, |stop| {
            while blocked.still_there() {
                if !stop.keep_waiting() {
                    return Err(anyhow::Error::from(std::io::Error::from(
                        std::io::ErrorKind::Interrupted,
                    ))
                    .context(format!("waiting for {}", request.name)));
                }
                std::thread::sleep(BLOCKED_POLL);
            }
            Ok(())
        })?;
        ctx.observer.took()?;
    }
}

/// The error of a busy lock (`-n`), with the lock file to name whoever is in
/// the way.
fn busy(request: &Request, lock: LockFile) -> anyhow::Error {
    InTheWay::Lock {
        request: request.clone(),
        lock: std::sync::Arc::new(lock),
        budget: false,
        group: None,
    }
    .busy()
}
