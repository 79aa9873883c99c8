//! `--mem SIZE` on `gpu:N`: a memory budget, held as a lock held.
//!
//! A budget holder takes `gpu:N.lock` shared (and `gpu` shared, as every
//! member does), so a request for the whole device (no `--mem`, or `gpu`)
//! and plain `flock gpu:N.lock` exclude every budget holder, and the kernel
//! frees a budget the instant its holder (devlock and every process that
//! inherited the lock) is gone. Its budget is labelled in its own shared
//! hold's registration (`.gpu:N@PID.K.hold`, `mem_mib`), believed only as
//! status believes one (its flock held by the very process it names) and
//! only while that process holds `gpu:N.lock` per `/proc/locks`: a forged
//! registration can only ever be its forger's own budget.
//!
//! Admission goes through the fair line of `gpu:N` like any other request,
//! so no request overtakes an earlier one still waiting. Only the request at
//! the front looks: it is admitted when the holders' budgets (each its
//! budget, or what its job measurably uses where more), the memory used on
//! the device outside them (the probe's device figure less the holders'
//! use), its own budget and the headroom fit in the device's total. Once
//! admitted it takes the lock shared, registers, and keeps its place in
//! line while its job starts ([`Monitor`]): the next budget on the device is
//! looked at only once this one's memory stopped growing, or `--settle`
//! passed. A front request that does not fit sleeps in the kernel: one
//! thread per budget holder blocks in flock(2) on that holder's
//! registration (granted when the holder is gone), beside a timer that
//! looks again every [`REPROBE_EVERY`] (memory outside the gate may come
//! or go); everyone behind it sleeps on its place in line.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

use crate::exit::{ExitCode, coded};
use crate::flock::dir::ScratchDir;
use crate::flock::file::open_read_only;
use crate::flock::nesting::inside_holder;
use crate::flock::record::Record;
use crate::flock::registration::{self, Kind, Registration};
use crate::flock::take::{Context, Entry, Held, Taken, blocking, register, watch};
use crate::gpu::memory::{self, Budget, Room};
use crate::interrupt::Stop;
use crate::proc::locks::{FileId, LockTable};
use crate::request::Request;
use crate::resource::Resource;
use crate::sys::fs::{Flock, flock};
use crate::sys::signal::Thread;
use crate::wait_display::Waited;

/// How often a front request that does not fit looks at the device again
/// when no budget holder leaves first. A look is one probe (two nvidia-smi
/// runs: tens of milliseconds of CPU on a real driver, a few on the fake),
/// a read of `/proc/locks` and of the directory; between looks the waiting
/// devlock sleeps in the kernel.
pub(crate) const REPROBE_EVERY: Duration = Duration::from_secs(5);

/// How often a starting job's memory is sampled: three samples in a row
/// within [`settle_delta`] of each other, once it uses any, and it has
/// settled.
pub(crate) const SAMPLE_STARTING: Duration = Duration::from_secs(1);

/// How often a settled job's memory is sampled, for the over-budget watch.
pub(crate) const SAMPLE_HELD: Duration = Duration::from_secs(5);

/// What a budget request asks for.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub index: u32,
    pub mem_mib: u64,
    pub headroom_mib: u64,
    pub probe_timeout: Duration,
    /// What the probe said as the run started (its check of the size), and
    /// when: the first look uses it while it is [`FRESH`], so an
    /// uncontended budget costs one probe, not two.
    pub seen: Option<(Instant, crate::gpu::device::DeviceReport)>,
}

/// How long a probe's answer stands for the first look.
const FRESH: Duration = Duration::from_millis(250);

impl Ask {
    /// The device now: the run's first answer while fresh, else a probe.
    fn probe(&self) -> crate::gpu::device::DeviceReport {
        match &self.seen {
            Some((at, report)) if at.elapsed() < FRESH => report.clone(),
            _ => memory::probe(self.probe_timeout),
        }
    }
}

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

fn figures(resource: &Resource, room: &Room, ask: &Ask) -> String {
    crate::messages::budget_figures(resource, room, ask.mem_mib, ask.headroom_mib)
}

