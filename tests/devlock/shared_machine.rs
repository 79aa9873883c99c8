//! A shared machine: root and two other users (65534 and 65533, through
//! setpriv), each attack of issue #12 played for real, and the outcome it
//! must have. Every test needs root and setpriv (some unshare or a pty's
//! job-control shell): without them it fails under
//! `DEVLOCK_TEST_REQUIRE_TOOLS=1` (CI), else it says why it skips.
//!
//! Handshakes only: a holder writes its pid into a ready file, a stranger's
//! lock holder does the same, and whatever happens in another process is
//! awaited through status or `/proc`, bounded by `HANG`.

use std::io::{BufReader, Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use devlock::testing::record::Record;

use crate::harness::*;

/// Where devlock's tickets start in a queue file (see src/queue.rs).
const SLOT_BASE: u64 = 1 << 20;
/// Where the slot-count agreement bytes start.
const AGREE_BASE: u64 = 4096;

pub(crate) fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

/// The system's python3, which every user can run.
pub(crate) fn python() -> &'static str {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// A holder's script: writes its pid into `ready-TAG` (in one rename), then
/// holds until `release-TAG` exists or the test's directory is gone.
pub(crate) fn hold_script(s: &Scratch, tag: &str) -> (String, PathBuf) {
    let ready = s.work(&format!("ready-{tag}"));
    let release = s.work(&format!("release-{tag}"));
    let script = format!(
        "echo $$ > {r}.tmp && mv {r}.tmp {r}; while [ ! -e {rel} ] && [ -d {w} ]; do sleep 0.01; done",
        r = ready.display(),
        rel = release.display(),
        w = s.work("").display()
    );
    (script, ready)
}

/// `devlock` as `uid` (root for 0), with the scratch directory's env.
pub(crate) fn devlock_as(s: &Scratch, uid: u32) -> Command {
    let mut cmd = if uid == 0 {
        Command::new(BIN)
    } else {
        as_user(uid, BIN)
    };
    cmd.env("DEVLOCK_DIR", s.dir())
        .env_remove("NO_COLOR")
        .stdin(Stdio::null());
    cmd
}

pub(crate) fn run_as(s: &Scratch, uid: u32, args: &[&str]) -> Output {
    devlock_as(s, uid).args(args).output().unwrap()
}

/// `devlock ARGS -- sh -c HOLD` as `uid`, once it holds: the guard and the
/// command's pid.
pub(crate) fn hold_as(s: &Scratch, uid: u32, args: &[&str], tag: &str) -> (Killed, u32) {
    let (script, ready) = hold_script(s, tag);
    let child = devlock_as(s, uid)
        .args(args)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let guard = Killed(child);
    (guard, pid_in(&ready))
}

/// The stranger (fixture stranger.py) as `uid`, holding what `args` say
/// until released: the guard and its pid.
fn stranger_holds(s: &Scratch, uid: u32, args: &[&str], tag: &str) -> (Killed, u32) {
    let ready = s.work(&format!("ready-{tag}"));
    let release = s.work(&format!("release-{tag}"));
    let child = as_user(uid, python())
        .arg(fixture("stranger.py"))
        .args(args)
        .arg(&ready)
        .arg(&release)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let guard = Killed(child);
    (guard, pid_in(&ready))
}

/// Runs a command as `uid` to completion; whether it succeeded.
pub(crate) fn user_does(uid: u32, program: &str, args: &[&str]) -> bool {
    as_user(uid, program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Writes `bytes` over the file at `path`, as `uid`.
pub(crate) fn write_as(uid: u32, path: &Path, bytes: &[u8]) {
    let mut child = as_user(uid, python())
        .arg(fixture("stranger.py"))
        .arg("write")
        .arg(path)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    assert!(
        wait_child(&mut child).success(),
        "writing {}",
        path.display()
    );
}

fn status_as(s: &Scratch, uid: u32, name: &str) -> serde_json::Value {
    let out = run_as(s, uid, &["status", "--json", name]);
    assert!(out.status.success(), "status: {}", stderr(&out));
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["resources"][0].clone()
}

/// The one line a failing devlock says.
pub(crate) fn one_line(out: &Output) -> String {
    let err = stderr(out);
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("devlock: "), "{err}");
    assert!(!err.contains("os error"), "no bare OS error: {err}");
    err
}

/// The scratch directory as root's devlock makes it (1777, root).
/// `out` is busy (75), and its one line names `who`.
fn assert_busy_naming(out: &Output, who: &str) {
    assert_eq!(out.status.code(), Some(75), "{}", stderr(out));
    assert!(one_line(out).contains(who), "{}", stderr(out));
}

fn open_dir(s: &Scratch) {
    assert!(s.run(&["-n", "warm-up", "--", "true"]).status.success());
}

fn array_len(v: &serde_json::Value) -> usize {
    v.as_array().map_or(0, Vec::len)
}

// ----------------------------------------------------------------------------
// 1. Exclusion broken by a rename; a squatted directory and file.

test!(a_holder_whose_lock_file_another_user_renames_says_so_and_status_shows_it, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_holder_whose_lock_file_another_user_renames_says_so_and_status_shows_it() {
    let s = Scratch::new();
    open_dir(&s);
    // User A makes r.lock: it is A's to rename.
    assert!(
        run_as(&s, USER_A, &["-n", "r", "--", "true"])
            .status
            .success()
    );
    let (script, ready) = hold_script(&s, "h");
    let mut holder = Killed(
        s.devlock()
            .args(["--step", "root-job", "r", "--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(holder.0.stderr.take().unwrap());
    let warning = wait_for_line(&mut err, "warning");
    assert!(
        warning.contains(&format!(
            "{} is not set up: nobody can let a second holder in",
            s.dir().display()
        )) && warning.contains(&format!("sudo devlock setup --dir {} r", s.dir().display())),
        "{warning}"
    );
    assert_eq!(warning.lines().count(), 1, "one warning line: {warning}");
    pid_in(&ready);
    let old = s.dir().join("r.old");
    assert!(user_does(
        USER_A,
        "mv",
        &[s.lock_path("r").to_str().unwrap(), old.to_str().unwrap()]
    ));
    // A fresh r.lock now lets anyone in beside root: the holder says so...
    let notice = wait_for_line(&mut err, "no longer names");
    assert!(
        notice.contains(&format!(
            "{} no longer names the file this job holds",
            s.lock_path("r").display()
        )) && notice.contains("another devlock may now take r beside this one"),
        "{notice}"
    );
    // ... and status shows it, beside whoever holds the new file.
    let (mut second, _) = hold_as(&s, USER_B, &["--step", "second", "r"], "b");
    let view = s.wait_for_status("r", "the conflict in status", |v| {
        array_len(&v["conflicts"]) == 1
    });
    assert_eq!(view["conflicts"][0]["pid"], holder.id(), "{view}");
    assert_eq!(view["conflicts"][0]["user"], "root");
    assert_eq!(view["conflicts"][0]["step"], "root-job");
    assert_eq!(view["holders"][0]["step"], "second", "{view}");
    let table = stdout(&s.run(&["status", "r"]));
    assert!(
        table.contains("root-job (pid")
            && table.contains("still holds a lock file that was renamed"),
        "{table}"
    );
    release(&s, "h");
    release(&s, "b");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut second.0).success());
    assert_eq!(array_len(&s.resource_status("r")["conflicts"]), 0);
}

test!(a_squatted_directory_and_lock_file_are_named_then_taken_over_by_setup, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_squatted_directory_and_lock_file_are_named_then_taken_over_by_setup() {
    let s = Scratch::new();
    // User A made the directory before root ever ran devlock.
    let dir = s.work("squat");
    let d = dir.to_str().unwrap();
    assert!(user_does(USER_A, "mkdir", &["-m", "1777", d]));
    let out = s
        .devlock()
        .args(["--dir", d, "-n", "r", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "it keeps working: {}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "one warning line: {err}");
    assert!(
        err.starts_with("devlock: warning: ")
            && err.contains(" is not set up: nobody can let a second holder in; fix: ")
            && err.contains(&format!("sudo devlock setup --dir {d} r")),
        "{err}"
    );
    let quiet = s
        .devlock()
        .args(["--dir", d, "-q", "-n", "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(stderr(&quiet), "", "-q silences it");
    let json: serde_json::Value = serde_json::from_slice(
        &s.devlock()
            .args(["--dir", d, "status", "--json"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert_eq!(json["trust"]["safe"], false, "{json}");
    assert_eq!(json["trust"]["issues"][0]["owner"], "nobody");
    // A holds q through a lock file of A's own while root sets up.
    let (mut a_holds, _) = hold_as(&s, USER_A, &["--dir", d, "q"], "a");
    // A waiter is told before it waits, not once it is through.
    let timed = s
        .devlock()
        .args(["--dir", d, "-w", "200ms", "q", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(timed.status.code(), Some(75), "{}", stderr(&timed));
    let err = stderr(&timed);
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines[0].starts_with("devlock: warning: ")
            && lines[0].contains(" is not set up: nobody can")
            && lines[1].starts_with("devlock: q · waiting")
            && lines
                .last()
                .unwrap()
                .starts_with("devlock: timed out after 200ms waiting for q")
            && lines.iter().filter(|l| l.contains("warning")).count() == 1,
        "{err}"
    );
    let setup = s
        .devlock()
        .args(["--dir", d, "setup", "r", "q"])
        .output()
        .unwrap();
    assert!(setup.status.success(), "{}", stderr(&setup));
    let said = stdout(&setup);
    assert!(
        said.contains(&format!("{d}: taken over from nobody")),
        "{said}"
    );
    assert!(
        said.contains(&format!("{d}/q.lock: taken over from nobody")),
        "{said}"
    );
    let meta = std::fs::metadata(&dir).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o1777));
    let q = std::fs::metadata(dir.join("q.lock")).unwrap();
    assert_eq!((q.uid(), q.mode() & 0o777), (0, 0o666));
    // Taken over in place: A still holds it, alone.
    let busy = s
        .devlock()
        .args(["--dir", d, "-n", "q", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(busy.status.code(), Some(75), "{}", stderr(&busy));
    // Neither the directory nor its files are A's to move any more.
    assert!(!user_does(
        USER_A,
        "mv",
        &[&format!("{d}/q.lock"), &format!("{d}/q.old")]
    ));
    assert!(!user_does(USER_A, "mv", &[d, &format!("{d}.old")]));
    let again = s
        .devlock()
        .args(["--dir", d, "setup", "r", "q"])
        .output()
        .unwrap();
    assert!(
        stdout(&again).contains("nothing changed"),
        "idempotent: {}",
        stdout(&again)
    );
    let json: serde_json::Value = serde_json::from_slice(
        &s.devlock()
            .args(["--dir", d, "status", "--json", "q"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert_eq!(json["trust"]["managed"], true, "{json}");
    assert_eq!(json["resources"][0]["trust"]["safe"], true, "{json}");
    release(&s, "a");
    assert!(wait_child(&mut a_holds.0).success());
}

test!(setup_refuses_without_root_and_makes_group_only_gpu_locks, needs: [Root, Tool("setpriv")]);
pub(crate) fn setup_refuses_without_root_and_makes_group_only_gpu_locks() {
    let s = Scratch::new();
    let out = run_as(&s, USER_A, &["setup", "gpu"]);
    assert_eq!(out.status.code(), Some(77), "{}", stderr(&out));
    assert!(
        one_line(&out).contains("devlock setup must run as root"),
        "{}",
        stderr(&out)
    );
    assert!(!s.dir().exists());
    // The GPUs from the probe, for the group nogroup (USER_A's own group).
    let out = s
        .devlock()
        .env("DEVLOCK_NVIDIA_SMI", fixture("nvidia-smi/fake-nvidia-smi"))
        .args(["setup", "--gpus", "--group", "nogroup"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("5 resources declared: gpu gpu:0 gpu:1 gpu:2 gpu:3"),
        "{}",
        stdout(&out)
    );
    let gid = nix::unistd::Group::from_name("nogroup")
        .unwrap()
        .unwrap()
        .gid
        .as_raw();
    let meta = std::fs::metadata(s.dir()).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o7777),
        (0, gid, 0o1770)
    );
    for name in ["gpu.lock", ".gpu.queue", "gpu:3.lock", ".gpu:3.queue"] {
        let m = std::fs::metadata(s.dir().join(name)).unwrap();
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o777),
            (0, gid, 0o660),
            "{name}"
        );
    }
    // A member takes the lock; anyone else cannot even reach it.
    assert!(
        run_as(&s, USER_A, &["-n", "gpu:1", "--", "true"])
            .status
            .success()
    );
    let out = run_as(&s, USER_B, &["-n", "gpu:1", "--", "true"]);
    assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
    assert!(
        one_line(&out).contains("Permission denied"),
        "{}",
        stderr(&out)
    );
    // An unknown group is a usage error.
    let out = s.run(&["setup", "--group", "no-such-group-here", "gpu"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

test!(the_shipped_tmpfiles_snippet_makes_a_managed_directory, needs: [Root, Tool("setpriv"), Tool("systemd-tmpfiles")]);
pub(crate) fn the_shipped_tmpfiles_snippet_makes_a_managed_directory() {
    let mut args = vec!["setup", "--print-tmpfiles", "gpu"];
    let members: Vec<String> = (0..8).map(|i| format!("gpu:{i}")).collect();
    args.extend(members.iter().map(String::as_str));
    // A directory that does not exist yet: the snippet is only what is asked.
    let printed = Command::new(BIN)
        .args(&args)
        .env("DEVLOCK_DIR", "/run/lock/devlock-not-made-here")
        .output()
        .unwrap();
    assert!(printed.status.success(), "{}", stderr(&printed));
    let shipped = stdout(&printed).replace("/run/lock/devlock-not-made-here", "/run/lock/devlock");
    let s = Scratch::new();
    let root = s.work("root");
    std::fs::create_dir(&root).unwrap();
    let conf = s.work("devlock.conf");
    std::fs::write(&conf, &shipped).unwrap();
    let out = Command::new("systemd-tmpfiles")
        .arg("--create")
        .arg(format!("--root={}", root.display()))
        .arg(&conf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = root.join("run/lock/devlock");
    let json: serde_json::Value = serde_json::from_slice(
        &Command::new(BIN)
            .arg("--dir")
            .arg(&dir)
            .args(["status", "--json", "gpu", "gpu:7"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert_eq!(json["trust"]["managed"], true, "{json}");
    for r in json["resources"].as_array().unwrap() {
        assert_eq!(r["trust"]["managed"], true, "{r}");
    }
    // The declared names came with it: a name they do not list is a typo
    // until --new says it is meant.
    assert_eq!(
        std::fs::read_to_string(dir.join(".names")).unwrap(),
        "gpu\ngpu:0\ngpu:1\ngpu:2\ngpu:3\ngpu:4\ngpu:5\ngpu:6\ngpu:7\n"
    );
    let typo = Command::new(BIN)
        .arg("--dir")
        .arg(&dir)
        .args(["GPU0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(typo.status.code(), Some(2), "{}", stderr(&typo));
    assert!(
        stderr(&typo).contains("GPU0 is not one of the resources root declared in")
            && stderr(&typo).contains("did you mean gpu:0?"),
        "{}",
        stderr(&typo)
    );
    assert!(!dir.join("GPU0.lock").exists());
    let meant = Command::new(BIN)
        .arg("--dir")
        .arg(&dir)
        .args(["--new", "scratch-disk", "--", "true"])
        .output()
        .unwrap();
    assert!(meant.status.success(), "{}", stderr(&meant));
    // Only root forgets a name in a managed directory; a declared one
    // leaves the list.
    let user = as_user(USER_A, BIN)
        .arg("--dir")
        .arg(&dir)
        .args(["forget", "scratch-disk"])
        .output()
        .unwrap();
    assert_eq!(user.status.code(), Some(77), "{}", stderr(&user));
    assert!(
        stderr(&user).contains("only root may forget"),
        "{}",
        stderr(&user)
    );
    let forgot = Command::new(BIN)
        .arg("--dir")
        .arg(&dir)
        .args(["forget", "scratch-disk"])
        .output()
        .unwrap();
    assert!(forgot.status.success(), "{}", stderr(&forgot));
    assert!(!dir.join("scratch-disk.lock").exists());
    // And setup over it changes nothing.
    let again = Command::new(BIN)
        .arg("--dir")
        .arg(&dir)
        .arg("setup")
        .args(&args[2..])
        .output()
        .unwrap();
    assert!(
        stdout(&again).contains("nothing changed"),
        "{}",
        stdout(&again)
    );
}

// ----------------------------------------------------------------------------
// 2. One write or one `ln` must not disable a resource.

test!(a_hard_link_to_a_lock_file_disables_nothing, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_hard_link_to_a_lock_file_disables_nothing() {
    let s = Scratch::new();
    assert!(s.run(&["setup", "r"]).status.success());
    let link = s.work("link");
    assert!(user_does(
        USER_A,
        "ln",
        &[s.lock_path("r").to_str().unwrap(), link.to_str().unwrap()]
    ));
    assert_eq!(std::fs::metadata(s.lock_path("r")).unwrap().nlink(), 2);
    for uid in [0, USER_A, USER_B] {
        let out = run_as(&s, uid, &["-n", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(0), "uid {uid}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "uid {uid}");
    }
    // A 0666 file anyone may write anyway: its record is written as usual.
    let (mut h, _) = hold_as(&s, 0, &["--step", "linked", "r"], "h");
    assert_eq!(s.resource_status("r")["holders"][0]["step"], "linked");
    release(&s, "h");
    assert!(wait_child(&mut h.0).success());
}

test!(a_corrupt_queue_header_changes_nothing, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_corrupt_queue_header_changes_nothing() {
    let s = Scratch::new();
    open_dir(&s);
    // A waiter once made the queue file; a stranger then writes the old
    // format's last ticket at its maximum, and garbage after it.
    let (mut h, _) = hold_as(&s, 0, &["r"], "h0");
    let mut w = Killed(
        s.devlock()
            .args(["-q", "r", "--", "true"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_blocked(&s.lock_path("r"), 1);
    release(&s, "h0");
    assert!(wait_child(&mut h.0).success());
    assert!(wait_child(&mut w.0).success());
    let queue = s.dir().join(".r.queue");
    let mut junk = (i64::MAX as u64).to_le_bytes().to_vec();
    junk.extend([0xff; 4096]);
    write_as(USER_A, &queue, &junk);
    for args in [
        vec!["-n", "r", "--", "true"],
        vec!["-n", "--slots", "2", "r", "--", "true"],
        vec!["-w", "5s", "r", "--", "true"],
    ] {
        let out = s.run(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    // The line works as ever: a waiter is first in line and gets its turn.
    let (mut h, _) = hold_as(&s, 0, &["r"], "h");
    let mut waiter = Killed(
        s.devlock()
            .args(["--report-every", "10ms", "r", "--", "true"])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(waiter.0.stderr.take().unwrap());
    let line = wait_for_line(&mut err, "in line");
    assert!(line.contains("1st in line"), "{line}");
    release(&s, "h");
    assert!(wait_child(&mut h.0).success());
    assert!(wait_child(&mut waiter.0).success());
}

test!(files_of_the_wrong_type_are_one_line_errors_and_setup_swaps_them_out, needs: [Root, Tool("setpriv")]);
pub(crate) fn files_of_the_wrong_type_are_one_line_errors_and_setup_swaps_them_out() {
    let victim_dir = Scratch::new();
    let victim = victim_dir.work("victim");
    std::fs::write(&victim, "precious").unwrap();
    let cases: [(&str, &[&str]); 3] = [
        ("r.lock", &["-n", "r", "--", "true"]),
        (".r.queue", &["-n", "r", "--", "true"]),
        (".r.slot1", &["-n", "--slots", "1", "r", "--", "true"]),
    ];
    for (name, args) in cases {
        for kind in ["fifo", "symlink", "socket", "directory"] {
            let s = Scratch::new();
            open_dir(&s);
            let path = s.dir().join(name);
            let p = path.to_str().unwrap();
            let planted = match kind {
                "fifo" => user_does(USER_A, "mkfifo", &[p]),
                "symlink" => user_does(USER_A, "ln", &["-s", victim.to_str().unwrap(), p]),
                "socket" => user_does(USER_A, python(), &[&fixture("stranger.py"), "socket", p]),
                _ => user_does(USER_A, "mkdir", &[p]),
            };
            assert!(planted, "planting a {kind} at {name}");
            let out = s.run(args);
            let what = format!("a {kind} at {name}");
            assert_eq!(out.status.code(), Some(74), "{what}: {}", stderr(&out));
            let err = one_line(&out);
            assert!(err.contains(p), "{what}: names the path: {err}");
            assert!(err.contains("not a regular file"), "{what}: {err}");
            assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
            let view = s.resource_status("r");
            if name == "r.lock" {
                assert_eq!(view["state"], "unknown", "{what}: never free: {view}");
            }
            assert!(
                view["trust"]["issues"]
                    .to_string()
                    .contains("not a regular file"),
                "{what}: {view}"
            );
        }
    }
    // Junk where registrations go: status ignores it, never hangs on it.
    let s = Scratch::new();
    open_dir(&s);
    let d = s.dir();
    assert!(user_does(
        USER_A,
        "mkfifo",
        &[d.join(".r@1.0.wait").to_str().unwrap()]
    ));
    assert!(user_does(
        USER_A,
        "ln",
        &["-s", "/etc/shadow", d.join(".r@2.0.hold").to_str().unwrap()]
    ));
    assert!(user_does(
        USER_A,
        python(),
        &[
            &fixture("stranger.py"),
            "socket",
            d.join(".r@3.0.wait").to_str().unwrap()
        ]
    ));
    assert!(user_does(
        USER_A,
        "mkdir",
        &[d.join(".r@4.0.lost").to_str().unwrap()]
    ));
    let (mut h, _) = hold_as(&s, 0, &["r"], "h");
    let view = s.resource_status("r");
    assert_eq!(view["state"], "held");
    assert_eq!(array_len(&view["waiters"]), 0, "{view}");
    assert_eq!(array_len(&view["conflicts"]), 0, "{view}");
    release(&s, "h");
    assert!(wait_child(&mut h.0).success());
    // setup swaps planted files for root's, unless they are locked.
    assert!(user_does(
        USER_A,
        "mkfifo",
        &[d.join("p.lock").to_str().unwrap()]
    ));
    assert!(user_does(
        USER_A,
        python(),
        &[
            &fixture("stranger.py"),
            "socket",
            d.join(".p.queue").to_str().unwrap()
        ]
    ));
    assert!(user_does(
        USER_A,
        "mkdir",
        &[d.join("q.lock").to_str().unwrap()]
    ));
    let (_locked, locker) = stranger_holds(
        &s,
        USER_A,
        &["flock", d.join("q.lock").to_str().unwrap()],
        "q",
    );
    let out = s.run(&["setup", "p", "q"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(
        said.contains("p.lock: replaced a FIFO owned by nobody"),
        "{said}"
    );
    assert!(
        said.contains(".p.queue: replaced a socket owned by nobody"),
        "{said}"
    );
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "not replacing {}: a directory owned by nobody, locked by pid {locker}, nobody",
            d.join("q.lock").display()
        )),
        "{err}"
    );
    assert!(d.join("q.lock").is_dir(), "a held file is never replaced");
    assert!(s.run(&["-n", "p", "--", "true"]).status.success());
}

// ----------------------------------------------------------------------------
// 3. A stranger's locks: named, and every wait stays bounded.

test!(strangers_locks_on_the_queue_are_named_and_waits_stay_bounded, needs: [Root, Tool("setpriv")]);
pub(crate) fn strangers_locks_on_the_queue_are_named_and_waits_stay_bounded() {
    let s = Scratch::new();
    assert!(s.run(&["setup", "r", "r2"]).status.success());
    let queue = s.dir().join(".r.queue");
    let q = queue.to_str().unwrap();
    // (a) On the old header: nothing uses it any more.
    {
        let (_lock, pid) = stranger_holds(&s, USER_A, &["ofd", q, "0", "4096", "write"], "a");
        for args in [
            vec!["-w", "3s", "r", "--", "true"],
            vec!["-n", "--any", "r", "r2", "--", "true"],
            vec!["-n", "--slots", "2", "r", "--", "true"],
            vec!["-n", "r", "--", "true"],
        ] {
            let out = s.run(&args);
            assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
        }
        let view = s.resource_status("r");
        let foreign = &view["foreign_locks"][0];
        assert_eq!(
            (foreign["range"].as_str(), foreign["pid"].as_u64()),
            (Some("0-4095"), Some(u64::from(pid))),
            "{view}"
        );
        assert_eq!(foreign["user"], "nobody");
        assert_eq!(foreign["effect"], "none");
        release(&s, "a");
    }
    // (b) One ticket byte: a place in line nobody registered, ahead of all.
    {
        let at = (SLOT_BASE + 1).to_string();
        let (_lock, pid) = stranger_holds(&s, USER_A, &["ofd", q, &at, "1", "write"], "b");
        let out = s.run(&["-n", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
        let err = one_line(&out);
        assert!(
            err.contains(&format!(
                "r is busy: 1 already waiting in line (a place in line held by pid {pid}, nobody, not a registered devlock)"
            )),
            "{err}"
        );
        let view = s.resource_status("r");
        let w = &view["waiters"][0];
        assert_eq!(
            (w["source"].as_str(), w["pid"].as_u64(), w["user"].as_str()),
            (Some("unregistered"), Some(u64::from(pid)), Some("nobody")),
            "{view}"
        );
        // Another user cannot see whose it is, and says so.
        let as_b = status_as(&s, USER_B, "r");
        assert!(as_b["waiters"][0]["pid"].is_null(), "{as_b}");
        let timed = s.run(&["-w", "300ms", "r", "--", "true"]);
        assert_eq!(timed.status.code(), Some(75), "{}", stderr(&timed));
        assert!(
            stderr(&timed).contains(&format!(
                "timed out after 300ms waiting for r: a place in line held by pid {pid}, nobody"
            )),
            "{}",
            stderr(&timed)
        );
        // A stop signal ends the wait at once.
        let mut waiter = Killed(
            s.devlock()
                .args(["-q", "r", "--", "true"])
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_blocked(&s.lock_path("r"), 1);
        signal(waiter.id(), libc::SIGTERM);
        let ended = wait_child(&mut waiter.0);
        assert!(
            ended.code() == Some(143) || ended.signal() == Some(libc::SIGTERM),
            "{ended:?}"
        );
        release(&s, "b");
    }
    // (c) Every ticket byte: no place in line can be had while it is there:
    // the resource is in use, as if a job held it, bounded like any wait.
    {
        let at = (SLOT_BASE + 1).to_string();
        let (_lock, pid) = stranger_holds(&s, USER_A, &["ofd", q, &at, "0", "write"], "c");
        let out = s.run(&["-n", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
        let out = s.run(&["-w", "300ms", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!(
                "its line is blocked by a lock that is not devlock's on bytes 1048577-EOF of {q} (pid {pid}, nobody)"
            )),
            "{}",
            stderr(&out)
        );
        let view = s.resource_status("r");
        assert_eq!(
            view["foreign_locks"][0]["effect"], "blocks the line",
            "{view}"
        );
        let table = stdout(&s.run(&["status", "r"]));
        assert!(
            table.contains(&format!(
                "warning: r: a write lock that is not devlock's on bytes 1048577-EOF of {q} (pid {pid}, nobody): blocks the line"
            )),
            "{table}"
        );
        release(&s, "c");
    }
    // (d) Over the slot agreement.
    {
        let (start, len) = (AGREE_BASE.to_string(), (1u64 << 16).to_string());
        let (_lock, _) = stranger_holds(&s, USER_A, &["ofd", q, &start, &len, "write"], "d");
        let out = s.run(&["-w", "300ms", "--slots", "2", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("blocked by a lock that is not devlock's on bytes 4096-69631"),
            "{}",
            stderr(&out)
        );
        release(&s, "d");
    }
    assert!(
        s.run(&["-n", "--slots", "2", "r", "--", "true"])
            .status
            .success()
    );
}

// ----------------------------------------------------------------------------
// 4. Status believes only what the kernel backs.

/// A record naming `pid` as the kernel knows it, with `edit` applied.
fn forged_record(pid: u32, edit: impl FnOnce(&mut Record)) -> Vec<u8> {
    let mut r = Record::for_this_process("forged");
    r.pid = pid;
    r.pid_start = devlock::testing::procfs::start_time(pid).unwrap();
    edit(&mut r);
    r.to_bytes()
}

test!(forged_and_replayed_records_and_registrations_are_not_believed, needs: [Root, Tool("setpriv")]);
pub(crate) fn forged_and_replayed_records_and_registrations_are_not_believed() {
    let s = Scratch::new();
    assert!(s.run(&["setup", "gpu", "gpu:0"]).status.success());
    let (script, ready) = hold_script(&s, "h");
    let mut holder = Killed(
        s.devlock()
            .args(["--step", "root-job", "gpu:0", "--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let command = pid_in(&ready);
    let devlock_pid = holder.id();
    s.wait_for_status("gpu:0", "root's record", |v| {
        v["holders"][0]["step"] == "root-job"
    });
    // A's own process, on the GPU without the lock.
    let mut notebook = Killed(
        as_user(USER_A, "sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let gpu_status = || {
        let out = s
            .devlock()
            .env("DEVLOCK_NVIDIA_SMI", fixture("nvidia-smi/fake-nvidia-smi"))
            .env("FAKE_SMI_PIDS", notebook.id().to_string())
            .args(["status", "--json"])
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // A rewrites root's record: another step, A's notebook as the child,
    // escapes and a right-to-left override in the via.
    let lock = s.lock_path("gpu:0");
    write_as(
        USER_A,
        &lock,
        &forged_record(devlock_pid, |r| {
            r.step = "evil\u{202e}gol".into();
            r.child = Some(notebook.id());
            r.child_start = devlock::testing::procfs::start_time(notebook.id());
            r.via = Some("\x1b]0;pwned\x07gpu\u{2067}".into());
        }),
    );
    let json = gpu_status();
    let view = json["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "gpu:0")
        .unwrap()
        .clone();
    let h = &view["holders"][0];
    assert_eq!(h["user"], "root", "users come from the kernel: {view}");
    assert_eq!(h["pids"], serde_json::json!([devlock_pid]), "{view}");
    assert_eq!(h["step"], "evil?gol", "a label, cleaned: {view}");
    assert_eq!(h["via"], "?]0;pwned?gpu?");
    let p = &json["devices"][0]["processes"][0];
    assert_eq!(p["pid"], notebook.id());
    assert_eq!(p["gated"], false, "a forged child is not gated: {json}");
    let table = stdout(&s.run(&["status", "gpu:0"]));
    assert!(
        !table.contains('\x1b') && !table.contains('\u{202e}') && !table.contains('\u{2067}'),
        "{table:?}"
    );
    // A record naming A's own process: not the kernel's holder, no label.
    write_as(USER_A, &lock, &forged_record(notebook.id(), |_| {}));
    let view = s.resource_status("gpu:0");
    let h = &view["holders"][0];
    assert_eq!(
        (h["pid"].as_u64(), h["source"].as_str(), h["user"].as_str()),
        (
            Some(u64::from(devlock_pid)),
            Some("no-record"),
            Some("root")
        ),
        "{view}"
    );
    assert!(h["step"].is_null());
    assert_eq!(view["stale_record"]["pid"], notebook.id());
    // Planted registrations: a waiter naming root's devlock, flocked by A,
    // and a copy of a real waiter's registration, flocked by A.
    let planted = s.dir().join(format!(".gpu:0@{devlock_pid}.7.wait"));
    std::fs::write(&planted, forged_record(devlock_pid, |_| {})).unwrap();
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (_a, _) = stranger_holds(&s, USER_A, &["flock", planted.to_str().unwrap()], "reg");
    let mut waiter = Killed(
        s.devlock()
            .args(["-q", "--step", "real-waiter", "gpu:0", "--", "true"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // (Between its ticket and its registration a waiter is a place in line
    // nobody registered: wait for the registration.)
    let view = s.wait_for_status("gpu:0", "the real waiter", |v| {
        v["waiters"][0]["step"] == "real-waiter"
    });
    assert_eq!(array_len(&view["waiters"]), 1, "only the real one: {view}");
    assert_eq!(view["waiters"][0]["step"], "real-waiter");
    let real = std::fs::read_dir(s.dir())
        .unwrap()
        .flatten()
        .find(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".gpu:0@{}.", waiter.id()))
        })
        .unwrap()
        .path();
    let replay = s.dir().join(format!(".gpu:0@{}.99.wait", waiter.id()));
    std::fs::copy(&real, &replay).unwrap();
    std::fs::set_permissions(&replay, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (_b, _) = stranger_holds(&s, USER_A, &["flock", replay.to_str().unwrap()], "replay");
    let view = s.resource_status("gpu:0");
    assert_eq!(
        array_len(&view["waiters"]),
        1,
        "a replay names nobody: {view}"
    );
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut waiter.0).success());
    let view = s.resource_status("gpu:0");
    assert_eq!(array_len(&view["waiters"]), 0, "{view}");
    let _ = command;
    let _ = notebook.0.kill();
}

test!(records_keep_no_command_line_and_a_released_label_names_nobody, needs: [Root, Tool("setpriv")]);
pub(crate) fn records_keep_no_command_line_and_a_released_label_names_nobody() {
    let s = Scratch::new();
    let (script, ready) = hold_script(&s, "h");
    let mut holder = Killed(
        s.devlock()
            .args(["r", "--", "sh", "-c", &script, "--api-token=hunter2"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    pid_in(&ready);
    let view = s.wait_for_status("r", "the record", |v| v["holders"][0]["step"] == "sh");
    let record = std::fs::read_to_string(s.lock_path("r")).unwrap();
    assert!(
        !record.contains("hunter2") && !record.contains("root"),
        "{record}"
    );
    // The command line is read live, for those allowed to see it.
    assert!(
        view["holders"][0]["command"]
            .to_string()
            .contains("--api-token=hunter2")
    );
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    // Chain-loaded, nothing of devlock is left when the command ends to
    // clear the label: it stays, naming a process that is gone, and status
    // labels nobody with it.
    let view = s.resource_status("r");
    assert_eq!(view["state"], "free", "{view}");
    assert_eq!(array_len(&view["holders"]), 0, "{view}");
    assert!(
        !stdout(&s.run(&["status", "r"])).contains(" sh "),
        "no label"
    );
}

// ----------------------------------------------------------------------------
// 5. Stopped in line: Ctrl-Z leaves it, SIGSTOP is shown.

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

/// Makes some live process other than the one that had it take `pid`: the
/// kernel hands out last_pid + 1, so set it just below and start sleeps
/// until one gets it (any other process that takes it first is just as
/// unrelated, and will do, as long as the job forks nothing meanwhile: a
/// child of the job's command would hold the lock it inherited).
fn reuse_pid(pid: u32) -> Option<Killed> {
    let last = Path::new("/proc/sys/kernel/ns_last_pid");
    for _ in 0..2000 {
        if Path::new(&format!("/proc/{pid}")).exists() {
            return None;
        }
        std::fs::write(last, (pid - 1).to_string()).unwrap();
        let child = Command::new("sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
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
    let mut args = vec!["--step", "job"];
    if shared {
        args.push("-s");
    }
    args.push("r");
    // A command that starts one child, which holds on once the command
    // (devlock's own process) is SIGKILLed; neither forks once ready (see
    // `reuse_pid`).
    let ready = s.work("ready-h");
    let script = format!(
        "sleep 1000 & echo $! > {r}.tmp && mv {r}.tmp {r} && wait",
        r = ready.display()
    );
    let mut holder = s
        .devlock()
        .args(&args)
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let command = pid_in(&ready);
    let devlock_pid = holder.id();
    s.wait_for_status("r", "the holder's label", |v| {
        v["holders"][0]["step"] == "job"
    });
    holder.kill().unwrap();
    holder.wait().unwrap();
    let _reused = reuse_pid(devlock_pid);
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
    signal(command, libc::SIGKILL);
    wait_gone(command);
}

test!(pid_reuse_after_kill_9_of_a_holder_blames_nobody_unrelated, needs: [Root, Tool("setpriv")]);
pub(crate) fn pid_reuse_after_kill_9_of_a_holder_blames_nobody_unrelated() {
    pid_reuse_round(true);
    pid_reuse_round(false);
}

// ----------------------------------------------------------------------------
// 7. One name per device; no data lost; nothing hidden.

test!(a_gpu_has_one_name_in_run_status_and_setup, needs: []);
pub(crate) fn a_gpu_has_one_name_in_run_status_and_setup() {
    let s = Scratch::new();
    for name in ["gpu:00", "gpu:+1", "gpu:x", "gpu:4294967296", "gpu:01"] {
        for args in [
            vec![name, "--", "true"],
            vec!["status", name],
            vec!["setup", name],
        ] {
            let out = s.run(&args);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
            let err = one_line(&out);
            assert!(err.contains("a GPU is gpu:N"), "{args:?}: {err}");
        }
    }
    let err = stderr(&s.run(&["gpu:00", "--", "true"]));
    assert!(err.contains("write it gpu:0"), "{err}");
    assert!(!s.dir().exists(), "nothing touched");
}

test!(dir_dot_with_a_cargo_lock_loses_no_data, needs: []);
pub(crate) fn dir_dot_with_a_cargo_lock_loses_no_data() {
    let s = Scratch::new();
    let project = s.work("project");
    std::fs::create_dir(&project).unwrap();
    let text = "# This file is automatically @generated by Cargo.\nversion = 4\n";
    std::fs::write(project.join("Cargo.lock"), text).unwrap();
    std::fs::write(project.join("yarn.lock"), "# yarn lockfile v1\n").unwrap();
    for resource in ["Cargo", "yarn"] {
        let out = Command::new(BIN)
            .current_dir(&project)
            .env_remove("DEVLOCK_DIR")
            .args(["--dir", ".", "-n", resource, "--", "sh", "-c"])
            .arg(format!("{BIN} --dir . status --json {resource}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        // Never read for a record, so nothing to say of its data.
        assert_eq!(stderr(&out), "");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["resources"][0]["state"], "held", "{json}");
        assert_eq!(json["resources"][0]["record"], "unreadable");
        // Labelled all the same: outside a directory made for locks the
        // record lives in a registration of its own (issue #32.10).
        assert_eq!(json["resources"][0]["holders"][0]["step"], "sh", "{json}");
    }
    assert_eq!(
        std::fs::read_to_string(project.join("Cargo.lock")).unwrap(),
        text
    );
    assert_eq!(
        std::fs::read_to_string(project.join("yarn.lock")).unwrap(),
        "# yarn lockfile v1\n"
    );
}

test!(a_private_lock_file_held_by_plain_flock_shows_as_held, needs: [Root, Tool("setpriv"), Tool("flock")]);
pub(crate) fn a_private_lock_file_held_by_plain_flock_shows_as_held() {
    let s = Scratch::new();
    open_dir(&s);
    let lock = s.lock_path("p");
    let (script, ready) = hold_script(&s, "f");
    let mut flock = Killed(
        as_user(USER_A, "sh")
            .arg("-c")
            .arg(format!(
                "umask 077; exec flock {} sh -c '{}'",
                lock.display(),
                script
            ))
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    pid_in(&ready);
    assert_eq!(std::fs::metadata(&lock).unwrap().mode() & 0o777, 0o600);
    let view = status_as(&s, USER_B, "p");
    assert_eq!(view["state"], "held", "never free: {view}");
    assert_eq!(view["record"], "private", "{view}");
    // Another user's plain flock: the kernel names the pid that took it,
    // but not whether that process still holds it (its pid may be another's
    // by now): named as the taker, held by what this user cannot see.
    assert_eq!(view["holders"][0]["source"], "unknown", "{view}");
    assert!(
        view["holders"][0]["note"]
            .as_str()
            .unwrap_or_default()
            .contains(&format!("taken by pid {}", flock.id())),
        "{view}"
    );
    // Root sees its descriptors: the holder itself.
    let view = s.resource_status("p");
    assert_eq!(view["holders"][0]["pid"], flock.id(), "{view}");
    assert_eq!(view["holders"][0]["user"], "nobody");
    let out = run_as(&s, USER_B, &["-n", "p", "--", "true"]);
    assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
    assert!(
        one_line(&out).contains("permission denied"),
        "{}",
        stderr(&out)
    );
    release(&s, "f");
    assert!(wait_child(&mut flock.0).success());
}

test!(status_inside_a_pid_namespace_says_held_by_unknown, needs: [Root, Tool("setpriv"), Tool("unshare")]);
pub(crate) fn status_inside_a_pid_namespace_says_held_by_unknown() {
    let s = Scratch::new();
    let (mut holder, _) = hold_as(&s, 0, &["r"], "h");
    let inside = |args: &[&str]| {
        Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", BIN])
            .args(args)
            .env("DEVLOCK_DIR", s.dir())
            .output()
            .unwrap()
    };
    let out = inside(&["status", "--json", "r"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let view = &json["resources"][0];
    assert_eq!(view["state"], "held", "never free: {json}");
    assert_eq!(view["holders"][0]["source"], "unknown");
    assert_eq!(
        view["holders"][0]["note"],
        "outside this container or PID namespace"
    );
    let busy = inside(&["-n", "r", "--", "true"]);
    assert_eq!(busy.status.code(), Some(75), "{}", stderr(&busy));
    assert!(
        stderr(&busy).contains("outside this container or PID namespace"),
        "{}",
        stderr(&busy)
    );
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    let json: serde_json::Value =
        serde_json::from_slice(&inside(&["status", "--json", "r"]).stdout).unwrap();
    assert_eq!(json["resources"][0]["state"], "free", "{json}");
}

// ----------------------------------------------------------------------------
// 8. Issue #22: every stranger's lock on a byte that matters is occupancy,
// named, and bounded by -n, -w and a stopping signal.

/// The last ticket byte a queue file has (see src/flock/queue.rs).
const TOP_TICKET: u64 = SLOT_BASE + (1 << 32);

/// A scratch directory with `r`'s queue file made: open (root's devlock
/// made it, 1777) or managed (`devlock setup r`).
fn scene(managed: bool) -> Scratch {
    let s = Scratch::new();
    if managed {
        assert!(s.run(&["setup", "r"]).status.success());
    } else {
        open_dir(&s);
    }
    // Through the line once, so the queue file is there.
    assert!(
        s.run(&["-n", "--slots", "1", "r", "--", "true"])
            .status
            .success()
    );
    assert!(s.dir().join(".r.queue").exists());
    s
}

/// A devlock waiting (shown on its stderr) for `r`, as root: the guard, once
/// its waiting line says it waits.
fn waiting_for(s: &Scratch, args: &[&str]) -> Killed {
    let mut child = s
        .devlock()
        .args(args)
        .args(["r", "--", "true"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    wait_for_line(&mut err, "waiting");
    // Keep reading, so the waiter never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
    });
    Killed(child)
}

/// `-n` and `-w` are busy (75), naming `words`; a waiter ends at once on
/// SIGTERM, and one gets in once the stranger lets go.
fn occupancy_is_bounded(s: &Scratch, words: &str, args: &[&str], tag: &str) {
    let mut run = vec!["-n"];
    run.extend(args);
    run.extend(["r", "--", "true"]);
    let out = s.run(&run);
    assert_eq!(out.status.code(), Some(75), "{run:?}: {}", stderr(&out));
    assert!(one_line(&out).contains(words), "{run:?}: {}", stderr(&out));
    let mut run = vec!["-w", "300ms"];
    run.extend(args);
    run.extend(["r", "--", "true"]);
    let out = s.run(&run);
    assert_eq!(out.status.code(), Some(75), "{run:?}: {}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("timed out after 300ms waiting for r") && err.contains(words),
        "{run:?}: {err}"
    );
    let mut stopped = waiting_for(s, args);
    signal(stopped.id(), libc::SIGTERM);
    let ended = wait_child(&mut stopped.0);
    assert!(
        ended.code() == Some(143) || ended.signal() == Some(libc::SIGTERM),
        "{ended:?}"
    );
    let mut gets_in = waiting_for(s, args);
    release(s, tag);
    assert!(wait_child(&mut gets_in.0).success());
}

test!(a_strangers_lock_on_an_agreement_byte_is_occupancy_never_a_usage_error, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_strangers_lock_on_an_agreement_byte_is_occupancy_never_a_usage_error() {
    for managed in [false, true] {
        let s = scene(managed);
        let queue = s.dir().join(".r.queue");
        let q = queue.to_str().unwrap();
        let at = (AGREE_BASE + 5).to_string();
        let (_lock, pid) = stranger_holds(&s, USER_A, &["ofd", q, &at, "1", "read"], "a");
        let named = format!(
            "a lock that is not devlock's on bytes 4101 of {q}, the agreement of --slots 5 (pid {pid}, nobody)"
        );
        // Status: held by it, never `free (5 slots)`.
        let view = s.resource_status("r");
        assert_eq!(view["state"], "held", "managed {managed}: {view}");
        assert!(view["slots"].is_null(), "{view}");
        assert_eq!(view["holders"][0]["pid"], pid, "{view}");
        assert_eq!(
            view["foreign_locks"][0]["effect"], "blocks the slot agreement",
            "{view}"
        );
        let as_b = status_as(&s, USER_B, "r");
        assert_eq!(as_b["state"], "held", "{as_b}");
        assert!(as_b["holders"][0]["pid"].is_null(), "{as_b}");
        // Another user cannot see whose it is: busy, never a usage error.
        let out = run_as(&s, USER_B, &["-n", "--slots", "3", "r", "--", "true"]);
        assert_busy_naming(&out, "held by a process this user cannot see");
        occupancy_is_bounded(&s, &named, &[], "a");
        // The same size as the stranger's is occupancy too: slots wait.
        let (_lock, _) = stranger_holds(&s, USER_A, &["ofd", q, &at, "1", "read"], "b");
        occupancy_is_bounded(&s, "the agreement of --slots 5", &["--slots", "2"], "b");
        // A devlock the kernel backs with another size is a usage error.
        let (_holder, _) = hold_as(&s, 0, &["--slots", "5", "r"], "h");
        let out = s.run(&["-n", "--slots", "3", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            one_line(&out)
                .contains("r is in use with --slots 5, but this asks for it with --slots 3"),
            "{}",
            stderr(&out)
        );
        release(&s, "h");
    }
}

test!(a_lock_on_the_top_ticket_byte_parked_in_a_socket_is_occupancy, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_lock_on_the_top_ticket_byte_parked_in_a_socket_is_occupancy() {
    for managed in [false, true] {
        let s = scene(managed);
        let queue = s.dir().join(".r.queue");
        let q = queue.to_str().unwrap();
        let at = TOP_TICKET.to_string();
        let (_lock, _) = stranger_holds(&s, USER_A, &["parked", "ofd", q, &at, "1"], "a");
        // Root sees every descriptor: none has it open, and says so.
        occupancy_is_bounded(
            &s,
            "a descriptor no process has open (one sent over a unix socket, say)",
            &[],
            "a",
        );
        let (_lock, _) = stranger_holds(&s, USER_A, &["parked", "ofd", q, &at, "1"], "b");
        let out = run_as(&s, USER_B, &["-n", "r", "--", "true"]);
        assert_busy_naming(&out, "held by a process this user cannot see");
        release(&s, "b");
        // A plain flock parked the same way: root's status says who took
        // it and that it is alive, never "gone".
        let lock = s.lock_path("r");
        let (_lock, taker) = stranger_holds(
            &s,
            USER_A,
            &["parked", "flock", lock.to_str().unwrap(), "0", "0"],
            "c",
        );
        let view = s.resource_status("r");
        assert_eq!(view["state"], "held", "{view}");
        let note = view["holders"][0]["note"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            note.contains(&format!("taken by pid {taker}")) && !note.contains("gone"),
            "{view}"
        );
        release(&s, "c");
    }
}

test!(many_foreign_locks_through_many_descriptors_cost_one_look, needs: [Root, Tool("setpriv")]);
pub(crate) fn many_foreign_locks_through_many_descriptors_cost_one_look() {
    let s = scene(true);
    let queue = s.dir().join(".r.queue");
    let q = queue.to_str().unwrap();
    let (_lock, _) = stranger_holds(&s, USER_A, &["many", q, "200", "1000"], "a");
    // Each of these read every process's descriptors once, not once per
    // lock: a hang bound only.
    for args in [
        vec!["-n", "r", "--", "true"],
        vec!["-n", "--slots", "2", "r", "--", "true"],
        vec!["status", "r"],
    ] {
        let started = std::time::Instant::now();
        let out = s.run(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert!(
            started.elapsed() < HANG / 6,
            "{args:?}: {:?}",
            started.elapsed()
        );
    }
    let view = s.resource_status("r");
    assert_eq!(array_len(&view["foreign_locks"]), 200, "{view}");
    release(&s, "a");
}

/// `devlock ARGS` run to completion under `strace -f`, with every path it
/// opened: what a run costs, counted in files rather than in seconds (a
/// count a loaded machine does not change).
fn run_counting_opens(s: &Scratch, args: &[&str]) -> (Output, Vec<String>) {
    let devlock = s.devlock();
    let trace = s.dir().with_extension("opens");
    let mut cmd = Command::new("strace");
    cmd.args([
        "-f",
        "-qq",
        "-s",
        "4096",
        "-e",
        "trace=open,openat,openat2",
        "-o",
    ])
    .arg(&trace)
    .arg(devlock.get_program())
    .args(args)
    .stdin(Stdio::null());
    for (key, value) in devlock.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    let out = cmd.output().unwrap();
    let opened = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .filter_map(|call| call.split('"').nth(1).map(str::to_owned))
        .collect();
    std::fs::remove_file(&trace).unwrap();
    (out, opened)
}

test!(planted_registrations_are_skipped_unopened, needs: [Root, Tool("setpriv"), Tool("strace")]);
pub(crate) fn planted_registrations_are_skipped_unopened() {
    let s = scene(false);
    let dir = s.dir();
    const PLANTED: usize = 100_000;
    // 100k files named as registrations of a live process (root's test).
    let prefix = format!(".r@{}.", std::process::id());
    assert!(user_does(
        USER_A,
        python(),
        &[
            &fixture("stranger.py"),
            "plant",
            dir.to_str().unwrap(),
            &prefix,
            &PLANTED.to_string(),
        ]
    ));
    let (_holder, _) = hold_as(&s, 0, &["--step", "real", "r"], "h");
    let mut waiter = waiting_for(&s, &["--step", "waiter"]);
    for args in [vec!["-n", "r", "--", "true"], vec!["status", "r"]] {
        let (out, opened) = run_counting_opens(&s, &args);
        assert!(!stderr(&out).contains("forged"), "{}", stderr(&out));
        // Not one planted file is opened, and the run opens a handful of
        // files however many are planted: the names are enough to skip
        // them.
        // Counted in files, not seconds: a planted registration nobody
        // flocks is skipped by its name and `d_ino`, unopened, but for the
        // few a look opens to sweep (`SWEEP_PER_LOOK`, 256), however many
        // were planted. (Opens under /proc follow the machine's processes,
        // not the directory.)
        let planted = opened.iter().filter(|p| p.contains(&prefix)).count();
        let in_the_dir = opened.iter().filter(|p| !p.starts_with('/')).count();
        assert!(
            planted <= 256 && in_the_dir <= 256 + 16,
            "{args:?} opened {planted} planted registrations, {in_the_dir} files of the directory"
        );
    }
    let view = s.resource_status("r");
    assert_eq!(view["holders"][0]["step"], "real", "{view}");
    release(&s, "h");
    assert!(wait_child(&mut waiter.0).success());
}

test!(a_plain_flock_on_a_slot_file_is_a_holder_of_that_slot, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_plain_flock_on_a_slot_file_is_a_holder_of_that_slot() {
    for managed in [false, true] {
        let s = scene(managed);
        let slot = s.dir().join(".r.slot1");
        let (mut lock, pid) = stranger_holds(&s, USER_A, &["flock", slot.to_str().unwrap()], "a");
        let view = s.resource_status("r");
        assert_ne!(view["state"], "free", "managed {managed}: {view}");
        let h = &view["holders"][0];
        assert_eq!(
            (h["pid"].as_u64(), h["slot"].as_u64()),
            (Some(u64::from(pid)), Some(1)),
            "{view}"
        );
        assert_eq!(h["user"], "nobody", "{view}");
        let as_b = status_as(&s, USER_B, "r");
        assert_ne!(as_b["state"], "free", "{as_b}");
        let out = s.run(&["-n", "--slots", "1", "r", "--", "true"]);
        assert_busy_naming(&out, &format!("pid {pid}"));
        let out = s.run(&["-w", "300ms", "--slots", "1", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("timed out after 300ms")
                && stderr(&out).contains(&format!("pid {pid}")),
            "{}",
            stderr(&out)
        );
        release(&s, "a");
        assert!(wait_child(&mut lock.0).success());
        assert!(
            s.run(&["-n", "--slots", "1", "r", "--", "true"])
                .status
                .success()
        );
    }
}

test!(a_file_lease_on_a_lock_file_is_occupancy_named_and_waited_out, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_file_lease_on_a_lock_file_is_occupancy_named_and_waited_out() {
    let s = scene(false);
    // A lock file a user made in the open directory: theirs to lease.
    assert!(
        run_as(&s, USER_A, &["-n", "l", "--", "true"])
            .status
            .success()
    );
    let lock = s.lock_path("l");
    let l = lock.to_str().unwrap();
    let (mut lease, pid) = stranger_holds(&s, USER_A, &["lease", l], "a");
    let out = s.run(&["-n", "l", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        one_line(&out).contains(&format!(
            "l is busy: a file lease on {l} (pid {pid}, nobody), not devlock's"
        )),
        "{}",
        stderr(&out)
    );
    let view = s.resource_status("l");
    assert_eq!(view["state"], "held", "never free: {view}");
    assert_eq!(view["holders"][0]["pid"], pid, "{view}");
    // A take waits for the lease to break (its holder gives it up when
    // told to), and keeps it from coming back until its turn: root's and
    // another user's.
    for uid in [0, USER_B] {
        let out = run_as(&s, uid, &["-w", "30s", "l", "--", "true"]);
        assert!(out.status.success(), "uid {uid}: {}", stderr(&out));
    }
    release(&s, "a");
    wait_child(&mut lease.0);
    // In a managed directory the files are root's: nobody else may lease them.
    let m = scene(true);
    let r = m.lock_path("r");
    let script = format!(
        "import fcntl, os\nfd = os.open({:?}, os.O_RDONLY)\nfcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)",
        r.to_str().unwrap()
    );
    assert!(!user_does(USER_A, python(), &["-c", &script]));
}

// ----------------------------------------------------------------------------
// Issue #22: setup's way to its directory, leases on squatted files, data in
// lock files devlock did not make, escapes in paths.

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
    let refused = |dir: &str, real: &Path, why: &str| {
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
    };
    let dir = format!("{t}/devlock");
    refused(
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
