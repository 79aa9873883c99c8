//! Who is in the way of a lock, in words: holders and waiters, the busy,
//! timeout, got and budget lines, from the status model's views.

use crate::error::Busy;
use crate::flock::dir::ScratchDir;
use crate::flock::file::Leased;
use crate::flock::in_the_way::InTheWay;
use crate::request::Request;
use crate::show::sanitize;
use crate::take::holder_of;
use crate::text::short_duration;
use crate::view::{Effect, Holder, HolderSource, ResourceView, WaiterSource, WaiterView};
use std::time::Duration;

/// `gpu:0 is busy: held by train (pid 4242, alice) for 5m03s`, naming
/// whoever is in the way in `view`: the holders, and those already in line
/// (who would go first), such as a request for the whole group queued
/// ahead.
pub(crate) fn busy(request: &Request, view: &ResourceView) -> String {
    let who = busy_phrase(view);
    let what = match &request.via {
        Some(member) => format!("{member} is busy, through its group {}", request.name),
        None => format!("{} is busy", request.name),
    };
    format!("{what}{who}")
}

/// `gpu is busy, through its member gpu:0: held by flock (pid 4242, alice)`:
/// a whole group's request that a holder of one member's file (plain
/// flock) keeps out.
pub(crate) fn busy_through_member(
    group: &crate::Resource,
    member: &Request,
    view: &ResourceView,
) -> String {
    format!(
        "{group} is busy, through its member {}{}",
        member.name,
        busy_phrase(view)
    )
}

/// `all of gpu:0, gpu:1 are busy: gpu:0 held by ...; gpu:1 held by ...`,
/// from each candidate's label and view.
pub(crate) fn all_busy(names: &[String], each: &[(String, ResourceView)]) -> String {
    let why: Vec<String> = each
        .iter()
        .map(|(label, view)| {
            let why = in_the_way(view, &view.waiters);
            format!("{label} {}", why.trim_start_matches(": "))
                .trim_end()
                .to_owned()
        })
        .collect();
    format!("all of {} are busy: {}", names.join(", "), why.join("; "))
}

/// `devlock: timed out after 10m waiting for gpu: held by ...` (with the
/// waiter's step where the line stays).
pub(crate) fn timed_out(
    waited: Duration,
    label: &str,
    in_the_way: &str,
    step: Option<&str>,
) -> String {
    let waited = humantime::format_duration(waited);
    let whose = step
        .map(|s| format!(" ({})", sanitize(s)))
        .unwrap_or_default();
    format!("devlock: timed out after {waited} waiting for {label}{in_the_way}{whose}\n")
}

/// The take's error when its wait ran out of `waited`: [`timed_out`]'s line
/// without `devlock: `, with who was in the way of which lock. One place for
/// the command line's `-w` and the library's timeout alike.
pub(crate) fn timed_out_busy(
    waited: Duration,
    label: &str,
    in_the_way: &str,
    step: Option<&str>,
    holder: Option<crate::error::Holder>,
    resource: String,
) -> Busy {
    let line = timed_out(waited, label, in_the_way, step);
    let line = line.trim_end_matches('\n');
    Busy {
        resource,
        holder,
        timed_out: true,
        message: line.strip_prefix("devlock: ").unwrap_or(line).to_owned(),
        in_the_way: Box::default(),
    }
}

/// `devlock: got gpu after 4s (train-b)`
pub(crate) fn got(label: &str, waited: Duration, step: &str) -> String {
    format!(
        "devlock: got {label} after {} ({})\n",
        short_duration(waited),
        sanitize(step)
    )
}

/// `ns-train (pid 4242, alice)`, `train (pid 4242, alice, inherited: its
/// devlock is gone) via gpu:0`.
pub(crate) fn holder_label(h: &Holder) -> String {
    let pid = h
        .pid
        .map_or("pid unknown".to_owned(), |p| format!("pid {p}"));
    let mut user = h
        .user
        .as_deref()
        .map(|u| format!(", {}", sanitize(u)))
        .unwrap_or_default();
    if h.stopped {
        user.push_str(", stopped");
    }
    if let Some(container) = &h.container {
        user.push_str(&format!(", in {}", sanitize(container)));
    }
    let inherited = if h.source == HolderSource::Inherited {
        ", inherited: its devlock is gone"
    } else {
        ""
    };
    let label = match (&h.step, &h.command) {
        (Some(step), _) => format!("{} ({pid}{user}{inherited})", sanitize(step)),
        (None, Some(cmd)) if h.source == HolderSource::NoRecord => {
            format!("{pid} ({}{user}, no record)", sanitize(&cmd.join(" ")))
        }
        _ => format!("an unknown holder ({pid}{user})"),
    };
    match &h.via {
        Some(via) => format!("{label} via {}", sanitize(via)),
        None => label,
    }
}

