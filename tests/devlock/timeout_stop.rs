//! `-w` ends a wait the way the library's timeout does (the take's Stop):
//! whatever kind of wait it was, one line, the conflict code, nothing left
//! registered, and a lock granted at the deadline either runs the command
//! or is let go.

use crate::harness::*;

/// The waiters `status` shows for `resource` that registered.
fn registered(s: &Scratch, resource: &str) -> usize {
    registered_waiters(&s.resource_status(resource))
}

test!(a_timeout_ends_every_kind_of_wait_with_one_line_and_nothing_left, needs: []);
pub(crate) fn a_timeout_ends_every_kind_of_wait_with_one_line_and_nothing_left() {
    let s = Scratch::new();
    let mut held = hold_until_released(&s, &["gpu:0", "gpu:1"], "held");
    let ran = s.work("ran");
    let touch = ran.to_str().unwrap();
    for wait in [
        &["gpu:0"][..],
        &["gpu:1", "gpu:0"],
        &["--any", "gpu:0", "gpu:1"],
    ] {
        let mut args = vec!["-w", "300ms"];
        args.extend(wait);
        args.extend(["--", "touch", touch]);
        let out = s.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(75), "{wait:?}: {err}");
        assert!(!ran.exists(), "{wait:?}: the command ran after a timeout");
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("devlock: timed out after 300ms waiting for ")
                && last.contains("held by "),
            "{wait:?}: {err}"
        );
        assert_eq!(err.matches("timed out").count(), 1, "{wait:?}: {err}");
        // Gone as the run ended, by the registrations' drops.
        for resource in ["gpu:0", "gpu:1"] {
            assert_eq!(registered(&s, resource), 0, "{wait:?}: {resource}");
        }
        // -q keeps it to the exit status, which -E renumbers.
        let mut quiet = vec!["-q", "-E", "9"];
        quiet.extend(&args);
        let out = s.run(&quiet);
        assert_eq!(out.status.code(), Some(9), "{wait:?} -q");
        assert_eq!(stderr(&out), "", "{wait:?} -q");
        assert!(!ran.exists());
    }
    release(&s, "held");
    wait_child(&mut held);
}

test!(a_lock_granted_at_the_deadline_runs_the_command_or_is_let_go, needs: []);
pub(crate) fn a_lock_granted_at_the_deadline_runs_the_command_or_is_let_go() {
    let s = Scratch::new();
    let log = s.work("log");
    let append = format!("echo ran >> {}", log.display());
    let (mut ran, mut timed_out) = (0, 0);
    for round in 0..20 {
        // The holder leaves about as the waiter's time runs out: either
        // outcome may come, never both and never neither.
        let ready = s.work(&format!("ready-{round}"));
        let script = format!(": > {}; sleep 0.2", ready.display());
        let mut holder = s.hold(&["r"], &script, &ready);
        // Timeouts from well before to well after the holder leaves.
        let timeout = format!("{}ms", 100 + 10 * round);
        let out = s.run(&["-w", &timeout, "r", "--", "sh", "-c", &append]);
        let err = stderr(&out);
        let lines = std::fs::read_to_string(&log).unwrap_or_default();
        match out.status.code() {
            Some(0) => {
                ran += 1;
                assert_eq!(lines.lines().count(), ran, "round {round}: {err}");
                assert!(!err.contains("timed out"), "round {round}: {err}");
            }
            Some(75) => {
                timed_out += 1;
                assert_eq!(lines.lines().count(), ran, "round {round}: ran: {err}");
                assert!(
                    err.contains(&format!("timed out after {timeout}")),
                    "round {round}: {err}"
                );
            }
            other => panic!("round {round}: {other:?}: {err}"),
        }
        wait_child(&mut holder);
        assert!(flock_is_free(&s.lock_path("r")), "round {round}: kept");
        assert_eq!(registered(&s, "r"), 0, "round {round}");
    }
    eprintln!("at the deadline: {ran} ran, {timed_out} timed out");
}
