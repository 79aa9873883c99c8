//! A contended wait: the main thread sleeps in flock(2) while a helper thread
//! shows the wait, enforces the timeout and answers signals.
//!
//! What it shows depends on where stderr goes. On a terminal whose line is
//! devlock's (its process group is the foreground group, and holds nothing
//! else, so no other devlock of the same job draws there), one line redrawn
//! in place, fitted to the terminal's width (asked again on every redraw
//! and on SIGWINCH) and cleared before the command starts. On a terminal
//! that is not devlock's to draw on (a background job, `make -j`), one line
//! when the wait starts and one when it ends. Elsewhere (a log), a line when
//! the wait starts, every `--report-every`, and when it ends. Every line
//! that stays names the waiter's own step.

use std::io::Write;
use std::os::unix::thread::JoinHandleExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::exit::ExitCode;
use crate::lockfile::LockFile;
use crate::resource::Resource;
use crate::scratch::ScratchDir;
use crate::status::{self, ResourceView, WaiterView};
use crate::supervise::{self, Received};
use crate::text::{fit, ordinal, sanitize, short_duration};
use crate::tty;
use crate::waiters::Registration;

const WAITING: u8 = 0;
const ACQUIRED: u8 = 1;
const GAVE_UP: u8 = 2;
/// The wait ended without the locks (a job stop, an error): the helper
/// clears its display and ends.
const LEFT: u8 = 3;

/// Width assumed for a terminal that does not say.
const DEFAULT_COLUMNS: usize = 80;

/// How to wait and what to show meanwhile.
#[derive(Debug, Clone)]
pub struct WaitPlan {
    pub deadline: Option<Instant>,
    pub timeout: Option<Duration>,
    pub quiet: bool,
    /// Whether stderr is a terminal (where the line may be devlock's).
    pub on_terminal: bool,
    pub report_every: Duration,
    pub conflict_code: ExitCode,
    /// The waiter's own step, which every line that stays names.
    pub step: String,
}

/// How a wait is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Display {
    /// Redrawn in place on a terminal line that is devlock's.
    Live,
    /// On a terminal shared with others: a line at the start and the end.
    Static,
    /// Not a terminal: a line at the start, every interval, and the end.
    Log,
}

impl Display {
    /// Asked only once a wait begins: an uncontended take never pays for
    /// the look at the process group.
    fn for_plan(plan: &WaitPlan) -> Display {
        if !plan.on_terminal {
            Display::Log
        } else if tty::in_foreground(2) && tty::alone_in_group() {
            Display::Live
        } else {
            Display::Static
        }
    }
}

/// After a job stop (Ctrl-Z) gave up the line and the job was continued:
/// `devlock: continued; back in line for gpu:0, at the end`, by the rules
/// of the waiting lines (nothing with `-q`; fitted to a terminal; naming the
/// waiter's step where the line stays, on a shared terminal or in a log).
pub fn say_back_in_line(plan: &WaitPlan, resources: &str) {
    if plan.quiet {
        return;
    }
    let display = Display::for_plan(plan);
    let step = (display != Display::Live).then(|| format!(" ({})", sanitize(&plan.step)));
    let resources = format!(" for {resources}");
    let parts = [
        ("devlock: continued; back in line", false),
        (resources.as_str(), true),
        (", at the end", true),
        (step.as_deref().unwrap_or_default(), false),
    ];
    let line = match display {
        Display::Log => parts.iter().map(|(p, _)| *p).collect(),
        Display::Live | Display::Static => {
            let width = tty::columns(2).unwrap_or(DEFAULT_COLUMNS).saturating_sub(1);
            fit(&parts, width.max(1))
        }
    };
    say(&format!("{line}\n"));
}

