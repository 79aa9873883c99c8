//! Many devices, fair lines: groups and members, several resources without
//! deadlock, --any, shared mode, slots and first-come first-served.

use std::process::{Child, Command, Stdio};

use crate::harness::*;

fn no_wait(s: &Scratch, args: &[&str]) -> Option<i32> {
    let mut all = vec!["-n"];
    all.extend(args);
    all.extend(["--", "true"]);
    s.run(&all).status.code()
}

/// Starts a waiter whose command appends `TAG` to `log`.
fn logging_waiter(s: &Scratch, args: &[&str], tag: &str) -> Child {
    s.devlock()
        .arg("-q")
        .args(args)
        .args([
            "--",
            "sh",
            "-c",
            &format!("echo {tag} >> {}", s.work("log").display()),
        ])
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

fn log(s: &Scratch) -> String {
    std::fs::read_to_string(s.work("log")).unwrap_or_default()
}

fn waiters_of(s: &Scratch, name: &str) -> usize {
    s.resource_status(name)["waiters"]
        .as_array()
        .map_or(0, Vec::len)
}

test!(a_whole_group_excludes_its_members_and_members_share_the_box, needs: []);
pub(crate) fn a_whole_group_excludes_its_members_and_members_share_the_box() {
    let s = Scratch::new();
    let mut whole = hold_until_released(&s, &["gpu"], "g");
    assert_eq!(no_wait(&s, &["gpu:0"]), Some(75));
    assert_eq!(no_wait(&s, &["gpu:3"]), Some(75));
    release(&s, "g");
    wait_child(&mut whole);

    let mut member = hold_until_released(&s, &["gpu:0"], "m");
    assert_eq!(
        no_wait(&s, &["gpu"]),
        Some(75),
        "a member excludes the whole group"
    );
    assert_eq!(no_wait(&s, &["gpu:0"]), Some(75));
    assert_eq!(
        no_wait(&s, &["gpu:1"]),
        Some(0),
        "another member runs beside it"
    );
    let json = s.status_json(&["gpu", "gpu:0"]);
    let group = &json["resources"][0];
    assert_eq!(
        (group["name"].as_str(), group["state"].as_str()),
        (Some("gpu"), Some("shared"))
    );
    assert_eq!(group["holders"][0]["via"], "gpu:0");
    assert_eq!(group["holders"][0]["pid"], member.id());
    assert_eq!(json["resources"][1]["state"], "held");
    let table = stdout(&s.run(&["status", "gpu"]));
    assert!(
        table.contains("shared by 1") && table.contains("(via gpu:0)"),
        "{table}"
    );
    release(&s, "m");
    wait_child(&mut member);
}

test!(opposite_orders_never_deadlock, needs: []);
pub(crate) fn opposite_orders_never_deadlock() {
    let s = Scratch::new();
    let rounds = 150;
    let spawn = |order: &str| {
        Command::new("sh")
            .args([
                "-c",
                &format!("for i in $(seq {rounds}); do {BIN} -q {order} -- true || exit 1; done"),
            ])
            .env("DEVLOCK_DIR", s.dir())
            .spawn()
            .unwrap()
    };
    let mut ab = spawn("a b");
    let mut ba = spawn("b a");
    assert!(wait_child(&mut ab).success());
    assert!(wait_child(&mut ba).success());
}

test!(no_wait_and_timeout_release_what_they_took, needs: []);
pub(crate) fn no_wait_and_timeout_release_what_they_took() {
    let s = Scratch::new();
    let mut b = hold_until_released(&s, &["b"], "b");
    assert_eq!(no_wait(&s, &["a", "b"]), Some(75));
    assert!(
        flock_is_free(&s.lock_path("a")),
        "a was taken and not given back"
    );
    let timed = s.run(&["-w", "100ms", "b", "a", "--", "true"]);
    assert_eq!(timed.status.code(), Some(75));
    assert!(flock_is_free(&s.lock_path("a")));
    release(&s, "b");
    wait_child(&mut b);
}

test!(any_takes_a_free_member_and_tells_the_command, needs: []);
pub(crate) fn any_takes_a_free_member_and_tells_the_command() {
    let s = Scratch::new();
    let mut busy = hold_until_released(&s, &["gpu:0"], "0");
    let show = "echo $DEVLOCK_RESOURCES/$CUDA_VISIBLE_DEVICES/$CUDA_DEVICE_ORDER";
    let out = s.run(&["--any", "gpu:0", "gpu:1", "gpu:2", "--", "sh", "-c", show]);
    assert_eq!(
        stdout(&out).trim(),
        "gpu:1/1/PCI_BUS_ID",
        "{}",
        stderr(&out)
    );
    let out = s.run(&[
        "--any", "--count", "2", "gpu:3", "gpu:2", "gpu:1", "gpu:0", "--", "sh", "-c", show,
    ]);
    assert_eq!(
        stdout(&out).trim(),
        "gpu:1 gpu:2/1,2/PCI_BUS_ID",
        "{}",
        stderr(&out)
    );
    let out = s.run(&["gpu:2", "gpu:1", "--", "sh", "-c", show]);
    assert_eq!(
        stdout(&out).trim(),
        "gpu:1 gpu:2/1,2/PCI_BUS_ID",
        "plain form too"
    );
    assert_eq!(no_wait(&s, &["--any", "gpu:0"]), Some(75));
    release(&s, "0");
    wait_child(&mut busy);
}

test!(any_waits_for_the_first_to_come_free_in_arrival_order, needs: []);
pub(crate) fn any_waits_for_the_first_to_come_free_in_arrival_order() {
    let s = Scratch::new();
    let mut h0 = hold_until_released(&s, &["gpu:0"], "0");
    let mut h1 = hold_until_released(&s, &["gpu:1"], "1");
    let mut first = logging_waiter(&s, &["--any", "gpu:0", "gpu:1"], "first");
    s.wait_for_status("gpu:1", "first --any waiter", |v| {
        registered_waiters(v) == 1
    });
    let mut second = logging_waiter(&s, &["--any", "gpu:0", "gpu:1"], "second");
    s.wait_for_status("gpu:1", "second --any waiter", |v| {
        registered_waiters(v) == 2
    });
    release(&s, "1");
    wait_child(&mut h1);
    assert!(wait_child(&mut first).success());
    assert!(wait_child(&mut second).success());
    assert_eq!(
        log(&s),
        "first\nsecond\n",
        "the earlier --any job goes first"
    );
    release(&s, "0");
    wait_child(&mut h0);
}

test!(shared_holders_run_together_and_an_exclusive_one_alone, needs: []);
pub(crate) fn shared_holders_run_together_and_an_exclusive_one_alone() {
    let s = Scratch::new();
    let mut reader = hold_until_released(&s, &["-s", "dataset"], "r");
    assert_eq!(no_wait(&s, &["-s", "dataset"]), Some(0), "readers share");
    assert_eq!(
        no_wait(&s, &["dataset"]),
        Some(75),
        "a writer waits for readers"
    );
    let mut second = hold_until_released(&s, &["--shared", "dataset"], "r2");
    let view = s.resource_status("dataset");
    assert_eq!(view["state"], "shared");
    assert_eq!(view["holders"].as_array().unwrap().len(), 2, "{view}");
    assert!(
        view["holders"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h["step"] == "sh"),
        "{view}"
    );
    let table = stdout(&s.run(&["status", "dataset"]));
    assert!(table.contains("shared by 2"), "{table}");
    release(&s, "r");
    release(&s, "r2");
    wait_child(&mut reader);
    wait_child(&mut second);
    let mut writer = hold_until_released(&s, &["dataset"], "w");
    assert_eq!(
        no_wait(&s, &["-s", "dataset"]),
        Some(75),
        "a writer excludes readers"
    );
    release(&s, "w");
    wait_child(&mut writer);
}

test!(a_waiting_writer_is_not_starved_by_new_readers, needs: []);
pub(crate) fn a_waiting_writer_is_not_starved_by_new_readers() {
    let s = Scratch::new();
    let mut reader = hold_until_released(&s, &["-s", "dataset"], "r");
    let mut writer = logging_waiter(&s, &["dataset"], "writer");
    s.wait_for_status("dataset", "the writer in line", |v| {
        registered_waiters(v) == 1
    });
    // New readers queue behind the waiting writer instead of joining in.
    assert_eq!(no_wait(&s, &["-s", "dataset"]), Some(75));
    let mut late_reader = logging_waiter(&s, &["-s", "dataset"], "reader");
    s.wait_for_status("dataset", "the late reader in line", |v| {
        registered_waiters(v) == 2
    });
    let view = s.resource_status("dataset");
    assert_eq!(view["waiters"][0]["position"], 1);
    assert_eq!(view["waiters"][1]["position"], 2);
    release(&s, "r");
    wait_child(&mut reader);
    assert!(wait_child(&mut writer).success());
    assert!(wait_child(&mut late_reader).success());
    assert_eq!(log(&s), "writer\nreader\n");
}

test!(a_waiter_is_not_overtaken_by_a_tight_retry_loop, needs: []);
pub(crate) fn a_waiter_is_not_overtaken_by_a_tight_retry_loop() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let mut waiter = logging_waiter(&s, &["r"], "waiter");
    wait_blocked(&s.lock_path("r"), 1);
    // A pushy job that re-asks as fast as it can until the waiter has run.
    let pushy = format!(
        "while [ ! -s {log} ]; do {BIN} -q -n r -- sh -c 'echo pushy >> {log}'; done",
        log = s.work("log").display()
    );
    let mut pusher = Command::new("sh")
        .args(["-c", &pushy])
        .env("DEVLOCK_DIR", s.dir())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    release(&s, "h");
    wait_child(&mut holder);
    assert!(wait_child(&mut waiter).success());
    wait_child(&mut pusher);
    assert!(log(&s).starts_with("waiter\n"), "overtaken: {:?}", log(&s));
}

