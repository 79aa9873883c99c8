//! How the backend reports a wait without knowing any screen: the
//! [`Observer`] a caller hands it (the command line's waiting display, the
//! library's board, or [`Quiet`]), the handles it gets to watch each lock
//! waited for ([`Watch`]), and what a wait for room waits on ([`RoomNote`]).

use std::sync::{Arc, Mutex};

use anyhow::Result;

use crate::flock::dir::ScratchDir;
use crate::flock::file::LockFile;
use crate::flock::registration::Registration;
use crate::interrupt::Stop;
use crate::resource::Resource;

/// Handles of its own on one lock waited for (and its line), so whoever
/// shows the wait looks at it with a few reads, not a directory walk.
#[derive(Debug)]
pub struct Watch {
    pub dir: ScratchDir,
    pub resource: Resource,
    pub lock: LockFile,
    /// Our place in line, when we have one.
    pub ticket: Option<u64>,
    /// The slot count our place in line agreed on (0: a plain lock), when
    /// we have one: our own agreement byte, which names nobody else.
    pub agreement: Option<u64>,
    /// What the lines call it: the resource, or for a group taken on a
    /// member's behalf, the member with its group.
    pub label: String,
    /// For a `--mem` request at the front of its line: the figures it waits
    /// on (kept up to date by the waiting thread), shown instead of the
    /// holders.
    pub room: Option<Arc<Mutex<RoomNote>>>,
}

/// What a wait that is not for a lock alone waits on, as data (the front
/// ends word it): a `--mem` request's figures, or a line said already.
#[derive(Debug, Clone, Default)]
pub enum RoomNote {
    /// Nothing looked at yet.
    #[default]
    Nothing,
    /// The device's room, too small for the ask.
    Figures {
        resource: Resource,
        room: crate::gpu::memory::Room,
        ask_mib: u64,
        headroom_mib: u64,
    },
    /// Anything else (a look that failed, a lock held whole, a stranger's
    /// lock), as a line.
    Said(String),
}

/// A wait about to begin.
#[derive(Debug)]
pub struct Wait {
    /// What the lines call the whole wait (`gpu`, `any of gpu:0 gpu:1`).
    pub label: String,
    /// One per lock waited for, when the observer [`Observer::shows`].
    pub watches: Vec<Watch>,
    /// The waiter's registrations, which go when the wait is over (or when
    /// a signal ends the process).
    pub registrations: Vec<Option<Registration>>,
    /// The wait sleeps in lock calls a signal interrupts (so a display may
    /// start late, when the wait has lasted long enough to show).
    pub lazy: bool,
}

/// Who watches a take wait. Called on the taking thread.
pub trait Observer: Sync {
    /// Whether a wait gathers [`Watch`]es to show.
    fn shows(&self) -> bool;

    /// Runs `block` (which sleeps in the kernel until the lock is ours, and
    /// that `stop` interrupts) while the wait is shown.
    fn wait(&self, wait: Wait, stop: &Stop, block: &mut dyn FnMut() -> Result<()>) -> Result<()>;

    /// One lock (or one `--any` pick) is taken: what showed its wait is
    /// settled before the next wait shows its own.
    fn took(&self) -> Result<()> {
        Ok(())
    }
}

/// Waits in silence (a library take that nobody shows).
#[derive(Debug, Default)]
pub struct Quiet;

impl Observer for Quiet {
    fn shows(&self) -> bool {
        false
    }

    fn wait(&self, wait: Wait, _stop: &Stop, block: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let result = block();
        drop(wait.registrations);
        result
    }
}
