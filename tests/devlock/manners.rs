//! Conventions people bring from flock(1), timeout(1) and the shell:
//! durations, usage errors that say what to do, empty variables, the
//! exported directory, -q, and a typo found before the wait.

use std::io::BufReader;
use std::os::unix::ffi::OsStrExt;
use std::process::{Command, Stdio};

use crate::harness::*;

test!(a_bare_number_is_seconds_wherever_a_duration_is_taken, needs: []);
pub(crate) fn a_bare_number_is_seconds_wherever_a_duration_is_taken() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "long", "r"], "h");
    let out = s.run(&["-w", "1", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("timed out after 1s waiting for r"),
        "{}",
        stderr(&out)
    );
    let fractional = s.run(&["-w", "0.2", "r", "--", "true"]);
    assert!(
        stderr(&fractional).contains("timed out after 200ms"),
        "{}",
        stderr(&fractional)
    );
    for args in [
        vec!["--report-every", "1", "-n", "free", "--", "true"],
        vec!["--probe-timeout", "2", "status", "free"],
    ] {
        let out = s.run(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    release(&s, "h");
    wait_child(&mut holder);
}

test!(every_usage_error_names_the_flag_and_the_fix, needs: []);
pub(crate) fn every_usage_error_names_the_flag_and_the_fix() {
    let s = Scratch::new();
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec!["--count", "2", "a", "b", "--", "true"],
            &["--count needs --any"],
        ),
        (
            vec!["--nowait", "r", "--", "true"],
            &["'--nowait'", "did you mean '--no-wait'?"],
        ),
        (
            vec!["-n", "-w", "5", "r", "--", "true"],
            &["--no-wait and --timeout", "give one of them"],
        ),
        (
            vec!["--idle-threshold", "1GiB", "gpu", "--", "true"],
            &["--idle-threshold needs --require-idle"],
        ),
        (
            vec!["--conflict-exit-code", "0", "r", "--", "true"],
            &["--conflict-exit-code 0", "1-255"],
        ),
        (
            vec!["status", "--", "echo", "hi"],
            &["runs nothing", "devlock RESOURCE -- echo hi"],
        ),
        (
            vec!["gpu", "status", "--", "true"],
            &["status is the name of devlock's subcommand", "status-lock"],
        ),
        (
            vec!["gpu", "setup", "--", "true"],
            &["setup is the name of devlock's subcommand", "setup-lock"],
        ),
        (
            vec!["setup", "gpu", "status"],
            &["status is the name of devlock's subcommand", "status-lock"],
        ),
        (
            vec!["--dir", "", "r", "--", "true"],
            &["--dir needs a directory"],
        ),
        (
            vec!["-w", "soon", "r", "--", "true"],
            &["'soon'", "a bare number is seconds"],
        ),
        (
            vec!["-w", "5x", "r", "--", "true"],
            &["'5x'", "not a duration"],
        ),
        (
            vec!["status", "-n"],
            &["'-n'", "(see devlock status --help)"],
        ),
        (vec!["setup", "--bogus"], &["(see devlock setup --help)"]),
        (
            vec!["--bogus", "r", "--", "true"],
            &["(see devlock --help)"],
        ),
    ];
    for (args, wants) in cases {
        let out = s.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            stdout(&out).is_empty(),
            "{args:?} printed: {}",
            stdout(&out)
        );
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.starts_with("devlock: "), "{args:?}: {err}");
        for want in wants {
            assert!(err.contains(want), "{args:?}: no {want:?} in {err}");
        }
        // One hint a message, never stacked: at most one parenthesis at the
        // end, and none beside a did-you-mean.
        assert!(
            err.matches(" (").count() <= 1
                && !(err.contains("did you mean") && err.contains(" (see")),
            "{args:?}: one hint: {err}"
        );
        assert!(!err.contains("few variations"), "{args:?}: {err}");
    }
    assert!(
        !s.dir().exists(),
        "a usage error touched the scratch directory"
    );
}

