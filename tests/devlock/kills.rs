//! A supervisor's SIGKILL of devlock's process group or session ends the
//! whole job, in every placement devlock uses: its own group, a terminal's
//! group shared with a script, a session leader, under `make -j`, under
//! `timeout -k`, after Python's `start_new_session` and `os.killpg`, and
//! under systemd's `KillMode=control-group` and `mixed` (in a real cgroup).
//!
//! The job is a command that ignores SIGTERM (it logs it and goes on) and
//! has a child of its own that ignores it too, as a stuck training job with
//! a data loader. A second taker waits in line outside the killed job; its
//! command writes, as it starts, the state of each of the job's processes.
//! Each test asserts that none of them survived, that the waiter's command
//! started only after the last was gone, and that the lock is free after.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::harness::*;

/// The job under test, started by `start` as `devlock r -- sh -c SCRIPT`
/// (or inside whatever `start` wraps it in).
struct Job {
    s: Scratch,
    heard: PathBuf,
}

impl Job {
    fn new() -> Job {
        let s = Scratch::new();
        let heard = s.work("heard");
        Job { s, heard }
    }

    /// The command after `--`: its child is started with SIGTERM ignored,
    /// then the command itself logs SIGTERM and carries on.
    fn command(&self, tag: &str) -> Vec<String> {
        let pids = self.s.work(&format!("pids{tag}"));
        vec![
            "sh".into(),
            "-c".into(),
            format!(
                "trap '' TERM; sleep 1000 & trap 'echo term >> {heard}' TERM; \
                 echo \"$$ $!\" > {pids}.tmp; mv {pids}.tmp {pids}; \
                 while :; do sleep 0.05; done",
                heard = self.heard.display(),
                pids = pids.display(),
            ),
        ]
    }

    /// `devlock r -- COMMAND` as a shell line (for make, timeout, Python).
    fn devlock_line(&self, resource: &str, tag: &str) -> String {
        let mut words = vec![
            BIN.to_owned(),
            "--dir".into(),
            self.s.dir().display().to_string(),
            resource.into(),
            "--".into(),
        ];
        words.extend(self.command(tag));
        words
            .iter()
            .map(|w| format!("'{}'", w.replace('\'', r"'\''")))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The command's and its child's pids, once it runs.
    fn processes(&self, tag: &str) -> Vec<u32> {
        let path = self.s.work(&format!("pids{tag}"));
        wait_for_file(&path);
        std::fs::read_to_string(&path)
            .unwrap()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect()
    }

    /// A taker of `resource` waiting in line outside the job, whose command
    /// reports the state and kernel flags of `victims` the moment it starts.
    fn waiter(&self, resource: &str, victims: &[u32], tag: &str) -> Waiter {
        let report = self.s.work(&format!("report{tag}"));
        let script = format!(
            "for p in {victims}; do \
               if read -r line < /proc/$p/stat; then set -- ${{line##*) }}; echo \"$p $1 $7\"; \
               else echo \"$p gone\"; fi; \
             done > {report}.tmp 2>/dev/null; mv {report}.tmp {report}",
            victims = pid_list(victims),
            report = report.display()
        );
        let child = self
            .s
            .devlock()
            .args(["-q", "-w", "120", resource, "--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Waiter {
            child: Killed(child),
            report,
        }
    }
}

/// `PF_EXITING` in the flags of /proc/PID/stat: the process is in exit(2).
const PF_EXITING: u64 = 0x4;

struct Waiter {
    child: Killed,
    report: PathBuf,
}

impl Waiter {
    /// Once the job was killed at `killed`: every victim was gone when the
    /// waiter's command started, and the waiter ran to the end.
    fn saw_them_gone(mut self, placement: &str, killed: Instant) {
        wait_for_file(&self.report);
        let after = killed.elapsed();
        let report = std::fs::read_to_string(&self.report).unwrap();
        for line in report.lines() {
            let mut words = line.split_whitespace();
            let (pid, state) = (words.next().unwrap(), words.next().unwrap_or(""));
            // Killed and past closing its files (the kernel's PF_EXITING):
            // it runs no more of its own code and holds nothing.
            let exiting = words
                .next()
                .and_then(|f| f.parse::<u64>().ok())
                .is_some_and(|flags| flags & PF_EXITING != 0);
            assert!(
                exiting || matches!(state, "gone" | "Z" | "X" | ""),
                "{placement}: process {pid} of the killed job was still there ({state}) \
                 when the next waiter's command started: {report}"
            );
        }
        assert!(
            wait_child(&mut self.child.0).success(),
            "{placement}: the waiter failed"
        );
        eprintln!(
            "{placement}: the next waiter's command ran {:.1} ms after the SIGKILL",
            after.as_secs_f64() * 1e3
        );
    }
}

/// Waits until the kernel shows the waiter in line for `resource`.
fn in_line(job: &Job, resource: &str) {
    wait_blocked(&job.s.lock_path(resource), 1);
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) of a process or group this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

/// Every process of session `sid`, as `pkill -s SID` finds them.
fn session_members(sid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let (_, rest) = s.rsplit_once(')')?;
                    rest.split_whitespace().nth(3)?.parse::<u32>().ok()
                })
                == Some(sid)
        })
        .collect()
}

