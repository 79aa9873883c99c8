//! What a hold's watch finds, as data (no words): the events the core's
//! [`crate::hold_watch::HoldWatch`] ticks out of a hold's usage and budget
//! watch, which the front ends act on and word.

use std::time::Duration;

use crate::resource::Resource;

/// One thing a hold's watch found to do or to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HoldEvent {
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
    pub fn is_stop(&self) -> bool {
        matches!(
            self,
            HoldEvent::BudgetStop { .. } | HoldEvent::IdleStop { .. }
        )
    }
}
