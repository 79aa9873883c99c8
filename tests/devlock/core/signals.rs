//! Signals: each reaches the command once and the lock outlives its cleanup;
//! Ctrl-C is not delivered twice; a killed command's child holds on.

use super::*;

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
    let pidfile = s.work("pid");
    // One child process, and nothing it starts: a polling loop's `sleep`s
    // would hold the inherited lock beside it, and status could name one
    // of them first.
    let mut holder = s.hold(
        &["r"],
        &format!(
            "sleep 600 & echo $! > {pid}; echo > {ready}; wait",
            pid = pidfile.display(),
            ready = ready.display(),
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
    signal(child_pid, libc::SIGTERM);
    wait_gone(child_pid);
    assert!(s.run(&["-n", "r", "--", "true"]).status.success());
}
