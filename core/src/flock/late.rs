//! A plain waiter's registration, made once its wait has lasted
//! [`REGISTER_AFTER`]: the usual hand-off under contention (a few
//! milliseconds) then creates and removes no file in the lock directory.
//!
//! Why: a registration is a file created in the wait directory and
//! removed at the grant. On ext4 each is a journalled change to that
//! directory, and the removal sits between the grant and the command; with
//! eight contenders it cost devlock some 12% of its holds per second
//! against util-linux flock(1), which writes nothing (bench/run, section 3;
//! the figures are in bench/RESULTS.md). A wait that short is over before
//! anyone could read the name: a waiting display draws its first line after
//! 200 ms, and every waiter ahead of it started no later than it did. The
//! kernel shows the waiter from its first instant all the same (its place
//! in line, and at the front its flock(2) wait); status counts it there.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use crate::flock::registration::Registration;
use crate::interrupt::Alarm;

/// How long a plain wait lasts before the waiter registers: under the
/// 200 ms after which a waiting display first names those ahead.
pub(crate) const REGISTER_AFTER: Duration = Duration::from_millis(100);

/// How often the alarm repeats until the waiter has registered: its first
/// signal may land just before the waiting thread enters its lock call.
const RETRY: Duration = Duration::from_millis(20);

/// A registration made later, on the waiting thread, when its lock call is
/// interrupted after [`REGISTER_AFTER`].
pub(crate) struct Late<'a> {
    due: Instant,
    make: &'a dyn Fn() -> Option<Registration>,
    /// Until the registration is tried (then taken: it is tried once).
    alarm: RefCell<Option<Alarm>>,
    made: RefCell<Option<Registration>>,
}

impl<'a> Late<'a> {
    /// Arms the alarm for this thread (the one about to sleep in the lock
    /// calls), due [`REGISTER_AFTER`] after `joined` (when the request took
    /// its place in line). Without a timer to be had, registers at once.
    pub(crate) fn arm(joined: Instant, make: &'a dyn Fn() -> Option<Registration>) -> Late<'a> {
        let due = joined + REGISTER_AFTER;
        let late = Late {
            due,
            make,
            alarm: RefCell::new(Alarm::at(due, RETRY)),
            made: RefCell::new(None),
        };
        if late.alarm.borrow().is_none() {
            late.register();
        }
        late
    }

    /// Called on each interruption of the wait's lock calls: registers
    /// once the wait has lasted long enough.
    pub(crate) fn on_wake(&self) {
        if self.alarm.borrow().is_some() && Instant::now() >= self.due {
            self.register();
        }
    }

    fn register(&self) {
        // Its repeats would interrupt the lock call that follows.
        if let Some(alarm) = self.alarm.borrow_mut().take() {
            alarm.disarm();
        }
        *self.made.borrow_mut() = (self.make)();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Nothing is made before the wait has lasted its while; once it has,
    /// the first wake makes the registration, and no later one tries again
    /// (a failed registration is not retried at every interruption).
    #[test]
    fn registers_once_and_only_when_due() {
        let tries = Cell::new(0);
        let make = || {
            tries.set(tries.get() + 1);
            None
        };
        let armed = Instant::now();
        let late = Late::arm(armed, &make);
        late.on_wake();
        // Not a timing assertion: on a slow machine the while may be over.
        assert!(tries.get() == 0 || armed.elapsed() >= REGISTER_AFTER);
        std::thread::sleep(REGISTER_AFTER);
        late.on_wake();
        late.on_wake();
        assert_eq!(tries.get(), 1);
    }
}
