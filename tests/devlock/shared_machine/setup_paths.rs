//! Issue #22: setup's way to its directory, leases on squatted files, data in
//! lock files devlock did not make, escapes in paths.

use super::*;

test!(setup_refuses_a_way_through_another_users_link_or_directory_and_changes_nothing, needs: [Root, Tool("setpriv")]);
pub(crate) fn setup_refuses_a_way_through_another_users_link_or_directory_and_changes_nothing() {
    let s = Scratch::new();
    // Elsewhere: root's private directory, with a 0700 directory and a file.
    let secret = s.work("secret");
    std::fs::create_dir(&secret).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::create_dir(secret.join("devlock")).unwrap();
    std::fs::set_permissions(
        secret.join("devlock"),
        std::fs::Permissions::from_mode(0o700),
    )
    .unwrap();
    std::fs::write(secret.join("file"), "root's\n").unwrap();
    // A's directory on the way to --dir...
    let team = s.work("team");
    let t = team.to_str().unwrap();
    assert!(user_does(USER_A, "mkdir", &[t]));
    let dir = format!("{t}/devlock");
    refused(
        &s,
        &dir,
        &team,
        "it is owned by nobody, who can replace what is below it",
    );
    assert!(
        !team.join("devlock").exists(),
        "nothing made in A's directory"
    );
    // ... which A swaps for a link to root's private directory.
    assert!(user_does(
        USER_A,
        "sh",
        &[
            "-c",
            &format!("rmdir {t} && ln -s {} {t}", secret.display())
        ]
    ));
    for target in ["devlock", "file"] {
        refused(
            &s,
            &format!("{t}/{target}"),
            &team,
            &format!(
                "it is a symbolic link (to {}) owned by nobody, who can point it anywhere",
                secret.display()
            ),
        );
    }
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
    assert_eq!(mode(&secret), 0o700);
    assert_eq!(mode(&secret.join("devlock")), 0o700, "not made 1777");
    assert_eq!(
        std::fs::read_dir(secret.join("devlock")).unwrap().count(),
        0,
        "no lock file made in it"
    );
    assert_eq!(
        std::fs::read_to_string(secret.join("file")).unwrap(),
        "root's\n",
        "not unlinked"
    );
    // Root's own link is followed, and the refusal names the real path of
    // what is at fault beyond it.
    let theirs = s.work("theirs");
    assert!(user_does(USER_A, "mkdir", &[theirs.to_str().unwrap()]));
    let via = s.work("via");
    std::os::unix::fs::symlink(&theirs, &via).unwrap();
    refused(
        &s,
        &format!("{}/devlock", via.display()),
        &theirs,
        "it is owned by nobody, who can replace what is below it",
    );
    // A directory others may write without the sticky bit is refused too;
    // a sticky one like /tmp (the work directory here) is not.
    let loose = s.work("loose");
    std::fs::create_dir(&loose).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o777)).unwrap();
    refused(
        &s,
        &format!("{}/devlock", loose.display()),
        &loose,
        "it is writable by everyone and not sticky (777)",
    );
    let fine = s.work("fine");
    let out = s
        .devlock()
        .args(["--dir", fine.to_str().unwrap(), "setup", "r"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(mode(&fine), 0o1777);
}

/// `devlock --dir DIR setup r` refused with one line naming `real`, on the
/// way to `dir`, and `why`; nothing done.
fn refused(s: &Scratch, dir: &str, real: &Path, why: &str) {
    let out = s
        .devlock()
        .args(["--dir", dir, "setup", "r"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
    assert_eq!(stdout(&out), "", "nothing done, nothing said on stdout");
    let err = one_line(&out);
    assert!(
        err.starts_with(&format!(
            "devlock: refusing to set up {dir}: {} is on the way, and {why}",
            real.display()
        )) && err.trim_end().ends_with("nothing was changed"),
        "{err}"
    );
}

/// Whether `bytes` hold a control character a terminal acts on (C0 but
/// the newline, DEL, or the C1 range as UTF-8).
fn has_raw_controls(bytes: &[u8]) -> bool {
    String::from_utf8_lossy(bytes)
        .chars()
        .any(|c| c != '\n' && c.is_control())
}

test!(escapes_in_a_path_through_another_users_link_never_reach_the_terminal, needs: [Root, Tool("setpriv")]);
pub(crate) fn escapes_in_a_path_through_another_users_link_never_reach_the_terminal() {
    let s = Scratch::new();
    // A's directory, named with a title-setting escape and a bell, and
    // A's link to it: --dir passes through both.
    let evil = s.work("x\x1b]0;pwned\x07y");
    assert!(user_does(USER_A, "mkdir", &[evil.to_str().unwrap()]));
    let link = s.work("link");
    assert!(user_does(
        USER_A,
        "ln",
        &["-s", evil.to_str().unwrap(), link.to_str().unwrap()]
    ));
    // Open to all, so that B can make the lock directory in it.
    assert!(user_does(
        USER_A,
        "chmod",
        &["1777", evil.to_str().unwrap()]
    ));
    let dir = link.join("locks");
    let d = dir.to_str().unwrap();
    let run_as = |uid: u32, args: &[&str]| {
        let mut cmd = if uid == 0 {
            Command::new(BIN)
        } else {
            as_user(uid, BIN)
        };
        cmd.env("DEVLOCK_DIR", d)
            .env("DEVLOCK_NVML", "none")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let run = |args: &[&str]| run_as(0, args);
    let out = run_as(USER_B, &["-n", "r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(!has_raw_controls(&out.stderr), "raw escapes: {err:?}");
    assert!(
        err.contains("x?]0;pwned?y, on the way to the locks, is nobody's")
            || err.contains("devlock: warning: a directory, on the way to the locks, is nobody's"),
        "the real path is named, sanitised (or, too long for the line, left out): {err}"
    );
    assert!(
        err.trim_end()
            .ends_with("choose a --dir under root's (details: devlock status)"),
        "no fix that setup would refuse: {err}"
    );
    for args in [&["status", "r"][..], &["status", "--json", "r"]] {
        let out = run_as(USER_B, args);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            !has_raw_controls(&out.stdout) && !has_raw_controls(&out.stderr),
            "{args:?}: {:?}",
            stdout(&out)
        );
    }
    // Root never goes through A's link: a take and status refuse the way,
    // naming it sanitised.
    for args in [&["-n", "r", "--", "true"][..], &["status", "r"]] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(74), "{args:?}: {}", stderr(&out));
        assert!(!has_raw_controls(&out.stderr), "{:?}", stderr(&out));
        assert!(
            one_line(&out).contains("(to ")
                && one_line(&out).contains("x?]0;pwned?y) owned by nobody"),
            "{}",
            stderr(&out)
        );
    }
    // Setup refuses the way, naming it sanitised.
    let out = run(&["setup", "r"]);
    assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
    assert!(!has_raw_controls(&out.stderr), "{:?}", stderr(&out));
    assert!(one_line(&out).contains("is on the way"), "{}", stderr(&out));
    // An error naming the path is sanitised too: a file where the
    // directory should be.
    let file = s.work("f\x1b[2Jile");
    std::fs::write(&file, "").unwrap();
    let out = Command::new(BIN)
        .args(["--dir", file.to_str().unwrap(), "-n", "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
    assert!(!has_raw_controls(&out.stderr), "{:?}", stderr(&out));
    assert!(stderr(&out).contains("f?[2Jile"), "{}", stderr(&out));
}

test!(print_tmpfiles_refuses_a_dir_that_would_break_its_lines, needs: []);
pub(crate) fn print_tmpfiles_refuses_a_dir_that_would_break_its_lines() {
    let out = Command::new(BIN)
        .args([
            "setup",
            "--print-tmpfiles",
            "--dir",
            "/run/lock/x\nd /etc/evil 0777 root root -",
            "gpu",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(stdout(&out), "", "no snippet");
    let err = one_line(&out);
    assert!(
        err.contains("--dir /run/lock/x?d /etc/evil 0777 root root - holds a control"),
        "{err}"
    );
    // Spaces are quoted, as tmpfiles.d(5) reads them.
    let out = Command::new(BIN)
        .args(["setup", "--print-tmpfiles", "--dir", "/run/lock/a b", "gpu"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("d \"/run/lock/a b\" 1777 root root -\n"),
        "{}",
        stdout(&out)
    );
}

/// A renewed read lease as `uid` on the file at `path` (fixture
/// leaseholder.py), with a flock through the same descriptor when `flock`:
/// the guard and its pid, once it holds.
fn lease_as(s: &Scratch, uid: u32, path: &Path, flock: bool, tag: &str) -> (Killed, u32) {
    let ready = s.work(&format!("ready-{tag}"));
    let release = s.work(&format!("release-{tag}"));
    let mut cmd = as_user(uid, python());
    cmd.arg(fixture("leaseholder.py"))
        .arg(path)
        .arg(&ready)
        .arg(&release);
    if flock {
        cmd.arg("flock");
    }
    let guard = Killed(cmd.stdin(Stdio::null()).spawn().unwrap());
    (guard, pid_in(&ready))
}

test!(no_lease_a_squatter_planted_survives_setups_takeover, needs: [Root, Tool("setpriv")]);
pub(crate) fn no_lease_a_squatter_planted_survives_setups_takeover() {
    let s = Scratch::new();
    open_dir(&s);
    // A made r.lock and q.lock, so A may lease them.
    for r in ["r", "q"] {
        assert!(
            run_as(&s, USER_A, &["-q", "-n", r, "--", "true"])
                .status
                .success()
        );
    }
    let ino = |r: &str| std::fs::metadata(s.lock_path(r)).unwrap().ino();
    let (old_r, old_q) = (ino("r"), ino("q"));
    // A renewed read lease on r.lock; a flock and a lease on q.lock.
    let (mut leases_r, _) = lease_as(&s, USER_A, &s.lock_path("r"), false, "r");
    let (mut holds_q, q_pid) = lease_as(&s, USER_A, &s.lock_path("q"), true, "q");
    let out = s.run(&["setup", "r", "q"]);
    // q is held: kept (a held lock file is never replaced), and said so.
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(
        said.contains(&format!(
            "{}: replaced a regular file owned by nobody with a new one (root:root 666)",
            s.lock_path("r").display()
        )),
        "{said}"
    );
    assert!(
        stderr(&out).contains(&format!(
            "{} is held, so it was kept (taken over in place), but the lease on it (pid {q_pid}, nobody) stays",
            s.lock_path("q").display()
        )),
        "{}",
        stderr(&out)
    );
    let meta = std::fs::metadata(s.lock_path("r")).unwrap();
    assert_ne!(meta.ino(), old_r, "a new file");
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o666));
    assert_eq!(ino("q"), old_q, "the held file kept");
    // No take of r waits on the lease, root's or another user's.
    for uid in [0, USER_B] {
        let out = devlock_as(&s, uid)
            .args(["-q", "-w", "10", "r", "--", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{uid}: {}", stderr(&out));
    }
    // Once q is free (its holder gone), setup replaces nothing more: q is
    // root's and has no lease left.
    release(&s, "q");
    assert!(wait_child(&mut holds_q.0).success());
    let again = s.run(&["setup", "r", "q"]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stdout(&again).contains("nothing changed"),
        "{}",
        stdout(&again)
    );
    release(&s, "r");
    assert!(wait_child(&mut leases_r.0).success());
}

test!(a_lock_file_the_command_writes_itself_is_never_overwritten_or_cut, needs: []);
pub(crate) fn a_lock_file_the_command_writes_itself_is_never_overwritten_or_cut() {
    let s = Scratch::new();
    let project = s.work("project");
    std::fs::create_dir(&project).unwrap();
    // A directory made for locks (sticky), where the record goes into the
    // lock file (elsewhere it never does: see hostile_takes.rs).
    std::fs::set_permissions(&project, std::fs::Permissions::from_mode(0o1777)).unwrap();
    // Missing at first (devlock makes it), and empty at first (as
    // `touch` or util-linux flock leave it): devlock's record goes in,
    // then the command writes its own data over it once it runs (once
    // the record names it), and exits.
    for (round, before) in [("missing", None), ("empty", Some(""))] {
        let lock = project.join("out.lock");
        let _ = std::fs::remove_file(&lock);
        if let Some(text) = before {
            std::fs::write(&lock, text).unwrap();
        }
        let script = "until grep -q \"\\\"pid\\\":$$,\" out.lock; do sleep 0.01; done; \
                      printf 'version = 4\\n' > out.lock";
        let out = Command::new(BIN)
            .current_dir(&project)
            .env_remove("DEVLOCK_DIR")
            .args(["--dir", ".", "-w", "60", "out", "--", "sh", "-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{round}: {}", stderr(&out));
        assert_eq!(
            std::fs::read_to_string(&lock).unwrap(),
            "version = 4\n",
            "{round}: release cut what the command wrote"
        );
    }
    // A record devlock wrote stays once the command ends (chain-loaded,
    // nobody is left to clear it), naming a process that is gone: status
    // labels nobody with it.
    let out = Command::new(BIN)
        .current_dir(&project)
        .env_remove("DEVLOCK_DIR")
        .args(["--dir", ".", "-n", "mine", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let out = Command::new(BIN)
        .current_dir(&project)
        .env_remove("DEVLOCK_DIR")
        .args(["--dir", ".", "status", "--json", "mine"])
        .output()
        .unwrap();
    let view = &json_of(&out)["resources"][0];
    assert_eq!(view["state"], "free", "{view}");
    assert_eq!(array_len(&view["holders"]), 0, "{view}");
}

test!(a_command_that_waits_for_its_own_jobs_lock_file_is_told_so, needs: [Tool("flock")]);
pub(crate) fn a_command_that_waits_for_its_own_jobs_lock_file_is_told_so() {
    // cargo locks Cargo.lock: `devlock --dir . Cargo -- cargo build` waits
    // for itself. util-linux flock plays cargo here.
    let s = Scratch::new();
    let project = s.work("project");
    std::fs::create_dir(&project).unwrap();
    std::fs::write(project.join("Cargo.lock"), "version = 4\n").unwrap();
    let mut job = Killed(
        Command::new(BIN)
            .current_dir(&project)
            .env_remove("DEVLOCK_DIR")
            .args([
                "--dir",
                ".",
                "Cargo",
                "--",
                "flock",
                "-w",
                "120",
                "Cargo.lock",
                "true",
            ])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(job.0.stderr.take().unwrap());
    let said = wait_for_line(&mut err, "part of this job");
    assert!(
        said.contains(
            "flock (pid ") && said.contains(
            "), part of this job, waits for a lock on ./Cargo.lock, which this job holds as Cargo: it will wait for ever"
        ),
        "{said}"
    );
    // SIGTERM ends the job (devlock passes it on to the command).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(job.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    wait_child(&mut job.0);
    assert_eq!(
        std::fs::read_to_string(project.join("Cargo.lock")).unwrap(),
        "version = 4\n"
    );
}

test!(setup_changes_no_file_outside_through_a_planted_hard_link, needs: [Root, Tool("setpriv")]);
pub(crate) fn setup_changes_no_file_outside_through_a_planted_hard_link() {
    let s = Scratch::new();
    // Root's 0666 file elsewhere (another directory's lock file, say): A
    // may link it (fs.protected_hardlinks lets anyone link a file they can
    // write) into a directory A made first at --dir.
    let outside = s.work("outside.lock");
    std::fs::write(&outside, "").unwrap();
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o666)).unwrap();
    let dir = s.work("squat");
    let d = dir.to_str().unwrap();
    assert!(user_does(USER_A, "mkdir", &["-m", "1777", d]));
    assert!(user_does(
        USER_A,
        "ln",
        &[outside.to_str().unwrap(), &format!("{d}/r.lock")]
    ));
    let out = s
        .devlock()
        .args(["--dir", d, "setup", "--group", "root", "r"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!(
            "{d}/r.lock: replaced a regular file owned by root with 2 links with a new one (root:root 660)"
        )),
        "{}",
        stdout(&out)
    );
    let meta = std::fs::metadata(&outside).unwrap();
    assert_eq!(
        meta.mode() & 0o7777,
        0o666,
        "the file outside keeps its mode"
    );
    assert_eq!(meta.nlink(), 1, "and is linked here no more");
    let lock = std::fs::metadata(dir.join("r.lock")).unwrap();
    assert_eq!(
        (lock.uid(), lock.mode() & 0o777, lock.nlink()),
        (0, 0o660, 1)
    );
}

test!(a_strangers_lock_that_shuts_one_candidates_line_does_not_shut_any, needs: [Root, Tool("setpriv")]);
/// `--any r q`: a stranger's lock on r's slot agreement passes r over and
/// the request takes q; with both lines shut, `-n` names the first
/// stranger's lock (busy, 75), never a usage error.
pub(crate) fn a_strangers_lock_that_shuts_one_candidates_line_does_not_shut_any() {
    let s = scene(false);
    assert!(
        s.run(&["-n", "--slots", "1", "q", "--", "true"])
            .status
            .success()
    );
    let queue = |r: &str| {
        s.dir()
            .join(format!(".{r}.queue"))
            .to_str()
            .unwrap()
            .to_owned()
    };
    let at = (AGREE_BASE + 5).to_string();
    let (_r, _) = stranger_holds(&s, USER_A, &["ofd", &queue("r"), &at, "1", "read"], "r");
    let out = run_as(
        &s,
        USER_B,
        &[
            "-w",
            "30",
            "--any",
            "r",
            "q",
            "--",
            "sh",
            "-c",
            "echo $DEVLOCK_RESOURCES",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "q", "{}", stderr(&out));
    let (_q, _) = stranger_holds(&s, USER_A, &["ofd", &queue("q"), &at, "1", "read"], "q");
    let out = run_as(&s, USER_B, &["-n", "--any", "r", "q", "--", "true"]);
    assert_busy_naming(&out, "the agreement of --slots 5");
}

test!(a_strangers_agreement_beside_a_devlocks_is_named_in_status, needs: [Root, Tool("setpriv")]);
/// A `--slots 3` holder holds its agreement byte; a stranger then read-locks
/// the byte of `--slots 5` beside it, which keeps every new request out of
/// the line. Status names the stranger's byte and still counts the holder's
/// 3 slots, whichever of the two the kernel's table lists first.
pub(crate) fn a_strangers_agreement_beside_a_devlocks_is_named_in_status() {
    let s = scene(false);
    let q = s.dir().join(".r.queue");
    let (_holder, holder) = hold_as(&s, 0, &["--slots", "3", "r"], "h");
    let at = (AGREE_BASE + 5).to_string();
    let (_lock, pid) = stranger_holds(
        &s,
        USER_A,
        &["ofd", q.to_str().unwrap(), &at, "1", "read"],
        "a",
    );
    let view = s.resource_status("r");
    let foreign = view["foreign_locks"].as_array().unwrap();
    assert!(
        foreign
            .iter()
            .any(|f| f["range"] == "4101" && f["effect"] == "blocks the slot agreement"),
        "{view}"
    );
    assert_eq!(view["slots"], 3, "{view}");
    assert!(
        view["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["pids"].as_array().unwrap().contains(&holder.into())),
        "{view}"
    );
    let out = s.run(&["-n", "--slots", "3", "r", "--", "true"]);
    assert_busy_naming(&out, &format!("pid {pid}, nobody"));
    release(&s, "a");
    release(&s, "h");
}
