//! Stopped in line (Ctrl-Z leaves the queue, SIGSTOP is shown) and pid reuse
//! after kill -9 of a holder.

use super::*;

/// A job-control shell on a pty (bash -i under script(1)): commands in,
/// the terminal's bytes out.
struct Shell {
    child: Killed,
    input: std::process::ChildStdin,
    output: std::sync::mpsc::Receiver<u8>,
    seen: Vec<u8>,
}

impl Shell {
    fn start(s: &Scratch) -> Shell {
        let mut child = on_a_pty("bash --norc --noprofile -i")
            .env("DEVLOCK_DIR", s.dir())
            .env("PS1", "$ ")
            .env("TERM", "dumb")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let input = child.stdin.take().unwrap();
        let mut out = child.stdout.take().unwrap();
        let (tx, output) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 256];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                for &b in &buf[..n] {
                    let _ = tx.send(b);
                }
            }
        });
        Shell {
            child: Killed(child),
            input,
            output,
            seen: Vec::new(),
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.input.write_all(bytes).unwrap();
        self.input.flush().unwrap();
    }

    /// Reads until the terminal has shown `needle`.
    fn wait_for(&mut self, needle: &str) {
        let deadline = std::time::Instant::now() + HANG;
        while !String::from_utf8_lossy(&self.seen).contains(needle) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.output.recv_timeout(left) {
                Ok(b) => self.seen.push(b),
                Err(_) => panic!(
                    "the terminal never showed {needle:?}: {:?}",
                    String::from_utf8_lossy(&self.seen)
                ),
            }
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen).into_owned()
    }
}

fn is_stopped(pid: u32) -> bool {
    devlock::testing::procfs::is_stopped(pid)
}

/// One round: a holder, a waiter in a job-control shell that Ctrl-Z stops,
/// a second waiter that must get the resource first, then `fg`. `how` is
/// given to all three (`--slots 1`: the wait for a slot; the plain lock
/// otherwise).
fn ctrl_z_round(quiet: bool, how: &[&str]) {
    let s = Scratch::new();
    let mut hold_args = how.to_vec();
    hold_args.push("r");
    let (mut holder, _) = hold_as(&s, 0, &hold_args, "h");
    let log = s.work("log");
    let mut shell = Shell::start(&s);
    let q = if quiet { "-q " } else { "" };
    shell.send(
        format!(
            "{BIN} {q}{} --step first r -- sh -c 'echo first >> {}'\n",
            how.join(" "),
            log.display()
        )
        .as_bytes(),
    );
    let view = s.wait_for_status("r", "the first waiter", |v| registered_waiters(v) == 1);
    let first = view["waiters"][0]["pid"].as_u64().unwrap() as u32;
    // Ctrl-Z through the terminal: the line discipline stops the job.
    shell.send(b"\x1a");
    wait_until_true("the first waiter to stop", || is_stopped(first));
    let view = s.resource_status("r");
    assert_eq!(array_len(&view["waiters"]), 0, "it left the line: {view}");
    let mut no_wait = vec!["-n"];
    no_wait.extend(how);
    no_wait.extend(["r", "--", "true"]);
    let out = s.run(&no_wait);
    assert!(
        stderr(&out).contains("r is busy") && !stderr(&out).contains("waiting in line"),
        "{}",
        stderr(&out)
    );
    // Someone behind it gets the resource first.
    let mut second = Killed(
        s.devlock()
            .arg("-q")
            .args(how)
            .args(["--step", "second", "r", "--", "sh", "-c"])
            .arg(format!("echo second >> {}", log.display()))
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    s.wait_for_status("r", "the second waiter", |v| registered_waiters(v) == 1);
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut second.0).success());
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "second\n");
    // fg continues it: it joins again at the back and runs.
    shell.send(b"fg\n");
    wait_until_true("the first waiter to run", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l == "second\nfirst\n")
    });
    shell.send(b"echo DONE-$((6*7))\n");
    shell.wait_for("DONE-42");
    let text = shell.text();
    if quiet {
        assert!(!text.contains("devlock:"), "quiet: {text:?}");
    } else {
        assert!(
            text.contains("devlock: continued; back in line for r, at the end"),
            "{text:?}"
        );
    }
    shell.send(b"exit\n");
    let _ = wait_child(&mut shell.child.0);
}

fn wait_until_true(what: &str, ok: impl Fn() -> bool) {
    poll_until(what, || if ok() { "yes" } else { "no" }, |v| *v == "yes");
}