/// `block ended 3m ago, still 19.8 GiB on gpu:0`: a library hold kept past
/// its block's end because its process still uses the device.
pub(crate) fn kept_phrase(h: &Holder) -> Option<String> {
    let ago = short_duration(Duration::from_millis(h.kept_for_ms?));
    let still = match (h.kept_mib, h.kept_gpu) {
        (Some(mib), Some(gpu)) => format!(", still {} on gpu:{gpu}", crate::gpu::memory::size(mib)),
        (None, Some(gpu)) => format!(", still on gpu:{gpu}"),
        _ => ", still on its GPU".to_owned(),
    };
    Some(format!("block ended {ago} ago{still}"))
}

/// What the library says once when a block's end keeps its hold.
pub(crate) fn kept_after_block(names: &str, mib: Option<u64>, gpu: u32) -> String {
    let uses = match mib {
        Some(mib) => format!("{} on gpu:{gpu}", crate::gpu::memory::size(mib)),
        None => format!("memory on gpu:{gpu}"),
    };
    format!(
        "{names} is kept after the block's end: this process (or one it started) still uses \
         {uses}, and the lock goes when the driver no longer lists it (free it with \
         `del model; gc.collect(); torch.cuda.empty_cache()`, or end the process; \
         release=\"block\" lets go at the block's end)"
    )
}

pub(crate) fn held_for(h: &Holder) -> Option<String> {
    h.held_for_ms
        .map(|ms| short_duration(Duration::from_millis(ms)))
}

/// `ns-train (pid 4242, alice), held 5m03s`
pub(crate) fn holder_words(h: &Holder) -> String {
    let held = held_for(h)
        .map(|d| format!(", held {d}"))
        .unwrap_or_default();
    format!("{}{held}", holder_label(h))
}

/// The first holder's words, and how many more share the lock.
pub(crate) fn holders_words(view: &ResourceView) -> String {
    let Some(first) = view.holders.first() else {
        return String::new();
    };
    match view.holders.len() {
        1 => holder_words(first),
        n => format!("{} and {} more", holder_words(first), n - 1),
    }
}

/// `pid 77, bob`, or what stands for a process this user cannot see.
pub(crate) fn who(pid: Option<u32>, user: Option<&str>) -> String {
    match (pid, user) {
        (Some(pid), Some(user)) => format!("pid {pid}, {}", sanitize(user)),
        (Some(pid), None) => format!("pid {pid}"),
        _ => crate::proc::fdinfo::unseen_owner().to_owned(),
    }
}

/// `eval (pid 77, bob)`, `pid 77 (bob, no record)` for a process blocked
/// on the lock without a registration (util-linux flock), or `a place held
/// by pid 77, mallory, not a registered devlock` for a place in line that
/// no devlock registered; `, stopped` when it is.
pub(crate) fn waiter_label(w: &WaiterView) -> String {
    let stopped = if w.stopped { ", stopped" } else { "" };
    if w.source == WaiterSource::Unregistered {
        return format!(
            "a place held by {}{stopped}, not a registered devlock",
            who(w.pid, w.user.as_deref())
        );
    }
    let pid = w
        .pid
        .map_or("pid unknown".to_owned(), |p| format!("pid {p}"));
    let user = w
        .user
        .as_deref()
        .map(|u| format!(", {}", sanitize(u)))
        .unwrap_or_default();
    match &w.step {
        Some(step) => format!("{} ({pid}{user}{stopped})", sanitize(step)),
        None => format!(
            "{pid} ({}{stopped}, no record)",
            user.trim_start_matches(", ")
        ),
    }
}

/// The first waiter ahead, and how many more.
pub(crate) fn waiters_words(first: &WaiterView, ahead: &[WaiterView]) -> String {
    match ahead.len() {
        0 | 1 => waiter_label(first),
        n => format!("{} and {} more", waiter_label(first), n - 1),
    }
}

