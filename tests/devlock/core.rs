//! The core: exclusion, interop with util-linux flock, exit codes, signals,
//! kill -9, nested use, unsafe files and bad input.

use std::io::BufReader;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};

use crate::harness::*;

mod build;
mod files;
mod nesting;
mod signals;
mod waits;

test!(many_processes_never_overlap_in_a_read_modify_write, needs: []);
pub(crate) fn many_processes_never_overlap_in_a_read_modify_write() {
    let s = Scratch::new();
    let counter = s.work("counter");
    std::fs::write(&counter, "0").unwrap();
    // Each section reads, yields (so a missing lock would interleave), writes.
    let section = format!(
        "n=$(cat {c}); sleep 0.001; echo $((n+1)) > {c}",
        c = counter.display()
    );
    let loops: Vec<_> = (0..6)
        .map(|_| {
            let script = format!(
                "for i in 1 2 3 4 5 6 7 8 9 10; do {bin} -q r -- sh -c '{section}' || exit 1; done",
                bin = BIN
            );
            let mut cmd = Command::new("sh");
            cmd.args(["-c", &script]).env("DEVLOCK_DIR", s.dir());
            cmd.spawn().unwrap()
        })
        .collect();
    for mut child in loops {
        assert!(wait_child(&mut child).success());
    }
    assert_eq!(std::fs::read_to_string(&counter).unwrap().trim(), "60");
}

test!(flock_holder_blocks_devlock_and_is_named, needs: []);
pub(crate) fn flock_holder_blocks_devlock_and_is_named() {
    let s = Scratch::new();
    std::fs::create_dir(s.dir()).unwrap();
    let ready = s.work("ready");
    let release = s.work("release");
    let mut holder = Command::new("/usr/bin/flock")
        .arg(s.lock_path("r"))
        .args([
            "sh",
            "-c",
            &format!(
                "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
                ready.display(),
                release.display()
            ),
        ])
        .spawn()
        .unwrap();
    wait_for_file(&ready);
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(75));
    let err = stderr(&out);
    assert!(err.starts_with("devlock: r is busy: held by pid "), "{err}");
    assert!(
        err.contains(&holder.id().to_string()),
        "names the flock pid: {err}"
    );
    assert_eq!(err.lines().count(), 1);
    std::fs::write(&release, "").unwrap();
    assert!(wait_child(&mut holder).success());
    assert!(s.run(&["-n", "r", "--", "true"]).status.success());
}

test!(devlock_holder_blocks_flock, needs: []);
pub(crate) fn devlock_holder_blocks_flock() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let mut holder = s.hold(
        &["r"],
        &format!(
            "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
            ready.display(),
            release.display()
        ),
        &ready,
    );
    assert!(!flock_is_free(&s.lock_path("r")));
    std::fs::write(&release, "").unwrap();
    assert!(wait_child(&mut holder).success());
    assert!(flock_is_free(&s.lock_path("r")));
}

test!(exit_status_is_passed_on, needs: []);
pub(crate) fn exit_status_is_passed_on() {
    let s = Scratch::new();
    let code = |args: &[&str]| s.run(args).status.code();
    assert_eq!(code(&["r", "--", "sh", "-c", "exit 0"]), Some(0));
    assert_eq!(code(&["r", "--", "sh", "-c", "exit 3"]), Some(3));
    // Killed by a signal, the command is devlock's process: its status says
    // so itself (a shell shows 143).
    let killed = s.run(&["r", "--", "sh", "-c", "kill -TERM $$"]).status;
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&killed),
        Some(libc::SIGTERM)
    );
    let killed = s.run(&["r", "--", "sh", "-c", "kill -KILL $$"]).status;
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&killed),
        Some(libc::SIGKILL)
    );
    let missing = s.run(&["r", "--", "no-such-command-devlock"]);
    assert_eq!(missing.status.code(), Some(127));
    assert!(stderr(&missing).contains("no-such-command-devlock: command not found"));
    let not_exec = s.work("not-executable");
    std::fs::write(&not_exec, "#!/bin/sh\n").unwrap();
    let denied = s.run(&["r", "--", not_exec.to_str().unwrap()]);
    assert_eq!(denied.status.code(), Some(126));
    assert!(
        stderr(&denied).contains("cannot execute"),
        "{}",
        stderr(&denied)
    );
    // The lock was released each time.
    assert!(flock_is_free(&s.lock_path("r")));
}