test!(an_empty_devlock_variable_counts_as_unset, needs: []);
pub(crate) fn an_empty_devlock_variable_counts_as_unset() {
    let s = Scratch::new();
    let out = s
        .devlock()
        .env("DEVLOCK_ETCD", "")
        .env("DEVLOCK_ETCD_USER", "")
        .env("DEVLOCK_NVIDIA_SMI", "")
        .args(["r", "--", "echo", "ran"])
        .output()
        .unwrap();
    assert_eq!(stdout(&out).trim(), "ran", "{}", stderr(&out));
    // An empty DEVLOCK_DIR is the default directory (status only reads it).
    let out = s
        .devlock()
        .env("DEVLOCK_DIR", "")
        .args(["status", "--json", "r"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["dir"], devlock::DEFAULT_DIR);
}

test!(devlock_dir_is_exported_absolute_and_byte_exact, needs: []);
pub(crate) fn devlock_dir_is_exported_absolute_and_byte_exact() {
    let s = Scratch::new();
    // A relative --dir whose name is not UTF-8.
    let name = std::ffi::OsStr::from_bytes(b"locks-\xff");
    let got = s.work("got");
    let mut cmd = Command::new(BIN);
    cmd.current_dir(s.root.path())
        .env_remove("DEVLOCK_DIR")
        .arg("--dir")
        .arg(name)
        .args(["r", "--", "sh", "-c"])
        .arg(format!(
            "printf %s \"$DEVLOCK_DIR\" > {got}; cd /; exec {BIN} -n r -- echo inner",
            got = got.display()
        ));
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&got).unwrap(),
        s.root.path().join(name).as_os_str().as_bytes(),
        "exported as an absolute path, byte for byte"
    );
    assert_eq!(
        stdout(&out).trim(),
        "inner",
        "the nested devlock found the same gate from another directory"
    );
}

test!(quiet_keeps_a_busy_lock_to_the_exit_status_but_says_errors, needs: []);
pub(crate) fn quiet_keeps_a_busy_lock_to_the_exit_status_but_says_errors() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    for args in [
        vec!["-n", "-q", "r", "--", "true"],
        vec!["-q", "-w", "100ms", "r", "--", "true"],
        vec!["-q", "-n", "--any", "r", "--", "true"],
    ] {
        let out = s.run(&args);
        assert_eq!(out.status.code(), Some(75), "{args:?}");
        assert_eq!(stderr(&out), "", "{args:?}");
    }
    let missing = s.run(&["-q", "-n", "free", "--", "no-such-command-devlock"]);
    assert_eq!(missing.status.code(), Some(127));
    assert!(stderr(&missing).contains("command not found"));
    release(&s, "h");
    wait_child(&mut holder);
}

test!(a_missing_or_unrunnable_command_fails_before_joining_the_line, needs: []);
pub(crate) fn a_missing_or_unrunnable_command_fails_before_joining_the_line() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    // The holder keeps r until released: these can only end at once.
    let missing = s.run(&["r", "--", "no-such-command-devlock"]);
    assert_eq!(missing.status.code(), Some(127), "{}", stderr(&missing));
    assert_eq!(
        stderr(&missing).trim(),
        "devlock: no-such-command-devlock: command not found"
    );
    let not_exec = s.work("not-executable");
    std::fs::write(&not_exec, "#!/bin/sh\n").unwrap();
    let denied = s.run(&["r", "--", not_exec.to_str().unwrap()]);
    assert_eq!(denied.status.code(), Some(126), "{}", stderr(&denied));
    let on_path = s
        .devlock()
        .env("PATH", s.work(""))
        .args(["r", "--", "not-executable"])
        .output()
        .unwrap();
    assert_eq!(on_path.status.code(), Some(126), "{}", stderr(&on_path));
    let view = s.resource_status("r");
    assert_eq!(view["waiters"].as_array().unwrap().len(), 0, "{view}");
    release(&s, "h");
    wait_child(&mut holder);
}

