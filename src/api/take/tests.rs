//! The library's take, tested: the command line's plan, words and waits.

use super::*;
use crate::api::status_document;
use crate::exit::ExitCodeOf;
use std::path::Path;

/// The budget `spec` plans, with no time to ask the device.
fn budget_plan(spec: &Spec) -> Result<Option<crate::plan::Budget>> {
    let plan = || -> anyhow::Result<_> {
        let mut plan = Plan::from_spec(spec).map_err(crate::messages::in_library_words)?;
        plan.probe_timeout = Duration::ZERO;
        plan.look().map_err(crate::messages::in_library_words)?;
        Ok(plan.budget)
    };
    plan().map_err(Error::from)
}

fn options(dir: &Path, wait: Wait) -> Options {
    Options {
        dir: dir.into(),
        wait,
        step: "unit".into(),
    }
}

fn take_now(dir: &Path, spec: &Spec, inside: &[HeldLock]) -> Result<Hold> {
    let mut acquiring = Acquiring::start(spec, &options(dir, Wait::NoWait), inside)?;
    acquiring.wait(Duration::ZERO).expect("done at once")
}

#[test]
fn a_member_takes_its_group_shared_and_sets_cuda() {
    let tmp = tempfile::tempdir().unwrap();
    // A directory made for locks (sticky): the records are in the lock files.
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    let hold = take_now(tmp.path(), &Spec::new(["gpu:1", "gpu:0"]), &[]).unwrap();
    assert_eq!(hold.resources(), ["gpu:0", "gpu:1"]);
    assert_eq!(hold.cuda_visible_devices().as_deref(), Some("0,1"));
    assert!(hold.locks().contains(&HeldLock {
        resource: "gpu".into(),
        exclusive: false
    }));
    assert!(hold.holds_here() && !hold.is_nested());
    assert_eq!(
        hold.fds().len(),
        4,
        "the group's lock and label, and both members' locks"
    );
}

#[test]
fn an_enclosing_hold_passes_through_and_busy_names_the_holder_as_dash_n() {
    let tmp = tempfile::tempdir().unwrap();
    let outer = take_now(tmp.path(), &Spec::new(["gpu"]), &[]).unwrap();
    let inner = take_now(tmp.path(), &Spec::new(["gpu:3"]), &outer.locks()).unwrap();
    assert!(inner.is_nested());
    assert_eq!(inner.cuda_visible_devices().as_deref(), Some("3"));
    let err = take_now(tmp.path(), &Spec::new(["gpu"]), &[]).unwrap_err();
    let busy = err.busy().expect("a Busy");
    assert_eq!(busy.resource, "gpu");
    let holder = busy.holder.as_ref().expect("a holder");
    assert_eq!(holder.step.as_deref(), Some("unit"));
    assert_eq!(holder.pid, Some(std::process::id()));
    assert!(
        busy.message.starts_with("gpu is busy: held by unit (pid "),
        "{}",
        busy.message
    );
    assert_eq!(err.exit_code(), 75);
}

/// One busy type: the core's data about what is in the way, and the
/// command line's words on the same value, which a clone shares.
#[test]
fn a_busy_carries_what_is_in_the_way_and_its_words() {
    use crate::flock::in_the_way::InTheWay;
    let tmp = tempfile::tempdir().unwrap();
    let _outer = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap();
    let err = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap_err();
    let busy = err.busy().expect("a Busy");
    assert!(
        busy.message.starts_with("r is busy: held by unit (pid "),
        "{}",
        busy.message
    );
    let InTheWay::Lock {
        request,
        lock,
        budget: false,
        group: None,
    } = &*busy.in_the_way
    else {
        panic!("not the lock in the way: {busy:?}");
    };
    assert_eq!(request.name.as_str(), "r");
    let InTheWay::Lock { lock: cloned, .. } = &*busy.clone().in_the_way else {
        panic!("a clone is the same busy");
    };
    assert!(
        Arc::ptr_eq(lock, cloned),
        "a clone shares the open lock file"
    );
}

#[test]
fn a_spec_without_a_resource_is_a_usage_error_in_the_librarys_words() {
    let tmp = tempfile::tempdir().unwrap();
    let err = take_now(tmp.path(), &Spec::new(Vec::<String>::new()), &[]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "missing RESOURCE: name at least one resource to lock"
    );
    assert_eq!(err.exit_code(), 2);
}