/// Runs `block` (which sleeps in the kernel until the locks are ours) on
/// this thread while a helper thread shows the wait, enforces the deadline
/// and watches for stopping signals. A timeout or a stopping signal while
/// waiting ends the process from the helper thread: nothing has started yet,
/// so nothing is left running, and the kernel drops every lock and place in
/// line. Settle the returned [`Waited`] to learn of a stopping signal that
/// arrived at the very moment the locks were taken.
pub fn wait_for<T>(
    label: String,
    watches: Vec<Watch>,
    registrations: Vec<Option<Registration>>,
    plan: &WaitPlan,
    block: impl FnOnce() -> Result<T>,
) -> Result<(T, Waited)> {
    if plan.quiet && plan.deadline.is_none() {
        // Nothing to show and no deadline: no helper thread. A stopping
        // signal may simply end devlock while it waits (nothing has started,
        // and the kernel drops every lock and place in line); it is blocked
        // again before anything starts.
        supervise::unblock_stop_signals();
        let held = {
            let _stops = crate::interrupt::CatchJobStops::new();
            block()
        };
        supervise::block_handled_signals();
        drop(registrations);
        return Ok((held?, Waited::default()));
    }
    let state = Arc::new(AtomicU8::new(WAITING));
    let started = Instant::now();
    let display = Display::for_plan(plan);
    let shown = Shown { label, watches };
    let helper = {
        let state = state.clone();
        let plan = plan.clone();
        std::thread::Builder::new()
            .name("devlock-wait".into())
            .stack_size(256 * 1024)
            .spawn(move || helper(shown, registrations, state, started, plan, display))?
    };
    let held = {
        // Job stops reach this thread only (the helper keeps them held), and
        // interrupt its lock call.
        let _stops = crate::interrupt::CatchJobStops::new();
        block()
    };
    let held = match held {
        Ok(held) => held,
        Err(e) => {
            if state
                .compare_exchange(WAITING, LEFT, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // The helper gave up first and is ending the process.
                loop {
                    std::thread::park();
                }
            }
            // SAFETY: as below; the helper then sees LEFT and ends, taking
            // its display and the registrations with it.
            unsafe { libc::pthread_kill(helper.as_pthread_t(), supervise::wake_signal()) };
            let _ = helper.join();
            return Err(e);
        }
    };
    if state
        .compare_exchange(WAITING, ACQUIRED, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // The helper gave up first and is ending the process; it must not
        // look as if the command ran.
        loop {
            std::thread::park();
        }
    }
    // SAFETY: the helper is alive until joined, and has the wake signal
    // blocked (every thread has), so it only ends its sigtimedwait.
    unsafe { libc::pthread_kill(helper.as_pthread_t(), supervise::wake_signal()) };
    Ok((
        held,
        Waited {
            helper: Some(helper),
            // On a terminal (live or shared) the last line, "got ..." or
            // the cleared live line, comes before the command's own output;
            // in a log the command may start first (hand-off latency).
            on_terminal: display != Display::Log && !plan.quiet,
        },
    ))
}

/// A wait that is over but whose helper thread may still be finishing.
#[derive(Debug, Default)]
pub struct Waited {
    helper: Option<std::thread::JoinHandle<Option<Received>>>,
    on_terminal: bool,
}

impl Waited {
    /// Whether the helper still has to finish its lines on a terminal
    /// (clear the live line, or say "got"), which must happen before the
    /// command writes to it.
    pub fn must_settle_before_spawn(&self) -> bool {
        self.helper.is_some() && self.on_terminal
    }

    /// Joins the helper; returns a stopping signal it caught at the moment
    /// the locks were taken, for the command to hear.
    pub fn settle(self) -> Option<Received> {
        self.helper.and_then(|h| h.join().unwrap_or(None))
    }
}

/// What the waiting display looks at: its own handles on one lock waited
/// for (and its line), so a redraw costs a few reads, not a directory walk.
#[derive(Debug)]
pub struct Watch {
    pub dir: ScratchDir,
    pub resource: Resource,
    pub lock: LockFile,
    /// Our place in line, when we have one.
    pub ticket: Option<u64>,
    /// What the lines call it: the resource, or for a group taken on a
    /// member's behalf, the member with its group.
    pub label: String,
}

/// Who stands in the way of one watched lock, as of now.
struct Seen {
    view: ResourceView,
    /// Registered waiters ahead of us in line, nearest the front first.
    ahead: Vec<WaiterView>,
    /// 1 for the first in line.
    place: Option<usize>,
}

