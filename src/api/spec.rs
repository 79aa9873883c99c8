//! The library's input: the command line's options as a [`Spec`], planned
//! by the command line's rules ([`crate::plan::Plan::from_spec`]).

use std::time::Duration;

/// What to take: the command line's `RESOURCE...` with `--shared`,
/// `--slots N`, `--any`/`--count K` and `--mem`, by the same rules (a
/// member `G:M` also takes its group `G` shared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// The resources, as the user wrote them (checked as the command line
    /// checks them).
    pub resources: Vec<String>,
    /// `--shared`.
    pub shared: bool,
    /// `--slots N`.
    pub slots: Option<u16>,
    /// `--any`.
    pub any: bool,
    /// `--count K` (with `any`).
    pub count: u8,
    /// `--mem` (the memory budget on `gpu:N`), as the command line's text
    /// (`20GiB`, `512MiB`, a bare number of MiB).
    pub mem: Option<String>,
    /// `--mem-headroom`, as the command line's text.
    pub mem_headroom: Option<String>,
    /// `--settle`.
    pub settle: Option<Duration>,
    /// `--mem-strict`: once over budget for `settle`, the hold's
    /// [`crate::BudgetEvent::Stop`] tells the caller to stop its work.
    pub mem_strict: bool,
    /// `--idle-timeout`: once the hold's GPUs computed nothing for this
    /// long, its [`crate::IdleEvent::Idle`] warns, and after a grace (this
    /// again, at most 10 minutes) its [`crate::IdleEvent::Stop`] tells the
    /// caller to stop its work.
    pub idle_timeout: Option<Duration>,
}

impl Spec {
    /// An exclusive take of every resource named.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(resources: I) -> Spec {
        Spec {
            resources: resources.into_iter().map(Into::into).collect(),
            shared: false,
            slots: None,
            any: false,
            count: 1,
            mem: None,
            mem_headroom: None,
            settle: None,
            mem_strict: false,
            idle_timeout: None,
        }
    }
}

/// An exclusive take of one resource, as `devlock NAME --` takes it.
impl From<&str> for Spec {
    fn from(resource: &str) -> Spec {
        Spec::new([resource])
    }
}

/// An exclusive take of one resource, as `devlock NAME --` takes it.
impl From<String> for Spec {
    fn from(resource: String) -> Spec {
        Spec::new([resource])
    }
}

/// A duration as the command line reads one (`90`, `1.5`, `90s`, `10m`,
/// `1h30m`), for the library's option `name` (`timeout`, `settle`): what a
/// binding does with a string it is given. A text that is none is a usage
/// error in the library's words.
pub fn duration_of(name: &str, text: &str) -> crate::Result<std::time::Duration> {
    crate::units::parse_duration(text)
        .map_err(|_| crate::Error::Usage(crate::messages::library_duration(name, text)))
}