#[test]
fn exclusive_inside_a_shared_hold_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new(["r"]);
    spec.shared = true;
    let outer = take_now(tmp.path(), &spec, &[]).unwrap();
    let err = take_now(tmp.path(), &Spec::new(["r"]), &outer.locks()).unwrap_err();
    assert!(err.to_string().contains("would wait for itself"), "{err}");
}

#[test]
fn usage_errors_are_the_command_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new(["a", "b"]);
    spec.slots = Some(2);
    let err = take_now(tmp.path(), &spec, &[]).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    let err = take_now(tmp.path(), &Spec::new(["-x"]), &[]).unwrap_err();
    assert!(err.to_string().contains("must not start with"), "{err}");
}

fn mem_spec(resources: &[&str], mem: Option<&str>) -> Spec {
    let mut spec = Spec::new(resources.iter().copied());
    spec.mem = mem.map(Into::into);
    spec
}

/// Every budget usage error is found before the device is asked (no
/// probe runs: these need no GPU, fake or real), in the command line's
/// words, exit 2.
#[test]
fn a_budget_is_planned_by_the_command_lines_rules_before_any_probe() {
    let cases: Vec<(Spec, &str)> = vec![
        (mem_spec(&["gpu:0"], Some("0")), "mem must be more than 0"),
        (
            mem_spec(&["gpu:0"], Some("20XB")),
            "invalid value '20XB' for mem=: unknown size unit",
        ),
        (
            mem_spec(&["gpu"], Some("20GiB")),
            "mem budgets one GPU's memory: give gpu:N, not gpu",
        ),
        (
            mem_spec(&["gpu:0", "gpu:1"], Some("1GiB")),
            "mem takes one gpu:N, or several candidates with any=True",
        ),
        (
            Spec {
                shared: true,
                ..mem_spec(&["gpu:0"], Some("1GiB"))
            },
            "mem cannot be combined with shared=True or slots=",
        ),
        (
            Spec {
                any: true,
                count: 2,
                ..mem_spec(&["gpu:0", "gpu:1"], Some("1GiB"))
            },
            "count must be 1",
        ),
        (
            Spec {
                settle: Some(Duration::from_secs(1)),
                ..mem_spec(&["gpu:0"], None)
            },
            "mem_headroom=, settle= and mem_strict=True need mem=",
        ),
        (
            Spec {
                mem_headroom: Some("1".into()),
                ..mem_spec(&["gpu:0"], Some("1GiB"))
            },
            "",
        ),
    ];
    for (spec, words) in cases {
        let planned = budget_plan(&spec);
        if words.is_empty() {
            // Well formed: the probe is asked (given no time, it cannot
            // answer: the device's memory is unknown, exit 69).
            let err = planned.expect_err("no time to probe");
            assert_eq!(err.exit_code(), 69, "{err:#}");
            continue;
        }
        let err = planned.expect_err(words);
        assert_eq!(err.exit_code(), 2, "{err:#}");
        assert!(err.to_string().contains(words), "{err:#} lacks {words}");
    }
    // No budget asked: none planned, and nothing probed.
    let plain = mem_spec(&["gpu:0"], None);
    assert!(budget_plan(&plain).unwrap().is_none());
}

#[test]
fn a_wait_is_shown_cancelled_and_timed_out_in_the_command_lines_words() {
    let tmp = tempfile::tempdir().unwrap();
    let _outer = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap();
    let mut waiting =
        Acquiring::start(&Spec::new(["r"]), &options(tmp.path(), Wait::Block), &[]).unwrap();
    assert!(waiting.is_waiting());
    let line = loop {
        assert!(waiting.wait(Duration::from_millis(10)).is_none());
        let line = waiting.waiting_line(None);
        if !line.is_empty() {
            break line;
        }
    };
    // How long it says depends on how soon the waiting thread showed
    // its wait (seconds on a loaded machine); what the line is does not.
    let waited = line
        .strip_prefix("devlock: r · waiting ")
        .and_then(|rest| rest.split_once(" for unit (pid "))
        .map(|(waited, _)| waited);
    assert!(
        waited.is_some_and(|w| w.ends_with('s') && w.starts_with(|c: char| c.is_ascii_digit())),
        "{line}"
    );
    assert!(line.ends_with("· 1st in line (unit)"), "{line}");
    waiting.cancel();
    let mut timing = Acquiring::start(
        &Spec::new(["r"]),
        &options(tmp.path(), Wait::Timeout(Duration::from_millis(50))),
        &[],
    )
    .unwrap();
    let err = loop {
        if let Some(outcome) = timing.wait(Duration::from_millis(10)) {
            break outcome.unwrap_err();
        }
    };
    let busy = err.busy().expect("a Busy");
    assert!(busy.timed_out);
    assert!(
        busy.message
            .starts_with("timed out after 50ms waiting for r: held by unit"),
        "{}",
        busy.message
    );
}

