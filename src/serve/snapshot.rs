//! The status that `devlock serve` answers with: one snapshot of the status
//! model at a time, shared by every request of the same second, with the
//! command lines taken out.
//!
//! A snapshot is what `devlock status --json` gathers: every lock file in
//! the directory, the kernel's lock table, and the GPUs within the probe's
//! time limit. Requests that come while one is being taken wait for it
//! rather than start their own, so a page left open in ten browsers and a
//! Prometheus scraping every second cost one gather a second, and a GPU
//! source that hangs is asked by one request at a time (NVML's own thread
//! then answers "unknown" at once; see `gpu::nvml`). A failed gather (an
//! unsafe directory, an unreadable `/proc/locks`) is not kept: the next
//! request tries again. A gather reads each process's descriptors once
//! (the lock table carries that reading, see `proc::fdinfo`), so its work
//! is one pass over them however many locks a stranger holds or `dup`s.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;

use crate::view::{self, StatusReport};

/// How long a snapshot answers requests before the next is taken.
pub(crate) const FRESH_FOR: Duration = Duration::from_secs(1);

/// One gather of the status, as served.
#[derive(Debug)]
pub(crate) struct Snapshot {
    /// `devlock status --json`'s model, every `command` withheld.
    pub(crate) report: StatusReport,
    /// When it was taken.
    pub(crate) at: SystemTime,
    /// How long it took, the GPU probe included.
    pub(crate) took: Duration,
    /// The last day's holds of each GPU, from the usage records (read at
    /// most once a minute; empty where there are none to read).
    pub(crate) history: Arc<History>,
    /// The last day's use by user, from the same reading.
    pub(crate) users: Arc<Users>,
    /// The site's idle timeout (`devlock setup --idle-timeout`): a ceiling
    /// on every job's.
    pub(crate) idle_ceiling: Option<Duration>,
}

/// The last day summed by user as `devlock report --by user --since 24h`
/// sums it ([`crate::report::rows`]), and where the records are.
#[derive(Debug, Default)]
pub(crate) struct Users {
    pub(crate) rows: Vec<crate::report::Row>,
    pub(crate) total: crate::report::Row,
    /// The usage directory read; `None` where no records are kept.
    pub(crate) dir: Option<PathBuf>,
}

/// Each GPU's holds of the last 24 hours (bounded: see
/// [`crate::usage::history`]).
pub(crate) type History = std::collections::BTreeMap<u32, crate::usage::history::Day>;

/// How long a history answers before the records are read again.
const HISTORY_FRESH_FOR: Duration = Duration::from_secs(60);

impl Snapshot {
    /// `/status.json`: formatted as `devlock status --json` prints it.
    pub(crate) fn json(&self) -> Result<String> {
        let mut json = serde_json::to_string_pretty(&self.report)?;
        json.push('\n');
        Ok(json)
    }
}

/// The snapshots of one directory.
#[derive(Debug)]
pub(crate) struct Snapshots {
    dir: PathBuf,
    probe_timeout: Duration,
    latest: Mutex<Option<(Instant, Arc<Snapshot>)>>,
    history: Mutex<Option<(Instant, Usage)>>,
}

/// What one reading of the usage records gives the page.
type Usage = (Arc<History>, Arc<Users>);

impl Snapshots {
    pub(crate) fn new(dir: PathBuf, probe_timeout: Duration) -> Snapshots {
        Snapshots {
            dir,
            probe_timeout,
            latest: Mutex::new(None),
            history: Mutex::new(None),
        }
    }

    /// The history and the users' day, read again when older than
    /// [`HISTORY_FRESH_FOR`], from the usage directory of the lock
    /// directory open as `lock` ([`crate::usage::dir_for`]).
    fn history(&self, lock: Option<&crate::flock::dir::ScratchDir>) -> Usage {
        use crate::report;
        use crate::usage::history;
        let mut kept = self.history.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((taken, usage)) = kept.as_ref()
            && taken.elapsed() < HISTORY_FRESH_FOR
        {
            return usage.clone();
        }
        let now = crate::usage::now_ms();
        let dir = crate::usage::dir_for(lock);
        let jobs = dir
            .as_ref()
            .and_then(|dir| crate::usage::read::jobs(dir, now).ok())
            .map(|(jobs, _)| jobs)
            .unwrap_or_default();
        let (rows, total) = report::rows(
            &jobs,
            report::By::User,
            now.saturating_sub(history::SPAN_MS),
            now,
        );
        let usage = (
            Arc::new(history::of(&jobs, now)),
            Arc::new(Users { rows, total, dir }),
        );
        *kept = Some((Instant::now(), usage.clone()));
        usage
    }

    /// The latest snapshot, or a new one when it is older than
    /// [`FRESH_FOR`].
    pub(crate) fn get(&self) -> Result<Arc<Snapshot>> {
        // Held while gathering: whoever comes meanwhile waits for this one.
        let mut latest = self.latest.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((taken, snapshot)) = latest.as_ref()
            && taken.elapsed() < FRESH_FOR
        {
            return Ok(snapshot.clone());
        }
        let started = Instant::now();
        let at = SystemTime::now();
        let mut report = view::gather(&self.dir, &[], Some(self.probe_timeout))?;
        withhold_commands(&mut report);
        // Opened (never made) as a take opens it, once for both records
        // read from it.
        let lock = crate::flock::dir::ScratchDir::open(&self.dir)
            .ok()
            .flatten();
        let (history, users) = self.history(lock.as_ref());
        // Read as a job reads it: believed only when root's (see
        // `usage::idle::site_default`).
        let idle_ceiling = lock.as_ref().and_then(crate::usage::idle::site_default);
        let snapshot = Arc::new(Snapshot {
            report,
            at,
            took: started.elapsed(),
            history,
            users,
            idle_ceiling,
        });
        *latest = Some((started, snapshot.clone()));
        Ok(snapshot)
    }
}

/// Command lines are never served: they can carry secrets (a token passed
/// as an argument), and serve answers whoever reaches it, not the users
/// `/proc` would show them to.
fn withhold_commands(report: &mut StatusReport) {
    for holder in report
        .resources
        .iter_mut()
        .flat_map(|r| r.holders.iter_mut())
    {
        holder.command = None;
    }
}
