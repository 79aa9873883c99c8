//! Each stop signal reaches the command exactly once, counted inside the
//! command, for each way people send one: to devlock's pid, to its
//! process group, typed at a terminal (a real pty, alone and under a tool
//! that shares the group), and through timeout(1); and a program that
//! reads the terminal keeps working in the foreground, Ctrl-Z included.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::harness::*;

mod moment;

use moment::{a_full_fifo, drain_in_a_thread, made_by_another_user, pid_running, writing_to};

/// The command under test: this test binary running [`signal_counter`],
/// which writes a line to `got` in its handler for every SIGINT and
/// SIGTERM the kernel delivers to it. (A shell's trap or a Python handler
/// runs once for two signals that arrive close together, so neither can
/// count.) It says who it and its parent are, and runs until `release`.
struct Counter {
    got: PathBuf,
    pids: PathBuf,
    release: PathBuf,
    /// The command line that runs it, after `--`.
    command: Vec<String>,
}

impl Counter {
    fn new(s: &Scratch, tag: &str) -> Counter {
        let got = s.work(&format!("got-{tag}"));
        let pids = s.work(&format!("pids-{tag}"));
        let release = s.work(&format!("release-{tag}"));
        let exe = std::env::current_exe().unwrap();
        let command = vec![
            "env".to_owned(),
            format!("DEVLOCK_TEST_COUNTER={}", got.display()),
            format!("DEVLOCK_TEST_COUNTER_PIDS={}", pids.display()),
            format!("DEVLOCK_TEST_COUNTER_RELEASE={}", release.display()),
            exe.display().to_string(),
        ];
        Counter {
            got,
            pids,
            release,
            command,
        }
    }

    /// `devlock ARGS -- COUNTER`'s arguments after `devlock`.
    fn args(&self, args: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.push("--".to_owned());
        all.extend(self.command.iter().cloned());
        all
    }

    /// The command's pid (devlock's: it became the command), once it runs.
    fn pid(&self) -> u32 {
        wait_for_file(&self.pids);
        let text = std::fs::read_to_string(&self.pids).unwrap();
        text.split_whitespace().next().unwrap().parse().unwrap()
    }

    /// Waits until the command heard something and has taken delivery of
    /// every copy sent (none pending); then lets it end and returns what it
    /// heard.
    fn settle(&self, command: u32, sig: i32) -> Vec<String> {
        until("the command to hear the signal", || {
            self.heard().next().is_some()
        });
        until("the command to take delivery", || !pending(command, sig));
        std::fs::write(&self.release, "").unwrap();
        wait_gone(command);
        self.heard().collect()
    }

    fn heard(&self) -> impl Iterator<Item = String> {
        std::fs::read_to_string(&self.got)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
            .into_iter()
    }
}