#[test]
fn a_timeout_that_runs_out_before_the_wait_shows_names_the_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let _outer = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap();
    // Out of time at once: the waiting thread has (almost always) not
    // shown its wait yet, as a short timeout on a loaded machine.
    let mut timing = Acquiring::start(
        &Spec::new(["r"]),
        &options(tmp.path(), Wait::Timeout(Duration::ZERO)),
        &[],
    )
    .unwrap();
    let err = timing
        .wait(Duration::ZERO)
        .expect("out of time")
        .unwrap_err();
    let busy = err.busy().expect("a Busy");
    assert!(busy.timed_out);
    assert_eq!(busy.resource, "r");
    assert_eq!(
        busy.holder.as_ref().and_then(|h| h.step.as_deref()),
        Some("unit")
    );
    assert!(
        busy.message
            .starts_with("timed out after 0s waiting for r: held by unit (pid "),
        "{}",
        busy.message
    );
}

#[test]
fn a_cancel_leaves_a_slots_wait_at_the_front_of_the_line_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new(["pool"]);
    spec.slots = Some(2);
    let _a = take_now(tmp.path(), &spec, &[]).unwrap();
    let _b = take_now(tmp.path(), &spec, &[]).unwrap();
    let mut waiting = Acquiring::start(&spec, &options(tmp.path(), Wait::Block), &[]).unwrap();
    // At the front of the line, racing for a slot: the board says so.
    while waiting.waiting_line(None).is_empty() {
        assert!(waiting.wait(Duration::from_millis(5)).is_none());
    }
    // Returns only once every racing thread is out (Stop::stop waits).
    waiting.cancel();
}

fn hold_of(spec: impl Into<Spec>, dir: &Path, wait: Wait) -> Result<Hold> {
    Acquiring::start(&spec.into(), &options(dir, wait), &[])?.hold()
}

/// Issue #32.8: a member is taken with its group, by the plan the
/// command line and Python use, never as a bare lock of its own.
#[test]
fn a_member_is_taken_with_its_group_as_the_command_line_takes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let group = hold_of("gpu", tmp.path(), Wait::Block).unwrap();
    let err = hold_of("gpu:0", tmp.path(), Wait::NoWait).unwrap_err();
    let busy = err.busy().expect("busy, as devlock -n gpu:0 is");
    assert_eq!(busy.resource, "gpu", "{busy:?}");
    assert_eq!(err.exit_code(), 75);
    drop(group);
    let member = hold_of("gpu:1", tmp.path(), Wait::NoWait).unwrap();
    assert_eq!(member.cuda_visible_devices().as_deref(), Some("1"));
    assert!(member.locks().contains(&HeldLock {
        resource: "gpu".into(),
        exclusive: false
    }));
    // The group's exclusive take waits for the member's shared hold.
    let err = hold_of("gpu", tmp.path(), Wait::Timeout(Duration::from_millis(20))).unwrap_err();
    assert!(err.busy().is_some_and(|b| b.timed_out), "{err}");
}

#[test]
fn a_spec_takes_slots_and_a_usage_error_is_the_command_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let mut spec = Spec::new(["pool"]);
    spec.slots = Some(2);
    let a = hold_of(spec.clone(), tmp.path(), Wait::NoWait).unwrap();
    let b = hold_of(spec.clone(), tmp.path(), Wait::NoWait).unwrap();
    assert_ne!(a.slot(), b.slot());
    assert!(
        hold_of(spec, tmp.path(), Wait::NoWait)
            .unwrap_err()
            .busy()
            .is_some()
    );
    let err = hold_of("gpu:01", tmp.path(), Wait::NoWait).unwrap_err();
    assert_eq!(err.exit_code(), 2, "{err}");
}

#[test]
fn status_is_the_command_lines_document() {
    let tmp = tempfile::tempdir().unwrap();
    let _hold = take_now(tmp.path(), &Spec::new(["r"]), &[]).unwrap();
    let doc: serde_json::Value =
        serde_json::from_str(&status_document(tmp.path(), &[], None).unwrap()).unwrap();
    assert_eq!(doc["resources"][0]["name"], "r");
    assert_eq!(doc["resources"][0]["holders"][0]["step"], "unit");
}