impl Watch {
    fn seen(&self) -> Seen {
        let place = self.ticket.and_then(|ticket| {
            let name = self.resource.file_name();
            crate::queue::count_ahead(&self.dir, &name, ticket)
                .ok()
                .map(|n| n + 1)
        });
        // Naming who is ahead needs the registrations; only read them when
        // somebody is.
        if place.is_some_and(|p| p > 1) {
            let view = status::describe(&self.lock, &self.dir, &self.resource);
            let me = std::process::id();
            let ahead: Vec<WaiterView> = match view.waiters.iter().position(|w| w.pid == Some(me)) {
                Some(mine) => view.waiters[..mine].to_vec(),
                None => view
                    .waiters
                    .iter()
                    .take(place.unwrap_or(1) - 1)
                    .cloned()
                    .collect(),
            };
            return Seen { view, ahead, place };
        }
        Seen {
            view: status::describe_holders(&self.lock, &self.dir, &self.resource),
            ahead: Vec::new(),
            place,
        }
    }
}

struct Shown {
    label: String,
    watches: Vec<Watch>,
}

impl Shown {
    /// The waiting line in parts: what the line may shrink (who is in the
    /// way) and what it keeps (how long, which place, whose step).
    fn parts(&self, waited: Duration, step: Option<&str>) -> Vec<(String, bool)> {
        let mut parts = vec![(
            format!(
                "devlock: {} · waiting {}",
                self.label,
                short_duration(waited)
            ),
            false,
        )];
        match &self.watches[..] {
            [] => {}
            [watch] => {
                let seen = watch.seen();
                if let Some(h) = seen.view.holders.first() {
                    let ancestor = if h.pid.is_some_and(is_ancestor) {
                        " — an ancestor of this devlock: if it is the job this runs in, it did \
                         not pass its lock down (Python: close_fds=False) and this wait will \
                         not end"
                    } else {
                        ""
                    };
                    parts.push((
                        format!(" for {}{ancestor}", holders_words(&seen.view)),
                        true,
                    ));
                }
                if let Some(first) = seen.ahead.first() {
                    parts.push((
                        format!(" · behind {}", waiters_words(first, &seen.ahead)),
                        true,
                    ));
                }
                if let Some(place) = seen.place {
                    parts.push((format!(" · {} in line", ordinal(place)), false));
                }
            }
            several => {
                let each: Vec<String> = several
                    .iter()
                    .map(|watch| {
                        let seen = watch.seen();
                        let who = match (seen.view.holders.first(), seen.ahead.first()) {
                            (Some(_), _) => holders_words(&seen.view),
                            (None, Some(first)) => {
                                format!("behind {}", waiters_words(first, &seen.ahead))
                            }
                            (None, None) => "in line".to_owned(),
                        };
                        format!("{}: {who}", watch.label)
                    })
                    .collect();
                parts.push((format!(" · {}", each.join("; ")), true));
            }
        }
        if let Some(step) = step {
            parts.push((format!(" ({})", sanitize(step)), false));
        }
        parts
    }

    /// `: held by ... for 5m03s` for each lock waited for, for the timeout.
    fn in_the_way(&self) -> String {
        match &self.watches[..] {
            [] => String::new(),
            [watch] => {
                let seen = watch.seen();
                in_the_way(&seen.view, &seen.ahead)
            }
            several => {
                let each: Vec<String> = several
                    .iter()
                    .map(|watch| {
                        let seen = watch.seen();
                        let why = in_the_way(&seen.view, &seen.ahead);
                        format!("{} {}", watch.label, why.trim_start_matches(": "))
                    })
                    .collect();
                format!(": {}", each.join("; "))
            }
        }
    }
}

