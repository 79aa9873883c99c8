//! The tick of a hold's watch, and what it finds as data (no words): once
//! a second, its usage ([`crate::usage::track`]: record, sampler, idle
//! policy) and its budget's watch ([`crate::flock::budget::watch`]) return
//! [`HoldEvent`]s; the front ends act on them and word them (the command
//! line's watcher process on stderr, the library's one watch thread to its
//! caller).

use crate::flock::budget::watch::BudgetWatch;
use crate::hold_event::HoldEvent;
use crate::usage::track::Tracker;

/// What watches a hold while it lasts: its usage and its budget's watch.
#[derive(Debug, Default)]
pub struct HoldWatch {
    pub usage: Option<Tracker>,
    pub budget: Option<BudgetWatch>,
}

impl HoldWatch {
    /// Once a second: what the usage and the budget's watch found (the
    /// budget's watch rests while `budget_rests`: a library hold kept past
    /// its block has no work left to measure).
    pub fn tick(&mut self, budget_rests: bool) -> Vec<HoldEvent> {
        let mut events = self.usage.as_mut().map(Tracker::tick).unwrap_or_default();
        if !budget_rests && let Some(budget) = self.budget.as_mut() {
            events.extend(budget.check());
        }
        events
    }
}