/// The common end: the job's processes are gone, the waiter started after
/// them, and the lock is free.
fn ends_the_job(job: &Job, placement: &str, victims: &[u32], waiter: Waiter, killed: Instant) {
    waiter.saw_them_gone(placement, killed);
    for &pid in victims {
        wait_gone(pid);
    }
    assert!(
        flock_is_free(&job.s.lock_path("r")),
        "{placement}: lock still held"
    );
}

test!(a_group_sigkill_ends_the_job_in_a_group_of_its_own, needs: []);
/// devlock started by the test as the leader of a process group of its
/// own (a shell job, a CI runner's step), then `kill -9 -- -PGID`.
pub(crate) fn a_group_sigkill_ends_the_job_in_a_group_of_its_own() {
    let job = Job::new();
    let mut devlock = job.s.devlock();
    devlock
        .arg("r")
        .arg("--")
        .args(job.command(""))
        .process_group(0)
        .stdin(Stdio::null());
    let devlock = Killed(devlock.spawn().unwrap());
    let victims = job.processes("");
    let waiter = job.waiter("r", &victims, "");
    in_line(&job, "r");
    let killed = Instant::now();
    kill(-(devlock.id() as i32), libc::SIGKILL);
    ends_the_job(&job, "own group", &victims, waiter, killed);
}

test!(kill_9_of_the_command_alone_leaves_its_children_holding, needs: []);
/// `kill -9 PID` of devlock's pid alone kills the command, which devlock
/// became, and nothing else: what the command started keeps the lock it
/// inherited (as under util-linux `flock`), and the next in line gets it
/// once that is gone too. (A supervisor ends a job by its group.)
pub(crate) fn kill_9_of_the_command_alone_leaves_its_children_holding() {
    let job = Job::new();
    let mut devlock = job.s.devlock();
    devlock
        .arg("r")
        .arg("--")
        .args(job.command(""))
        .process_group(0)
        .stdin(Stdio::null());
    let mut devlock = Killed(devlock.spawn().unwrap());
    let victims = job.processes("");
    assert_eq!(victims[0], devlock.id(), "the command is devlock's process");
    let waiter = job.waiter("r", &victims, "");
    in_line(&job, "r");
    kill(devlock.id() as i32, libc::SIGKILL);
    let _ = devlock.0.wait();
    // The child goes on, holding: the waiter stays in line.
    assert!(
        std::path::Path::new(&format!("/proc/{}", victims[1])).exists(),
        "the command's child was killed with it"
    );
    in_line(&job, "r");
    assert!(!waiter.report.exists(), "the waiter ran beside the child");
    let killed = Instant::now();
    kill(victims[1] as i32, libc::SIGKILL);
    ends_the_job(
        &job,
        "the command's pid alone, then its child",
        &victims[1..],
        waiter,
        killed,
    );
}