/// What stands in the way of one lock, in parts: the holders (`held by
/// ns-train (pid 4242, alice) for 5m03s`), the devlocks and flock callers
/// `ahead` in line (`eval (pid 77, bob) waits in line first`), and what is
/// not devlock's: places in line among `ahead` that nobody registered, and
/// locks on the queue file that hold the line up.
pub(crate) fn obstacles(
    view: &ResourceView,
    ahead: &[WaiterView],
) -> (Option<String>, Vec<String>) {
    let held = view.holders.first().map(|h| {
        let held = match kept_phrase(h) {
            Some(kept) => format!(": {kept}"),
            None => held_for(h).map(|d| format!(" for {d}")).unwrap_or_default(),
        };
        let note = h
            .note
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        let more = match view.holders.len() {
            1 => String::new(),
            n => format!(" and by {} more", n - 1),
        };
        format!("held by {}{held}{note}{more}", holder_label(h))
    });
    let mut line = Vec::new();
    let known: Vec<WaiterView> = ahead
        .iter()
        .filter(|w| w.source != WaiterSource::Unregistered)
        .cloned()
        .collect();
    if let Some(first) = known.first() {
        let waits = if known.len() > 1 { "wait" } else { "waits" };
        line.push(format!(
            "{} {waits} in line first",
            waiters_words(first, &known)
        ));
    }
    for w in ahead
        .iter()
        .filter(|w| w.source == WaiterSource::Unregistered)
    {
        let stopped = if w.stopped { ", stopped" } else { "" };
        line.push(format!(
            "a place in line held by {}{stopped}, not a registered devlock",
            who(w.pid, w.user.as_deref())
        ));
    }
    for l in view
        .foreign_locks
        .iter()
        .filter(|l| l.effect != Effect::None)
    {
        line.push(format!(
            "a lock that is not devlock's on bytes {} of {} ({}) {}",
            l.range,
            sanitize(&l.path),
            who(l.pid, l.user.as_deref()),
            l.effect.words()
        ));
    }
    (held, line)
}

/// `: held by ns-train (pid 4242, alice) for 5m03s`, `; eval (pid 77, bob)
/// waits in line first` when someone is ahead in line, what else holds the
/// line up (a place or a lock that is not devlock's), or nothing when the
/// way is clear.
pub(crate) fn in_the_way(view: &ResourceView, ahead: &[WaiterView]) -> String {
    let (held, line) = obstacles(view, ahead);
    let parts: Vec<String> = held.into_iter().chain(line).collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(": {}", parts.join("; "))
    }
}

/// For `-n`, where everyone in line is ahead: [`in_the_way`], or when
/// nobody holds the lock but the line is not empty, `: 2 already waiting in
/// line (...)` with who they are.
pub(crate) fn busy_phrase(view: &ResourceView) -> String {
    if !view.holders.is_empty() || view.waiters.is_empty() {
        return in_the_way(view, &view.waiters);
    }
    let (_, line) = obstacles(view, &view.waiters);
    let who = if line.is_empty() {
        String::new()
    } else {
        format!(" ({})", line.join("; "))
    };
    format!(": {} already waiting in line{who}", view.waiters.len())
}

/// `gpu:0: 60 GiB of 80 GiB budgeted (eval 20 GiB, eval 20 GiB, …), 12 GiB
/// outside the gate; 30 GiB asked, 2 GiB headroom`: the figures a `--mem`
/// request is admitted or refused on, for `-n`, `-w` and the waiting line.
pub(crate) fn budget_figures(
    resource: &crate::resource::Resource,
    room: &crate::gpu::memory::Room,
    ask_mib: u64,
    headroom_mib: u64,
) -> String {
    use crate::gpu::memory::size;
    const SHOWN: usize = 4;
    let mut each: Vec<String> = room
        .budgets
        .iter()
        .take(SHOWN)
        .map(|m| {
            let over = if m.used_mib > m.budget.mem_mib {
                format!(", using {}", size(m.used_mib))
            } else {
                String::new()
            };
            format!(
                "{} {}{over}",
                sanitize(&m.budget.step),
                size(m.budget.mem_mib)
            )
        })
        .collect();
    if room.budgets.len() > SHOWN {
        each.push("…".to_owned());
    }
    let list = if each.is_empty() {
        String::new()
    } else {
        format!(" ({})", each.join(", "))
    };
    format!(
        "{resource}: {} of {} budgeted{list}, {} outside the gate; {} asked, {} headroom",
        size(room.budgeted_mib()),
        size(room.total_mib),
        size(room.used_outside_mib),
        size(ask_mib),
        size(headroom_mib),
    )
}

/// `-n` with `--mem` on a device without room: what is in the way, in figures.
pub(crate) fn no_room(figures: &str) -> String {
    format!("no room for this budget on {figures}")
}