/// Takes a budget on `request` (`gpu:N`, shared): at once when it is first
/// in line and fits, else in line (or, with `-n`, not at all).
pub(crate) fn take(ctx: &Context, request: &Request, ask: &Ask) -> Result<(Taken, Waited)> {
    let mut entry = Entry::join(ctx.dir, request)?;
    if inside_holder(&entry.lock, request)? {
        return Ok((Taken::Inherited(entry.lock), Waited::default()));
    }
    let code = ctx.plan.map_or(ExitCode::Busy, |p| p.conflict_code);
    let resource = &request.name;
    if !entry.ticket.has_anyone_ahead()? {
        let seen = look(ctx.dir, resource, entry.lock.id(), ask)
            .map_err(|why| coded(ExitCode::NotIdle, why))?;
        if seen.room.admits(ask.mem_mib, ask.headroom_mib) {
            if entry.lock.try_lock_at_path(ctx.dir, false)? {
                return Ok((Taken::Held(admit(ctx, entry, ask)?), Waited::default()));
            }
        } else if ctx.no_wait {
            drop(entry);
            return Err(crate::messages::no_room(
                &figures(resource, &seen.room, ask),
                code,
            ));
        }
    }
    if ctx.no_wait {
        let Entry { lock, ticket, .. } = entry;
        // Out of line before looking, so we are not among those ahead.
        drop(ticket);
        let view = crate::status::model::describe(&lock, ctx.dir, resource);
        if let Some(starter) = view.holders.iter().find(|h| h.starting == Some(true)) {
            return Err(crate::messages::budget_starting(resource, starter, code));
        }
        return Err(crate::messages::busy(request, &view, code));
    }
    let room_text = Arc::new(Mutex::new(String::new()));
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
    let label = crate::messages::label_of(request);
    // Not lazy: the wait for room is no lock call an alarm could interrupt.
    let (entry, waited) = blocking(ctx, label, watches, vec![registration], false, |stop| {
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
                    set(&room_text, format!("{resource}: {why}"));
                    Vec::new()
                }
            };
            sleep_for_room(ctx.dir, &holders, REPROBE_EVERY, stop)
                .with_context(|| format!("waiting for room on {resource}"))?;
        }
        entry.lock.lock_at_path(ctx.dir, false, &keep)?;
        Ok(entry)
    })?;
    Ok((Taken::Held(admit(ctx, entry, ask)?), waited))
}

/// A waiter's registration that names the budget it asks for.
fn register_asking(
    ctx: &Context,
    request: &Request,
    ticket: u64,
    mem_mib: u64,
) -> Option<Registration> {
    let registration = register(ctx, request, ticket)?;
    let mut record = ctx.record();
    record.ticket = Some(ticket);
    record.mem_mib = Some(mem_mib);
    let _ = registration.rewrite(&record);
    Some(registration)
}

