//! The core: exclusion, interop with util-linux flock, exit codes, signals,
//! kill -9, nested use, unsafe files and bad input.

use std::io::BufReader;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};

use crate::harness::*;

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

/// A script that records each TERM/INT it gets, takes its time to clean up,
/// and only then marks itself done.
fn slow_cleanup_script(s: &Scratch) -> String {
    format!(
        "trap 'echo sig >> {got}; sleep 0.3; echo > {done}; exit 0' TERM INT; echo > {ready}; \
         while :; do sleep 0.01; done",
        got = s.work("got").display(),
        done = s.work("done").display(),
        ready = s.work("ready").display(),
    )
}

fn signal_reaches_command_once_and_lock_outlives_cleanup(sig: i32) {
    let s = Scratch::new();
    let mut holder = s.hold(&["r"], &slow_cleanup_script(&s), &s.work("ready"));
    // A waiter that checks the holder had finished cleaning up when it got in.
    let mut waiter = s
        .devlock()
        .args(["-q", "r", "--", "sh", "-c"])
        .arg(format!(
            "test -e {} && echo clean > {}",
            s.work("done").display(),
            s.work("next").display()
        ))
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 1);
    // One signal, one delivery: the command is devlock's process, and
    // nobody passes on (or absorbs) a copy.
    signal(holder.id(), sig);
    let status = wait_child(&mut holder);
    assert_eq!(
        status.code(),
        Some(0),
        "devlock ends with the command's status"
    );
    assert!(
        wait_child(&mut waiter).success(),
        "waiter started before cleanup ended"
    );
    assert_eq!(
        std::fs::read_to_string(s.work("next")).unwrap().trim(),
        "clean"
    );
    assert_eq!(
        std::fs::read_to_string(s.work("got")).unwrap(),
        "sig\n",
        "delivered exactly once"
    );
}

test!(sigterm_reaches_the_command_once_and_the_next_waits_for_cleanup, needs: []);
pub(crate) fn sigterm_reaches_the_command_once_and_the_next_waits_for_cleanup() {
    signal_reaches_command_once_and_lock_outlives_cleanup(libc::SIGTERM);
}

test!(sigint_reaches_the_command_once_and_the_next_waits_for_cleanup, needs: []);
pub(crate) fn sigint_reaches_the_command_once_and_the_next_waits_for_cleanup() {
    signal_reaches_command_once_and_lock_outlives_cleanup(libc::SIGINT);
}

