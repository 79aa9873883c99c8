//! The tick of a hold's watch, and what it finds as data (no words): once
//! a second, its usage ([`crate::usage::track`]: record, sampler, idle
//! policy) and its budget's watch ([`crate::flock::budget::watch`]) return
//! [`HoldEvent`]s; the front ends act on them and word them (the command
//! line's watcher process on stderr, the library's one watch thread to its
//! caller).

use std::time::Duration;

use crate::flock::budget::watch::BudgetWatch;
use crate::resource::Resource;
use crate::usage::track::Tracker;

/// What watches a hold while it lasts: its usage and its budget's watch.
#[derive(Debug, Default)]
pub(crate) struct HoldWatch {
    pub usage: Option<Tracker>,
    pub budget: Option<BudgetWatch>,
}

impl HoldWatch {
    /// Once a second: what the usage and the budget's watch found (the
    /// budget's watch rests while `budget_rests`: a library hold kept past
    /// its block has no work left to measure).
    pub(crate) fn tick(&mut self, budget_rests: bool) -> Vec<HoldEvent> {
        let mut events = self.usage.as_mut().map(Tracker::tick).unwrap_or_default();
        if !budget_rests && let Some(budget) = self.budget.as_mut() {
            events.extend(budget.check());
        }
        events
    }
}

/// One thing a hold's watch found to do or to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HoldEvent {
    /// The budget's job settled (or `--settle` passed, or it is stopped):
    /// its place in line goes to the next budget.
    StepAside,
    /// The budget's label: over budget by this figure (MiB), or (`None`)
    /// back under.
    OverMark(Option<u64>),
    /// The labels' idle mark: idle since this (ms since the epoch), or
    /// (`None`) no longer idle.
    IdleMark(Option<u64>),
    /// The job uses more than its budget by more than a tenth (once per hold).
    OverBudget {
        resource: Resource,
        step: String,
        used_mib: u64,
        mem_mib: u64,
    },
    /// With `--mem-strict`: it stayed over for `settle`; the job is stopped.
    BudgetStop {
        resource: Resource,
        step: String,
        used_mib: u64,
        mem_mib: u64,
        settle: Duration,
    },
    /// Its GPUs computed nothing for the idle timeout (once per idle spell);
    /// it is stopped after `grace` unless they compute.
    Idle {
        names: String,
        step: String,
        idle_for: Duration,
        grace: Duration,
    },
    /// Its usage record cannot be kept (the hold goes on without): why.
    NoRecord { why: String },
    /// It stayed idle through the grace; the job is stopped.
    IdleStop {
        names: String,
        step: String,
        idle_for: Duration,
    },
}

impl HoldEvent {
    /// Whether the job is to be stopped.
    pub(crate) fn is_stop(&self) -> bool {
        matches!(
            self,
            HoldEvent::BudgetStop { .. } | HoldEvent::IdleStop { .. }
        )
    }
}
