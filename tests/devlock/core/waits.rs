//! Waits and their edges: the conflict code, a waiter that starts when the
//! holder ends, a replaced lock file, nested takes that cannot be let
//! through, and what the caller left ignored or closed.

use super::*;

test!(no_wait_and_timeout_fail_with_the_conflict_code_and_name_the_holder, needs: []);
pub(crate) fn no_wait_and_timeout_fail_with_the_conflict_code_and_name_the_holder() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let mut holder = s.hold(
        &["--step", "trainer", "r"],
        &format!(
            "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
            ready.display(),
            release.display()
        ),
        &ready,
    );
    let busy = s.run(&["-n", "r", "--", "touch", s.work("ran").to_str().unwrap()]);
    assert_eq!(busy.status.code(), Some(75));
    let err = stderr(&busy);
    assert!(err.contains("r is busy: held by trainer (pid "), "{err}");
    let timed = s.run(&[
        "-w",
        "200ms",
        "--conflict-exit-code",
        "9",
        "r",
        "--",
        "touch",
        s.work("ran").to_str().unwrap(),
    ]);
    assert_eq!(timed.status.code(), Some(9));
    assert!(
        stderr(&timed).contains("timed out after 200ms waiting for r: held by trainer"),
        "{}",
        stderr(&timed)
    );
    assert!(!s.work("ran").exists());
    // Neither left a trace in the holder's record or in status.
    let view = s.resource_status("r");
    assert_eq!(view["holders"][0]["step"], "trainer");
    assert_eq!(view["waiters"].as_array().unwrap().len(), 0);
    std::fs::write(&release, "").unwrap();
    wait_child(&mut holder);
}

test!(a_waiter_starts_once_the_holder_ends_and_says_so, needs: []);
pub(crate) fn a_waiter_starts_once_the_holder_ends_and_says_so() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let mut holder = s.hold(
        &["--step", "first", "r"],
        &format!(
            "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
            ready.display(),
            release.display()
        ),
        &ready,
    );
    let mut waiter = s
        .devlock()
        .args(["r", "--", "echo", "second ran"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(waiter.stderr.take().unwrap());
    let first = wait_for_line(&mut err, "waiting");
    assert!(
        first.contains("devlock: r · waiting 0s for first (pid "),
        "{first}"
    );
    assert!(first.contains("1st in line"), "{first}");
    std::fs::write(&release, "").unwrap();
    let got = wait_for_line(&mut err, "got r after");
    assert!(got.starts_with("devlock: got r after "), "{got}");
    assert!(wait_child(&mut waiter).success());
    wait_child(&mut holder);
}

test!(a_replaced_lock_file_is_noticed, needs: []);
pub(crate) fn a_replaced_lock_file_is_noticed() {
    // Someone deletes the lock file while a holder holds it and a waiter has
    // the old inode open; a newcomer then creates a new file. The waiter
    // wakes on the dead inode, sees the path names another file, and takes
    // the new one: the two never run together.
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let log = s.work("log");
    let section = format!(
        "echo enter >> {log}; sleep 0.05; echo leave >> {log}",
        log = log.display()
    );
    let mut holder = s.hold(
        &["r"],
        &format!(
            "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
            ready.display(),
            release.display()
        ),
        &ready,
    );
    let mut waiter = s
        .devlock()
        .args(["-q", "r", "--", "sh", "-c", &section])
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 1);
    std::fs::remove_file(s.lock_path("r")).unwrap();
    let mut newcomer = s
        .devlock()
        .args(["-q", "r", "--", "sh", "-c", &section])
        .spawn()
        .unwrap();
    // The waiter sleeps on the deleted inode, which no path names any more;
    // the newcomer sleeps in line behind it.
    wait_blocked(&s.lock_path("r"), 1);
    std::fs::write(&release, "").unwrap();
    wait_child(&mut holder);
    assert!(wait_child(&mut waiter).success());
    assert!(wait_child(&mut newcomer).success());
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "enter\nleave\nenter\nleave\n"
    );
    assert!(s.lock_path("r").exists(), "the lock file is there again");
}

