//! Another user's budgets and forged ones, a starting job stopped by
//! Ctrl-Z, and a stranger's lock on a started budget's ticket.

use super::*;

test!(budgets_of_another_user_count_and_are_counted, needs: [Root, Tool("setpriv")]);
pub(crate) fn budgets_of_another_user_count_and_are_counted() {
    let g = Gpus::new(&[80 * GIB]);
    std::fs::set_permissions(
        &g.state,
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    // In the managed directory: root's gpu and gpu:0 files, from the probe.
    let out = g.run(&["setup", "--gpus"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let a = mem_on("root-job", "60GiB", "0.2s", "gpu:0");
    let mut root_job = g.job(&a, "root", 0, 0, false);
    g.wait_ready("root");
    g.wait_settled("gpu:0", 1);
    let nobody = |args: &[&str]| {
        let mut cmd = as_user(USER_A, BIN);
        cmd.args(args)
            .env("DEVLOCK_DIR", g.s.dir())
            .on_fake_gpu(&g.state)
            .stdin(Stdio::null());
        cmd
    };
    let out = nobody(&["-n", "--mem", "30GiB", "gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("60 GiB of 80 GiB budgeted (root-job 60 GiB)"),
        "{}",
        stderr(&out)
    );
    // Another user's budget counts for root in turn.
    let ready = g.s.work("ready-nobody");
    let release = g.s.work("release-nobody");
    let script = format!(
        "echo > {r}.tmp; mv {r}.tmp {r}; while [ ! -e {release} ]; do sleep 0.01; done",
        r = ready.display(),
        release = release.display()
    );
    let mut theirs = nobody(&[
        "--step",
        "nobody-job",
        "--mem",
        "10GiB",
        "--settle",
        "0.2s",
        "gpu:0",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_file(&ready);
    let view = g.wait_settled("gpu:0", 2);
    assert!(
        view["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["user"] == "nobody" && h["mem_mib"] == 10 * GIB),
        "{view}"
    );
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("70 GiB of 80 GiB budgeted"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        g.status_trust(),
        (true, true),
        "the managed directory stays safe and managed"
    );
    std::fs::write(&release, "").unwrap();
    assert!(wait_child(&mut theirs).success());
    finish(&g, "root", &mut root_job);
}

/// A process's start time, clock ticks since boot (field 22 of its stat).
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = stat.rsplit_once(')').unwrap().1;
    after_name
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap()
}

/// A version 2 record with these members, as devlock writes one.
fn forged_record(members: &str) -> String {
    let body = format!("{{{members}}}");
    let check = body.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{{\"magic\":\"devlock-record\",\"v\":2,\"check\":\"{check:016x}\",{members}}}\n")
}

test!(a_forged_budget_cannot_claim_another_holders_job, needs: []);
pub(crate) fn a_forged_budget_cannot_claim_another_holders_job() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("theirs", "20GiB", "0.2s", "gpu:0");
    let mut job = g.job(&a, "a", 0, 20 * GIB, false);
    let command: u32 = g
        .wait_ready("a")
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap();
    g.wait_settled("gpu:0", 1);
    // A forger (no ancestor of that job) holds the device shared, as anyone
    // may, and labels its own 1 MiB budget with the other holder's command
    // as its "child".
    let lock = std::fs::File::open(g.s.dir().join("gpu:0.lock")).unwrap();
    let young = g.s.dir().join(".forged");
    let label = std::fs::File::create_new(&young).unwrap();
    let forger = Forger::hold(&lock, &label);
    let me = forger.0;
    std::fs::rename(&young, g.s.dir().join(format!(".gpu:0@{me}.0.hold"))).unwrap();
    let members = format!(
        "\"step\":\"forger\",\"pid\":{me},\"pid_start\":{},\"child\":{command},\"child_start\":{},\"since_ms\":1,\"ticket\":1,\"mem_mib\":1",
        start_time(me),
        start_time(command)
    );
    std::io::Write::write_all(&mut &label, forged_record(&members).as_bytes()).unwrap();
    let view = g.wait_view("gpu:0", "the forger's budget believed", |v| {
        v["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["mem_mib"] == 1)
    });
    assert_eq!(view["memory"]["budgets_mib"], 20 * GIB + 1, "{view}");
    // 20 GiB + 1 MiB budgeted, 40 GiB and 2 GiB headroom asked: it fits,
    // unless the other job's 20 GiB were counted twice.
    let out = g.run(&["-n", "--mem", "40GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The forger's own budget still counts.
    let out = g.run(&["-n", "--mem", "58GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains("forger 1 MiB"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("using"), "{}", stderr(&out));
    drop(forger);
    finish(&g, "a", &mut job);
}

/// A forked process that holds `lock` shared and `label` exclusive (flock,
/// on the descriptors it inherits) until dropped: killed and reaped.
struct Forger(u32);

impl Forger {
    fn hold(lock: &std::fs::File, label: &std::fs::File) -> Forger {
        use std::os::fd::AsRawFd;
        let (lock, label) = (lock.as_raw_fd(), label.as_raw_fd());
        let mut ready = [0; 2];
        // SAFETY: pipe(2) into a two-int array.
        assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
        // SAFETY: the child makes only async-signal-safe calls (flock,
        // write, pause, _exit) on descriptors it inherited.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                if libc::flock(lock, libc::LOCK_SH) != 0 || libc::flock(label, libc::LOCK_EX) != 0 {
                    libc::_exit(1);
                }
                libc::write(ready[1], b"r".as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        let mut byte = [0u8; 1];
        // SAFETY: read(2) of one byte; the fds are the pipe's.
        unsafe {
            libc::close(ready[1]);
            assert_eq!(
                libc::read(ready[0], byte.as_mut_ptr().cast(), 1),
                1,
                "forger ready"
            );
            libc::close(ready[0]);
        }
        Forger(pid as u32)
    }
}

impl Drop for Forger {
    fn drop(&mut self) {
        // SAFETY: kill(2) and waitpid(2) of our own child.
        unsafe {
            libc::kill(self.0 as i32, libc::SIGKILL);
            libc::waitpid(self.0 as i32, std::ptr::null_mut(), 0);
        }
    }
}

test!(a_starting_job_stopped_by_ctrl_z_lets_the_next_budget_start, needs: [Tool("bash")]);
pub(crate) fn a_starting_job_stopped_by_ctrl_z_lets_the_next_budget_start() {
    let g = Gpus::new(&[80 * GIB]);
    let pty = Pty::new(120);
    let mut shell = pty.spawn(
        Command::new("bash")
            .args(["--norc", "--noprofile", "-i"])
            .env("PS1", "PROMPT> ")
            .env_remove("PROMPT_COMMAND")
            .env("DEVLOCK_DIR", g.s.dir())
            .env("DEVLOCK_NVML", "none")
            .on_fake_gpu(&g.state),
    );
    pty.wait_for("PROMPT> ");
    // Starting for an hour unless it steps aside: its memory never shows.
    pty.type_in(
        format!(
            "'{BIN}' --step slow --mem 10GiB --settle 1h gpu:0 -- sh -c 'echo job-started; read x; echo job-read-$x'\n"
        )
        .as_bytes(),
    );
    pty.wait_for("job-started");
    let view = g.wait_view("gpu:0", "the job starting", |v| {
        v["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["starting"] == true)
    });
    assert_eq!(view["holders"][0]["step"], "slow", "{view}");
    let mark = pty.output().len();
    pty.type_in(b"\x1a");
    pty.wait_until("the job stopped", |out| {
        out[mark..].contains("Stopped") && out[mark..].contains("PROMPT> ")
    });
    // The hold's watcher (which ignores the terminal's stop) sees the job
    // stopped at its next look and steps aside for it.
    g.wait_settled("gpu:0", 1);
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let view = g.wait_settled("gpu:0", 1);
    assert_eq!(
        view["holders"][0]["mem_mib"],
        10 * GIB,
        "the stopped job keeps its budget: {view}"
    );
    let mark = pty.output().len();
    pty.type_in(b"fg\n");
    pty.type_in(b"on\n");
    pty.wait_until("the job to read on, then the prompt", |out| {
        let after = &out[mark..];
        after
            .find("job-read-on")
            .is_some_and(|at| after[at..].contains("PROMPT> "))
    });
    pty.type_in(b"exit\n");
    wait_child(&mut shell);
}

test!(a_lock_on_a_started_budgets_ticket_is_shown_as_a_place_of_its_own, needs: []);
pub(crate) fn a_lock_on_a_started_budgets_ticket_is_shown_as_a_place_of_its_own() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("theirs", "20GiB", "0.2s", "gpu:0");
    let mut job = g.job(&a, "a", 0, 20 * GIB, false);
    g.wait_ready("a");
    let view = g.wait_settled("gpu:0", 1);
    assert_eq!(view["waiters"], serde_json::json!([]), "{view}");
    // Anyone may lock the byte of the ticket the holder took (the first,
    // in an empty line) once its job started and it let go of it.
    let queue = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(g.s.dir().join(".gpu:0.queue"))
        .unwrap();
    let place = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: (1 << 20) + 1,
        l_len: 1,
        l_pid: 0,
    };
    // SAFETY: F_OFD_SETLK reads one struct flock.
    let set = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&queue),
            libc::F_OFD_SETLK,
            &place,
        )
    };
    assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
    // That lock is in line ahead of every newcomer: shown as what it is,
    // not hidden behind the holder whose ticket number it has.
    let view = g.view("gpu:0");
    assert_eq!(view["holders"][0]["starting"], false, "{view}");
    assert_eq!(view["waiters"][0]["source"], "unregistered", "{view}");
    assert_eq!(view["waiters"][0]["pid"], std::process::id(), "{view}");
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not a registered devlock"),
        "{}",
        stderr(&out)
    );
    drop(queue);
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    finish(&g, "a", &mut job);
}