/// Polls `ok` until it holds; only a hang fails.
fn until(what: &str, ok: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !ok() {
        assert!(start.elapsed() < HANG, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Whether `sig` is pending for `pid` (for the process or its main thread).
fn pending(pid: u32, sig: i32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let bit = 1u64 << (sig - 1);
    status.lines().any(|line| {
        let Some((name, mask)) = line.split_once(':') else {
            return false;
        };
        matches!(name, "SigPnd" | "ShdPnd")
            && u64::from_str_radix(mask.trim(), 16).is_ok_and(|m| m & bit != 0)
    })
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) of a process or group this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

fn spawn_quiet(cmd: &mut Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn once(heard: &[String], what: &str, path: &str) {
    assert_eq!(heard, [what], "{path}: the command heard {heard:?}");
}

test!(a_signal_sent_to_devlocks_pid_reaches_the_command_once, needs: []);
pub(crate) fn a_signal_sent_to_devlocks_pid_reaches_the_command_once() {
    for (sig, name) in [(libc::SIGINT, "INT"), (libc::SIGTERM, "TERM")] {
        let s = Scratch::new();
        let counter = Counter::new(&s, "pid");
        let mut devlock = spawn_quiet(s.devlock().args(counter.args(&["r"])));
        let command = counter.pid();
        assert_eq!(command, devlock.id(), "the command is devlock's process");
        kill(devlock.id() as i32, sig);
        once(&counter.settle(command, sig), name, "kill PID");
        assert!(wait_child(&mut devlock).success());
    }
}

/// A second copy sent a moment after the first merges with it unseen when
/// it comes before the first is delivered: the paths where devlock could
/// add one are tried a few times.
const ROUNDS: usize = 8;

test!(a_signal_sent_to_devlocks_process_group_reaches_the_command_once, needs: []);
pub(crate) fn a_signal_sent_to_devlocks_process_group_reaches_the_command_once() {
    // As a shell runs a job, CI runners and Slurm stop one: the whole
    // process group devlock was started in.
    for round in 0..ROUNDS {
        let s = Scratch::new();
        let counter = Counter::new(&s, "group");
        let mut devlock = spawn_quiet(s.devlock().args(counter.args(&["r"])).process_group(0));
        let command = counter.pid();
        kill(-(devlock.id() as i32), libc::SIGINT);
        let heard = counter.settle(command, libc::SIGINT);
        once(&heard, "INT", &format!("kill -- -PGID, round {round}"));
        assert!(wait_child(&mut devlock).success());
    }
}

test!(timeout_reaches_the_command_once, needs: [Tool("timeout")]);
pub(crate) fn timeout_reaches_the_command_once() {
    // timeout(1) signals its child, and then (without --foreground) its
    // whole process group too: a command under it hears the signal once or
    // twice, as the two sends meet in one pending signal or not, with or
    // without devlock. devlock, being the command, adds none: with
    // --foreground (the child alone) it is exactly once, and without, never
    // more than timeout's two. timeout does so when its time is up, or when
    // it is itself told to stop, which lets the test pick the moment
    // instead of guessing a duration.
    for round in 0..ROUNDS {
        for foreground in [true, false] {
            let s = Scratch::new();
            let counter = Counter::new(&s, "timeout");
            let mut timeout = Command::new("timeout");
            if foreground {
                timeout.arg("--foreground");
            }
            let mut timeout = spawn_quiet(
                timeout
                    .args(["-s", "INT", "1h", BIN])
                    .args(counter.args(&["r"]))
                    .env("DEVLOCK_DIR", s.dir()),
            );
            let command = counter.pid();
            kill(timeout.id() as i32, libc::SIGINT);
            let heard = counter.settle(command, libc::SIGINT);
            let path = format!("timeout, foreground {foreground}, round {round}");
            if foreground {
                once(&heard, "INT", &path);
            } else {
                assert!(
                    matches!(heard.len(), 1 | 2) && heard.iter().all(|h| h == "INT"),
                    "{path}: the command heard {heard:?}"
                );
            }
            wait_child(&mut timeout);
        }
    }
}

test!(ctrl_c_at_a_terminal_reaches_the_command_once, needs: []);
pub(crate) fn ctrl_c_at_a_terminal_reaches_the_command_once() {
    // devlock as the terminal's job, and devlock under a shell that shares
    // its process group (as make and scripts do).
    let s = Scratch::new();
    for (tag, shared) in [("alone", false), ("shared", true)] {
        let counter = Counter::new(&s, tag);
        let pty = Pty::new(80);
        let mut leader = if shared {
            let mut line = vec![BIN.to_owned()];
            line.extend(counter.args(&["r"]));
            pty.spawn(
                Command::new("sh")
                    .args(["-c", &format!("{}; true", sh_line(&line))])
                    .env("DEVLOCK_DIR", s.dir()),
            )
        } else {
            pty.spawn(s.devlock().args(counter.args(&["r"])))
        };
        let command = counter.pid();
        pty.type_in(b"\x03");
        once(&counter.settle(command, libc::SIGINT), "INT", tag);
        wait_child(&mut leader);
    }
}

test!(ctrl_c_under_make_j_reaches_each_command_once, needs: [Tool("make")]);
pub(crate) fn ctrl_c_under_make_j_reaches_each_command_once() {
    let s = Scratch::new();
    let a = Counter::new(&s, "a");
    let b = Counter::new(&s, "b");
    let recipe = |c: &Counter, r: &str| {
        let mut line = vec![BIN.to_owned(), r.to_owned(), "--".to_owned()];
        line.extend(c.command.iter().cloned());
        format!("\t{}\n", sh_line(&line).replace('$', "$$"))
    };
    let makefile = s.work("Makefile");
    std::fs::write(
        &makefile,
        format!(
            "all: a b\na:\n{}b:\n{}",
            recipe(&a, "gpu:0"),
            recipe(&b, "gpu:1")
        ),
    )
    .unwrap();
    let pty = Pty::new(80);
    let mut make = pty.spawn(
        Command::new("make")
            .args(["-s", "-j2", "-f"])
            .arg(&makefile)
            .env("DEVLOCK_DIR", s.dir()),
    );
    let command_a = a.pid();
    let command_b = b.pid();
    pty.type_in(b"\x03");
    // Both hear it before either may end: make stops the other recipe when
    // one fails.
    until("both commands to hear it", || {
        a.heard().next().is_some() && b.heard().next().is_some()
    });
    let heard_a = a.settle(command_a, libc::SIGINT);
    let heard_b = b.settle(command_b, libc::SIGINT);
    once(&heard_a, "INT", "make -j, recipe a");
    once(&heard_b, "INT", "make -j, recipe b");
    wait_child(&mut make);
}

/// A shell line that runs `args` (quoted for sh).
fn sh_line(args: &[String]) -> String {
    args.iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

test!(a_command_reading_the_terminal_works_in_the_foreground, needs: []);
pub(crate) fn a_command_reading_the_terminal_works_in_the_foreground() {
    let s = Scratch::new();
    let pty = Pty::new(80);
    let mut devlock = pty.spawn(s.devlock().args([
        "r",
        "--",
        "sh",
        "-c",
        "printf 'name? '; read name; echo \"hello, $name\"",
    ]));
    pty.wait_for("name? ");
    pty.type_in(b"devlock\n");
    pty.wait_for("hello, devlock");
    assert!(wait_child(&mut devlock).success());
}

test!(ctrl_z_stops_the_job_and_fg_gives_the_command_the_terminal_again, needs: [Tool("bash")]);
pub(crate) fn ctrl_z_stops_the_job_and_fg_gives_the_command_the_terminal_again() {
    let s = Scratch::new();
    let pty = Pty::new(120);
    let mut shell = pty.spawn(
        Command::new("bash")
            .args(["--norc", "--noprofile", "-i"])
            .env("PS1", "PROMPT> ")
            .env("DEVLOCK_DIR", s.dir())
            .env_remove("PROMPT_COMMAND"),
    );
    pty.wait_for("PROMPT> ");
    let line = sh_line(&[
        BIN.to_owned(),
        "r".to_owned(),
        "--".to_owned(),
        "sh".to_owned(),
        "-c".to_owned(),
        "echo first-prompt; read a; echo \"a=$a\"; echo second-prompt; read b; echo \"b=$b\""
            .to_owned(),
    ]);
    pty.type_in(format!("{line}\n").as_bytes());
    pty.wait_for("first-prompt");
    pty.type_in(b"one\n");
    pty.wait_for("a=one");
    pty.wait_for("second-prompt");
    let mark = pty.output().len();
    pty.type_in(b"\x1a");
    // The shell sees the job stopped and prompts again.
    pty.wait_until("the job stopped", |out| {
        out[mark..].contains("Stopped") && out[mark..].contains("PROMPT> ")
    });
    assert!(
        !flock_is_free(&s.lock_path("r")),
        "a stopped job keeps its lock"
    );
    let mark = pty.output().len();
    pty.type_in(b"fg\n");
    pty.type_in(b"two\n");
    pty.wait_until("the job to read on, then the prompt", |out| {
        let after = &out[mark..];
        after
            .find("b=two")
            .is_some_and(|at| after[at..].contains("PROMPT> "))
    });
    pty.type_in(b"exit\n");
    wait_child(&mut shell);
    assert!(flock_is_free(&s.lock_path("r")));
}

test!(a_ctrl_z_just_before_the_command_starts_stops_the_whole_job, needs: [Root, Tool("setpriv"), Tool("bash"), Tool("mkdir")]);
pub(crate) fn a_ctrl_z_just_before_the_command_starts_stops_the_whole_job() {
    // devlock holds job stops back from the moment it starts until the
    // command runs (a stopped devlock must not keep a place in line). A
    // Ctrl-Z held back at the very end, once the lock is taken, is the
    // job's: the command, which now has the terminal, stops with devlock,
    // and fg gives it the terminal again. The moment is made to last: the
    // one line devlock says before it starts the command (a directory
    // another user made) goes into a pipe that is full.
    let s = Scratch::new();
    let dir = s.work("squat");
    let d = dir.to_str().unwrap().to_owned();
    made_by_another_user(&d);
    let fifo = s.work("stderr");
    let reader = a_full_fifo(&fifo);
    let pty = Pty::new(120);
    let mut shell = pty.spawn(
        Command::new("bash")
            .args(["--norc", "--noprofile", "-i"])
            .env("PS1", "PROMPT> ")
            .env_remove("PROMPT_COMMAND"),
    );
    pty.wait_for("PROMPT> ");
    let line = sh_line(&[
        BIN.to_owned(),
        "--dir".to_owned(),
        d.clone(),
        "r".to_owned(),
        "--".to_owned(),
        "sh".to_owned(),
        "-c".to_owned(),
        "read a; echo \"a=$a\"".to_owned(),
    ]);
    pty.type_in(format!("{line} 2>{}\n", fifo.display()).as_bytes());
    let devlock = std::cell::Cell::new(0);
    until("devlock to hold the lock and write its warning", || {
        devlock.set(pid_running(BIN, &d).unwrap_or(0));
        devlock.get() != 0 && writing_to(devlock.get(), 2)
    });
    let devlock = devlock.get();
    assert!(!flock_is_free(&dir.join("r.lock")), "it holds the lock");
    let mark = pty.output().len();
    pty.type_in(b"\x1a");
    until("the Ctrl-Z to be held back", || {
        pending(devlock, libc::SIGTSTP)
    });
    // Let the warning through: the command starts, and the job stops.
    let drain = drain_in_a_thread(reader);
    pty.wait_until("the job stopped", |out| {
        out[mark..].contains("Stopped") && out[mark..].contains("PROMPT> ")
    });
    assert!(
        !flock_is_free(&dir.join("r.lock")),
        "a stopped job keeps its lock"
    );
    let mark = pty.output().len();
    pty.type_in(b"fg\n");
    pty.type_in(b"one\n");
    pty.wait_until("the command to read the terminal, then the prompt", |out| {
        let after = &out[mark..];
        after
            .find("a=one")
            .is_some_and(|at| after[at..].contains("PROMPT> "))
    });
    pty.type_in(b"exit\n");
    wait_child(&mut shell);
    let said = drain.join().unwrap();
    assert!(said.contains("devlock: warning: "), "{said:?}");
    assert!(flock_is_free(&dir.join("r.lock")));
}

test!(a_warning_while_the_command_has_the_terminal_does_not_stop_the_job, needs: [Tool("bash")]);
pub(crate) fn a_warning_while_the_command_has_the_terminal_does_not_stop_the_job() {
    // With `stty tostop`, a process outside the terminal's foreground group
    // that writes to it is stopped. While the command runs it has the
    // terminal and devlock does not, yet devlock may have to say that its
    // lock file was renamed away.
    let s = Scratch::new();
    let pty = Pty::new(200);
    let mut shell = pty.spawn(
        Command::new("bash")
            .args(["--norc", "--noprofile", "-i"])
            .env("PS1", "PROMPT> ")
            .env("DEVLOCK_DIR", s.dir())
            .env_remove("PROMPT_COMMAND"),
    );
    pty.wait_for("PROMPT> ");
    pty.type_in(b"stty tostop\n");
    // A lock file that holds somebody's data is held without a record,
    // and watched (by the job's watcher, which says what it finds).
    assert!(s.run(&["r", "--", "true"]).status.success());
    std::fs::write(s.lock_path("r"), "somebody's data\n").unwrap();
    let line = sh_line(&[
        BIN.to_owned(),
        "r".to_owned(),
        "--".to_owned(),
        "sh".to_owned(),
        "-c".to_owned(),
        "echo reading-$((6*7)); read a; echo \"a=$a\"".to_owned(),
    ]);
    pty.type_in(format!("{line}\n").as_bytes());
    // Not the typed line's echo: the command's own output.
    pty.wait_for("reading-42");
    std::fs::rename(s.lock_path("r"), s.dir().join("moved-away")).unwrap();
    pty.wait_for("no longer names the file this job holds");
    let mark = pty.output().len();
    pty.type_in(b"one\n");
    pty.wait_until("the command to read on, then the prompt", |out| {
        let after = &out[mark..];
        after
            .find("a=one")
            .is_some_and(|at| after[at..].contains("PROMPT> "))
    });
    assert!(
        !pty.output().contains("Stopped"),
        "the job stopped: {}",
        pty.output()
    );
    pty.type_in(b"exit\n");
    wait_child(&mut shell);
}

/// The file the counter's handler writes to.
static COUNTER_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn count(sig: libc::c_int) {
    let line: &[u8] = if sig == libc::SIGINT {
        b"INT\n"
    } else {
        b"TERM\n"
    };
    // SAFETY: write(2) is async-signal-safe; the descriptor stays open.
    unsafe {
        libc::write(
            COUNTER_FD.load(std::sync::atomic::Ordering::Relaxed),
            line.as_ptr().cast(),
            line.len(),
        )
    };
}

/// Not a test: the command of the tests above (see [`Counter`]), which the
/// test binary runs instead of its tests when `DEVLOCK_TEST_COUNTER` is set.
pub(crate) fn signal_counter() {
    let Some(got) = std::env::var_os("DEVLOCK_TEST_COUNTER") else {
        return;
    };
    let var = |name: &str| PathBuf::from(std::env::var_os(name).unwrap());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(got)
        .unwrap();
    COUNTER_FD.store(
        std::os::fd::IntoRawFd::into_raw_fd(file),
        std::sync::atomic::Ordering::Relaxed,
    );
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a handler that only writes; SA_RESTART keeps the loop's
        // calls going.
        unsafe {
            let mut action = std::mem::zeroed::<libc::sigaction>();
            action.sa_sigaction = count as *const () as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
    let pids = var("DEVLOCK_TEST_COUNTER_PIDS");
    let tmp = pids.with_extension("tmp");
    // SAFETY: getppid cannot fail.
    let parent = unsafe { libc::getppid() };
    std::fs::write(&tmp, format!("{} {parent}", std::process::id())).unwrap();
    std::fs::rename(&tmp, &pids).unwrap();
    // On the CPU rather than asleep, so that a signal is delivered the
    // moment it is sent and a second copy cannot merge with the first
    // unseen; it looks for `release` now and then.
    let release = var("DEVLOCK_TEST_COUNTER_RELEASE");
    let mut spins = 0u64;
    loop {
        std::hint::spin_loop();
        spins += 1;
        if spins.is_multiple_of(200_000) && release.exists() {
            break;
        }
    }
}
