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

mod disable;
mod names;
mod occupancy;
mod records;
mod setup_paths;
mod squat;
mod stopped;

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