test!(a_waiter_killed_in_line_never_blocks_the_line, needs: []);
pub(crate) fn a_waiter_killed_in_line_never_blocks_the_line() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let mut doomed = logging_waiter(&s, &["r"], "doomed");
    s.wait_for_status("r", "first waiter", |v| registered_waiters(v) == 1);
    let mut next = logging_waiter(&s, &["r"], "next");
    s.wait_for_status("r", "second waiter", |v| registered_waiters(v) == 2);
    doomed.kill().unwrap();
    doomed.wait().unwrap();
    assert_eq!(waiters_of(&s, "r"), 1);
    release(&s, "h");
    wait_child(&mut holder);
    assert!(wait_child(&mut next).success());
    assert_eq!(log(&s), "next\n");
}

test!(slots_admit_up_to_n_and_everyone_must_agree_on_n, needs: []);
pub(crate) fn slots_admit_up_to_n_and_everyone_must_agree_on_n() {
    let s = Scratch::new();
    let slot_of = |tag: &str| s.work(&format!("slot-{tag}"));
    let hold_slot = |tag: &str| {
        let ready = s.work(&format!("ready-{tag}"));
        let release = s.work(&format!("release-{tag}"));
        s.hold(
            &["--slots", "2", "gpu:0"],
            &format!(
                "echo $DEVLOCK_SLOT > {}; echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
                slot_of(tag).display(),
                ready.display(),
                release.display()
            ),
            &ready,
        )
    };
    let mut a = hold_slot("a");
    let mut b = hold_slot("b");
    let mut slots: Vec<String> = ["a", "b"]
        .iter()
        .map(|t| {
            std::fs::read_to_string(slot_of(t))
                .unwrap()
                .trim()
                .to_owned()
        })
        .collect();
    slots.sort();
    assert_eq!(slots, ["1", "2"]);
    assert_eq!(
        no_wait(&s, &["--slots", "2", "gpu:0"]),
        Some(75),
        "a third waits"
    );
    let mismatch = s.run(&["-n", "--slots", "3", "gpu:0", "--", "true"]);
    assert_eq!(mismatch.status.code(), Some(2));
    assert!(
        stderr(&mismatch)
            .contains("gpu:0 is in use with --slots 2, but this asks for it with --slots 3"),
        "{}",
        stderr(&mismatch)
    );
    let plain = s.run(&["-n", "gpu:0", "--", "true"]);
    assert_eq!(plain.status.code(), Some(2), "{}", stderr(&plain));
    let view = s.resource_status("gpu:0");
    assert_eq!(
        (view["state"].as_str(), view["slots"].as_u64()),
        (Some("shared"), Some(2))
    );
    assert!(
        view["holders"]
            .as_array()
            .unwrap()
            .iter()
            .all(|h| h["pids"] == serde_json::json!([h["pid"]]) && h["command"][0] == "sh"),
        "each slot holder's label names its command, which is its devlock's process: {view}"
    );
    let mut held_slots: Vec<u64> = view["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["slot"].as_u64().unwrap())
        .collect();
    held_slots.sort();
    assert_eq!(held_slots, [1, 2]);
    assert!(stdout(&s.run(&["status"])).contains("shared by 2 (2 slots)"));
    // A waiter gets the slot that comes free.
    let mut c = logging_waiter(&s, &["--slots", "2", "gpu:0"], "third");
    s.wait_for_status("gpu:0", "third in line", |v| registered_waiters(v) == 1);
    release(&s, "a");
    wait_child(&mut a);
    assert!(wait_child(&mut c).success());
    release(&s, "b");
    wait_child(&mut b);
    // Once nobody uses it, another size may be chosen.
    assert_eq!(no_wait(&s, &["--slots", "3", "gpu:0"]), Some(0));
}

test!(bad_combinations_are_usage_errors, needs: []);
pub(crate) fn bad_combinations_are_usage_errors() {
    let s = Scratch::new();
    for args in [
        vec!["--count", "2", "a", "--", "true"],
        vec!["--any", "--count", "3", "a", "b", "--", "true"],
        vec!["--slots", "0", "a", "--", "true"],
        vec!["--slots", "2", "a", "b", "--", "true"],
        vec!["--slots", "2", "--shared", "a", "--", "true"],
        vec!["--report-every", "0s", "a", "--", "true"],
    ] {
        let out = s.run(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).starts_with("devlock: "));
    }
}