/// A devlock started with `--report-every 20ms` whose stderr the test reads.
fn reporting_waiter(
    s: &Scratch,
    args: &[&str],
) -> (std::process::Child, BufReader<std::process::ChildStderr>) {
    let mut child = s
        .devlock()
        .args(["--report-every", "20ms"])
        .args(args)
        .args(["--", "true"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = BufReader::new(child.stderr.take().unwrap());
    (child, err)
}

test!(any_failures_and_waits_name_every_holder, needs: []);
pub(crate) fn any_failures_and_waits_name_every_holder() {
    let s = Scratch::new();
    let mut train = hold_until_released(&s, &["--step", "train", "gpu:0"], "t");
    let mut eval = hold_until_released(&s, &["--step", "eval", "gpu:1"], "e");
    let busy = s.run(&["-n", "--any", "gpu:0", "gpu:1", "--", "true"]);
    assert_eq!(busy.status.code(), Some(75));
    let err = stderr(&busy);
    assert!(
        err.starts_with("devlock: all of gpu:0, gpu:1 are busy: gpu:0 held by train (pid ")
            && err.contains("; gpu:1 held by eval (pid "),
        "{err}"
    );
    let timed = s.run(&["-w", "0.1", "--any", "gpu:0", "gpu:1", "--", "true"]);
    let err = stderr(&timed);
    assert!(
        err.contains(
            "timed out after 100ms waiting for any of gpu:0 gpu:1: gpu:0 held by train (pid "
        ) && err.contains("gpu:1 held by eval (pid "),
        "{err}"
    );
    let (mut waiter, mut err) = reporting_waiter(&s, &["--any", "gpu:0", "gpu:1"]);
    let line = wait_for_line(&mut err, "waiting");
    assert!(
        line.contains("any of gpu:0 gpu:1 · waiting ")
            && line.contains("gpu:0: train (pid ")
            && line.contains("gpu:1: eval (pid "),
        "{line}"
    );
    release(&s, "t");
    assert!(wait_child(&mut waiter).success());
    release(&s, "e");
    wait_child(&mut train);
    wait_child(&mut eval);
}

test!(a_wait_behind_a_queued_whole_group_request_names_it, needs: []);
pub(crate) fn a_wait_behind_a_queued_whole_group_request_names_it() {
    let s = Scratch::new();
    // train holds gpu:0, and so gpu shared; `whole` waits for all of gpu.
    let mut train = hold_until_released(&s, &["--step", "train", "gpu:0"], "t");
    let mut whole = s
        .devlock()
        .args(["-q", "--step", "whole", "gpu", "--", "true"])
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("gpu"), 1);
    // Named by its step once registered (between joining the line and
    // registering, the kernel names its pid only).
    s.wait_for_status("gpu", "whole registered", |v| registered_waiters(v) == 1);
    // gpu:1 is free, but its group's line has `whole` first.
    let busy = s.run(&["-n", "gpu:1", "--", "true"]);
    assert_eq!(busy.status.code(), Some(75));
    let err = stderr(&busy);
    assert!(
        err.contains("gpu:1 is busy, through its group gpu: held by train (pid ")
            && err.contains("via gpu:0")
            && err.contains("; whole (pid "),
        "{err}"
    );
    assert!(err.contains("waits in line first"), "{err}");
    let (mut waiter, mut err) = reporting_waiter(&s, &["--step", "mine", "gpu:1"]);
    let line = wait_for_line(&mut err, "waiting");
    assert!(
        line.starts_with("devlock: gpu:1 (its group gpu) · waiting ")
            && line.contains(" · behind whole (pid ")
            && line.contains("2nd in line"),
        "{line}"
    );
    release(&s, "t");
    wait_child(&mut train);
    assert!(wait_child(&mut whole).success());
    assert!(wait_child(&mut waiter).success());
}

test!(a_holder_whose_devlock_is_gone_is_called_inherited_in_messages_and_in_the_group_row, needs: []);
pub(crate) fn a_holder_whose_devlock_is_gone_is_called_inherited_in_messages_and_in_the_group_row()
{
    let s = Scratch::new();
    let ready = s.work("ready");
    let release_file = s.work("release");
    let pidfile = s.work("pid");
    let mut holder = s.hold(
        &["--step", "train", "gpu:0"],
        &format!(
            "(while [ ! -e {release} ]; do sleep 0.01; done) & echo $! > {pid}; echo > {ready}; wait",
            pid = pidfile.display(),
            ready = ready.display(),
            release = release_file.display()
        ),
        &ready,
    );
    // The command (devlock's own process) killed alone: the child it
    // started holds on through the descriptor it inherited.
    let command = pid_in(&pidfile);
    s.wait_for_status("gpu:0", "the holder's record", |v| {
        v["holders"][0]["step"] == "train"
    });
    signal(holder.id(), libc::SIGKILL);
    wait_child(&mut holder);
    let user = devlock::testing::procfs::user_name(nix::unistd::getuid().as_raw());
    let busy = s.run(&["-n", "gpu:0", "--", "true"]);
    assert_eq!(busy.status.code(), Some(75));
    assert!(
        stderr(&busy).contains(&format!(
            "gpu:0 is busy: held by train (pid {command}, {user}, inherited: its devlock is gone)"
        )),
        "{}",
        stderr(&busy)
    );
    let whole = s.run(&["-n", "gpu", "--", "true"]);
    assert!(
        stderr(&whole).contains(&format!(
            "gpu is busy: held by train (pid {command}, {user}, inherited: its devlock is gone) via gpu:0"
        )),
        "{}",
        stderr(&whole)
    );
    let group = s.resource_status("gpu");
    assert_eq!(group["holders"][0]["step"], "train", "{group}");
    assert_eq!(group["holders"][0]["source"], "inherited");
    assert_eq!(group["holders"][0]["via"], "gpu:0");
    let table = stdout(&s.run(&["status"]));
    let row = table.lines().find(|l| l.starts_with("gpu ")).unwrap();
    assert!(row.contains("train (inherited) (via gpu:0)"), "{table}");
    assert!(!table.contains("(unknown)"), "{table}");
    std::fs::write(&release_file, "").unwrap();
    wait_gone(command);
}

test!(a_group_row_borrows_only_a_label_its_member_backs, needs: []);
pub(crate) fn a_group_row_borrows_only_a_label_its_member_backs() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release_file = s.work("release");
    let pidfile = s.work("pid");
    let mut holder = s.hold(
        &["--step", "train", "gpu:0"],
        &format!(
            "(while [ ! -e {release} ]; do sleep 0.01; done) & echo $! > {pid}; echo > {ready}; wait",
            pid = pidfile.display(),
            ready = ready.display(),
            release = release_file.display()
        ),
        &ready,
    );
    // The command (devlock's own process) killed alone: the child it
    // started holds on through the descriptor it inherited.
    let command = pid_in(&pidfile);
    s.wait_for_status("gpu:0", "the holder's record", |v| {
        v["holders"][0]["step"] == "train"
    });
    signal(holder.id(), libc::SIGKILL);
    wait_child(&mut holder);
    // The group's own label, the shared hold's registration that the
    // command inherited, is gone too: someone removed the file.
    let mut removed = 0;
    for entry in std::fs::read_dir(s.dir()).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".gpu@") && name.ends_with(".hold") {
            std::fs::remove_file(entry.path()).unwrap();
            removed += 1;
        }
    }
    assert_eq!(removed, 1, "the group's hold registration");
    let group = s.resource_status("gpu");
    let h = &group["holders"][0];
    assert_eq!(
        (h["step"].as_str(), h["source"].as_str(), h["via"].as_str()),
        (Some("train"), Some("inherited"), Some("gpu:0")),
        "the member's label: {group}"
    );
    assert_eq!(h["pid"], command, "{group}");
    // A member label that its own file does not back (the record naming
    // the holding child as its command, with another start time) is not
    // borrowed either.
    let member = s.lock_path("gpu:0");
    let mut record = devlock::testing::record::read_from(&std::fs::File::open(&member).unwrap())
        .valid()
        .expect("the member's record");
    record.child = Some(command);
    record.child_start = Some(1);
    record
        .write_to(
            &std::fs::OpenOptions::new()
                .write(true)
                .open(&member)
                .unwrap(),
        )
        .unwrap();
    let view = s.resource_status("gpu:0");
    assert!(view["holders"][0]["step"].is_null(), "{view}");
    let group = s.resource_status("gpu");
    assert!(group["holders"][0]["step"].is_null(), "{group}");
    assert_eq!(group["holders"][0]["source"], "inherited", "{group}");
    std::fs::write(&release_file, "").unwrap();
    wait_gone(command);
}
