//! Issue #32's takes: the busy file another user cannot squat (case 4),
//! the library's one take (case 8), one typed busy for a lease (case 9) and
//! `--dir . NAME` keeping devlock's record out of the command's file (case
//! 10), each through the real binary (and the library, where it is the
//! front end at stake). Handshakes only: files written in one rename, lines
//! read, status asked.

use std::io::BufReader;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use crate::harness::*;
use crate::shared_machine::{devlock_as, one_line, python, user_does};
use devlock::ExitCodeOf;

/// A file's text, once it has been written (in one rename).
fn text_of(path: &Path) -> String {
    wait_for_file(path);
    std::fs::read_to_string(path).unwrap()
}

/// Field 22 of `/proc/PID/stat`: the process's start time, as a co-user
/// reads it.
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split(' ').nth(19).unwrap().parse().unwrap()
}

// ----------------------------------------------------------------------------
// 4. `devlock busy` cannot be squatted.

test!(devlock_busy_cannot_be_squatted_by_another_user, needs: [Root, Tool("setpriv")]);
pub(crate) fn devlock_busy_cannot_be_squatted_by_another_user() {
    let s = Scratch::new();
    // Root makes the lock directory (1777), as in the other cross-user tests.
    assert!(s.run(&["-n", "r", "--", "true"]).status.success());
    // A shared temporary directory, as /tmp is.
    let tmp = s.work("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (name, go, rc, done) = (s.work("name"), s.work("go"), s.work("rc"), s.work("done"));
    let script = format!(
        "printf %s \"$DEVLOCK_BUSY_FILE\" > {name}.tmp && mv {name}.tmp {name}; \
         while [ ! -e {go} ]; do sleep 0.01; done; \
         {BIN} busy 1h; echo $? > {rc}.tmp; mv {rc}.tmp {rc}; \
         while [ ! -e {done} ]; do sleep 0.01; done",
        name = name.display(),
        go = go.display(),
        rc = rc.display(),
        done = done.display(),
    );
    // A GPU hold with an idle policy: its watcher reads the busy file and
    // removes it at the end (a hold nothing watches names none).
    let gpus = s.work("gpus");
    std::fs::create_dir(&gpus).unwrap();
    std::fs::write(gpus.join("gpus"), "0 81920\n").unwrap();
    std::fs::write(gpus.join("util.0"), "0\n").unwrap();
    std::fs::set_permissions(&gpus, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mut victim = Killed(
        devlock_as(&s, USER_A)
            .env("TMPDIR", &tmp)
            .on_fake_gpu(&gpus)
            .args([
                "-q",
                "--idle-timeout",
                "2h",
                "gpu:0",
                "--",
                "sh",
                "-c",
                &script,
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let busy_file = text_of(&name);
    // What a co-user can learn of the hold from /proc: its pid and start.
    let pid = victim.id();
    let derivable = tmp.join(format!("devlock-busy-{USER_A}-{pid}-{}", start_time(pid)));
    let token = busy_file
        .strip_prefix(&format!("{}-", derivable.display()))
        .unwrap_or_else(|| panic!("{busy_file} is not named for the holder"));
    assert!(
        token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()),
        "a 128-bit token: {busy_file}"
    );
    another_user_squats_every_name_it_can_derive(&tmp, &derivable, token);
    std::fs::write(&go, "").unwrap();
    assert_eq!(text_of(&rc).trim(), "0", "devlock busy as the job's user");
    let meta = std::fs::symlink_metadata(&busy_file).unwrap();
    assert!(meta.is_file() && meta.uid() == USER_A, "{meta:?}");
    let until = meta.modified().unwrap();
    assert!(
        until > SystemTime::now() + Duration::from_secs(50 * 60),
        "{until:?}"
    );
    std::fs::write(&done, "").unwrap();
    assert!(wait_child(&mut victim.0).success());
    // Removed when the hold ends: by its watcher, once it sees the command
    // gone.
    poll_until(
        "the busy file removed",
        || Path::new(&busy_file).exists(),
        |exists| !exists,
    );
    another_hold_gets_another_token(&s, &gpus, token);
}

/// B squats every name it can derive, as the attack did (0600, its own),
/// and finds nothing of A's to squat in the directory's listing.
fn another_user_squats_every_name_it_can_derive(tmp: &Path, derivable: &Path, token: &str) {
    for squat in [
        derivable.display().to_string(),
        format!("{}-{}", derivable.display(), "0".repeat(32)),
    ] {
        assert!(user_does(
            USER_B,
            "sh",
            &["-c", &format!("umask 077; : > {squat}")]
        ));
    }
    let listing = as_user(USER_B, "ls").arg("-a").arg(tmp).output().unwrap();
    assert!(!String::from_utf8_lossy(&listing.stdout).contains(token));
}

/// Another hold, another token.
fn another_hold_gets_another_token(s: &Scratch, gpus: &Path, token: &str) {
    let again = s
        .devlock()
        .on_fake_gpu(gpus)
        .args([
            "-q",
            "--idle-timeout",
            "2h",
            "gpu:0",
            "--",
            "sh",
            "-c",
            "printf %s \"$DEVLOCK_BUSY_FILE\"",
        ])
        .output()
        .unwrap();
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(!stdout(&again).is_empty() && !stdout(&again).ends_with(token));
}

// ----------------------------------------------------------------------------
// 8. One take for every front end: the library's member takes its group.

test!(the_librarys_member_take_meets_the_group_the_command_line_holds, needs: []);
pub(crate) fn the_librarys_member_take_meets_the_group_the_command_line_holds() {
    let s = Scratch::new();
    let now = devlock::Options {
        dir: s.dir(),
        wait: devlock::Wait::NoWait,
        step: "lib".into(),
    };
    for name in ["rack", "rack:0", "rack:1", "pool"] {
        // Known names, so that no run warns of a new one.
        assert!(s.run(&["-n", "--new", name, "--", "true"]).status.success());
    }
    let mut group = hold_until_released(&s, &["--step", "train", "rack"], "g");
    let cli = s.run(&["-n", "rack:0", "--", "true"]);
    assert_eq!(cli.status.code(), Some(75), "{}", stderr(&cli));
    let err = devlock::Acquiring::start(&"rack:0".into(), &now, &[])
        .and_then(devlock::Acquiring::hold)
        .expect_err("the group is held");
    let busy = err.busy().expect("a Busy, as devlock -n says");
    assert_eq!(busy.resource, "rack", "{busy:?}");
    assert_eq!(
        busy.holder.as_ref().and_then(|h| h.step.as_deref()),
        Some("train")
    );
    assert_eq!(err.exit_code(), 75);
    // The same words, but for how long the group was held: the two were
    // said at two moments, which a second's boundary may fall between.
    assert_eq!(
        without_ages(&err.to_string()),
        without_ages(one_line(&cli).trim_start_matches("devlock: ").trim_end())
    );
    release(&s, "g");
    assert!(wait_child(&mut group).success());
    // The library's member holds its group shared, as the command line's.
    let member = devlock::Acquiring::start(&"rack:0".into(), &now, &[])
        .and_then(devlock::Acquiring::hold)
        .unwrap();
    let whole = s.run(&["-n", "rack", "--", "true"]);
    assert_eq!(whole.status.code(), Some(75), "{}", stderr(&whole));
    assert!(one_line(&whole).contains("lib (pid "), "{}", stderr(&whole));
    assert_eq!(
        s.run(&["-n", "rack:0", "--", "true"]).status.code(),
        Some(75)
    );
    assert!(s.run(&["-n", "rack:1", "--", "true"]).status.success());
    // And --slots, by the same plan.
    let mut spec = devlock::Spec::new(["pool"]);
    spec.slots = Some(1);
    let slot = devlock::Acquiring::start(&spec, &now, &[])
        .and_then(devlock::Acquiring::hold)
        .unwrap();
    assert_eq!(slot.slot(), Some(1));
    let other = s.run(&["-n", "--slots", "1", "pool", "--", "true"]);
    assert_eq!(other.status.code(), Some(75), "{}", stderr(&other));
    drop((member, slot));
    assert!(s.run(&["-n", "rack", "--", "true"]).status.success());
}

/// `line` without the ages in it (`held by train (...) for 1s` → `held by
/// train (...) for _`): what two messages said at two moments share.
fn without_ages(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(at) = rest.find(" for ") {
        let (before, after) = rest.split_at(at + " for ".len());
        out.push_str(before);
        rest = after;
        if rest.starts_with(|c: char| c.is_ascii_digit()) {
            out.push('_');
            rest = rest.trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '.');
        }
    }
    out.push_str(rest);
    out
}

// ----------------------------------------------------------------------------
// 9. One busy: a file lease is the same typed busy as a holder.

/// A read lease on `path` by this user whose holder ignores the kernel's
/// call to let go (SIGIO): the lease stays until released, or until the
/// kernel's lease-break-time (45 s by default) after the first open for
/// writing. Once it holds: the guard, its pid and the file that releases it.
fn stubborn_lease(s: &Scratch, path: &Path, tag: &str) -> (Killed, u32, PathBuf) {
    let (ready, release) = (
        s.work(&format!("ready-{tag}")),
        s.work(&format!("release-{tag}")),
    );
    let script = format!(
        "import fcntl, os, signal, time\n\
         signal.signal(signal.SIGIO, signal.SIG_IGN)\n\
         fd = os.open({path:?}, os.O_RDONLY)\n\
         fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)\n\
         open({ready:?} + '.tmp', 'w').write(str(os.getpid()))\n\
         os.rename({ready:?} + '.tmp', {ready:?})\n\
         while not os.path.exists({release:?}): time.sleep(0.01)\n",
        path = path.to_str().unwrap(),
        ready = ready.to_str().unwrap(),
        release = release.to_str().unwrap(),
    );
    let guard = Killed(
        Command::new(python())
            .args(["-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = pid_in(&ready);
    (guard, pid, release)
}

test!(a_lease_is_the_same_busy_as_a_holder, needs: [Tool("python3")]);
pub(crate) fn a_lease_is_the_same_busy_as_a_holder() {
    let s = Scratch::new();
    assert!(s.run(&["-n", "l", "--", "true"]).status.success());
    let path = s.lock_path("l");
    let (mut leased, pid, release_lease) = stubborn_lease(&s, &path, "l");
    let quiet = s.run(&["-n", "-q", "--conflict-exit-code", "3", "l", "--", "true"]);
    assert_eq!(quiet.status.code(), Some(3), "{}", stderr(&quiet));
    assert_eq!(
        stderr(&quiet),
        "",
        "-q keeps a busy lock to the exit status"
    );
    let said = s.run(&["-n", "--conflict-exit-code", "3", "l", "--", "true"]);
    assert_eq!(said.status.code(), Some(3), "{}", stderr(&said));
    let line = one_line(&said);
    assert!(
        line.contains(&format!(
            "l is busy: a file lease on {} (pid {pid}, ",
            path.display()
        )),
        "{line}"
    );
    // --any passes the leased candidate over while another is free, and
    // names it, busy, when every one is shut.
    let any = s.run(&["-n", "--any", "l", "m", "--", "true"]);
    assert!(any.status.success(), "{}", stderr(&any));
    let (script, ready) = wait_for_release(&s, "m");
    let mut m = s.hold(&["m"], &script, &ready);
    let shut = s.run(&[
        "-n",
        "-q",
        "--conflict-exit-code",
        "4",
        "--any",
        "l",
        "m",
        "--",
        "true",
    ]);
    assert_eq!(shut.status.code(), Some(4), "{}", stderr(&shut));
    release(&s, "m");
    assert!(wait_child(&mut m).success());
    // The library: a Busy naming the lease's holder.
    let now = devlock::Options {
        dir: s.dir(),
        wait: devlock::Wait::NoWait,
        step: "lib".into(),
    };
    let err = devlock::Acquiring::start(&"l".into(), &now, &[])
        .and_then(devlock::Acquiring::hold)
        .expect_err("leased");
    let busy = err.busy().unwrap_or_else(|| panic!("not a Busy: {err:?}"));
    assert_eq!(busy.resource, "l");
    assert_eq!(busy.holder.as_ref().and_then(|h| h.pid), Some(pid));
    assert!(
        err.is_busy(),
        "a busy outcome: --conflict-exit-code renumbers it"
    );
    std::fs::write(&release_lease, "").unwrap();
    assert!(wait_child(&mut leased.0).success());
}

test!(a_lease_that_never_breaks_times_out_with_the_conflict_code, needs: [Tool("python3")]);
pub(crate) fn a_lease_that_never_breaks_times_out_with_the_conflict_code() {
    let s = Scratch::new();
    assert!(s.run(&["-n", "l", "--", "true"]).status.success());
    // A holder that ignores the kernel's call to let go: the open waits
    // out the kernel's lease-break-time, -w far less.
    let (mut leased, _, release_file) = stubborn_lease(&s, &s.lock_path("l"), "l");
    let out = s.run(&[
        "-w",
        "300ms",
        "-q",
        "--conflict-exit-code",
        "3",
        "l",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(stderr(&out), "");
    std::fs::write(&release_file, "").unwrap();
    wait_child(&mut leased.0);
}

// ----------------------------------------------------------------------------
// 10. `--dir . NAME`: devlock's record stays out of the command's file.

/// `devlock --dir . ARGS` run in `project`.
fn in_project(project: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.current_dir(project)
        .env_remove("DEVLOCK_DIR")
        .args(["--dir", "."])
        .args(args)
        .stdin(Stdio::null());
    cmd
}

test!(dir_dot_hands_the_command_none_of_devlocks_record, needs: []);
pub(crate) fn dir_dot_hands_the_command_none_of_devlocks_record() {
    let s = Scratch::new();
    let project = s.work("project");
    std::fs::create_dir(&project).unwrap();
    let lock = project.join("out.lock");
    // The command reads its file once devlock has named it (the child
    // label is written after the start), then appends to it: what it reads
    // is what was there, and what is left is what it wrote.
    let go = s.work("go");
    let script = format!(
        "while [ ! -e {go} ]; do sleep 0.01; done; cat out.lock > {seen}; \
         printf 'version = 4\\n' >> out.lock",
        go = go.display(),
        seen = s.work("seen").display()
    );
    let mut job = Killed(
        in_project(
            &project,
            &["--step", "mine", "out", "--", "sh", "-c", &script],
        )
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    // Status names the holder and its command, from the record it keeps
    // elsewhere; -n names it too.
    poll_until(
        "status to name the holder and its command",
        || {
            let out = in_project(&project, &["status", "--json", "out"])
                .output()
                .unwrap();
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["resources"][0]
                ["holders"][0]
                .clone()
        },
        |holder| holder["step"] == "mine" && holder["command"][0] == "sh",
    );
    let busy = in_project(&project, &["-n", "out", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(busy.status.code(), Some(75), "{}", stderr(&busy));
    assert!(
        one_line(&busy).contains("out is busy: held by mine (pid "),
        "{}",
        stderr(&busy)
    );
    std::fs::write(&go, "").unwrap();
    assert!(wait_child(&mut job.0).success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut job.0.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(err, "", "nothing to warn of");
    assert_eq!(
        std::fs::read_to_string(s.work("seen")).unwrap(),
        "",
        "no record to read"
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), "version = 4\n");
    // Nothing of devlock's is left but its dot files.
    let left: Vec<String> = std::fs::read_dir(&project)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(left, ["out.lock"]);
}

test!(dir_dot_still_names_a_command_that_waits_for_its_own_fresh_lock_file, needs: [Tool("flock")]);
pub(crate) fn dir_dot_still_names_a_command_that_waits_for_its_own_fresh_lock_file() {
    // cargo locks Cargo.lock, here before it ever wrote one: devlock's
    // fresh file is the command's, and the self-wait is named.
    let s = Scratch::new();
    let project = s.work("project");
    std::fs::create_dir(&project).unwrap();
    let mut job = Killed(
        in_project(
            &project,
            &["Cargo", "--", "flock", "-w", "120", "Cargo.lock", "true"],
        )
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let mut err = BufReader::new(job.0.stderr.take().unwrap());
    let said = wait_for_line(&mut err, "part of this job");
    assert!(
        said.contains("waits for a lock on ./Cargo.lock, which this job holds as Cargo"),
        "{said}"
    );
    signal(job.id(), libc::SIGTERM);
    wait_child(&mut job.0);
    assert_eq!(std::fs::read(project.join("Cargo.lock")).unwrap(), b"");
}