test!(any_takes_a_members_group_only_with_the_member_it_picks, needs: []);
pub(crate) fn any_takes_a_members_group_only_with_the_member_it_picks() {
    let s = Scratch::new();
    let mut b = hold_until_released(&s, &["b"], "b");
    // b is held whole, so b:1 cannot be had; a:1 can, and a --any must not
    // sit on b's group meanwhile.
    let out = s.run(&[
        "--any",
        "a:1",
        "b:1",
        "--",
        "sh",
        "-c",
        "echo $DEVLOCK_RESOURCES",
    ]);
    assert_eq!(stdout(&out).trim(), "a:1", "{}", stderr(&out));
    let mut g0 = hold_until_released(&s, &["gpu:0"], "g0");
    let mut g1 = hold_until_released(&s, &["gpu:1"], "g1");
    // The whole group is not free while members are held, whatever this
    // run took on the way.
    assert_eq!(no_wait(&s, &["--any", "gpu", "gpu:1"]), Some(75));
    for tag in ["b", "g0", "g1"] {
        release(&s, tag);
    }
    for child in [&mut b, &mut g0, &mut g1] {
        wait_child(child);
    }
}

test!(any_count_and_ordered_jobs_do_not_deadlock, needs: []);
pub(crate) fn any_count_and_ordered_jobs_do_not_deadlock() {
    let s = Scratch::new();
    let rounds = 40;
    let spawn = |args: &str| {
        Command::new("sh")
            .args([
                "-c",
                &format!("for i in $(seq {rounds}); do {BIN} -q {args} -- true || exit 1; done"),
            ])
            .env("DEVLOCK_DIR", s.dir())
            .spawn()
            .unwrap()
    };
    let mut any = spawn("--any --count 2 a:1 b:1");
    let mut ordered = spawn("a:1 b");
    let mut other = spawn("b:1 a");
    for child in [&mut any, &mut ordered, &mut other] {
        assert!(wait_child(child).success());
    }
}