test!(ctrl_z_in_line_gives_up_the_place_and_fg_rejoins_at_the_back, needs: [Root, Tool("setpriv"), Tool("script"), Tool("bash")]);
pub(crate) fn ctrl_z_in_line_gives_up_the_place_and_fg_rejoins_at_the_back() {
    ctrl_z_round(false, &[]);
    ctrl_z_round(true, &[]);
    ctrl_z_round(false, &["--slots", "1"]);
    ctrl_z_round(true, &["--slots", "1"]);
}

test!(sigstop_of_a_waiter_or_a_holder_shows_as_stopped, needs: [Root, Tool("setpriv")]);
pub(crate) fn sigstop_of_a_waiter_or_a_holder_shows_as_stopped() {
    let s = Scratch::new();
    open_dir(&s);
    let (mut holder, command) = hold_as(&s, USER_A, &["r"], "h");
    let mut waiter = Killed(
        devlock_as(&s, USER_B)
            .args(["-q", "--step", "frozen", "r", "--", "true"])
            .spawn()
            .unwrap(),
    );
    s.wait_for_status("r", "the waiter", |v| registered_waiters(v) == 1);
    signal(waiter.id(), libc::SIGSTOP);
    signal(command, libc::SIGSTOP);
    let view = s.wait_for_status("r", "both stopped", |v| {
        v["waiters"][0]["stopped"] == true && v["holders"][0]["stopped"] == true
    });
    assert_eq!(view["waiters"][0]["step"], "frozen");
    let table = stdout(&s.run(&["status", "r"]));
    assert!(
        table.contains("sh (stopped)") && table.contains("waits #1 (stopped)"),
        "{table}"
    );
    let busy = s.run(&["-n", "r", "--", "true"]);
    assert!(
        stderr(&busy).contains("nobody, stopped"),
        "{}",
        stderr(&busy)
    );
    signal(waiter.id(), libc::SIGCONT);
    signal(command, libc::SIGCONT);
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut waiter.0).success());
}

// ----------------------------------------------------------------------------
// 6. Pid reuse after kill -9 of a holder.

/// The holder's child that keeps its lock once the holder is killed:
/// SIGKILLed when the test ends, passed or failed (left, it would keep the
/// test runner's output open for its 1000 s), or at [`Inheritor::end`].
struct Inheritor(u32);

impl Inheritor {
    /// Kills it and waits until it is gone, and the lock with it. The guard
    /// is spent: its pid, free again, may be another test's process next.
    fn end(self) {
        let pid = self.0;
        std::mem::forget(self);
        signal(pid, libc::SIGKILL);
        wait_gone(pid);
    }
}