fn helper(
    shown: Shown,
    registration: Vec<Option<Registration>>,
    state: Arc<AtomicU8>,
    started: Instant,
    plan: WaitPlan,
    display: Display,
) -> Option<Received> {
    let tick = match display {
        Display::Live => Duration::from_secs(1),
        Display::Log => plan.report_every,
        // One line at the start: the deadline is the only other reason to wake.
        Display::Static => Duration::from_secs(86_400),
    };
    let step = (display != Display::Live).then_some(plan.step.as_str());
    let mut next_report = started;
    // A live line is on the screen, on the row the cursor is on.
    let mut drawn = false;
    // The live line was lost (devlock went to the background): its end is
    // said as on a shared terminal.
    let mut lost = false;
    loop {
        let now = Instant::now();
        if !plan.quiet && now >= next_report {
            let parts = shown.parts(now - started, step);
            let parts: Vec<(&str, bool)> = parts.iter().map(|(p, s)| (p.as_str(), *s)).collect();
            match display {
                Display::Live if tty::in_foreground(2) => {
                    // One column short of the edge: a line that ends in the
                    // last column leaves some terminals waiting to wrap.
                    let width = tty::columns(2).unwrap_or(DEFAULT_COLUMNS).saturating_sub(1);
                    say(&format!("\r\x1b[K{}", fit(&parts, width.max(1))));
                    drawn = true;
                    lost = false;
                }
                Display::Live => {
                    // In the background now: whatever row the line was on,
                    // the cursor has moved on; never draw over a prompt.
                    if drawn {
                        lost = true;
                    }
                    drawn = false;
                }
                Display::Static => {
                    let width = tty::columns(2).unwrap_or(DEFAULT_COLUMNS).saturating_sub(1);
                    say(&format!("{}\n", fit(&parts, width.max(1))));
                }
                Display::Log => {
                    let line: String = parts.iter().map(|(p, _)| *p).collect();
                    say(&format!("{line}\n"));
                }
            }
            next_report = now
                .checked_add(tick)
                .unwrap_or(now + Duration::from_secs(86_400));
        }
        if let Some(deadline) = plan.deadline
            && now >= deadline
            && give_up(&state)
        {
            clear(&mut drawn);
            if !plan.quiet {
                let waited = humantime::format_duration(plan.timeout.unwrap_or_default());
                let whose = step
                    .map(|s| format!(" ({})", sanitize(s)))
                    .unwrap_or_default();
                say(&format!(
                    "devlock: timed out after {waited} waiting for {}{}{whose}\n",
                    shown.label,
                    shown.in_the_way()
                ));
            }
            drop(registration);
            std::process::exit(plan.conflict_code.code());
        }
        let mut until = if plan.quiet {
            now + Duration::from_secs(3600)
        } else {
            next_report
        };
        if let Some(deadline) = plan.deadline {
            until = until.min(deadline);
        }
        let signal = supervise::wait_stop_or_wake(until.saturating_duration_since(Instant::now()));
        if signal.is_some_and(|s| s.signo == libc::SIGWINCH) {
            // The terminal changed size: redraw now, to the new width.
            if display == Display::Live && state.load(Ordering::Acquire) == WAITING {
                next_report = Instant::now();
            }
            continue;
        }
        let stop = signal.filter(|s| s.signo != supervise::wake_signal());
        if state.load(Ordering::Acquire) == LEFT {
            clear(&mut drawn);
            return None;
        }
        if state.load(Ordering::Acquire) == ACQUIRED {
            clear(&mut drawn);
            if !plan.quiet && (display != Display::Live || lost) {
                let whose = format!(" ({})", sanitize(&plan.step));
                say(&format!(
                    "devlock: got {} after {}{whose}\n",
                    shown.label,
                    short_duration(started.elapsed())
                ));
            }
            return stop;
        }
        if let Some(sig) = stop {
            if give_up(&state) {
                clear(&mut drawn);
                drop(registration);
                std::process::exit(ExitCode::Signal(sig.signo).code());
            }
            // The locks were taken at this very moment: the command must hear it.
            clear(&mut drawn);
            return Some(sig);
        }
    }
}

/// One write per line, so lines from several processes never interleave.
fn say(text: &str) {
    let _ = std::io::stderr().write_all(text.as_bytes());
}

