//! devlock becomes its command (chain-loading, issue 35): the command runs
//! as devlock's own process, and what must run during a hold runs in a
//! watcher that is nobody's child in the job, holds no lock, and stops the
//! whole job when the idle policy or a budget says so. Against the fake
//! nvidia-smi (contrib/fake-gpu), which makes a hold need a watcher.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::harness::*;

/// A scratch directory with one fake GPU, sampled fast.
struct Gpu {
    s: Scratch,
    state: PathBuf,
}

impl Gpu {
    fn new() -> Gpu {
        let s = Scratch::new();
        let state = s.work("gpus");
        std::fs::create_dir(&state).unwrap();
        std::fs::write(state.join("gpus"), "0 81920\n").unwrap();
        std::fs::write(state.join("util.0"), "0\n").unwrap();
        Gpu { s, state }
    }

    fn devlock(&self) -> Command {
        let mut cmd = self.s.devlock();
        cmd.on_fake_gpu(&self.state)
            .env("DEVLOCK_SAMPLE_EVERY", "200ms")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    /// `devlock ARGS gpu:0 -- sh -c ...` in a process group of its own: the
    /// command uses `mib` on the GPU, starts a child in its group (`sleep`),
    /// and writes `ready` ("COMMAND CHILD") once both run.
    fn job(&self, args: &[&str], mib: u64) -> Child {
        let ready = self.s.work("ready");
        let script = format!(
            "echo 0 $$ {mib} > {state}/use.job; sleep 1000 & \
             echo \"$$ $!\" > {r}.tmp; mv {r}.tmp {r}; while :; do sleep 0.05; done",
            state = self.state.display(),
            r = ready.display()
        );
        let mut cmd = self.devlock();
        cmd.args(args)
            .args(["gpu:0", "--", "sh", "-c", &script])
            .process_group(0);
        cmd.spawn().unwrap()
    }

    /// The command's and its child's pids, once they run.
    fn ready(&self) -> (u32, u32) {
        let path = self.s.work("ready");
        wait_for_file(&path);
        let text = std::fs::read_to_string(&path).unwrap();
        let mut pids = text.split_whitespace().map(|p| p.parse().unwrap());
        (pids.next().unwrap(), pids.next().unwrap())
    }

    /// The watcher's pid, once it has labelled the lock with it.
    fn watcher(&self) -> u32 {
        let lock = self.s.lock_path("gpu:0");
        poll_until(
            "the watcher in the lock's record",
            || std::fs::read_to_string(&lock).unwrap_or_default(),
            |text| text.contains("\"watcher\""),
        );
        let text = std::fs::read_to_string(&lock).unwrap();
        let at = text.find("\"watcher\":").unwrap() + "\"watcher\":".len();
        text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    }

    /// The end line's `how` of the one job, once written.
    fn how_it_ended(&self) -> String {
        let file = self
            .s
            .usage_dir()
            .join(format!("{}.jsonl", nix::unistd::geteuid()));
        let line = poll_until(
            "the end line",
            || std::fs::read_to_string(&file).unwrap_or_default(),
            |text| text.contains("\"event\":\"end\""),
        );
        let end = line
            .lines()
            .find(|l| l.contains("\"event\":\"end\""))
            .unwrap()
            .to_owned();
        let v: serde_json::Value = serde_json::from_str(&end).unwrap();
        v["how"].as_str().unwrap().to_owned()
    }
}

/// The parent pid and process group in /proc/PID/stat.
fn parent_and_group(pid: u32) -> Option<(u32, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(1);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// Whether any descriptor of `pid` holds a lock (a `lock:` line in its fdinfo).
fn holds_any_lock(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
        .any(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .lines()
                .any(|l| l.starts_with("lock:"))
        })
}

test!(the_command_has_devlocks_pid, needs: []);
/// The command runs as devlock's own process: the pid its parent started,
/// the flock's taker in the kernel's table, the holder status names, with
/// no other process beside it.
pub(crate) fn the_command_has_devlocks_pid() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let mut job = Killed(
        s.devlock()
            .args(["--step", "train", "r", "--", "sh", "-c"])
            .arg(format!(
                "echo $$ > {r}.tmp; mv {r}.tmp {r}; while :; do sleep 0.05; done",
                r = ready.display()
            ))
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap(),
    );
    assert_eq!(pid_in(&ready), job.id(), "the command is devlock's process");
    let view = s.resource_status("r");
    let holder = &view["holders"][0];
    assert_eq!(holder["pid"], job.id(), "{view:#}");
    assert_eq!(holder["step"], "train", "{view:#}");
    assert_eq!(holder["source"], "record", "{view:#}");
    // Nothing but the command and its sleeps in its group: no guard, no watcher.
    let group = group_members(&[job.id()].into_iter().collect());
    for pid in group {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        // (Empty: a `sleep` that ended meanwhile.)
        assert!(matches!(comm.trim(), "sh" | "sleep" | ""), "{pid}: {comm}");
    }
    signal(job.id(), libc::SIGTERM);
    let status = wait_child(&mut job.0);
    assert_eq!(status.code(), None, "killed by the signal, as the command");
    // Free once the command's last `sleep`, which inherited it, is gone too.
    poll_until(
        "the lock to be free",
        || flock_is_free(&s.lock_path("r")),
        |free| *free,
    );
}

