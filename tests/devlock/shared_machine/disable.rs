//! One write or one `ln` must not disable a resource; a stranger's locks on
//! the queue are named, and every wait stays bounded.

use super::*;

test!(a_hard_link_to_a_lock_file_disables_nothing, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_hard_link_to_a_lock_file_disables_nothing() {
    let s = Scratch::new();
    assert!(s.run(&["setup", "r"]).status.success());
    let link = s.work("link");
    assert!(user_does(
        USER_A,
        "ln",
        &[s.lock_path("r").to_str().unwrap(), link.to_str().unwrap()]
    ));
    assert_eq!(std::fs::metadata(s.lock_path("r")).unwrap().nlink(), 2);
    for uid in [0, USER_A, USER_B] {
        let out = run_as(&s, uid, &["-n", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(0), "uid {uid}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "uid {uid}");
    }
    // A 0666 file anyone may write anyway: its record is written as usual.
    let (mut h, _) = hold_as(&s, 0, &["--step", "linked", "r"], "h");
    assert_eq!(s.resource_status("r")["holders"][0]["step"], "linked");
    release(&s, "h");
    assert!(wait_child(&mut h.0).success());
}

test!(a_corrupt_queue_header_changes_nothing, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_corrupt_queue_header_changes_nothing() {
    let s = Scratch::new();
    open_dir(&s);
    // A waiter once made the queue file; a stranger then writes the old
    // format's last ticket at its maximum, and garbage after it.
    let (mut h, _) = hold_as(&s, 0, &["r"], "h0");
    let mut w = queued(&s, &["-q", "r", "--", "true"], "r");
    release(&s, "h0");
    assert!(wait_child(&mut h.0).success());
    assert!(wait_child(&mut w.0).success());
    let queue = s.dir().join(".r.queue");
    let mut junk = (i64::MAX as u64).to_le_bytes().to_vec();
    junk.extend([0xff; 4096]);
    write_as(USER_A, &queue, &junk);
    for args in [
        vec!["-n", "r", "--", "true"],
        vec!["-n", "--slots", "2", "r", "--", "true"],
        vec!["-w", "5s", "r", "--", "true"],
    ] {
        let out = s.run(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    // The line works as ever: a waiter is first in line and gets its turn.
    let (mut h, _) = hold_as(&s, 0, &["r"], "h");
    let mut waiter = Killed(
        s.devlock()
            .args(["--report-every", "10ms", "r", "--", "true"])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(waiter.0.stderr.take().unwrap());
    let line = wait_for_line(&mut err, "in line");
    assert!(line.contains("1st in line"), "{line}");
    release(&s, "h");
    assert!(wait_child(&mut h.0).success());
    assert!(wait_child(&mut waiter.0).success());
}

test!(files_of_the_wrong_type_are_one_line_errors_and_setup_swaps_them_out, needs: [Root, Tool("setpriv")]);
pub(crate) fn files_of_the_wrong_type_are_one_line_errors_and_setup_swaps_them_out() {
    every_wrong_type_at_every_lock_path_is_a_one_line_error();
    let s = Scratch::new();
    open_dir(&s);
    junk_where_registrations_go_is_ignored(&s);
    setup_swaps_planted_files_unless_they_are_locked(&s);
}

/// A FIFO, a symlink, a socket or a directory at a lock file's, a queue
/// file's or a slot file's path: a one-line error naming it, nothing written.
fn every_wrong_type_at_every_lock_path_is_a_one_line_error() {
    let victim_dir = Scratch::new();
    let victim = victim_dir.work("victim");
    std::fs::write(&victim, "precious").unwrap();
    let cases: [(&str, &[&str]); 3] = [
        ("r.lock", &["-n", "r", "--", "true"]),
        (".r.queue", &["-n", "r", "--", "true"]),
        (".r.slot1", &["-n", "--slots", "1", "r", "--", "true"]),
    ];
    for (name, args) in cases {
        for kind in ["fifo", "symlink", "socket", "directory"] {
            let s = Scratch::new();
            open_dir(&s);
            let path = s.dir().join(name);
            let p = path.to_str().unwrap();
            let planted = match kind {
                "fifo" => user_does(USER_A, "mkfifo", &[p]),
                "symlink" => user_does(USER_A, "ln", &["-s", victim.to_str().unwrap(), p]),
                "socket" => user_does(USER_A, python(), &[&fixture("stranger.py"), "socket", p]),
                _ => user_does(USER_A, "mkdir", &[p]),
            };
            assert!(planted, "planting a {kind} at {name}");
            let out = s.run(args);
            let what = format!("a {kind} at {name}");
            assert_eq!(out.status.code(), Some(74), "{what}: {}", stderr(&out));
            let err = one_line(&out);
            assert!(err.contains(p), "{what}: names the path: {err}");
            assert!(err.contains("not a regular file"), "{what}: {err}");
            assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
            let view = s.resource_status("r");
            if name == "r.lock" {
                assert_eq!(view["state"], "unknown", "{what}: never free: {view}");
            }
            assert!(
                view["trust"]["issues"]
                    .to_string()
                    .contains("not a regular file"),
                "{what}: {view}"
            );
        }
    }
}

/// Junk where registrations go: status ignores it, never hangs on it.
fn junk_where_registrations_go_is_ignored(s: &Scratch) {
    let d = s.dir();
    assert!(user_does(
        USER_A,
        "mkfifo",
        &[d.join(".r@1.0.wait").to_str().unwrap()]
    ));
    assert!(user_does(
        USER_A,
        "ln",
        &["-s", "/etc/shadow", d.join(".r@2.0.hold").to_str().unwrap()]
    ));
    assert!(user_does(
        USER_A,
        python(),
        &[
            &fixture("stranger.py"),
            "socket",
            d.join(".r@3.0.wait").to_str().unwrap()
        ]
    ));
    assert!(user_does(
        USER_A,
        "mkdir",
        &[d.join(".r@4.0.lost").to_str().unwrap()]
    ));
    let (mut h, _) = hold_as(s, 0, &["r"], "h");
    let view = s.resource_status("r");
    assert_eq!(view["state"], "held");
    assert_eq!(array_len(&view["waiters"]), 0, "{view}");
    assert_eq!(array_len(&view["conflicts"]), 0, "{view}");
    release(s, "h");
    assert!(wait_child(&mut h.0).success());
}

/// setup swaps planted files for root's, unless they are locked.
fn setup_swaps_planted_files_unless_they_are_locked(s: &Scratch) {
    let d = s.dir();
    assert!(user_does(
        USER_A,
        "mkfifo",
        &[d.join("p.lock").to_str().unwrap()]
    ));
    assert!(user_does(
        USER_A,
        python(),
        &[
            &fixture("stranger.py"),
            "socket",
            d.join(".p.queue").to_str().unwrap()
        ]
    ));
    assert!(user_does(
        USER_A,
        "mkdir",
        &[d.join("q.lock").to_str().unwrap()]
    ));
    let (_locked, locker) = stranger_holds(
        s,
        USER_A,
        &["flock", d.join("q.lock").to_str().unwrap()],
        "q",
    );
    let out = s.run(&["setup", "p", "q"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(
        said.contains("p.lock: replaced a FIFO owned by nobody"),
        "{said}"
    );
    assert!(
        said.contains(".p.queue: replaced a socket owned by nobody"),
        "{said}"
    );
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "not replacing {}: a directory owned by nobody, locked by pid {locker}, nobody",
            d.join("q.lock").display()
        )),
        "{err}"
    );
    assert!(d.join("q.lock").is_dir(), "a held file is never replaced");
    assert!(s.run(&["-n", "p", "--", "true"]).status.success());
}

// ----------------------------------------------------------------------------
// 3. A stranger's locks: named, and every wait stays bounded.

test!(strangers_locks_on_the_queue_are_named_and_waits_stay_bounded, needs: [Root, Tool("setpriv")]);
pub(crate) fn strangers_locks_on_the_queue_are_named_and_waits_stay_bounded() {
    let s = Scratch::new();
    assert!(s.run(&["setup", "r", "r2"]).status.success());
    let queue = s.dir().join(".r.queue");
    let q = queue.to_str().unwrap();
    a_lock_on_the_old_header_changes_nothing(&s, q);
    one_ticket_byte_is_a_place_in_line_nobody_registered(&s, q);
    every_ticket_byte_blocks_the_line(&s, q);
    a_lock_over_the_slot_agreement_blocks_slots(&s, q);
    assert!(
        s.run(&["-n", "--slots", "2", "r", "--", "true"])
            .status
            .success()
    );
}

/// On the old header: nothing uses it any more.
fn a_lock_on_the_old_header_changes_nothing(s: &Scratch, q: &str) {
    let (_lock, pid) = stranger_holds(s, USER_A, &["ofd", q, "0", "4096", "write"], "a");
    for args in [
        vec!["-w", "3s", "r", "--", "true"],
        vec!["-n", "--any", "r", "r2", "--", "true"],
        vec!["-n", "--slots", "2", "r", "--", "true"],
        vec!["-n", "r", "--", "true"],
    ] {
        let out = s.run(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    let view = s.resource_status("r");
    let foreign = &view["foreign_locks"][0];
    assert_eq!(
        (foreign["range"].as_str(), foreign["pid"].as_u64()),
        (Some("0-4095"), Some(u64::from(pid))),
        "{view}"
    );
    assert_eq!(foreign["user"], "nobody");
    assert_eq!(foreign["effect"], "none");
    release(s, "a");
}

/// One ticket byte: a place in line nobody registered, ahead of all.
fn one_ticket_byte_is_a_place_in_line_nobody_registered(s: &Scratch, q: &str) {
    let at = (SLOT_BASE + 1).to_string();
    let (_lock, pid) = stranger_holds(s, USER_A, &["ofd", q, &at, "1", "write"], "b");
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let err = one_line(&out);
    assert!(
        err.contains(&format!(
            "r is busy: 1 already waiting in line (a place in line held by pid {pid}, nobody, not a registered devlock)"
        )),
        "{err}"
    );
    let view = s.resource_status("r");
    let w = &view["waiters"][0];
    assert_eq!(
        (w["source"].as_str(), w["pid"].as_u64(), w["user"].as_str()),
        (Some("unregistered"), Some(u64::from(pid)), Some("nobody")),
        "{view}"
    );
    // Another user cannot see whose it is, and says so.
    let as_b = status_as(s, USER_B, "r");
    assert!(as_b["waiters"][0]["pid"].is_null(), "{as_b}");
    let timed = s.run(&["-w", "300ms", "r", "--", "true"]);
    assert_eq!(timed.status.code(), Some(75), "{}", stderr(&timed));
    assert!(
        stderr(&timed).contains(&format!(
            "timed out after 300ms waiting for r: a place in line held by pid {pid}, nobody"
        )),
        "{}",
        stderr(&timed)
    );
    // A stop signal ends the wait at once.
    let mut waiter = Killed(
        s.devlock()
            .args(["-q", "r", "--", "true"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_blocked(&s.lock_path("r"), 1);
    signal(waiter.id(), libc::SIGTERM);
    let ended = wait_child(&mut waiter.0);
    assert!(
        ended.code() == Some(143) || ended.signal() == Some(libc::SIGTERM),
        "{ended:?}"
    );
    release(s, "b");
}

/// Every ticket byte: no place in line can be had while it is there:
/// the resource is in use, as if a job held it, bounded like any wait.
fn every_ticket_byte_blocks_the_line(s: &Scratch, q: &str) {
    let at = (SLOT_BASE + 1).to_string();
    let (_lock, pid) = stranger_holds(s, USER_A, &["ofd", q, &at, "0", "write"], "c");
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let out = s.run(&["-w", "300ms", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!(
            "its line is blocked by a lock that is not devlock's on bytes 1048577-EOF of {q} (pid {pid}, nobody)"
        )),
        "{}",
        stderr(&out)
    );
    let view = s.resource_status("r");
    assert_eq!(
        view["foreign_locks"][0]["effect"], "blocks the line",
        "{view}"
    );
    let table = stdout(&s.run(&["status", "r"]));
    assert!(
        table.contains(&format!(
            "warning: r: a write lock that is not devlock's on bytes 1048577-EOF of {q} (pid {pid}, nobody): blocks the line"
        )),
        "{table}"
    );
    release(s, "c");
}

/// Over the slot agreement.
fn a_lock_over_the_slot_agreement_blocks_slots(s: &Scratch, q: &str) {
    let (start, len) = (AGREE_BASE.to_string(), (1u64 << 16).to_string());
    let (_lock, _) = stranger_holds(s, USER_A, &["ofd", q, &start, &len, "write"], "d");
    let out = s.run(&["-w", "300ms", "--slots", "2", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("blocked by a lock that is not devlock's on bytes 4096-69631"),
        "{}",
        stderr(&out)
    );
    release(s, "d");
}
