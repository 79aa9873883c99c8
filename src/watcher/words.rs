//! The words of a hold's watch: each [`HoldEvent`] the core returns as the
//! line the command line writes beside its command (the library passes the
//! same line on to its caller, without `devlock: `).

use crate::gpu::memory::size;
use crate::hold_event::HoldEvent;

/// The whole line for `event` (`devlock: ...\n`); `None` for a mark, which
/// only labels the hold.
pub(crate) fn line(event: &HoldEvent) -> Option<String> {
    Some(match event {
        HoldEvent::StepAside | HoldEvent::OverMark(_) | HoldEvent::IdleMark(_) => return None,
        HoldEvent::OverBudget {
            resource,
            step,
            used_mib,
            mem_mib,
        } => crate::messages::busy::over_budget(resource, step, *used_mib, *mem_mib),
        HoldEvent::BudgetStop {
            resource,
            step,
            used_mib,
            mem_mib,
            settle,
        } => format!(
            "devlock: --mem-strict: {resource}: stopping {}: over budget ({} of {}) for {}\n",
            crate::show::sanitize(step),
            size(*used_mib),
            size(*mem_mib),
            humantime::format_duration(*settle)
        ),
        HoldEvent::Idle {
            names,
            step,
            idle_for,
            grace,
        } => crate::messages::idle_warning(names, step, *idle_for, *grace),
        HoldEvent::IdleStop {
            names,
            step,
            idle_for,
        } => crate::messages::idle_stop(names, step, *idle_for),
        HoldEvent::NoRecord { why } => {
            format!("devlock: note: no usage record for this job: {why}\n")
        }
    })
}

/// The line for the library's caller: without `devlock: ` and the newline.
pub(crate) fn plain(event: &HoldEvent) -> Option<String> {
    let text = line(event)?;
    let line = text.trim_end_matches('\n');
    Some(line.strip_prefix("devlock: ").unwrap_or(line).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn budget_events_are_the_command_lines_lines() {
        let over = HoldEvent::OverBudget {
            resource: "gpu:0".parse().unwrap(),
            step: "job".into(),
            used_mib: 20_000,
            mem_mib: 10_000,
        };
        assert!(
            line(&over)
                .unwrap()
                .starts_with("devlock: warning: gpu:0: job uses "),
            "{over:?}"
        );
        let stop = HoldEvent::BudgetStop {
            resource: "gpu:0".parse().unwrap(),
            step: "job".into(),
            used_mib: 20_000,
            mem_mib: 10_000,
            settle: Duration::from_secs(30),
        };
        let said = plain(&stop).unwrap();
        assert!(
            said.starts_with("--mem-strict: gpu:0: stopping job: over budget (")
                && said.ends_with(") for 30s"),
            "{said}"
        );
        assert_eq!(line(&HoldEvent::OverMark(Some(1))), None);
    }

    #[test]
    fn idle_events_are_the_command_lines_lines() {
        let stop = HoldEvent::IdleStop {
            names: "gpu:0".into(),
            step: "s".into(),
            idle_for: Duration::from_secs(120),
        };
        assert_eq!(
            line(&stop).unwrap(),
            "devlock: --idle-timeout: gpu:0: stopping s: its GPUs computed nothing for 2m00s\n"
        );
    }
}
