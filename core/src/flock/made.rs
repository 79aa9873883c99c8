//! The registrations a process made in one scratch directory and has not
//! removed yet, so that a run ending by exit(2) from its waiting display's
//! thread (a signal while it waits), whose other threads' drops never run,
//! removes them as those drops would.

use std::os::fd::RawFd;

#[derive(Debug, Clone, Default)]
pub struct Made(std::sync::Arc<std::sync::Mutex<Vec<MadeEntry>>>);

#[derive(Debug)]
struct MadeEntry {
    dir: RawFd,
    name: String,
    /// A shared hold's file, emptied first (see the registration's drop).
    hold: Option<RawFd>,
}

impl Made {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<MadeEntry>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lists a registration just made as `name` in the directory `dir`;
    /// `hold` is a shared hold's own descriptor of it.
    pub(crate) fn note(&self, dir: RawFd, name: &str, hold: Option<RawFd>) {
        self.lock().push(MadeEntry {
            dir,
            name: name.to_owned(),
            hold,
        });
    }

    /// Takes `name` off the list and, unless `detached` (a copy in a forked
    /// child), removes its file: under the list's lock, so that a removal
    /// of everything on the way out never uses a descriptor number that has
    /// gone.
    pub(crate) fn remove(&self, dir: RawFd, name: &str, hold: Option<RawFd>, detached: bool) {
        let mut listed = self.lock();
        listed.retain(|e| e.name != name);
        if !detached {
            remove(dir, name, hold);
        }
    }

    /// Removes every registration still listed: only on the way out of the
    /// process, whose descriptors the entries borrow.
    pub fn remove_all_before_exit(&self) {
        let mut listed = self.lock();
        for entry in listed.drain(..) {
            remove(entry.dir, &entry.name, entry.hold);
        }
        // Kept locked: the process exits with it held, and no registration
        // of another thread is dropped meanwhile.
        std::mem::forget(listed);
    }
}

/// Empties a hold's label, then unlinks the file.
fn remove(dir: RawFd, name: &str, hold: Option<RawFd>) {
    if let Some(fd) = hold {
        let _ = crate::sys::fs::truncate_fd(fd);
    }
    let _ = crate::sys::fs::unlinkat_raw(dir, name);
}