test!(a_session_leaders_group_or_session_sigkill_ends_the_job, needs: []);
/// `setsid devlock ...` (a session leader), then SIGKILL of its group (the
/// session's id), and in a second round of every process of its session.
pub(crate) fn a_session_leaders_group_or_session_sigkill_ends_the_job() {
    for whole_session in [false, true] {
        let job = Job::new();
        let mut devlock = job.s.devlock();
        devlock
            .arg("r")
            .arg("--")
            .args(job.command(""))
            .stdin(Stdio::null());
        // SAFETY: only setsid(2) between fork and exec.
        unsafe {
            devlock.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let devlock = Killed(devlock.spawn().unwrap());
        let victims = job.processes("");
        let waiter = job.waiter("r", &victims, "");
        in_line(&job, "r");
        let sid = devlock.id();
        let killed = Instant::now();
        if whole_session {
            for pid in session_members(sid) {
                // The session may lose members meanwhile: best effort, as pkill.
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        } else {
            kill(-(sid as i32), libc::SIGKILL);
        }
        let placement = if whole_session {
            "every process of its session"
        } else {
            "session leader's group"
        };
        ends_the_job(&job, placement, &victims, waiter, killed);
    }
}

test!(timeout_kill_after_ends_the_job, needs: [Tool("timeout")]);
/// `timeout -s TERM -k 1000 1000 devlock r -- ...`: the SIGTERM reaches
/// the command as timeout sends it (it logs it and goes on), then timeout's
/// SIGKILL of its whole group ends everything (timeout with it: 137 to its
/// shell). Each of timeout's timers is made to run out when the test is
/// ready for it, by the SIGALRM that timeout's own timer would send: the
/// first once the waiter is in line, the second once the command heard
/// the SIGTERM (on a busy machine, a second passes before either).
pub(crate) fn timeout_kill_after_ends_the_job() {
    let job = Job::new();
    let mut timeout = Command::new("timeout");
    timeout
        .args(["-s", "TERM", "-k", "1000", "1000", "sh", "-c"])
        .arg(format!("exec {}", job.devlock_line("r", "")))
        .process_group(0)
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    let mut timeout = Killed(timeout.spawn().unwrap());
    let victims = job.processes("");
    let waiter = job.waiter("r", &victims, "");
    in_line(&job, "r");
    kill(timeout.id() as i32, libc::SIGALRM);
    poll_until(
        "the command heard timeout's SIGTERM",
        || std::fs::read_to_string(&job.heard).unwrap_or_default(),
        |heard| !heard.is_empty(),
    );
    kill(timeout.id() as i32, libc::SIGALRM);
    let status = wait_child(&mut timeout.0);
    let killed = Instant::now();
    // timeout's SIGKILL of its group ends timeout too: the shell says 137.
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "timeout's exit: {status:?}"
    );
    // timeout sends its SIGTERM to the command and again to its group:
    // once or twice (as the two sends meet in one pending signal or not),
    // as without devlock, which adds none.
    let heard = std::fs::read_to_string(&job.heard).unwrap_or_default();
    assert!(
        matches!(heard.lines().count(), 1 | 2),
        "the command heard SIGTERM once or twice: {heard:?}"
    );
    ends_the_job(&job, "timeout -k", &victims, waiter, killed);
}

test!(python_killpg_after_start_new_session_ends_the_job, needs: [Tool("python3")]);
/// Airflow, Celery, supervisord's killasgroup: Python starts devlock with
/// `start_new_session=True` and ends it with `os.killpg(p.pid, SIGKILL)`.
pub(crate) fn python_killpg_after_start_new_session_ends_the_job() {
    let job = Job::new();
    let go = job.s.work("go");
    let mut argv = vec![
        BIN.to_owned(),
        "--dir".into(),
        job.s.dir().display().to_string(),
        "r".into(),
        "--".into(),
    ];
    argv.extend(job.command(""));
    let script = format!(
        "import os, signal, subprocess, sys, time\n\
         p = subprocess.Popen({argv:?}, start_new_session=True, stdin=subprocess.DEVNULL)\n\
         print(p.pid, flush=True)\n\
         while not os.path.exists({go:?}): time.sleep(0.005)\n\
         os.killpg(p.pid, signal.SIGKILL)\n\
         sys.exit(0 if p.wait() == -signal.SIGKILL else 1)\n",
        go = go.display().to_string(),
    );
    let mut python = Killed(
        Command::new("python3")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let victims = job.processes("");
    let waiter = job.waiter("r", &victims, "");
    in_line(&job, "r");
    let killed = Instant::now();
    std::fs::write(&go, "").unwrap();
    assert!(
        wait_child(&mut python.0).success(),
        "python saw devlock die of SIGKILL"
    );
    ends_the_job(&job, "Python os.killpg", &victims, waiter, killed);
}

test!(make_j_cancelled_by_a_group_sigkill_ends_every_job, needs: [Tool("make")]);
/// `make -j2` with two devlock jobs, cancelled by SIGKILL of make's group
/// (a CI runner's cancel): both jobs end.
pub(crate) fn make_j_cancelled_by_a_group_sigkill_ends_every_job() {
    let job = Job::new();
    let makefile = job.s.work("Makefile");
    std::fs::write(
        &makefile,
        format!(
            "all: a b\na:\n\t{}\nb:\n\t{}\n",
            job.devlock_line("r", "a").replace('$', "$$"),
            job.devlock_line("r2", "b").replace('$', "$$")
        ),
    )
    .unwrap();
    let mut make = Command::new("make");
    make.args(["-s", "-j2", "-f"])
        .arg(&makefile)
        .process_group(0)
        .stdin(Stdio::null())
        .stderr(Stdio::null());
    let make = Killed(make.spawn().unwrap());
    let (a, b) = (job.processes("a"), job.processes("b"));
    let wa = job.waiter("r", &a, "a");
    let wb = job.waiter("r2", &b, "b");
    in_line(&job, "r");
    in_line(&job, "r2");
    let killed = Instant::now();
    kill(-(make.id() as i32), libc::SIGKILL);
    wa.saw_them_gone("make -j2, first job", killed);
    wb.saw_them_gone("make -j2, second job", killed);
    for pid in a.iter().chain(&b) {
        wait_gone(*pid);
    }
    assert!(flock_is_free(&job.s.lock_path("r")));
    assert!(flock_is_free(&job.s.lock_path("r2")));
}

test!(in_a_terminals_shared_group_a_kill_ends_the_job_and_spares_the_others, needs: []);
/// A terminal's foreground job shared with a script (`sh -c 'devlock ...;
/// ...'`): the command stays in that group, so a group SIGKILL reaches it
/// directly; and a `kill -9` of the command and its child alone there
/// ends the job and not the script's group.
pub(crate) fn in_a_terminals_shared_group_a_kill_ends_the_job_and_spares_the_others() {
    for devlock_alone in [false, true] {
        let job = Job::new();
        let pty = Pty::new(200);
        let line = format!(
            "{}; echo script-went-on; sleep 1000",
            job.devlock_line("r", "")
        );
        let mut leader = Killed(pty.spawn(Command::new("sh").arg("-c").arg(line)));
        let victims = job.processes("");
        let waiter = job.waiter("r", &victims, "");
        in_line(&job, "r");
        let killed = Instant::now();
        let placement = if devlock_alone {
            for &pid in &victims {
                kill(pid as i32, libc::SIGKILL);
            }
            "the job's processes alone, in a terminal's shared group"
        } else {
            kill(-(leader.id() as i32), libc::SIGKILL);
            "a terminal's shared group"
        };
        ends_the_job(&job, placement, &victims, waiter, killed);
        if devlock_alone {
            // The script that shared the group goes on.
            pty.wait_for("script-went-on");
            assert!(
                leader.0.try_wait().unwrap().is_none(),
                "the script was killed"
            );
        }
        let _ = leader.0.kill();
    }
}

test!(a_process_the_command_detached_keeps_the_lock_after_the_kill, needs: [Tool("setsid")]);
/// A background process the command deliberately detached (setsid) keeps
/// the lock until it exits, after a group SIGKILL as before; status shows
/// it as a holder whose devlock is gone.
pub(crate) fn a_process_the_command_detached_keeps_the_lock_after_the_kill() {
    let job = Job::new();
    let ready = job.s.work("daemon");
    let release = job.s.work("release");
    let script = format!(
        "setsid sh -c 'echo $$ > {ready}.tmp; mv {ready}.tmp {ready}; \
         while [ ! -e {release} ]; do sleep 0.01; done' & \
         while :; do sleep 0.05; done",
        ready = ready.display(),
        release = release.display()
    );
    let mut devlock = job.s.devlock();
    devlock
        .args(["r", "--", "sh", "-c", &script])
        .process_group(0)
        .stdin(Stdio::null());
    let devlock = Killed(devlock.spawn().unwrap());
    let daemon = pid_in(&ready);
    kill(-(devlock.id() as i32), libc::SIGKILL);
    let view = job.s.wait_for_status("r", "the daemon alone holding", |v| {
        v["holders"][0]["pids"] == serde_json::json!([daemon])
    });
    assert_eq!(view["state"], "held", "{view}");
    let waiter = job.waiter("r", &[daemon], "");
    in_line(&job, "r");
    assert!(
        !waiter.report.exists(),
        "the waiter ran while the daemon held on"
    );
    std::fs::write(&release, "").unwrap();
    let released = Instant::now();
    ends_the_job(
        &job,
        "a detached daemon, once it exits",
        &[daemon],
        waiter,
        released,
    );
}

/// A cgroup v2 of our own (systemd's unit), or none where none can be made.
struct Unit {
    path: PathBuf,
}

impl Unit {
    fn new() -> Option<Unit> {
        let path = cgroup2_root()?.join(format!("devlock-test-{}", std::process::id()));
        let _ = std::fs::remove_dir(&path);
        std::fs::create_dir(&path).ok()?;
        Some(Unit { path })
    }

    fn procs(&self) -> Vec<u32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// SIGKILL to every process of the unit, as systemd ends a unit.
    fn kill_all(&self) {
        if std::fs::write(self.path.join("cgroup.kill"), "1").is_err() {
            while !self.procs().is_empty() {
                for pid in self.procs() {
                    // SAFETY: plain kill(2) of a process in our cgroup.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
            }
        }
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        self.kill_all();
        let start = Instant::now();
        while std::fs::remove_dir(&self.path).is_err() && start.elapsed() < HANG {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

test!(systemd_stop_with_either_kill_mode_ends_the_job, needs: [Root, Cgroup]);
/// systemd's stop of a unit whose main process is devlock: SIGTERM to
/// every process of the unit's cgroup (`KillMode=control-group`) or to the
/// main process alone (`mixed`), then, the job still running, SIGKILL to
/// every process left. The unit is a real cgroup v2 (a session of its own,
/// as systemd starts a service).
pub(crate) fn systemd_stop_with_either_kill_mode_ends_the_job() {
    for mixed in [false, true] {
        let job = Job::new();
        let unit = Unit::new().expect("a cgroup v2 of our own");
        let mut main = Command::new("sh");
        main.arg("-c")
            .arg(format!(
                "echo $$ > {}; exec {}",
                unit.path.join("cgroup.procs").display(),
                job.devlock_line("r", "")
            ))
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only setsid(2) between fork and exec.
        unsafe {
            main.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let main = Killed(main.spawn().unwrap());
        let victims = job.processes("");
        let waiter = job.waiter("r", &victims, "");
        in_line(&job, "r");
        let mode = if mixed { "mixed" } else { "control-group" };
        let targets = if mixed { vec![main.id()] } else { unit.procs() };
        for pid in targets {
            // SAFETY: plain kill(2) of a process in our cgroup.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        }
        // The command hears it (and goes on): systemd's stop times out.
        wait_for_file(&job.heard);
        let killed = Instant::now();
        unit.kill_all();
        ends_the_job(
            &job,
            &format!("systemd KillMode={mode}"),
            &victims,
            waiter,
            killed,
        );
    }
}

/// Processes whose command line holds `marker` (zombies have none).
fn marked(marker: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .collect()
}

test!(a_group_sigkill_at_any_moment_of_the_start_leaves_nothing, needs: []);
/// A supervisor's SIGKILL can land at any moment, the command's start
/// included: kills spread over devlock's first milliseconds (the spread is
/// chaos, not a handshake) never leave a process of the job behind, nor
/// the lock held.
pub(crate) fn a_group_sigkill_at_any_moment_of_the_start_leaves_nothing() {
    let s = Scratch::new();
    let mut seed = std::process::id() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    let mut survivors = Vec::new();
    for round in 0..40 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let marker = format!("devlock-kill-test-{}-{round}", std::process::id());
        let mut devlock = s.devlock();
        devlock
            .args(["r", "--", "sh", "-c", "sleep 1000 & sleep 1000; :", &marker])
            .process_group(0)
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        let mut devlock = devlock.spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_micros(seed % 6000));
        kill(-(devlock.id() as i32), libc::SIGKILL);
        let _ = devlock.wait();
        let start = Instant::now();
        loop {
            let left = marked(&marker);
            if left.is_empty() {
                break;
            }
            if start.elapsed() > std::time::Duration::from_secs(5) {
                survivors.push((round, left));
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    for (_, pids) in &survivors {
        for pid in pids {
            // SAFETY: plain kill(2) of a survivor this test started.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
    }
    assert!(
        survivors.is_empty(),
        "processes outlived their job's SIGKILL: {survivors:?}"
    );
    poll_until(
        "the lock to be free",
        || flock_is_free(&s.lock_path("r")),
        |free| *free,
    );
}
