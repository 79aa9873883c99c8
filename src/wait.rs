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
/// this thread while a helper thread shows the wait. Returns a stopping signal
/// that arrived at the very moment the locks were taken, for the supervisor
/// to pass on. A timeout or a stopping signal while waiting ends the process
/// from the helper thread: nothing has started yet, so nothing is left
/// running, and the kernel drops every lock and place in line.
pub fn wait_for<T>(
    dir: &ScratchDir,
    label: String,
    holder_of: Option<Resource>,
    registrations: Vec<Option<Registration>>,
    plan: &WaitPlan,
    block: impl FnOnce() -> Result<T>,
) -> Result<(T, Option<Received>)> {
    let state = Arc::new(AtomicU8::new(WAITING));
    let started = Instant::now();
    let shown = Shown {
        dir: dir.path().to_owned(),
        label,
        holder_of,
    };
    let helper = {
        let state = state.clone();
        let plan = plan.clone();
        std::thread::Builder::new()
            .name("devlock-wait".into())
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
    // SAFETY: the helper thread is alive until joined; SIGCHLD is blocked in
    // it and only wakes its sigtimedwait.
    unsafe { libc::pthread_kill(helper.as_pthread_t(), libc::SIGCHLD) };
    let pending = helper.join().unwrap_or(None);
    Ok((held, pending))
}

struct Shown {
    dir: std::path::PathBuf,
    label: String,
    holder_of: Option<Resource>,
}

impl Shown {
    fn view(&self) -> Option<ResourceView> {
        let resource = self.holder_of.as_ref()?;
        let dir = ScratchDir::open(&self.dir).ok()??;
        let lock = LockFile::open(&dir, &resource.file_name()).ok()?;
        Some(status::describe(&lock, &dir, resource))
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
    let mut stderr = std::io::stderr();
    loop {
        let now = Instant::now();
        if !plan.quiet && now >= next_report {
            let line = waiting_line(&shown, now - started);
            if plan.live {
                let _ = write!(stderr, "\r\x1b[K{line}");
            } else {
                let _ = writeln!(stderr, "{line}");
            }
            next_report = now + tick;
        }
        if let Some(deadline) = plan.deadline
            && now >= deadline
            && give_up(&state)
        {
            let holder = shown.view().map(|v| holder_phrase(&v)).unwrap_or_default();
            clear_live(&plan);
            let waited = humantime::format_duration(plan.timeout.unwrap_or_default());
            let _ = writeln!(
                stderr,
                "devlock: timed out after {waited} waiting for {}{holder}",
                shown.label
            );
            drop(registration);
            std::process::exit(plan.conflict_code.code());
        }
        let mut until = next_report;
        if plan.quiet {
            until = now + Duration::from_secs(3600);
        }
        if let Some(deadline) = plan.deadline {
            until = until.min(deadline);
        }
        let signal = supervise::wait_signal(Some(until.saturating_duration_since(Instant::now())));
        if state.load(Ordering::Acquire) == ACQUIRED {
            clear_live(&plan);
            if !plan.quiet && !plan.live {
                let _ = writeln!(
                    stderr,
                    "devlock: got {} after {}",
                    shown.label,
                    short_duration(started.elapsed())
                );
            }
            let pending = signal.filter(|s| s.signo != libc::SIGCHLD);
            return pending;
        }
        if let Some(sig) = signal.filter(|s| s.signo != libc::SIGCHLD) {
            if give_up(&state) {
                clear_live(&plan);
                drop(registration);
                std::process::exit(ExitCode::Signal(sig.signo).code());
            }
            // The lock was taken at this very moment: the command must hear it.
            clear_live(&plan);
            return Some(sig);
        }
    }
}

fn give_up(state: &AtomicU8) -> bool {
    state
        .compare_exchange(WAITING, GAVE_UP, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}

fn clear_live(plan: &WaitPlan) {
    if plan.live && !plan.quiet {
        let _ = write!(std::io::stderr(), "\r\x1b[K");
    }
}

fn waiting_line(shown: &Shown, waited: Duration) -> String {
    let view = shown.view();
    let me = std::process::id();
    let holder = view
        .as_ref()
        .and_then(|v| v.holders.first())
        .map(|h| format!(" for {}", holder_words(h)))
        .unwrap_or_default();
    let place = view
        .as_ref()
        .and_then(|v| v.waiters.iter().find(|w| w.pid == me))
        .map(|w| format!(" · {} in line", ordinal(w.position)))
        .unwrap_or_default();
    format!(
        "devlock: {} · waiting {}{holder}{place}",
        shown.label,
        short_duration(waited)
    )
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