test!(a_nested_take_whose_parent_closed_the_lock_says_why_it_waits, needs: []);
pub(crate) fn a_nested_take_whose_parent_closed_the_lock_says_why_it_waits() {
    // Python's subprocess and sudo close inherited descriptors; the nested
    // devlock then does not hold the lock and must not pretend to (the
    // ancestor, here the command itself, holds it for other work), but it
    // says what is going on.
    let s = Scratch::new();
    let lock = s.lock_path("r");
    let script = format!(
        "sh -c 'for f in /proc/$$/fd/*; do [ \"$(readlink $f)\" = {lock} ] && eval \"exec ${{f##*/}}>&-\"; done; \
         ls -l /proc/$$/fd | grep -q r.lock && exit 9; exec {BIN} -w 300ms r -- echo inner'",
        lock = lock.display()
    );
    let out = s.run(&["r", "--", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(!stdout(&out).contains("inner"));
    assert!(
        stderr(&out).contains("an ancestor of this devlock"),
        "{}",
        stderr(&out)
    );
}

test!(an_exclusive_take_inside_a_shared_hold_fails_instead_of_waiting_for_itself, needs: []);
pub(crate) fn an_exclusive_take_inside_a_shared_hold_fails_instead_of_waiting_for_itself() {
    let s = Scratch::new();
    let out = s.run(&["gpu:0", "--", BIN, "-n", "gpu", "--", "echo", "ran"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gpu is held only shared by the job this runs in"),
        "{}",
        stderr(&out)
    );
    assert!(!stdout(&out).contains("ran"));
    let out = s.run(&["gpu:0", "--", BIN, "-w", "5s", "gpu", "--", "echo", "ran"]);
    assert_eq!(
        out.status.code(),
        Some(75),
        "also when allowed to wait: {}",
        stderr(&out)
    );
}

test!(an_ignored_sigchld_or_closed_stdio_from_the_parent_does_no_harm, needs: []);
pub(crate) fn an_ignored_sigchld_or_closed_stdio_from_the_parent_does_no_harm() {
    let s = Scratch::new();
    let mut child = Command::new("sh")
        .args(["-c", &format!("trap '' CHLD; exec {BIN} r -- true")])
        .env("DEVLOCK_DIR", s.dir())
        .spawn()
        .unwrap();
    assert!(
        wait_child(&mut child).success(),
        "devlock must still see its command end"
    );
    // The command copies the lock file while it holds it: a lock file
    // opened as fd 2 would hold its line.
    let copy = s.work("copy");
    let out = Command::new("sh")
        .args([
            "-c",
            &format!(
                "exec 0<&- 2>&-; exec {BIN} r -- sh -c 'sleep 0.3; echo CHILD-LINE >&2; cat {} > {}'",
                s.lock_path("r").display(),
                copy.display()
            ),
        ])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert!(out.status.success());
    let content = std::fs::read(&copy).unwrap();
    assert!(
        devlock::testing::record::parse(&content).is_some(),
        "the lock file holds something other than its record: {:?}",
        String::from_utf8_lossy(&content)
    );
    // The label stays after the release (nobody is left to clear it), naming
    // a process that is gone: status shows the lock free.
    let view = s.resource_status("r");
    assert_eq!(view["state"], "free", "{view:#}");
}

test!(signals_the_caller_ignored_stay_ignored_for_the_command, needs: []);
pub(crate) fn signals_the_caller_ignored_stay_ignored_for_the_command() {
    let s = Scratch::new();
    let out = Command::new("sh")
        .args([
            "-c",
            &format!("trap '' HUP; exec {BIN} r -- sh -c 'kill -HUP $$; echo survived'"),
        ])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert_eq!(stdout(&out).trim(), "survived", "{}", stderr(&out));
}