impl Drop for Inheritor {
    fn drop(&mut self) {
        // Not `signal`, which asserts: a panic while unwinding aborts.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0 as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// `devlock ARGS -- sh -c ...` whose command starts one child, which holds
/// on once the command (devlock's own process) is SIGKILLed, as it is here
/// once its label shows; neither forks once ready (see `reuse_pid`).
/// Returns that child and the killed holder's pid.
fn killed_holder(s: &Scratch, args: &[&str], tag: &str) -> (Inheritor, u32) {
    let ready = s.work(&format!("ready-{tag}"));
    let script = format!(
        "sleep 1000 & echo $! > {r}.tmp && mv {r}.tmp {r} && wait",
        r = ready.display()
    );
    let mut holder = s
        .devlock()
        .args(["--step", "job"])
        .args(args)
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let inheritor = Inheritor(pid_in(&ready));
    s.wait_for_status("r", "the holder's label", |v| {
        v["holders"][0]["step"] == "job"
    });
    holder.kill().unwrap();
    holder.wait().unwrap();
    (inheritor, holder.id())
}

/// Makes some live process of `uid` (root for 0) other than the one that
/// had it take `pid`: the kernel hands out last_pid + 1, so set it just
/// below and start sleeps until one gets it. None where another process
/// took it first (one just as unrelated, as long as the job forks nothing
/// meanwhile: a child of the job's command would hold the lock it
/// inherited).
fn reuse_pid(pid: u32, uid: u32) -> Option<Killed> {
    let last = Path::new("/proc/sys/kernel/ns_last_pid");
    for _ in 0..2000 {
        if Path::new(&format!("/proc/{pid}")).exists() {
            return None;
        }
        std::fs::write(last, (pid - 1).to_string()).unwrap();
        let mut sleep = match uid {
            0 => Command::new("sleep"),
            _ => as_user(uid, "sleep"),
        };
        let child = sleep.arg("1000").stdin(Stdio::null()).spawn().unwrap();
        if child.id() == pid {
            return Some(Killed(child));
        }
        drop(Killed(child));
    }
    panic!("pid {pid} was never reused");
}

fn pid_reuse_round(shared: bool) {
    let what = if shared { "shared" } else { "exclusive" };
    let s = Scratch::new();
    open_dir(&s);
    let args: &[&str] = if shared { &["-s", "r"] } else { &["r"] };
    let (inheritor, devlock_pid) = killed_holder(&s, args, "h");
    let command = inheritor.0;
    let _reused = reuse_pid(devlock_pid, 0);
    assert!(Path::new(&format!("/proc/{devlock_pid}")).exists());
    // Root sees the command holding it through the descriptor it inherited.
    let view = s.resource_status("r");
    let h = &view["holders"][0];
    let pids = h["pids"].as_array().unwrap();
    assert!(
        pids.contains(&command.into()) && !pids.contains(&devlock_pid.into()),
        "{what}: {view}"
    );
    assert_eq!(h["source"], "inherited", "{what}: {view}");
    assert_eq!(h["step"], "job", "{what}: {view}");
    let busy = s.run(&["-n", "r", "--", "true"]);
    let err = stderr(&busy);
    assert!(
        err.contains(&format!("pid {command}")) && !err.contains(&format!("pid {devlock_pid}")),
        "{what}: never the unrelated process: {err}"
    );
    // Another user cannot see root's descriptors: unknown, never the
    // unrelated process.
    let view = status_as(&s, USER_B, "r");
    let h = &view["holders"][0];
    assert_eq!(view["state"], if shared { "shared" } else { "held" });
    assert!(
        h["pid"] != devlock_pid && !h["pids"].to_string().contains(&devlock_pid.to_string()),
        "{what}: {view}"
    );
    assert_eq!(h["source"], "unknown", "{what}: {view}");
    inheritor.end();
}

test!(pid_reuse_after_kill_9_of_a_holder_blames_nobody_unrelated, needs: [Root, Tool("setpriv")]);
pub(crate) fn pid_reuse_after_kill_9_of_a_holder_blames_nobody_unrelated() {
    pid_reuse_round(true);
    pid_reuse_round(false);
}

test!(a_record_forged_for_a_reused_pid_fools_only_who_cannot_read_descriptors, needs: [Root, Tool("setpriv")]);
/// The lock file carries no tag since devlock became the command (a POSIX
/// lock on it would stop a whole-file lockf(3), and end at any close of the
/// file in the command), so where a holder's descriptors cannot be read,
/// its record is what names it. USER_A takes a dead holder's pid and writes
/// a record naming that process of its own: root and USER_A read the
/// descriptors and are not fooled; USER_B, who can read neither, is shown
/// USER_A's process as the holder, as devlock(1) says.
pub(crate) fn a_record_forged_for_a_reused_pid_fools_only_who_cannot_read_descriptors() {
    let s = Scratch::new();
    open_dir(&s);
    // The dead holder's pid must go to USER_A's process: where a process
    // of another test takes it first, the hold is made again.
    let (inheritor, dead, _reused) = (0..5)
        .find_map(|attempt| {
            let (inheritor, dead) = killed_holder(&s, &["r"], &attempt.to_string());
            match reuse_pid(dead, USER_A) {
                Some(reused) => Some((inheritor, dead, reused)),
                None => {
                    inheritor.end();
                    None
                }
            }
        })
        .expect("a dead holder's pid for a process of USER_A, in 5 tries");
    let mut forged = Record::for_this_process("forged");
    forged.pid = dead;
    forged.pid_start = devlock::testing::procfs::start_time(dead).unwrap();
    write_as(USER_A, &s.lock_path("r"), &forged.to_bytes());
    let seen = |view: &serde_json::Value| {
        let h = &view["holders"][0];
        (h["pids"].clone(), h["source"].clone(), h["step"].clone())
    };
    let view = s.resource_status("r");
    assert_eq!(
        seen(&view),
        (
            serde_json::json!([inheritor.0]),
            "inherited".into(),
            serde_json::Value::Null
        ),
        "root: {view}"
    );
    let view = status_as(&s, USER_A, "r");
    assert_eq!(
        seen(&view),
        (
            serde_json::json!([]),
            "unknown".into(),
            serde_json::Value::Null
        ),
        "the forger: {view}"
    );
    let view = status_as(&s, USER_B, "r");
    assert_eq!(
        seen(&view),
        (serde_json::json!([dead]), "record".into(), "forged".into()),
        "a third user: {view}"
    );
    inheritor.end();
}
