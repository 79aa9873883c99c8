//! A shown wait in one thread (issue 35, the drain): a waiter that shows
//! its wait (in a log, on a terminal line of its own), with or without
//! `-w`, never starts a second thread, and still reports on time, redraws
//! at a new width, times out and ends on a stopping signal as before.

use std::process::{Child, Stdio};
use std::time::Instant;

use crate::harness::*;
use crate::quiet_wait::threads;

/// `devlock ARGS r -- touch RAN` with stderr a file, blocked behind the
/// holder of `r` and shown: its first `waiting` line is in the file.
fn logging_waiter(
    s: &Scratch,
    args: &[&str],
    log: &std::path::Path,
    ran: &std::path::Path,
) -> Child {
    let child = s
        .devlock()
        .args(args)
        .args(["r", "--", "touch"])
        .arg(ran)
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    waiting_lines(log, 1);
    child
}

/// Waits until the log holds `count` waiting lines; returns it.
fn waiting_lines(log: &std::path::Path, count: usize) -> String {
    poll_until(
        &format!("{count} waiting lines in {}", log.display()),
        || std::fs::read_to_string(log).unwrap_or_default(),
        |text| text.matches(" · waiting ").count() >= count,
    )
}

test!(a_waiter_shown_in_a_log_is_one_thread_with_or_without_a_deadline, needs: []);
/// Shown in a log (`--report-every`), with no deadline and with one, a
/// waiter is one thread while it waits, past the start of its display and
/// its next report; a stopping signal ends it as it did: 128 + the signal,
/// its registrations gone, no `got` line, the command never started. One
/// that gets the lock says `got` and runs.
pub(crate) fn a_waiter_shown_in_a_log_is_one_thread_with_or_without_a_deadline() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    for (deadline, name) in [(&[][..], "forever"), (&["-w", "1h"][..], "deadline")] {
        let (log, ran) = (s.work(&format!("{name}.log")), s.work(name));
        let mut args = vec!["--step", name, "--report-every", "50ms"];
        args.extend(deadline);
        let mut waiter = Killed(logging_waiter(&s, &args, &log, &ran));
        let pid = waiter.id();
        // A report after the first line: the alarm was set again.
        waiting_lines(&log, 2);
        assert_eq!(threads(pid), 1, "{name}");
        assert!(!made_by(&s, pid).is_empty(), "{name}: registered");
        signal(pid, libc::SIGTERM);
        let status = wait_child(&mut waiter.0);
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{name}: {text}");
        assert!(!text.contains("got r"), "{name}: {text}");
        assert!(
            text.lines().all(|l| l.ends_with(&format!("({name})"))),
            "{text}"
        );
        assert_eq!(made_by(&s, pid), Vec::<String>::new(), "{name}");
        assert!(!ran.exists(), "{name}: the command ran");
    }
    let (log, ran) = (s.work("gets.log"), s.work("gets"));
    let mut waiter = Killed(logging_waiter(&s, &["--step", "gets"], &log, &ran));
    assert_eq!(threads(waiter.id()), 1);
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut waiter.0).success());
    assert!(ran.exists());
    let text = std::fs::read_to_string(&log).unwrap();
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("devlock: got r after ") && last.ends_with("(gets)"),
        "{text}"
    );
}

test!(a_timeout_on_one_thread_says_who_is_in_the_way, needs: []);
/// `-w` without a helper thread: the waiter stays one thread up to its
/// deadline, then gives up with the timeout's words and code, naming the
/// holder, its registrations gone and the command not started.
pub(crate) fn a_timeout_on_one_thread_says_who_is_in_the_way() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["--step", "holding", "r"], "h"));
    let (log, ran) = (s.work("w.log"), s.work("ran"));
    let mut waiter = Killed(logging_waiter(&s, &["-w", "1"], &log, &ran));
    let pid = waiter.id();
    // Every look until it ends: one thread (a look after the exit reads
    // nothing).
    let started = Instant::now();
    let status = loop {
        if let Some(status) = waiter.0.try_wait().unwrap() {
            break status;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let threads = status.lines().find_map(|l| l.strip_prefix("Threads:"));
        assert!(threads.is_none_or(|t| t.trim() == "1"), "{status}");
        assert!(started.elapsed() < HANG, "never timed out");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(75), "{text}");
    assert!(
        text.contains("devlock: timed out after 1s waiting for r: held by ")
            && text.contains("held by holding (pid "),
        "{text}"
    );
    assert_eq!(made_by(&s, pid), Vec::<String>::new());
    assert!(!ran.exists());
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
}

test!(a_live_waiting_line_is_one_thread_redrawn_on_resize_and_ended_by_ctrl_c, needs: []);
/// On a terminal line of its own, with no deadline and with one: one
/// thread while the line is drawn and after a resize redraws it at the new
/// width; Ctrl-C clears the line and ends the run with 130, its
/// registrations gone. One that gets the lock clears its line and runs.
pub(crate) fn a_live_waiting_line_is_one_thread_redrawn_on_resize_and_ended_by_ctrl_c() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    for (deadline, name) in [(&[][..], "forever"), (&["-w", "1h"][..], "deadline")] {
        let pty = Pty::new(80);
        let mut waiter =
            Killed(pty.spawn(s.devlock().args(deadline).args(["r", "--", "echo", "RAN"])));
        let pid = waiter.id();
        pty.wait_for("1st in line");
        assert_eq!(threads(pid), 1, "{name}");
        pty.narrowed_and_redrawn(45);
        assert_eq!(threads(pid), 1, "{name}");
        pty.type_in(b"\x03");
        let status = wait_child(&mut waiter.0);
        assert_eq!(status.code(), Some(128 + libc::SIGINT), "{name}");
        let out = pty.wait_until("the line cleared", |out| out.ends_with("\r\x1b[K"));
        assert!(!out.contains("RAN"), "{name}: {out:?}");
        assert_eq!(made_by(&s, pid), Vec::<String>::new(), "{name}");
    }
    let pty = Pty::new(80);
    let mut waiter = Killed(pty.spawn(s.devlock().args(["r", "--", "echo", "RAN"])));
    pty.wait_for("1st in line");
    assert_eq!(threads(waiter.id()), 1);
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    let out = pty.wait_for("RAN");
    assert!(wait_child(&mut waiter.0).success());
    let waiting = &out[..out.find("RAN").unwrap()];
    assert!(waiting.ends_with("\r\x1b[K"), "{out:?}");
    assert!(
        !waiting.contains('\n') && !waiting.contains("got"),
        "{out:?}"
    );
}