test!(a_watched_jobs_group_sigkill_leaves_nothing, needs: []);
/// A supervisor's SIGKILL of the job's group ends the command, its child
/// and the watcher (which is in the group), and frees the lock.
pub(crate) fn a_watched_jobs_group_sigkill_leaves_nothing() {
    let g = Gpu::new();
    let mut job = Killed(g.job(&["--idle-timeout", "1h"], 100));
    let (command, child) = g.ready();
    let watcher = g.watcher();
    assert_eq!(command, job.id());
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(job.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_child(&mut job.0);
    for pid in [command, child, watcher] {
        wait_gone(pid);
    }
    poll_until(
        "nothing left of the job's group",
        || group_members(&[job.id()].into_iter().collect()).len(),
        |left| *left == 0,
    );
    assert!(flock_is_free(&g.s.lock_path("gpu:0")));
}

test!(the_watcher_is_not_the_commands_child_and_holds_no_lock, needs: []);
/// The watcher runs in the job's group but is not the command's child (the
/// command never reaps it), and none of its descriptors holds a lock.
pub(crate) fn the_watcher_is_not_the_commands_child_and_holds_no_lock() {
    let g = Gpu::new();
    let mut job = Killed(g.job(&[], 100));
    let (command, _) = g.ready();
    let watcher = g.watcher();
    let (parent, group) = parent_and_group(watcher).unwrap();
    assert_ne!(parent, command, "the watcher is the command's child");
    assert_eq!(group, command, "the watcher is outside the job's group");
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{watcher}/comm"))
            .unwrap()
            .trim(),
        "devlock-watch"
    );
    assert!(!holds_any_lock(watcher), "the watcher holds a lock");
    assert!(
        holds_any_lock(command),
        "the command does not hold the lock"
    );
    // It ends with the command, having written the end line.
    signal(command, libc::SIGTERM);
    wait_child(&mut job.0);
    wait_gone(watcher);
    assert_eq!(g.how_it_ended(), "signal");
}

test!(a_watcher_killed_alone_leaves_the_job_running_and_the_lock_held, needs: []);
/// kill -9 of the watcher alone: the job runs on holding the lock, and
/// status says its watch is gone.
pub(crate) fn a_watcher_killed_alone_leaves_the_job_running_and_the_lock_held() {
    let g = Gpu::new();
    let mut job = Killed(g.job(&[], 100));
    let (command, child) = g.ready();
    let watcher = g.watcher();
    signal(watcher, libc::SIGKILL);
    wait_gone(watcher);
    assert!(job.0.try_wait().unwrap().is_none(), "the command ended");
    assert!(std::path::Path::new(&format!("/proc/{child}")).exists());
    assert!(
        !flock_is_free(&g.s.lock_path("gpu:0")),
        "the lock was let go"
    );
    let view = g.s.resource_status("gpu:0");
    let holder = &view["holders"][0];
    assert_eq!(holder["pid"], command, "{view:#}");
    assert_eq!(holder["watch_gone"], true, "{view:#}");
    let table = g.s.devlock().args(["status", "gpu:0"]).output().unwrap();
    assert!(
        stdout(&table).contains("(watch gone)"),
        "{}",
        stdout(&table)
    );
}

test!(an_idle_or_over_budget_stop_ends_the_whole_job, needs: []);
/// The watcher's stops reach the whole job: the command and the child it
/// started in its group, whose SIGTERM nobody forwards.
pub(crate) fn an_idle_or_over_budget_stop_ends_the_whole_job() {
    for (args, how) in [
        (&["--idle-timeout", "1s"][..], "idle"),
        (
            &["--mem", "1GiB", "--settle", "0.3s", "--mem-strict"][..],
            "over-budget",
        ),
    ] {
        let g = Gpu::new();
        let mut job = Killed(g.job(args, 4096));
        let (command, child) = g.ready();
        let status = wait_child(&mut job.0);
        assert_eq!(status.code(), None, "{how}: {status:?}");
        wait_gone(command);
        wait_gone(child);
        // The rest of the group (the loop's `sleep 0.05` of the moment,
        // which inherited the lock too) dies of the same signal, a moment
        // later on a busy machine: the lock is let go once it has.
        poll_until(
            &format!("{how}: the whole job gone and the lock let go"),
            || flock_is_free(&g.s.lock_path("gpu:0")),
            |free| *free,
        );
        assert_eq!(g.how_it_ended(), how);
    }
}

test!(a_command_that_closes_its_descriptors_lets_the_lock_go_and_a_shell_keeps_it, needs: [Tool("python3")]);
/// The lock lives in the command's descriptors (as under `flock -F`): a
/// command that closes every descriptor it inherits (sudo, ssh) lets the
/// lock go while it runs, as devlock(1) says; the remedy it gives, a shell
/// that holds the lock and runs the command as its child, keeps it.
pub(crate) fn a_command_that_closes_its_descriptors_lets_the_lock_go_and_a_shell_keeps_it() {
    let s = Scratch::new();
    for (tag, via_shell) in [("closer", false), ("shell", true)] {
        let (ready, go) = (
            s.work(&format!("{tag}-ready")),
            s.work(&format!("{tag}-go")),
        );
        let python = format!(
            "import os,time\nos.closerange(3, 65536)\nopen({r:?}, 'w').close()\nwhile not os.path.exists({g:?}): time.sleep(0.01)",
            r = ready.display().to_string(),
            g = go.display().to_string()
        );
        let mut cmd = s.devlock();
        cmd.args(["-q", "r", "--"]);
        if via_shell {
            cmd.args(["sh", "-c", "python3 -c \"$1\"; exit $?", "sh", &python]);
        } else {
            cmd.args(["python3", "-c", &python]);
        }
        let mut holder = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_file(&ready);
        let taken = s.run(&["-n", "r", "--", "true"]);
        if via_shell {
            assert_eq!(taken.status.code(), Some(75), "{tag}: {}", stderr(&taken));
        } else {
            assert!(taken.status.success(), "{tag}: {}", stderr(&taken));
        }
        std::fs::write(&go, "").unwrap();
        assert!(wait_child(&mut holder).success(), "{tag}");
    }
}
