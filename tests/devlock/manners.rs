//! Conventions people bring from flock(1), timeout(1) and the shell:
//! durations, usage errors that say what to do, empty variables, the
//! exported directory, -q, and a typo found before the wait.

use std::os::unix::ffi::OsStrExt;
use std::process::Command;

use crate::harness::*;

#[test]
fn a_bare_number_is_seconds_wherever_a_duration_is_taken() {
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

#[test]
fn every_usage_error_names_the_flag_and_the_fix() {
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
            vec!["--dir", "", "r", "--", "true"],
            &["--dir needs a directory"],
        ),
        (
            vec!["-w", "soon", "r", "--", "true"],
            &["'soon'", "a bare number is seconds"],
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
    }
    assert!(
        !s.dir().exists(),
        "a usage error touched the scratch directory"
    );
}

#[test]
fn an_empty_devlock_variable_counts_as_unset() {
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
    assert_eq!(json["dir"], devlock::scratch::DEFAULT_DIR);
}

#[test]
fn devlock_dir_is_exported_absolute_and_byte_exact() {
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

#[test]
fn quiet_keeps_a_busy_lock_to_the_exit_status_but_says_errors() {
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

#[test]
fn a_missing_or_unrunnable_command_fails_before_joining_the_line() {
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