/// What a wait for room waits on, in words: a budget's figures
/// ([`budget_figures`]), or the backend's line; nothing yet is empty.
pub(crate) fn room_note(note: &crate::flock::wait::RoomNote) -> String {
    use crate::flock::wait::RoomNote;
    match note {
        RoomNote::Nothing => String::new(),
        RoomNote::Figures {
            resource,
            room,
            ask_mib,
            headroom_mib,
        } => budget_figures(resource, room, *ask_mib, *headroom_mib),
        RoomNote::Said(line) => line.clone(),
    }
}

/// `warning: gpu:0: eval uses 27 GiB of its 20 GiB budget`
pub(crate) fn over_budget(
    resource: &crate::resource::Resource,
    step: &str,
    used: u64,
    mem: u64,
) -> String {
    use crate::gpu::memory::size;
    format!(
        "devlock: warning: {resource}: {} uses {} of its {} budget (over budget: other jobs on the device may run out of memory)\n",
        sanitize(step),
        size(used),
        size(mem)
    )
}

/// `-n --mem` behind a job that is starting: `gpu:0 is busy: eval (pid
/// 4242, alice) is starting under its 20 GiB budget; the next budget waits
/// until its memory stops growing (at most --settle)`
pub(crate) fn budget_starting(resource: &crate::resource::Resource, starter: &Holder) -> String {
    let budget = starter
        .mem_mib
        .map(|m| format!(" under its {} budget", crate::gpu::memory::size(m)))
        .unwrap_or_default();
    format!(
        "{resource} is busy: {} is starting{budget}; the next budget waits until its memory \
         stops growing (at most its --settle)",
        holder_label(starter)
    )
}

/// A busy lock as the backend made it (what is in the way, as data, and a
/// plain line) in the command line's words, naming the first holder in the
/// way (a member taken for its group's take in the group's words), on the
/// same [`Busy`]; a lease met where no wait for it is made is busy too;
/// anything else as it is.
pub(crate) fn worded(dir: &ScratchDir, err: anyhow::Error) -> anyhow::Error {
    // A lease met where no wait for it is made (an `--any` candidate's or
    // a slot's file): busy, as everywhere else.
    let err = match err.downcast::<Leased>() {
        Ok(leased) => {
            let resource = crate::flock::trust::resource_of(&leased.name)
                .map_or_else(|| leased.name.clone(), |r| r.to_string());
            return leased.into_busy(&resource);
        }
        Err(err) => err,
    };
    // What is said already (a stranger's lock, etcd's) stays as it is.
    let to_word = err
        .downcast_ref::<Busy>()
        .is_some_and(|busy| !matches!(*busy.in_the_way, InTheWay::Said));
    if !to_word {
        return err;
    }
    let mut busy = match err.downcast::<Busy>() {
        Ok(busy) => busy,
        Err(err) => return err,
    };
    let (holder, message) = words(dir, &busy.in_the_way);
    busy.holder = holder;
    busy.message = message;
    anyhow::Error::new(busy)
}

/// The first holder in the way, and the line, of what the backend found.
fn words(dir: &ScratchDir, in_the_way: &InTheWay) -> (Option<crate::error::Holder>, String) {
    let first = |view: &ResourceView| view.holders.first().map(holder_of);
    match in_the_way {
        InTheWay::Lock {
            request,
            lock,
            budget,
            group,
        } => {
            let view = crate::view::describe(lock, dir, &request.name);
            let starter = view.holders.iter().find(|h| h.starting == Some(true));
            let message = match (starter, group) {
                (Some(starter), _) if *budget => budget_starting(&request.name, starter),
                (_, Some(group)) => busy_through_member(group, request, &view),
                _ => busy(request, &view),
            };
            (first(&view), message)
        }
        InTheWay::Any { names, each } => {
            let each: Vec<(String, ResourceView)> = each
                .iter()
                .map(|(label, resource, lock)| {
                    (label.clone(), crate::view::describe(lock, dir, resource))
                })
                .collect();
            (None, all_busy(names, &each))
        }
        InTheWay::NoRoom { figures, lock, .. } => {
            let each: Vec<String> = figures.iter().map(room_note).collect();
            let holder = lock.as_ref().and_then(|(request, lock)| {
                first(&crate::view::describe(lock, dir, &request.name))
            });
            (holder, no_room(&each.join("; ")))
        }
        InTheWay::Said => (None, String::new()),
    }
}
