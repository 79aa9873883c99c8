//! What one run's session is given (the requests, the settings) and what
//! the command is given back once it holds (the resources, fences, slot).

use std::time::Duration;

use super::Config;
use crate::request::Request;

/// Everything the session needs to know, fixed at start.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub config: Config,
    pub ttl: Duration,
    pub kill_after: Duration,
    pub no_wait: bool,
    pub timeout: Option<Duration>,
    pub quiet: bool,
    pub report_every: Duration,
    pub step: String,
    pub command: Vec<String>,
}

/// What one run takes: `fixed` in order, then `count` of `candidates`
/// (`--any`); `members` are the resources the command is given when there
/// are no candidates.
#[derive(Debug, Clone)]
pub(super) struct Wanted {
    pub fixed: Vec<Request>,
    pub candidates: Vec<Request>,
    pub count: usize,
    pub members: Vec<crate::resource::Resource>,
}

/// The fencing token of each lock, by resource name.
pub(super) type Fences = Vec<(crate::resource::Resource, i64)>;

/// What the command is given.
#[derive(Debug, Clone, Default)]
pub(super) struct Got {
    pub fences: Fences,
    /// The resources asked for, or `--any`'s picks, sorted.
    pub resources: Vec<crate::resource::Resource>,
    /// `--slots`: the slot number taken.
    pub slot: Option<u64>,
    /// The key of the first of `resources`, when this run put it
    /// (`ETCD_LOCK_KEY`, as `etcdctl lock` sets it).
    pub lock_key: Option<String>,
}