test!(sighup_and_sigquit_are_passed_on, needs: []);
pub(crate) fn sighup_and_sigquit_are_passed_on() {
    use std::os::unix::process::CommandExt;
    for (sig, code) in [(libc::SIGHUP, 129), (libc::SIGQUIT, 131)] {
        let s = Scratch::new();
        let ready = s.work("ready");
        let mut devlock = s.devlock();
        devlock
            .args(["r", "--", "sh", "-c"])
            .arg(format!("echo > {}; exec sleep 100", ready.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // The signal's default action, as a job started from a terminal
        // has it: whoever ran the tests may have left it ignored (a
        // non-interactive shell's `cargo test &` ignores SIGINT and
        // SIGQUIT, nohup SIGHUP), and devlock rightly passes an ignored
        // signal on as ignored.
        // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
        unsafe {
            devlock.pre_exec(move || {
                libc::signal(sig, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut holder = devlock.spawn().unwrap();
        wait_for_file(&ready);
        signal(holder.id(), sig);
        let status = wait_child(&mut holder);
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(code - 128)
        );
    }
}

test!(terminal_ctrl_c_is_not_delivered_twice, needs: []);
pub(crate) fn terminal_ctrl_c_is_not_delivered_twice() {
    // Under `script` the command runs on a pty; writing ^C to it makes the
    // line discipline signal the whole foreground group (SI_KERNEL), as a
    // real terminal does. devlock must not forward another copy.
    let s = Scratch::new();
    let inner = format!(
        "{bin} r -- sh -c \"trap 'echo sig >> {got}; exit 0' INT; echo > {ready}; while :; do sleep 0.01; done\"",
        bin = BIN,
        got = s.work("got").display(),
        ready = s.work("ready").display(),
    );
    let mut script = on_a_pty(&inner)
        .env("DEVLOCK_DIR", s.dir())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(&s.work("ready"));
    use std::io::Write;
    script.stdin.as_mut().unwrap().write_all(b"\x03").unwrap();
    script.stdin.as_mut().unwrap().flush().unwrap();
    wait_child(&mut script);
    assert_eq!(std::fs::read_to_string(s.work("got")).unwrap(), "sig\n");
}

test!(a_child_of_a_killed_command_holds_the_lock_on, needs: []);
/// The command (devlock's process) killed by SIGKILL alone: a child it
/// started keeps the lock it inherited, and status names it, with the
/// hold's step, as `inherited`.
pub(crate) fn a_child_of_a_killed_command_holds_the_lock_on() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let pidfile = s.work("pid");
    let mut holder = s.hold(
        &["r"],
        &format!(
            "(while [ ! -e {release} ]; do sleep 0.01; done) & echo $! > {pid}; echo > {ready}; wait",
            pid = pidfile.display(),
            ready = ready.display(),
            release = release.display()
        ),
        &ready,
    );
    let child_pid = pid_in(&pidfile);
    s.wait_for_status("r", "the holder's record", |v| {
        v["holders"][0]["step"] == "sh"
    });
    signal(holder.id(), libc::SIGKILL);
    wait_child(&mut holder);
    // The child still runs and still holds the lock: nobody else gets in.
    assert!(std::path::Path::new(&format!("/proc/{child_pid}")).exists());
    assert!(!flock_is_free(&s.lock_path("r")));
    let busy = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(busy.status.code(), Some(75));
    let view = s.resource_status("r");
    assert_eq!(view["state"], "held");
    assert_eq!(view["holders"][0]["pid"], child_pid, "{view:#}");
    assert_eq!(view["holders"][0]["source"], "inherited", "{view:#}");
    assert_eq!(view["holders"][0]["step"], "sh", "{view:#}");
    std::fs::write(&release, "").unwrap();
    wait_gone(child_pid);
    assert!(s.run(&["-n", "r", "--", "true"]).status.success());
}

test!(nested_take_passes_through_instead_of_deadlocking, needs: []);
pub(crate) fn nested_take_passes_through_instead_of_deadlocking() {
    let s = Scratch::new();
    let out = s
        .devlock()
        .args([
            "-n",
            "r",
            "--",
            BIN,
            "-n",
            "r",
            "--",
            "sh",
            "-c",
            "echo inner",
        ])
        .output()
        .unwrap();
    assert_eq!(stdout(&out).trim(), "inner", "{}", stderr(&out));
    assert!(out.status.success());
    // Inside util-linux flock too: the kernel says the descriptor holds it.
    std::fs::create_dir_all(s.dir()).unwrap();
    let out = Command::new("/usr/bin/flock")
        .arg(s.lock_path("r"))
        .args([BIN, "-n", "r", "--", "sh", "-c", "exit 4"])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
}

test!(a_nested_take_finds_a_hold_far_up_the_descriptor_table, needs: [Tool("bash"), Tool("flock")]);
pub(crate) fn a_nested_take_finds_a_hold_far_up_the_descriptor_table() {
    // Scripts lock on a descriptor of their choosing (`exec 9>f; flock 9`,
    // `exec 900>f`): the take inside finds the hold wherever it is.
    let s = Scratch::new();
    std::fs::create_dir_all(s.dir()).unwrap();
    for fd in [9, 900] {
        let script =
            format!("exec {fd}>\"$1\" && flock {fd} && exec \"$2\" -n r -- sh -c 'exit 4'");
        let out = Command::new("bash")
            .args(["-c", &script, "bash"])
            .arg(s.lock_path("r"))
            .arg(BIN)
            .env("DEVLOCK_DIR", s.dir())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(4), "fd {fd}: {}", stderr(&out));
    }
}

test!(a_copied_environment_is_not_mistaken_for_holding, needs: []);
pub(crate) fn a_copied_environment_is_not_mistaken_for_holding() {
    // Another job holds r; a process that merely copied a holder's
    // environment must still wait.
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
    let out = s
        .devlock()
        .env("DEVLOCK_RESOURCES", "r")
        .args(["-n", "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75));
    std::fs::write(&release, "").unwrap();
    wait_child(&mut holder);
}

fn assert_refused(s: &Scratch, victim: &std::path::Path, what: &str) {
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(74), "{what}: {}", stderr(&out));
    let err = stderr(&out);
    assert!(err.starts_with("devlock: "), "{err}");
    assert!(
        err.contains(&s.lock_path("r").display().to_string()),
        "names the path: {err}"
    );
    assert_eq!(
        std::fs::read_to_string(victim).unwrap(),
        "precious",
        "{what}: victim changed"
    );
}

test!(planted_symlink_and_fifo_are_refused_and_a_hard_link_is_never_written, needs: []);
pub(crate) fn planted_symlink_and_fifo_are_refused_and_a_hard_link_is_never_written() {
    let s = Scratch::new();
    std::fs::create_dir(s.dir()).unwrap();
    // Made for locks (sticky, as devlock makes it): a record would go into
    // the lock file itself (see hostile_takes.rs for elsewhere).
    std::fs::set_permissions(s.dir(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = s.work("victim");
    std::fs::write(&victim, "precious").unwrap();

    std::os::unix::fs::symlink(&victim, s.lock_path("r")).unwrap();
    assert_refused(&s, &victim, "symlink");
    std::fs::remove_file(s.lock_path("r")).unwrap();

    std::os::unix::fs::symlink(s.work("dangling"), s.lock_path("r")).unwrap();
    assert_refused(&s, &victim, "dangling symlink");
    assert!(
        !s.work("dangling").exists(),
        "must not create through a dangling link"
    );
    std::fs::remove_file(s.lock_path("r")).unwrap();

    // A hard link is used as a gate (refusing it would let anyone who can
    // link a lock file disable it), but nothing is written into it.
    std::fs::hard_link(&victim, s.lock_path("r")).unwrap();
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "hard link: {}", stderr(&out));
    assert!(
        stderr(&out).contains("holding it without"),
        "says it keeps no record: {}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    std::fs::remove_file(s.lock_path("r")).unwrap();

    nix::unistd::mkfifo(
        &s.lock_path("r"),
        nix::sys::stat::Mode::from_bits_truncate(0o666),
    )
    .unwrap();
    assert_refused(&s, &victim, "fifo");
}

test!(a_symlinked_scratch_directory_is_refused, needs: []);
pub(crate) fn a_symlinked_scratch_directory_is_refused() {
    let s = Scratch::new();
    let real = s.work("real");
    std::fs::create_dir(&real).unwrap();
    std::os::unix::fs::symlink(&real, s.dir()).unwrap();
    let out = s.run(&["r", "--", "true"]);
    assert_eq!(out.status.code(), Some(74));
    assert!(stderr(&out).contains("symbolic link"), "{}", stderr(&out));
    assert!(std::fs::read_dir(&real).unwrap().next().is_none());
}

test!(lock_files_and_directory_are_usable_by_everyone_whatever_the_umask, needs: []);
pub(crate) fn lock_files_and_directory_are_usable_by_everyone_whatever_the_umask() {
    let s = Scratch::new();
    let out = Command::new("sh")
        .args(["-c", &format!("umask 077; exec {BIN} r -- true")])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(std::fs::metadata(s.dir()).unwrap().mode() & 0o7777, 0o1777);
    assert_eq!(
        std::fs::metadata(s.lock_path("r")).unwrap().mode() & 0o777,
        0o666
    );
}

test!(bad_input_is_refused_before_any_file_is_touched, needs: []);
pub(crate) fn bad_input_is_refused_before_any_file_is_touched() {
    let s = Scratch::new();
    let long = "x".repeat(65);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["", "--", "true"], "invalid resource name"),
        (vec!["../x", "--", "true"], "invalid resource name"),
        (vec!["a/b", "--", "true"], "invalid resource name"),
        (vec!["a\x1bb", "--", "true"], "invalid resource name"),
        (vec![".hidden", "--", "true"], "invalid resource name"),
        (vec![&long, "--", "true"], "invalid resource name"),
        (vec!["r", "true"], "missing `-- COMMAND`"),
        (vec!["r", "--"], "missing `-- COMMAND`"),
        (vec!["--", "true"], "missing RESOURCE"),
        (
            vec!["-w", "soon", "r", "--", "true"],
            "invalid value 'soon'",
        ),
        (
            vec!["--report-every", "x", "r", "--", "true"],
            "invalid value",
        ),
        (
            vec!["--no-such-flag", "r", "--", "true"],
            "unexpected argument",
        ),
    ];
    for (args, want) in cases {
        let out = s.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("devlock: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(!err.contains('\x1b'), "escape echoed back: {err:?}");
        assert!(!s.dir().exists(), "{args:?} touched the scratch dir");
    }
    use std::os::unix::ffi::OsStrExt;
    let out = s
        .devlock()
        .arg(std::ffi::OsStr::from_bytes(b"gp\xffu"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not valid UTF-8"));
    assert!(!s.dir().exists());
}

test!(an_unusable_directory_is_one_clear_line, needs: []);
pub(crate) fn an_unusable_directory_is_one_clear_line() {
    let s = Scratch::new();
    let file = s.work("plain-file");
    std::fs::write(&file, "").unwrap();
    let out = Command::new(BIN)
        .args(["--dir", file.to_str().unwrap(), "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(74));
    let err = stderr(&out);
    assert!(
        err.starts_with("devlock: ") && err.contains("not a directory"),
        "{err}"
    );
    let missing_parent = s.work("no/such/dir");
    let out = Command::new(BIN)
        .args(["--dir", missing_parent.to_str().unwrap(), "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(74));
    assert!(
        stderr(&out).contains("cannot create scratch directory"),
        "{}",
        stderr(&out)
    );
}

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

#[cfg(not(feature = "etcd"))]
test!(etcd_without_the_feature_says_how_to_get_it, needs: []);
#[cfg(not(feature = "etcd"))]
pub(crate) fn etcd_without_the_feature_says_how_to_get_it() {
    let s = Scratch::new();
    let out = s
        .devlock()
        .env("DEVLOCK_ETCD", "http://127.0.0.1:2379")
        .args(["r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // The install that works from a checkout, as the README's, not the
    // registry's.
    assert!(
        stderr(&out).contains("`cargo install --locked --path . --features etcd`"),
        "{}",
        stderr(&out)
    );
    // --help marks the flags this build cannot use, here and under setup.
    for args in [&["--help"][..], &["setup", "--help"]] {
        let help = stdout(&s.run(args));
        for flag in ["--etcd <", "--etcd-user", "--etcd-ca", "--etcd-key"] {
            let at = help
                .find(flag)
                .unwrap_or_else(|| panic!("{flag} in {help}"));
            let entry = &help[at..];
            let end = entry[2..].find("\n  -").map_or(entry.len(), |e| e + 2);
            assert!(
                entry[..end].contains("not in this build"),
                "{args:?} {flag}: {}",
                &entry[..end]
            );
        }
    }
}

test!(lease_flags_without_etcd_are_usage_errors, needs: []);
pub(crate) fn lease_flags_without_etcd_are_usage_errors() {
    let s = Scratch::new();
    for flag in ["--ttl", "--kill-after"] {
        let out = s
            .devlock()
            .env_remove("DEVLOCK_ETCD")
            .args([flag, "3s", "r", "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(
            stderr(&out).contains("only with --etcd"),
            "{}",
            stderr(&out)
        );
    }
}

test!(the_binary_does_not_load_libgcc_s, needs: [Tool("readelf")]);
pub(crate) fn the_binary_does_not_load_libgcc_s() {
    // build.rs links the unwinder statically: libgcc_s's constructor runs
    // dozens of cpuid instructions, each a trap to the hypervisor on a VM,
    // in every run (bench/RESULTS.md).
    let dynamic = readelf("-d");
    assert!(dynamic.contains("libc.so.6"), "{dynamic}");
    assert!(!dynamic.contains("libgcc_s"), "{dynamic}");
}

test!(the_binary_packs_its_relative_relocations, needs: [Tool("readelf"), Tool("getconf")]);
pub(crate) fn the_binary_packs_its_relative_relocations() {
    // build.rs links with -z pack-relative-relocs where this machine's glibc
    // reads DT_RELR (2.36 and later): as RELA entries, the loader read some
    // 2,200 of them in every run, a tenth of an uncontended run's CPU
    // (bench/RESULTS.md). On an older glibc the binary must go without, or
    // it would not start.
    let out = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .unwrap();
    let version = stdout(&out);
    let mut parts = version.trim().trim_start_matches("glibc ").split('.');
    let mut number = || parts.next().and_then(|p| p.parse::<u32>().ok()).unwrap();
    let reads_relr = (number(), number()) >= (2, 36);
    let dynamic = readelf("-d");
    assert_eq!(
        dynamic.contains("(RELR)"),
        reads_relr,
        "{version}: {dynamic}"
    );
}

/// What `readelf FLAG` says of the binary.
fn readelf(flag: &str) -> String {
    let out = Command::new("readelf").args([flag, BIN]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
}
