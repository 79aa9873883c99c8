//! Issue #35: waiters register in the lock directory's wait directory
//! (`.waiting`), so a take that lists the lock directory reads no waiter's
//! name; it is used only as a directory of root's or the lock directory's
//! owner, shared as the lock directory is, else a waiter registers in the
//! lock directory as before. Real processes; handshakes through status.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::harness::*;
use crate::shared_machine::user_does;

const WAIT_DIR: &str = ".waiting";

/// What a test puts at the wait directory's name before a waiter comes.
type Plant<'a> = Box<dyn Fn() + 'a>;

/// `devlock -q --step STEP r -- true` as `uid` (root for 0), in line
/// behind the holder of `r`; returned once status names it by its step.
fn waiter(s: &Scratch, uid: u32, step: &str) -> Killed {
    let mut cmd = if uid == 0 {
        s.devlock()
    } else {
        let mut cmd = as_user(uid, BIN);
        cmd.env("DEVLOCK_DIR", s.dir())
            .env("DEVLOCK_USAGE_DIR", "none");
        cmd
    };
    let child = Killed(
        cmd.args(["-q", "--step", step, "r", "--", "true"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let view = s.wait_for_status("r", &format!("{step} in line"), |v| {
        v["waiters"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["step"] == step))
    });
    let named = view["waiters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["step"] == step)
        .unwrap()
        .clone();
    assert_eq!(named["source"], "registration", "{view}");
    assert_eq!(named["pid"], child.id(), "{view}");
    child
}

/// The names in `dir` (none when it is not a directory).
fn names_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// The registration `pid` made, and the directory it is in.
fn registration_of(s: &Scratch, pid: u32) -> (String, bool) {
    let made = made_by(s, pid);
    assert_eq!(made.len(), 1, "{made:?}");
    let name = made[0].clone();
    assert!(name.ends_with(".wait"), "{name}");
    let in_wait_dir = s.dir().join(WAIT_DIR).join(&name).exists();
    assert_ne!(
        in_wait_dir,
        s.dir().join(&name).exists(),
        "{name}: in one place"
    );
    (name, in_wait_dir)
}

test!(a_waiter_registers_in_the_wait_directory_and_status_names_it, needs: []);
/// A waiter's registration is in the wait directory, made as the lock
/// directory is shared; status (text and JSON) names the waiter as before
/// and shows no resource for the wait directory; the file goes with the
/// wait, and a take lists the lock directory without it.
pub(crate) fn a_waiter_registers_in_the_wait_directory_and_status_names_it() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    let mut first = waiter(&s, 0, "first-in-line");
    let mut second = waiter(&s, 0, "second-in-line");
    for w in [&first, &second] {
        assert!(registration_of(&s, w.id()).1, "in the wait directory");
    }
    assert!(
        !names_in(&s.dir()).iter().any(|n| n.ends_with(".wait")),
        "no waiter in the lock directory: {:?}",
        names_in(&s.dir())
    );
    let meta = |p: &Path| std::fs::symlink_metadata(p).unwrap();
    let (top, waits) = (meta(&s.dir()), meta(&s.dir().join(WAIT_DIR)));
    assert!(waits.is_dir());
    assert_eq!(waits.mode() & 0o7777, top.mode() & 0o7777);
    assert_eq!(waits.uid(), top.uid());
    let view = s.resource_status("r");
    let steps: Vec<&str> = view["waiters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["step"].as_str().unwrap())
        .collect();
    assert_eq!(steps, ["first-in-line", "second-in-line"], "{view}");
    let text = stdout(&s.run(&["status", "r"]));
    assert!(
        text.contains("first-in-line") && text.contains("second-in-line"),
        "{text}"
    );
    let all = s.status_json(&[]);
    let shown: Vec<&str> = all["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(shown, ["r"], "{all}");
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut first.0).success());
    assert!(wait_child(&mut second.0).success());
    assert_eq!(names_in(&s.dir().join(WAIT_DIR)), Vec::<String>::new());
}

test!(a_killed_waiters_registration_in_the_wait_directory_is_swept, needs: []);
/// A waiter killed with SIGKILL leaves its registration in the wait
/// directory; the next look (status) names nobody and removes it.
pub(crate) fn a_killed_waiters_registration_in_the_wait_directory_is_swept() {
    let s = Scratch::new();
    let _holder = Killed(hold_until_released(&s, &["r"], "h"));
    let mut doomed = waiter(&s, 0, "doomed");
    let (name, in_wait_dir) = registration_of(&s, doomed.id());
    assert!(in_wait_dir);
    let file = s.dir().join(WAIT_DIR).join(&name);
    signal(doomed.id(), libc::SIGKILL);
    let _ = doomed.0.wait();
    assert!(file.exists(), "left by the kill");
    let view = s.resource_status("r");
    assert_eq!(view["waiters"], serde_json::json!([]), "{view}");
    assert!(!file.exists(), "swept by status");
}

test!(a_wait_directory_a_killed_maker_left_private_is_finished, needs: []);
/// A maker killed between making the wait directory (no access for
/// others) and giving it the lock directory's mode left it private; the
/// next waiter that may make it finishes it and registers in it.
pub(crate) fn a_wait_directory_a_killed_maker_left_private_is_finished() {
    let s = Scratch::new();
    assert!(s.run(&["-n", "warm-up", "--", "true"]).status.success());
    let waits = s.dir().join(WAIT_DIR);
    std::fs::create_dir(&waits).unwrap();
    std::fs::set_permissions(&waits, std::fs::Permissions::from_mode(0o700)).unwrap();
    let _holder = Killed(hold_until_released(&s, &["r"], "h"));
    let in_line = waiter(&s, 0, "after-the-kill");
    assert!(registration_of(&s, in_line.id()).1, "in the wait directory");
    let meta = |p: &Path| std::fs::symlink_metadata(p).unwrap();
    assert_eq!(meta(&waits).mode() & 0o7777, meta(&s.dir()).mode() & 0o7777);
}

test!(a_wait_directory_not_to_trust_is_passed_by_and_waiters_still_named, needs: [Root, Tool("setpriv")]);
/// In root's lock directory: another user's waiter never makes the wait
/// directory (it would be theirs); one that another user made, a link
/// (to a directory that would pass), a file, or root's of the wrong mode
/// is never used: every waiter registers in the lock directory, is named
/// by status, and nothing is made through the link.
pub(crate) fn a_wait_directory_not_to_trust_is_passed_by_and_waiters_still_named() {
    let s = Scratch::new();
    assert!(s.run(&["-n", "warm-up", "--", "true"]).status.success());
    let _holder = Killed(hold_until_released(&s, &["r"], "h"));
    let waits = s.dir().join(WAIT_DIR);
    let w = waits.to_str().unwrap().to_owned();
    let elsewhere = s.work("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let as_a = |script: &str| {
        assert!(user_does(USER_A, "sh", &["-c", script]), "{script}");
    };
    let plants: [(&str, Plant); 5] = [
        ("nothing (another user waits first)", Box::new(|| {})),
        (
            "another user's directory",
            Box::new(|| as_a(&format!("mkdir {w} && chmod 1777 {w}"))),
        ),
        (
            "a link to a directory that would pass",
            Box::new(|| as_a(&format!("ln -s {} {w}", elsewhere.display()))),
        ),
        ("a file", Box::new(|| as_a(&format!("touch {w}")))),
        (
            "root's directory, not sticky",
            Box::new(|| {
                std::fs::create_dir(&waits).unwrap();
                std::fs::set_permissions(&waits, std::fs::Permissions::from_mode(0o777)).unwrap();
            }),
        ),
    ];
    for (what, plant) in plants {
        plant();
        let planted = std::fs::symlink_metadata(&waits).ok();
        let users = if planted.is_none() {
            vec![USER_A]
        } else {
            vec![USER_A, 0]
        };
        for uid in users {
            let step = format!("{uid}-beside-{}", what.split(' ').next().unwrap());
            let in_line = waiter(&s, uid, &step);
            assert!(!registration_of(&s, in_line.id()).1, "{what}: {uid}");
            assert_eq!(
                std::fs::symlink_metadata(&waits)
                    .ok()
                    .map(|m| (m.ino(), m.uid())),
                planted.as_ref().map(|m| (m.ino(), m.uid())),
                "{what}: left as it was"
            );
        }
        assert_eq!(names_in(&elsewhere), Vec::<String>::new(), "{what}");
        if std::fs::remove_dir(&waits).is_err() {
            let _ = std::fs::remove_file(&waits);
        }
    }
}

test!(setup_makes_the_wait_directory_roots_and_forget_leaves_it, needs: [Root, Tool("setpriv")]);
/// `devlock setup` takes over what another user left at the wait
/// directory's name and makes it root's, shared as the lock directory;
/// another user's waiter then registers there and a third user's status
/// names it; setup again changes nothing; `devlock forget` forgets the
/// name and leaves the wait directory, which is no name to forget.
pub(crate) fn setup_makes_the_wait_directory_roots_and_forget_leaves_it() {
    let s = Scratch::new();
    assert!(s.run(&["-n", "warm-up", "--", "true"]).status.success());
    let waits = s.dir().join(WAIT_DIR);
    let w = waits.to_str().unwrap();
    assert!(user_does(
        USER_A,
        "sh",
        &["-c", &format!("mkdir -m 777 {w}")]
    ));
    let out = s.run(&["setup"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(".waiting: wait directory"),
        "{}",
        stdout(&out)
    );
    let meta = std::fs::symlink_metadata(&waits).unwrap();
    assert!(meta.is_dir());
    assert_eq!(
        (meta.uid(), meta.gid(), meta.mode() & 0o7777),
        (0, 0, 0o1777)
    );
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    let mut theirs = waiter(&s, USER_A, "a-in-line");
    assert!(
        registration_of(&s, theirs.id()).1,
        "in root's wait directory"
    );
    let seen_by_b = Command::new("setpriv")
        .args([
            &format!("--reuid={USER_B}"),
            &format!("--regid={USER_B}"),
            "--clear-groups",
            BIN,
            "status",
            "--json",
            "r",
        ])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    let view: serde_json::Value = serde_json::from_slice(&seen_by_b.stdout).unwrap();
    assert_eq!(
        view["resources"][0]["waiters"][0]["step"], "a-in-line",
        "{view}"
    );
    let again = s.run(&["setup"]);
    assert!(
        stdout(&again).contains("nothing changed"),
        "{}",
        stdout(&again)
    );
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut theirs.0).success());
    let forgot = s.run(&["forget", "r"]);
    assert!(forgot.status.success(), "{}", stderr(&forgot));
    assert!(!s.lock_path("r").exists());
    assert!(waits.is_dir(), "the wait directory stays");
    let refused = s.run(&["forget", WAIT_DIR]);
    assert!(!refused.status.success());
    assert!(waits.is_dir());
}