fn set(text: &Mutex<String>, value: String) {
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
    let (tx, rx) = mpsc::channel::<()>();
    let stops: Vec<Stop> = wakes.iter().map(|_| Stop::default()).collect();
    let threads: Mutex<Vec<Option<Thread>>> = Mutex::new(vec![None; wakes.len()]);
    let started = Barrier::new(wakes.len() + 1);
    std::thread::scope(|scope| {
        for (index, wake) in wakes.iter().enumerate() {
            let tx = tx.clone();
            let (mine, threads, started) = (&stops[index], &threads, &started);
            scope.spawn(move || {
                crate::interrupt::unblock_here();
                crate::interrupt::let_job_stops_in_here();
                threads.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(Thread::current());
                started.wait();
                let _finished = mine.finished_on_drop();
                let keep = || mine.keep_waiting() && stop.keep_waiting();
                match wake {
                    Wake::Gone(file) => loop {
                        match flock(file, Flock::Shared, false) {
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted && keep() => {}
                            _ => break,
                        }
                    },
                    Wake::Turn(ticket) => {
                        let _ = ticket.wait_turn(&keep);
                    }
                }
                let _ = tx.send(());
            });
        }
        started.wait();
        drop(tx);
        // A stop of the wait (the library's cancel, Ctrl-C in Python) reaches
        // these sleepers at once, not after `every`.
        let children: Vec<(Stop, Thread)> = stops
            .iter()
            .cloned()
            .zip(threads.lock().unwrap_or_else(|e| e.into_inner()).iter())
            .filter_map(|(s, t)| t.map(|t| (s, t)))
            .collect();
        let _adopted = stop.adopt(children);
        // A job stop must reach a thread asleep in a lock call, not this one.
        let mask = crate::interrupt::keep_job_stops_off_here();
        let _ = rx.recv_timeout(every);
        for (mine, thread) in stops
            .iter()
            .zip(threads.lock().unwrap_or_else(|e| e.into_inner()).iter())
        {
            if let Some(thread) = thread {
                mine.stop(*thread);
            }
        }
        crate::interrupt::restore(&mask);
    });
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
    pending: &mut crate::flock::take::Pending,
) -> Result<Vec<(Resource, Taken)>> {
    let mut taken = Vec::new();
    if let Some(group) = candidates.first().and_then(|(r, _)| r.name.group()) {
        let request = Request {
            name: group.clone(),
            exclusive: false,
            via: Some(candidates[0].0.name.clone()),
            slots: 0,
        };
        let (took, waited) = crate::flock::take::take(ctx, &request)?;
        pending.add(waited)?;
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
    let code = ctx.plan.map_or(ExitCode::Busy, |p| p.conflict_code);
    let rooms: Vec<Arc<Mutex<String>>> = candidates.iter().map(|_| Arc::default()).collect();
    // One look at every front: the first that fits, if any.
    let first_fit = |entries: &mut Vec<Entry>, stop: Option<&Stop>| -> Result<Option<usize>> {
        let mut asleep_on = Vec::new();
        for (i, (entry, (request, ask))) in entries.iter_mut().zip(candidates).enumerate() {
            if entry.ticket.has_anyone_ahead()? {
                set(&rooms[i], String::new());
                continue;
            }
            match look(ctx.dir, &request.name, entry.lock.id(), ask) {
                Ok(seen) if seen.room.admits(ask.mem_mib, ask.headroom_mib) => {
                    if entry.lock.try_lock_at_path(ctx.dir, false)? {
                        return Ok(Some(i));
                    }
                    set(&rooms[i], format!("{}: held whole", request.name));
                }
                Ok(seen) => {
                    set(&rooms[i], figures(&request.name, &seen.room, ask));
                    asleep_on.extend(seen.holders);
                }
                Err(why) => set(&rooms[i], format!("{}: {why}", request.name)),
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
    };
    let mut entries = entries;
    let chosen = match first_fit(&mut entries, None)? {
        Some(i) => Some(i),
        None if ctx.no_wait => {
            let each: Vec<String> = rooms
                .iter()
                .zip(candidates)
                .map(|(room, (request, _))| {
                    let text = room.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    if text.is_empty() {
                        format!("{}: others ahead in line", request.name)
                    } else {
                        text
                    }
                })
                .collect();
            drop(entries);
            return Err(crate::messages::no_room(&each.join("; "), code));
        }
        None => None,
    };
    let (index, mut entries, waited) = match chosen {
        Some(i) => (i, entries, Waited::default()),
        None => {
            let registrations = entries
                .iter()
                .zip(candidates)
                .map(|(e, (_, ask))| register_asking(ctx, &e.request, e.ticket.number, ask.mem_mib))
                .collect();
            let shows = ctx.shows();
            let watches = if shows {
                entries
                    .iter()
                    .zip(&rooms)
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
            let label = format!("any of {}", names.join(" "));
            let ((index, entries), waited) =
                blocking(ctx, label, watches, registrations, false, |stop| {
                    loop {
                        if let Some(i) = first_fit(&mut entries, Some(stop))? {
                            break Ok((i, entries));
                        }
                        if !stop.keep_waiting() {
                            break Err(anyhow::Error::from(std::io::Error::from(
                                std::io::ErrorKind::Interrupted,
                            )));
                        }
                    }
                })?;
            (index, entries, waited)
        }
    };
    pending.add(waited)?;
    let entry = entries.swap_remove(index);
    // The others' lines are left here.
    drop(entries);
    let name = entry.request.name.clone();
    taken.push((name, Taken::Held(admit(ctx, entry, &candidates[index].1)?)));
    Ok(taken)
}

/// What a budget request is, for the checks `--mem` and its companions get
/// before anything is taken (the command line's and the library's alike).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape<'a> {
    pub mem: Option<u64>,
    /// `--mem-headroom`, `--settle` or `--mem-strict` given.
    pub companions: bool,
    pub shared: bool,
    pub slots: bool,
    pub any: bool,
    pub count: u8,
    pub resources: &'a [Resource],
}

/// `--mem` and its companions: a budget of more than nothing, on `gpu:N`
/// resources only (one, or candidates of `--any`), never with `--shared` or
/// `--slots`. Usage errors, in the command line's words.
pub(crate) fn check_usage(shape: &Shape) -> Result<()> {
    let usage = |message: &str| Err(coded(ExitCode::Usage, message.to_owned()));
    let Some(mem) = shape.mem else {
        if shape.companions {
            return usage(
                "--mem-headroom, --settle and --mem-strict need --mem: they shape a memory budget",
            );
        }
        return Ok(());
    };
    if mem == 0 {
        return usage(
            "--mem must be more than 0 (e.g. --mem 20GiB); leave it out for the whole device",
        );
    }
    if shape.shared || shape.slots {
        return usage(
            "--mem cannot be combined with --shared or --slots: a budget already shares the device \
             by memory",
        );
    }
    if let Some(r) = shape.resources.iter().find(|r| r.gpu_index().is_none()) {
        return usage(&format!(
            "--mem budgets one GPU's memory: give gpu:N, not {r} (without --mem, {r} is taken whole)"
        ));
    }
    if !shape.any && shape.resources.len() > 1 {
        return usage("--mem takes one gpu:N, or several candidates with --any");
    }
    if shape.count > 1 {
        return usage("--mem with --any takes one device: --count must be 1");
    }
    Ok(())
}

/// A probe's answer and when it came.
pub(crate) type Seen = (Instant, crate::gpu::device::DeviceReport);

/// Each candidate's total memory (MiB), asked once before any wait, and
/// the probe's answer (for the first look). A device whose memory cannot
/// be learned is exit 69; a budget that could never fit (more than the
/// device, with the headroom) is a usage error.
pub(crate) fn totals(
    mem: u64,
    headroom: u64,
    resources: &[Resource],
    probe_timeout: Duration,
) -> Result<(Vec<(Resource, u64)>, Seen)> {
    let report = memory::probe(probe_timeout);
    let at = Instant::now();
    let mut totals = Vec::new();
    for resource in resources {
        let index = resource.gpu_index().expect("validated: gpu:N");
        let device = memory::device(&report, index).map_err(|why| coded(ExitCode::NotIdle, why))?;
        let total = device.memory_total_mib.unwrap_or(0);
        if mem + headroom > total {
            return Err(coded(
                ExitCode::Usage,
                format!(
                    "--mem {} with {} headroom can never fit on {resource}, which has {} in all",
                    memory::size(mem),
                    memory::size(headroom),
                    memory::size(total)
                ),
            ));
        }
        totals.push((resource.clone(), total));
    }
    Ok((totals, (at, report)))
}

/// What a budget's job learns: `DEVLOCK_MEM_MIB`, and for JAX
/// `XLA_PYTHON_CLIENT_MEM_FRACTION`, the budget's share of the device
/// (rounded down, so the job stays within it), unless the caller set it.
pub(crate) fn job_env(mem: u64, total: u64) -> Vec<(&'static str, String)> {
    let mut env = vec![("DEVLOCK_MEM_MIB", mem.to_string())];
    if std::env::var_os("XLA_PYTHON_CLIENT_MEM_FRACTION").is_none() && total > 0 {
        let thousandths = mem.saturating_mul(1000) / total;
        env.push((
            "XLA_PYTHON_CLIENT_MEM_FRACTION",
            format!("{}.{:03}", thousandths / 1000, thousandths % 1000),
        ));
    }
    env
}

/// How close three samples must be for a starting job to count as settled:
/// 1/50 of its budget, at least 128 MiB (allocators grow in chunks).
pub(crate) fn settle_delta(mem_mib: u64) -> u64 {
    (mem_mib / 50).max(128)
}

/// What the monitor thread measured.
#[derive(Debug, Default)]
struct Measures {
    /// The job's use, MiB, once sampled.
    used_mib: AtomicU64,
    sampled: AtomicBool,
    settled: AtomicBool,
    quit: AtomicBool,
}

/// Watches a budget's job while it runs: a thread samples what its process
/// tree uses on the device (every [`SAMPLE_STARTING`] while it starts, then
/// every [`SAMPLE_HELD`]); the supervisor's tick reads what it found.
#[derive(Debug)]
pub(crate) struct Monitor {
    measures: Arc<Measures>,
}

impl Monitor {
    pub(crate) fn start(ask: &Ask, roots: Vec<u32>, settle: Duration) -> Monitor {
        let measures = Arc::new(Measures::default());
        let (m, ask) = (measures.clone(), ask.clone());
        let spawned = std::thread::Builder::new()
            .name("devlock-mem".into())
            .stack_size(256 * 1024)
            .spawn(move || sample(&m, &ask, &roots, settle));
        if spawned.is_err() {
            // Nothing to measure with: the job starts alone for --settle.
            measures.sampled.store(false, Ordering::Release);
        }
        Monitor { measures }
    }

    /// The job's measured use, once sampled.
    pub(crate) fn used_mib(&self) -> Option<u64> {
        self.measures
            .sampled
            .load(Ordering::Acquire)
            .then(|| self.measures.used_mib.load(Ordering::Acquire))
    }

    /// Whether its memory stopped growing.
    pub(crate) fn settled(&self) -> bool {
        self.measures.settled.load(Ordering::Acquire)
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.measures.quit.store(true, Ordering::Release);
    }
}

fn sample(m: &Measures, ask: &Ask, roots: &[u32], settle: Duration) {
    let started = Instant::now();
    let mut last: VecDeque<u64> = VecDeque::new();
    while !m.quit.load(Ordering::Acquire) {
        let settled = m.settled.load(Ordering::Acquire);
        // Past --settle the job no longer starts: sample as for one held.
        std::thread::sleep(if settled || started.elapsed() >= settle {
            SAMPLE_HELD
        } else {
            SAMPLE_STARTING
        });
        let report = memory::probe(ask.probe_timeout);
        let Ok(device) = memory::device(&report, ask.index) else {
            continue;
        };
        let used = memory::tree_use(device, roots);
        m.used_mib.store(used, Ordering::Release);
        m.sampled.store(true, Ordering::Release);
        if settled {
            continue;
        }
        if used == 0 && last.is_empty() {
            continue;
        }
        last.push_back(used);
        if last.len() > 3 {
            last.pop_front();
        }
        let (lo, hi) = (
            last.iter().min().copied().unwrap_or(0),
            last.iter().max().copied().unwrap_or(0),
        );
        if last.len() == 3 && hi - lo <= settle_delta(ask.mem_mib) {
            m.settled.store(true, Ordering::Release);
        }
    }
}

/// The supervisor's part, once a second while the job runs: the starting
/// job steps aside once settled (or at `--settle`), and a job over its
/// budget by more than a tenth is said once, marked in its registration,
/// and with `--mem-strict` stopped once it has stayed over for `--settle`.
#[derive(Debug)]
pub(crate) struct Watch {
    pub monitor: Monitor,
    pub resource: Resource,
    pub step: String,
    pub mem_mib: u64,
    pub settle: Duration,
    pub strict: bool,
    pub quiet: bool,
    pub started: Instant,
    pub stepped_aside: bool,
    pub warned: bool,
    pub over_since: Option<Instant>,
    pub stopped: bool,
    /// Where what the watch says goes: `None`, on stderr beside the
    /// command (the command line); else kept here for the caller to pass
    /// on (the library, whose caller says it its own way).
    pub told: Option<Vec<String>>,
}

/// What the tick should do to the hold.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Action {
    StepAside,
    /// Relabel with this over-budget figure (`None`: back under).
    Relabel(Option<u64>),
    Stop,
}

impl Watch {
    /// The watch of a hold whose command just started: not strict, saying
    /// on stderr, nothing said or stepped aside yet (callers set the rest
    /// with struct update syntax).
    pub(crate) fn new(
        monitor: Monitor,
        resource: Resource,
        step: String,
        mem_mib: u64,
        settle: Duration,
    ) -> Watch {
        Watch {
            monitor,
            resource,
            step,
            mem_mib,
            settle,
            strict: false,
            quiet: false,
            started: Instant::now(),
            stepped_aside: false,
            warned: false,
            over_since: None,
            stopped: false,
            told: None,
        }
    }

    fn say(&mut self, text: String) {
        match self.told.as_mut() {
            None => crate::tty::say_while_command_runs(&text),
            Some(told) => told.push(text),
        }
    }

    /// Whether `used` is over the budget by more than a tenth.
    fn over(&self, used: u64) -> bool {
        used.saturating_mul(10) > self.mem_mib.saturating_mul(11)
    }

    /// The job stopped (Ctrl-Z): a stopped job allocates nothing, and
    /// devlock, stopped with it, would keep the next budget on the device
    /// waiting for as long as the job stays stopped, past `--settle`.
    pub(crate) fn stopped(&mut self) -> Vec<Action> {
        if self.stepped_aside {
            return Vec::new();
        }
        self.stepped_aside = true;
        vec![Action::StepAside]
    }

    /// Looks once; returns what to do (at most a few per tick).
    pub(crate) fn check(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        if !self.stepped_aside && (self.monitor.settled() || self.started.elapsed() >= self.settle)
        {
            self.stepped_aside = true;
            actions.push(Action::StepAside);
        }
        let Some(used) = self.monitor.used_mib() else {
            return actions;
        };
        match (self.over(used), self.over_since) {
            (true, None) => {
                self.over_since = Some(Instant::now());
                if !self.warned && !self.quiet {
                    self.say(crate::messages::over_budget(
                        &self.resource,
                        &self.step,
                        used,
                        self.mem_mib,
                    ));
                }
                self.warned = true;
                actions.push(Action::Relabel(Some(used)));
            }
            (true, Some(since)) => {
                if self.strict && !self.stopped && since.elapsed() >= self.settle {
                    self.stopped = true;
                    self.say(format!(
                        "devlock: --mem-strict: {}: stopping {}: over budget ({} of {}) for {}\n",
                        self.resource,
                        crate::text::sanitize(&self.step),
                        memory::size(used),
                        memory::size(self.mem_mib),
                        humantime::format_duration(self.settle)
                    ));
                    actions.push(Action::Stop);
                }
            }
            (false, Some(_)) => {
                self.over_since = None;
                actions.push(Action::Relabel(None));
            }
            (false, None) => {}
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(strict: bool, settle: Duration) -> Watch {
        let monitor = Monitor {
            measures: Arc::new(Measures::default()),
        };
        Watch {
            strict,
            quiet: true,
            ..Watch::new(
                monitor,
                "gpu:0".parse().unwrap(),
                "job".into(),
                10_000,
                settle,
            )
        }
    }

    fn measure(w: &Watch, used: u64, settled: bool) {
        let m = &w.monitor.measures;
        m.used_mib.store(used, Ordering::Release);
        m.sampled.store(true, Ordering::Release);
        m.settled.store(settled, Ordering::Release);
    }

    #[test]
    fn a_job_steps_aside_once_settled_and_is_marked_over_past_a_tenth() {
        let mut w = watch(false, Duration::from_secs(3600));
        assert_eq!(w.check(), [], "nothing measured, not settled");
        measure(&w, 11_000, false);
        assert_eq!(w.check(), [], "10 % over is within");
        measure(&w, 11_001, true);
        assert_eq!(
            w.check(),
            [Action::StepAside, Action::Relabel(Some(11_001))]
        );
        assert_eq!(w.check(), [], "said once, stepped aside once");
        measure(&w, 9_000, true);
        assert_eq!(w.check(), [Action::Relabel(None)], "back under");
    }

    #[test]
    fn strict_stops_a_job_that_stays_over_for_the_settle_time() {
        let mut w = watch(true, Duration::ZERO);
        measure(&w, 20_000, false);
        assert_eq!(
            w.check(),
            [Action::StepAside, Action::Relabel(Some(20_000))]
        );
        assert_eq!(w.check(), [Action::Stop]);
        assert_eq!(w.check(), [], "stopped once");
        let mut lenient = watch(false, Duration::ZERO);
        measure(&lenient, 20_000, false);
        lenient.check();
        assert_eq!(lenient.check(), [], "without --mem-strict, only said");
    }

    #[test]
    fn for_the_library_what_the_watch_says_is_kept_not_written() {
        let mut w = watch(true, Duration::ZERO);
        w.quiet = false;
        w.told = Some(Vec::new());
        measure(&w, 20_000, false);
        w.check();
        w.check();
        let told = w.told.take().unwrap();
        assert_eq!(told.len(), 2, "{told:?}");
        assert!(
            told[0].starts_with("devlock: warning: gpu:0: job uses "),
            "{}",
            told[0]
        );
        assert!(
            told[1].starts_with("devlock: --mem-strict: gpu:0: stopping job: over budget ("),
            "{}",
            told[1]
        );
    }

    #[test]
    fn settling_allows_allocator_chunks() {
        assert_eq!(settle_delta(1024), 128);
        assert_eq!(settle_delta(20_480), 409);
    }
}
