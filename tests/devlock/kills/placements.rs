//! Placements beyond a group of its own: a terminal's shared group, a
//! process the command detached, a systemd unit's cgroup, and a kill at
//! any moment of the start.

use super::*;

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