fn give_up(state: &AtomicU8) -> bool {
    state
        .compare_exchange(WAITING, GAVE_UP, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

/// Clears the live line if it is on the screen.
fn clear(drawn: &mut bool) {
    if std::mem::take(drawn) {
        say("\r\x1b[K");
    }
}

fn is_ancestor(pid: u32) -> bool {
    crate::procfs::ancestors(std::process::id()).any(|(ancestor, _)| ancestor == pid)
}

/// `ns-train (pid 4242, alice)`, `train (pid 4242, alice, inherited: its
/// devlock is gone) via gpu:0`.
fn holder_label(h: &status::Holder) -> String {
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
    let inherited = if h.source == "inherited" {
        ", inherited: its devlock is gone"
    } else {
        ""
    };
    let label = match (&h.step, &h.command) {
        (Some(step), _) => format!("{} ({pid}{user}{inherited})", sanitize(step)),
        (None, Some(cmd)) if h.source == "no-record" => {
            format!("{pid} ({}{user}, no record)", sanitize(&cmd.join(" ")))
        }
        _ => format!("an unknown holder ({pid}{user})"),
    };
    match &h.via {
        Some(via) => format!("{label} via {}", sanitize(via)),
        None => label,
    }
}

fn held_for(h: &status::Holder) -> Option<String> {
    h.held_for_ms
        .map(|ms| short_duration(Duration::from_millis(ms)))
}

/// `ns-train (pid 4242, alice), held 5m03s`
pub fn holder_words(h: &status::Holder) -> String {
    let held = held_for(h)
        .map(|d| format!(", held {d}"))
        .unwrap_or_default();
    format!("{}{held}", holder_label(h))
}

/// The first holder's words, and how many more share the lock.
fn holders_words(view: &ResourceView) -> String {
    let Some(first) = view.holders.first() else {
        return String::new();
    };
    match view.holders.len() {
        1 => holder_words(first),
        n => format!("{} and {} more", holder_words(first), n - 1),
    }
}

/// `pid 77, bob`, or what stands for a process this user cannot see.
fn who(pid: Option<u32>, user: Option<&str>) -> String {
    match (pid, user) {
        (Some(pid), Some(user)) => format!("pid {pid}, {}", sanitize(user)),
        (Some(pid), None) => format!("pid {pid}"),
        _ => "a process this user cannot see".to_owned(),
    }
}

/// `eval (pid 77, bob)`, `pid 77 (bob, no record)` for a process blocked
/// on the lock without a registration (util-linux flock), or `a place held
/// by pid 77, mallory, not a registered devlock` for a place in line that
/// no devlock registered; `, stopped` when it is.
fn waiter_label(w: &WaiterView) -> String {
    let stopped = if w.stopped { ", stopped" } else { "" };
    if w.source == "unregistered" {
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
fn waiters_words(first: &WaiterView, ahead: &[WaiterView]) -> String {
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
fn obstacles(view: &ResourceView, ahead: &[WaiterView]) -> (Option<String>, Vec<String>) {
    let held = view.holders.first().map(|h| {
        let held = held_for(h).map(|d| format!(" for {d}")).unwrap_or_default();
        let note = h.note.map(|n| format!(" ({n})")).unwrap_or_default();
        let more = match view.holders.len() {
            1 => String::new(),
            n => format!(" and by {} more", n - 1),
        };
        format!("held by {}{held}{note}{more}", holder_label(h))
    });
    let mut line = Vec::new();
    let known: Vec<WaiterView> = ahead
        .iter()
        .filter(|w| w.source != "unregistered")
        .cloned()
        .collect();
    if let Some(first) = known.first() {
        let waits = if known.len() > 1 { "wait" } else { "waits" };
        line.push(format!(
            "{} {waits} in line first",
            waiters_words(first, &known)
        ));
    }
    for w in ahead.iter().filter(|w| w.source == "unregistered") {
        let stopped = if w.stopped { ", stopped" } else { "" };
        line.push(format!(
            "a place in line held by {}{stopped}, not a registered devlock",
            who(w.pid, w.user.as_deref())
        ));
    }
    for l in view.foreign_locks.iter().filter(|l| l.effect != "none") {
        line.push(format!(
            "a lock that is not devlock's on bytes {} of {} ({}) {}",
            l.range,
            sanitize(&l.path),
            who(l.pid, l.user.as_deref()),
            l.effect
        ));
    }
    (held, line)
}

/// `: held by ns-train (pid 4242, alice) for 5m03s`, `; eval (pid 77, bob)
/// waits in line first` when someone is ahead in line, what else holds the
/// line up (a place or a lock that is not devlock's), or nothing when the
/// way is clear.
pub fn in_the_way(view: &ResourceView, ahead: &[WaiterView]) -> String {
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
pub fn busy_phrase(view: &ResourceView) -> String {
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
