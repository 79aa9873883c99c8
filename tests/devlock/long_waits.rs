//! What a long wait costs the machine (issue 35): a wait that has lasted a
//! few seconds gives back the pages its process touched starting up, and
//! still runs its command when its turn comes; a waiting line far back in
//! a long line names the holder and its place without reading every
//! registration ahead of it.

use std::io::{BufReader, Read};
use std::process::Stdio;

use crate::harness::*;

/// A field of /proc/PID/status, in kB.
fn status_kb(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

test!(a_long_wait_gives_back_its_startup_pages_and_still_runs_its_command, needs: []);
pub(crate) fn a_long_wait_gives_back_its_startup_pages_and_still_runs_its_command() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    // One that shows its wait in a log, one with -q: both sleep with a
    // display thread that gives the pages back.
    let mut logged = s
        .devlock()
        .args(["r", "--", "echo", "LOGGED-RAN"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(logged.stderr.take().unwrap());
    wait_for_line(&mut err, "· waiting");
    let mut quiet = s
        .devlock()
        .args(["-q", "r", "--", "echo", "QUIET-RAN"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 2);
    for waiter in [&logged, &quiet] {
        let at_start = status_kb(waiter.id(), "RssFile");
        poll_until(
            "a waiter's file-backed pages to go back",
            || status_kb(waiter.id(), "RssFile"),
            |now| *now * 2 < at_start,
        );
    }
    release(&s, "h");
    wait_child(&mut holder);
    for (waiter, said) in [(&mut logged, "LOGGED-RAN"), (&mut quiet, "QUIET-RAN")] {
        let mut out = String::new();
        waiter
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        assert!(wait_child(waiter).success());
        assert_eq!(out.trim(), said);
    }
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("devlock: got r after "), "{rest:?}");
}

test!(a_waiting_line_far_back_names_the_holder_and_its_place, needs: []);
pub(crate) fn a_waiting_line_far_back_names_the_holder_and_its_place() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "the-holder", "r"], "h");
    let mut ahead: Vec<_> = (0..17)
        .map(|i| {
            let child = s.devlock().args(["-q", "r", "--", "true"]).spawn().unwrap();
            wait_blocked(&s.lock_path("r"), i + 1);
            child
        })
        .collect();
    let mut waiter = s
        .devlock()
        .args(["r", "--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(waiter.stderr.take().unwrap());
    let line = wait_for_line(&mut err, "· waiting");
    assert!(line.contains(" · 18th in line"), "{line:?}");
    assert!(line.contains(" for the-holder (pid "), "{line:?}");
    assert!(!line.contains("behind"), "{line:?}");
    release(&s, "h");
    wait_child(&mut holder);
    for child in &mut ahead {
        assert!(wait_child(child).success());
    }
    assert!(wait_child(&mut waiter).success());
}