test!(every_exit_before_the_command_removes_what_the_run_made, needs: []);
/// A run that ends before its command starts — `-w` running out, `-n`,
/// SIGINT or SIGTERM while it waits (with and without `-q`), for one
/// resource or several (a member and, shared, its group) — leaves nothing
/// behind it but lock files.
pub(crate) fn every_exit_before_the_command_removes_what_the_run_made() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["gpu:0"], "h");
    let cases: Vec<(Vec<&str>, Option<i32>)> = vec![
        (vec!["-q", "-w", "0.5", "gpu:0"], None),
        (vec!["-w", "0.5", "gpu:1", "gpu:0"], None),
        (vec!["-n", "gpu:1", "gpu:0"], None),
        (vec!["-q", "gpu:0"], Some(libc::SIGINT)),
        (vec!["gpu:1", "gpu:0"], Some(libc::SIGTERM)),
        (vec!["-q", "-w", "1h", "gpu:0"], Some(libc::SIGHUP)),
    ];
    for (args, sig) in cases {
        let mut run = s
            .devlock()
            .args(&args)
            .args(["--", "true"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = run.id();
        if let Some(sig) = sig {
            // In line (its registration is there), then the signal.
            poll_until(
                "the waiter's registration",
                || made_by(&s, pid).len(),
                |n| *n > 0,
            );
            signal(pid, sig);
        }
        let status = wait_child(&mut run);
        assert!(!status.success(), "{args:?}");
        assert_eq!(made_by(&s, pid), Vec::<String>::new(), "{args:?}, {sig:?}");
    }
    release(&s, "h");
    assert!(wait_child(&mut holder).success());
}

test!(a_whole_group_waits_for_a_plain_flock_holder_of_a_member, needs: [Tool("flock")]);
/// Teams move from util-linux flock one script at a time: a colleague's
/// `flock gpu:0.lock ...` keeps `devlock gpu` out as it keeps `devlock
/// gpu:0` out. `-n` names the member's holder; a waiter's command starts
/// only once flock lets go.
pub(crate) fn a_whole_group_waits_for_a_plain_flock_holder_of_a_member() {
    let s = Scratch::new();
    // The member's file exists, as after any earlier `devlock gpu:0`.
    assert!(s.run(&["gpu:0", "--", "true"]).status.success());
    let (script, ready) = wait_for_release(&s, "f");
    let mut flock = Killed(
        Command::new("/usr/bin/flock")
            .arg(s.lock_path("gpu:0"))
            .args(["sh", "-c", &script])
            .spawn()
            .unwrap(),
    );
    wait_for_file(&ready);
    let busy = s.run(&["-n", "gpu", "--", "true"]);
    let err = stderr(&busy);
    assert_eq!(busy.status.code(), Some(75), "{err}");
    assert!(
        err.contains("gpu is busy, through its member gpu:0: held by pid")
            && err.contains(&format!("pid {}", flock.id())),
        "{err}"
    );
    let ran = s.work("ran");
    let mut waiter = s
        .devlock()
        .args(["-q", "gpu", "--", "touch"])
        .arg(&ran)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("gpu:0"), 1);
    assert!(
        !ran.exists(),
        "the group's command ran beside flock's holder"
    );
    release(&s, "f");
    assert!(wait_child(&mut flock.0).success());
    assert!(wait_child(&mut waiter).success());
    assert!(ran.exists());
}
