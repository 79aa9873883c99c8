//! The library's options: where a take ([`crate::Acquiring`]) takes, how
//! long it may wait, and the label status shows.

use std::path::PathBuf;
use std::time::Duration;

/// How long a take ([`crate::Acquiring`]) may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Sleep in the kernel until the lock is free.
    Block,
    /// Fail at once when someone else holds it.
    NoWait,
    /// Give up after this long.
    Timeout(Duration),
}

/// Where and how to take a lock.
#[derive(Debug, Clone)]
pub struct Options {
    /// The scratch directory ([`crate::DEFAULT_DIR`] by default).
    pub dir: PathBuf,
    /// Whether and how long to wait when someone else holds the lock.
    pub wait: Wait,
    /// The label status shows for the holder.
    pub step: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            // Empty counts as unset, as on the command line.
            dir: std::env::var_os("DEVLOCK_DIR")
                .filter(|d| !d.is_empty())
                .map_or_else(|| crate::flock::dir::DEFAULT_DIR.into(), PathBuf::from),
            wait: Wait::Block,
            step: std::env::args()
                .next()
                .and_then(|a| {
                    std::path::Path::new(&a)
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                })
                .unwrap_or_else(|| "rust".to_owned()),
        }
    }
}
