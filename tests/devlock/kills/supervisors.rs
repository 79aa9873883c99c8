//! SIGKILL as supervisors send it: to a group of its own, a session leader's
//! group or session, `timeout -k`, Python's `os.killpg`, `make -j`; and
//! kill -9 of the command alone.

use super::*;

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
