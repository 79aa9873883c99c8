//! A contended wait: the main thread sleeps in flock(2) while a helper thread
//! shows the wait, enforces the timeout and answers signals.

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
use crate::status::{self, ResourceView};
use crate::supervise::{self, Received};
use crate::text::{ordinal, sanitize, short_duration};
use crate::waiters::Registration;

const WAITING: u8 = 0;
const ACQUIRED: u8 = 1;
const GAVE_UP: u8 = 2;

/// How to wait and what to show meanwhile.
#[derive(Debug, Clone)]
pub struct WaitPlan {
    pub deadline: Option<Instant>,
    pub timeout: Option<Duration>,
    pub quiet: bool,
    pub live: bool,
    pub report_every: Duration,
    pub conflict_code: ExitCode,
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
    watch: Option<Watch>,
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
        let held = block();
        supervise::block_handled_signals();
        drop(registrations);
        return Ok((held?, Waited::default()));
    }
    let state = Arc::new(AtomicU8::new(WAITING));
    let started = Instant::now();
    let shown = Shown { label, watch };
    let helper = {
        let state = state.clone();
        let plan = plan.clone();
        std::thread::Builder::new()
            .name("devlock-wait".into())
            .stack_size(256 * 1024)
            .spawn(move || helper(shown, registrations, state, started, plan))?
    };
    let held = block()?;
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
            live: plan.live && !plan.quiet,
        },
    ))
}

/// A wait that is over but whose helper thread may still be finishing.
#[derive(Debug, Default)]
pub struct Waited {
    helper: Option<std::thread::JoinHandle<Option<Received>>>,
    live: bool,
}

impl Waited {
    /// Whether the helper still has to clear a live line off the terminal
    /// (which must happen before the command writes to it).
    pub fn must_settle_before_spawn(&self) -> bool {
        self.helper.is_some() && self.live
    }

    /// Joins the helper; returns a stopping signal it caught at the moment
    /// the locks were taken, for the command to hear.
    pub fn settle(self) -> Option<Received> {
        self.helper.and_then(|h| h.join().unwrap_or(None))
    }
}

/// What the waiting display looks at: its own handles on the lock (and the
/// line), so a redraw costs a few reads, not a directory walk.
#[derive(Debug)]
pub struct Watch {
    pub dir: ScratchDir,
    pub resource: Resource,
    pub lock: LockFile,
    /// Our place in line, when we have one.
    pub ticket: Option<u64>,
}

struct Shown {
    label: String,
    watch: Option<Watch>,
}

impl Shown {
    fn view(&self) -> Option<ResourceView> {
        let w = self.watch.as_ref()?;
        Some(status::describe_holders(&w.lock, &w.dir, &w.resource))
    }

    /// 1 for the first in line: the live tickets ahead of ours, plus one.
    fn place(&self) -> Option<usize> {
        let w = self.watch.as_ref()?;
        let ahead = crate::queue::count_ahead(&w.dir, &w.resource.file_name(), w.ticket?).ok()?;
        Some(ahead + 1)
    }
}

fn helper(
    shown: Shown,
    registration: Vec<Option<Registration>>,
    state: Arc<AtomicU8>,
    started: Instant,
    plan: WaitPlan,
) -> Option<Received> {
    let tick = if plan.live {
        Duration::from_secs(1)
    } else {
        plan.report_every
    };
    let mut next_report = started;
    loop {
        let now = Instant::now();
        if !plan.quiet && now >= next_report {
            let line = waiting_line(&shown, now - started);
            if plan.live {
                say(&format!("\r\x1b[K{line}"));
            } else {
                say(&format!("{line}\n"));
            }
            next_report = now
                .checked_add(tick)
                .unwrap_or(now + Duration::from_secs(86_400));
        }
        if let Some(deadline) = plan.deadline
            && now >= deadline
            && give_up(&state)
        {
            clear_live(&plan);
            if !plan.quiet {
                let holder = shown.view().map(|v| holder_phrase(&v)).unwrap_or_default();
                let waited = humantime::format_duration(plan.timeout.unwrap_or_default());
                say(&format!(
                    "devlock: timed out after {waited} waiting for {}{holder}\n",
                    shown.label
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
        let stop = signal.filter(|s| s.signo != supervise::wake_signal());
        if state.load(Ordering::Acquire) == ACQUIRED {
            clear_live(&plan);
            if !plan.quiet && !plan.live {
                say(&format!(
                    "devlock: got {} after {}\n",
                    shown.label,
                    short_duration(started.elapsed())
                ));
            }
            return stop;
        }
        if let Some(sig) = stop {
            if give_up(&state) {
                clear_live(&plan);
                drop(registration);
                std::process::exit(ExitCode::Signal(sig.signo).code());
            }
            // The locks were taken at this very moment: the command must hear it.
            clear_live(&plan);
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

fn clear_live(plan: &WaitPlan) {
    if plan.live && !plan.quiet {
        say("\r\x1b[K");
    }
}

fn waiting_line(shown: &Shown, waited: Duration) -> String {
    let view = shown.view();
    let holder = view
        .as_ref()
        .and_then(|v| v.holders.first())
        .map(|h| {
            let ancestor = if h.pid.is_some_and(is_ancestor) {
                " — an ancestor of this devlock: if it is the job this runs in, it did not \
                 pass its lock down (Python: close_fds=False) and this wait will not end"
            } else {
                ""
            };
            format!(" for {}{ancestor}", holder_words(h))
        })
        .unwrap_or_default();
    let place = shown
        .place()
        .map(|n| format!(" · {} in line", ordinal(n)))
        .unwrap_or_default();
    format!(
        "devlock: {} · waiting {}{holder}{place}",
        shown.label,
        short_duration(waited)
    )
}

fn is_ancestor(pid: u32) -> bool {
    crate::procfs::ancestors(std::process::id()).any(|(ancestor, _)| ancestor == pid)
}

/// `ns-train (pid 4242, alice)`
fn holder_label(h: &status::Holder) -> String {
    let pid = h
        .pid
        .map_or("pid unknown".to_owned(), |p| format!("pid {p}"));
    let user = h
        .user
        .as_deref()
        .map(|u| format!(", {}", sanitize(u)))
        .unwrap_or_default();
    match (&h.step, &h.command) {
        (Some(step), _) => format!("{} ({pid}{user})", sanitize(step)),
        (None, Some(cmd)) if h.source == "no-record" => {
            format!("{pid} ({}{user}, no record)", sanitize(&cmd.join(" ")))
        }
        _ => format!("an unknown holder ({pid}{user})"),
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

/// `: held by ns-train (pid 4242, alice) for 5m03s`, or nothing when free.
pub fn holder_phrase(view: &ResourceView) -> String {
    match view.holders.first() {
        Some(h) => {
            let held = held_for(h).map(|d| format!(" for {d}")).unwrap_or_default();
            format!(": held by {}{held}", holder_label(h))
        }
        None => String::new(),
    }
}
