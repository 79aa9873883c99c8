//! A quiet wait (`-q`, no `-w`) in one thread (issue 35, a waiter's memory):
//! its own lock call takes the stopping signals, as the waiting display's
//! thread did, with the same outcome, and no second thread starts.

use std::process::{Child, Stdio};
use std::time::Instant;

use crate::harness::*;

pub(crate) fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// `devlock -q r -- touch RAN`, blocked behind the holder of `r`.
fn quiet_waiter(s: &Scratch, ran: &std::path::Path) -> Child {
    let child = s
        .devlock()
        .args(["-q", "r", "--", "touch"])
        .arg(ran)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 1);
    child
}

test!(a_quiet_waiter_is_one_thread_that_each_stopping_signal_ends, needs: []);
/// A quiet waiter stays one thread for as long as it waits (the display's
/// thread started 200 ms into a wait; its registration, 100 ms in, is made
/// on the waiting thread itself), and each stopping signal ends its
/// wait as before: silently, with 128 + the signal, its registrations
/// gone, the command never started, the lock left to the holder.
pub(crate) fn a_quiet_waiter_is_one_thread_that_each_stopping_signal_ends() {
    let s = Scratch::new();
    // Killed: a failed assertion leaves no process behind.
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        let ran = s.work(&format!("ran-{sig}"));
        let mut waiter = Killed(quiet_waiter(&s, &ran));
        let pid = waiter.id();
        // In line at once; registered once it has waited 100 ms.
        poll_until(
            "the waiter to register",
            || made_by(&s, pid).len(),
            |n| *n > 0,
        );
        // Not a handshake: a thread that is never started cannot be waited
        // for, so the look comes well after the display's would have.
        let blocked = Instant::now();
        poll_until(
            "the wait to last past the display's start",
            || blocked.elapsed().as_millis(),
            |ms| *ms > 500,
        );
        assert_eq!(threads(pid), 1, "signal {sig}");
        signal(pid, sig);
        let status = wait_child(&mut waiter.0);
        let mut err = String::new();
        std::io::Read::read_to_string(&mut waiter.0.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(128 + sig), "signal {sig}: {err}");
        assert_eq!(err, "", "signal {sig}");
        assert_eq!(made_by(&s, pid), Vec::<String>::new(), "signal {sig}");
        assert!(!ran.exists(), "signal {sig}: the command ran");
    }
    assert!(!flock_is_free(&s.lock_path("r")), "the holder still holds");
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
}

test!(a_signal_ignored_by_the_caller_stays_ignored_after_a_quiet_wait, needs: []);
/// Catching the stopping signals while it waits does not change what the
/// command inherits: one the caller ignored (`nohup`, `trap '' HUP`) is
/// still ignored once the quiet wait is over and the command runs.
pub(crate) fn a_signal_ignored_by_the_caller_stays_ignored_after_a_quiet_wait() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    let waiter = s
        .sh(&format!(
            "trap '' HUP; exec {BIN} -q r -- sh -c 'kill -HUP $$; echo survived'"
        ))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 1);
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    let out = waiter.wait_with_output().unwrap();
    assert_eq!(stdout(&out).trim(), "survived");
    assert!(out.status.success());
}

test!(a_stopping_signal_the_caller_ignored_does_not_end_a_wait, needs: []);
/// A stopping signal the caller left ignored (`nohup`'s SIGHUP; SIGINT of a
/// job a script starts with `&`) is ignored by the wait as by the command
/// it becomes: a hang-up while in line under `nohup` leaves the waiter in
/// line, quiet or shown, and the command runs when the lock comes free.
pub(crate) fn a_stopping_signal_the_caller_ignored_does_not_end_a_wait() {
    let s = Scratch::new();
    for (quiet, h) in [("-q", "h-quiet"), ("", "h-shown")] {
        let mut holder = Killed(hold_until_released(&s, &["r"], h));
        let waiter = s
            .sh(&format!(
                "trap '' HUP INT; exec {BIN} {quiet} r -- echo ran"
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = waiter.id();
        wait_blocked(&s.lock_path("r"), 1);
        // Ignored and not blocked, the kernel drops each as it is sent
        // (a blocked one would wait for the waiter to take it).
        signal(pid, libc::SIGHUP);
        signal(pid, libc::SIGINT);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        // HUP and INT alone: the waiter's own alarm (a real-time signal,
        // 100 ms into its wait) may be on its way in at this instant.
        for field in ["SigPnd:", "ShdPnd:"] {
            let line = status.lines().find(|l| l.starts_with(field)).unwrap();
            let pending = u64::from_str_radix(line[field.len()..].trim(), 16).unwrap();
            let hup_int = (1 << (libc::SIGHUP - 1)) | (1 << (libc::SIGINT - 1));
            assert_eq!(pending & hup_int, 0, "{quiet}: {line}");
        }
        release(&s, h);
        assert!(wait_child(&mut holder.0).success());
        let out = waiter.wait_with_output().unwrap();
        assert_eq!(stdout(&out).trim(), "ran", "{quiet}");
        assert!(out.status.success(), "{quiet}: {:?}", out.status);
    }
}