test!(command_learns_what_it_holds, needs: []);
pub(crate) fn command_learns_what_it_holds() {
    let s = Scratch::new();
    let out = s.run(&[
        "gpu:1",
        "--",
        "sh",
        "-c",
        "echo $DEVLOCK_RESOURCES/$CUDA_VISIBLE_DEVICES/$CUDA_DEVICE_ORDER/$DEVLOCK_STEP",
    ]);
    assert_eq!(stdout(&out).trim(), "gpu:1/1/PCI_BUS_ID/sh");
}

test!(a_script_without_an_interpreter_line_runs_with_sh, needs: []);
/// As execvp(3) (which util-linux flock calls) does it: an executable text
/// file with no `#!` line is run by /bin/sh, found on PATH or by its path.
pub(crate) fn a_script_without_an_interpreter_line_runs_with_sh() {
    use std::os::unix::fs::PermissionsExt;
    let s = Scratch::new();
    let bin = s.work("bin");
    std::fs::create_dir(&bin).unwrap();
    let script = bin.join("plain-script");
    std::fs::write(&script, "echo ran \"$1\"\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let by_path = s.run(&["r", "--", script.to_str().unwrap(), "by-path"]);
    assert!(by_path.status.success(), "{}", stderr(&by_path));
    assert_eq!(stdout(&by_path), "ran by-path\n");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let by_name = s
        .devlock()
        .args(["r", "--", "plain-script", "by-name"])
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(by_name.status.success(), "{}", stderr(&by_name));
    assert_eq!(stdout(&by_name), "ran by-name\n");
}

test!(command_gets_the_callers_environment_with_the_jobs_over_it, needs: []);
/// devlock passes its environment on as it got it, byte for byte, with the
/// job's variables (`DEVLOCK_*`, the GPUs') in place of any of their names.
pub(crate) fn command_gets_the_callers_environment_with_the_jobs_over_it() {
    use std::os::unix::ffi::OsStrExt;
    let s = Scratch::new();
    let bytes = std::ffi::OsStr::from_bytes(b"caf\xe9 = x");
    let out = s
        .devlock()
        .args(["gpu:1", "--", "cat", "/proc/self/environ"])
        .env("NOT_UTF8", bytes)
        .env("DEVLOCK_STEP", "an outer step")
        .env("DEVLOCK_RESOURCES", "an outer lock")
        .env("DEVLOCK_STE", "a shorter name")
        .env("DEVLOCK_STEPS", "a longer name")
        .env("EMPTY", "")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let entries: Vec<&[u8]> = out
        .stdout
        .split(|&b| b == 0)
        .filter(|e| !e.is_empty())
        .collect();
    let values = |name: &str| -> Vec<&[u8]> {
        let prefix = [name.as_bytes(), b"="].concat();
        entries
            .iter()
            .filter_map(|e| e.strip_prefix(prefix.as_slice()))
            .collect()
    };
    // The caller's, byte for byte; the job's own replace the caller's
    // (once each), and a name that only starts like one of them is kept.
    assert_eq!(values("NOT_UTF8"), vec![b"caf\xe9 = x".as_slice()]);
    assert_eq!(values("DEVLOCK_STEP"), vec![b"cat".as_slice()]);
    assert_eq!(values("CUDA_VISIBLE_DEVICES"), vec![b"1".as_slice()]);
    assert_eq!(values("DEVLOCK_RESOURCES"), vec![b"gpu:1".as_slice()]);
    assert_eq!(values("DEVLOCK_STE"), vec![b"a shorter name".as_slice()]);
    assert_eq!(values("DEVLOCK_STEPS"), vec![b"a longer name".as_slice()]);
    assert_eq!(values("EMPTY"), vec![b"".as_slice()]);
    assert!(values("PATH").len() == 1, "{entries:?}");
}
