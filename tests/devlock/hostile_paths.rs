//! Issue #32, cases 1 and 5, played as root and two users (setpriv): root
//! never acts on a path a user can change (setup's usage directory raced
//! with `renameat2(RENAME_EXCHANGE)`, a user's link above it, a root take,
//! forget, status and report below a user's link), and a user's records
//! count for that user alone (a managed usage directory where a co-user
//! made the victim's file name first; an open one another user made).
//!
//! Handshakes only: the racer says it has swapped once through a file
//! written in one rename; everything else runs to completion.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::harness::*;
use crate::shared_machine::{one_line, python, user_does};

/// Swaps two names of its user's in one directory with
/// `renameat2(RENAME_EXCHANGE)` as fast as it can, until killed; after the
/// first swap it writes its pid into the ready file (in one rename).
const RACER: &str = r#"
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b, ready = (x.encode() for x in sys.argv[1:4])
first = True
while True:
    if libc.renameat2(-100, a, -100, b, 2) == 0 and first:
        first = False
        with open(ready + b".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(ready + b".tmp", ready)
"#;

/// `devlock` as `uid` (root for 0), with this scratch's lock directory and
/// `usage` as the usage directory.
fn devlock_as(s: &Scratch, uid: u32, usage: &Path) -> Command {
    let mut cmd = if uid == 0 {
        Command::new(BIN)
    } else {
        as_user(uid, BIN)
    };
    cmd.env("DEVLOCK_DIR", s.dir())
        .env("DEVLOCK_USAGE_DIR", usage)
        .env("DEVLOCK_NVML", "none")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null());
    cmd
}

fn run_as(s: &Scratch, uid: u32, usage: &Path, args: &[&str]) -> Output {
    devlock_as(s, uid, usage).args(args).output().unwrap()
}

/// Owner and mode bits of what is at `path` (not following a link).
fn owner_mode(path: &Path) -> (u32, u32) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    (meta.uid(), meta.mode() & 0o7777)
}

/// Root's private things elsewhere: a 0600 file and a 0700 directory.
fn root_secrets(s: &Scratch) -> (PathBuf, PathBuf) {
    let file = s.work("secret-file");
    std::fs::write(&file, "root's\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let dir = s.work("secret-dir");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    (file, dir)
}

fn assert_untouched(file: &Path, dir: &Path) {
    assert_eq!(owner_mode(file), (0, 0o600), "{}", file.display());
    assert_eq!(std::fs::read_to_string(file).unwrap(), "root's\n");
    assert_eq!(owner_mode(dir), (0, 0o700), "{}", dir.display());
    assert_eq!(
        std::fs::read_dir(dir).unwrap().count(),
        0,
        "nothing made in {}",
        dir.display()
    );
}

// ----------------------------------------------------------------------------
// Case 1: root never acts on a path a user can change.

test!(setup_raced_by_a_user_swapping_the_usage_directory_for_a_link_changes_nothing_outside, needs: [Root, Tool("setpriv")]);
pub(crate) fn setup_raced_by_a_user_swapping_the_usage_directory_for_a_link_changes_nothing_outside()
 {
    let s = Scratch::new();
    let (file, dir) = root_secrets(&s);
    let (mut took_over, mut raced) = (0, 0);
    for round in 0..40 {
        // A's usage directory (in a sticky directory of root's, as
        // /var/tmp/devlock-usage is) and A's link beside it, to the file or
        // the directory in turn, swapped for each other without end.
        let usage = s.work(&format!("usage-{round}"));
        let link = s.work(&format!("link-{round}"));
        let target = if round % 2 == 0 { &file } else { &dir };
        assert!(user_does(
            USER_A,
            "sh",
            &[
                "-c",
                &format!(
                    "mkdir {} && ln -s {} {}",
                    usage.display(),
                    target.display(),
                    link.display()
                )
            ]
        ));
        let ready = s.work(&format!("racing-{round}"));
        let racer = Killed(
            as_user(USER_A, python())
                .args(["-c", RACER])
                .arg(&usage)
                .arg(&link)
                .arg(&ready)
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        pid_in(&ready);
        let out = run_as(&s, 0, &usage, &["setup", "r"]);
        drop(racer);
        assert_untouched(&file, &dir);
        match out.status.code() {
            Some(0) => {
                took_over += 1;
                assert_eq!(
                    owner_mode(&usage),
                    (0, 0o1777),
                    "the usage directory is root's: {}",
                    stdout(&out)
                );
                assert!(std::fs::symlink_metadata(&usage).unwrap().is_dir());
            }
            Some(74) => {
                raced += 1;
                assert!(
                    one_line(&out).contains("keeps changing under devlock setup"),
                    "{}",
                    stderr(&out)
                );
            }
            _ => panic!("setup: {}{}", stdout(&out), stderr(&out)),
        }
    }
    assert!(took_over > 0, "setup never won ({raced} raced out)");
}

test!(setup_refuses_a_usage_directory_below_another_users_link_or_directory_before_changing_anything, needs: [Root, Tool("setpriv")]);
pub(crate) fn setup_refuses_a_usage_directory_below_another_users_link_or_directory_before_changing_anything()
 {
    let s = Scratch::new();
    let (file, dir) = root_secrets(&s);
    let up = s.work("up");
    assert!(user_does(
        USER_A,
        "ln",
        &["-s", dir.to_str().unwrap(), up.to_str().unwrap()]
    ));
    let mine = s.work("mine");
    assert!(user_does(USER_A, "mkdir", &[mine.to_str().unwrap()]));
    for (usage, why) in [
        (
            up.join("usage"),
            format!(
                "{} is on the way, and it is a symbolic link (to {}) owned by nobody, who can \
                 point it anywhere",
                up.display(),
                dir.display()
            ),
        ),
        (
            mine.join("usage"),
            format!(
                "{} is on the way, and it is owned by nobody, who can replace what is below it",
                mine.display()
            ),
        ),
    ] {
        let out = run_as(&s, 0, &usage, &["setup", "r"]);
        assert_eq!(out.status.code(), Some(74), "{}", stderr(&out));
        assert_eq!(stdout(&out), "", "nothing done");
        let err = one_line(&out);
        assert!(
            err.starts_with(&format!(
                "devlock: refusing to set up {}: {why}; every directory above the usage \
                 directory must be root's",
                usage.display()
            )) && err.trim_end().ends_with("nothing was changed"),
            "{err}"
        );
        assert!(!s.dir().exists(), "the lock directory was not made either");
        assert!(!mine.join("usage").exists());
        assert_untouched(&file, &dir);
    }
}

test!(root_takes_forget_status_and_report_refuse_a_way_through_another_users_link, needs: [Root, Tool("setpriv")]);
pub(crate) fn root_takes_forget_status_and_report_refuse_a_way_through_another_users_link() {
    let s = Scratch::new();
    // Root's directory elsewhere, with root's records in it...
    let elsewhere = s.work("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let records = elsewhere.join("usage");
    let out = run_as(&s, 0, &records, &["--step", "roots", "r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = || std::fs::read_to_string(records.join("0.jsonl")).unwrap();
    let before = lines();
    assert!(before.contains("\"roots\""), "{before}");
    // ... and A's link to it.
    let link = s.work("link");
    assert!(user_does(
        USER_A,
        "ln",
        &["-s", elsewhere.to_str().unwrap(), link.to_str().unwrap()]
    ));
    let why = format!(
        "{} is on the way, and it is a symbolic link (to {}) owned by nobody, who can point it \
         anywhere",
        link.display(),
        elsewhere.display()
    );
    let locks = link.join("locks");
    for args in [
        &["-n", "r", "--", "true"][..],
        &["status", "r"],
        &["forget", "r"],
    ] {
        let out = Command::new(BIN)
            .arg("--dir")
            .arg(&locks)
            .args(args)
            .env("DEVLOCK_NVML", "none")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(74), "{args:?}: {}", stderr(&out));
        let err = one_line(&out);
        assert!(
            err.starts_with(&format!(
                "devlock: refusing to use {}: {why}",
                locks.display()
            )),
            "{args:?}: {err}"
        );
        assert!(!elsewhere.join("locks").exists(), "{args:?}");
    }
    // Root's take keeps no record through the link, and says why once.
    let through = link.join("usage");
    let out = run_as(&s, 0, &through, &["r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(
        err.matches("no usage record for this job").count(),
        1,
        "{err}"
    );
    assert!(
        err.contains(&format!("refusing to use {}: {why}", through.display())),
        "{err}"
    );
    assert_eq!(lines(), before, "nothing written through the link");
    // Root's report reads nothing through it, and says so.
    let out = run_as(&s, 0, &through, &["report", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["jobs"].as_array().unwrap().len(), 0, "{doc}");
    let note = doc["notes"][0].as_str().unwrap();
    assert!(
        note.starts_with(&format!(
            "no records read: refusing to use {}: {why}",
            through.display()
        )),
        "{doc}"
    );
}

// ----------------------------------------------------------------------------
// Case 5: a user's records count for that user alone.

/// The names in `dir` of `uid`'s usage files with a tag.
fn tagged_files(dir: &Path, uid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap().to_owned();
            name.strip_prefix(&format!("{uid}."))
                .and_then(|rest| rest.strip_suffix(".jsonl"))
                .is_some_and(|tag| tag.len() == 16 && tag.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .collect()
}

/// The steps of the jobs `report --json` lists for `user`.
fn steps_of(doc: &serde_json::Value, user: &str) -> Vec<String> {
    let mut steps: Vec<String> = doc["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["user"] == user)
        .map(|j| j["step"].as_str().unwrap().to_owned())
        .collect();
    steps.sort();
    steps
}

fn report_json(s: &Scratch, uid: u32, usage: &Path) -> (serde_json::Value, String) {
    let out = run_as(s, uid, usage, &["report", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    (serde_json::from_slice(&out.stdout).unwrap(), stderr(&out))
}

test!(in_a_managed_usage_directory_a_co_user_cannot_stop_hide_or_remove_anothers_records, needs: [Root, Tool("setpriv")]);
pub(crate) fn in_a_managed_usage_directory_a_co_user_cannot_stop_hide_or_remove_anothers_records() {
    let s = Scratch::new();
    let usage = s.usage_dir();
    let out = run_as(&s, 0, &usage, &["setup", "r"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(owner_mode(&usage), (0, 0o1777));
    // B makes A's names first, private to B.
    let a = USER_A.to_string();
    assert!(user_does(
        USER_B,
        "sh",
        &[
            "-c",
            &format!(
                "cd {} && umask 077 && : > {a}.jsonl && : > {a}.jsonl.old",
                usage.display()
            )
        ]
    ));
    for step in ["first", "second"] {
        let out = run_as(&s, USER_A, &usage, &["--step", step, "r", "--", "true"]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stderr(&out), "", "recorded, nothing to say");
    }
    // Both in one file of A's that nobody could name first, found again.
    let files = tagged_files(&usage, USER_A);
    assert_eq!(files.len(), 1, "{files:?}");
    let file = &files[0];
    assert_eq!(owner_mode(file), (USER_A, 0o644));
    let text = std::fs::read_to_string(file).unwrap();
    assert_eq!(text.matches("\"event\":\"start\"").count(), 2, "{text}");
    // B can neither remove, rename, empty nor link it.
    let f = file.to_str().unwrap();
    for script in [
        format!("rm -f {f}"),
        format!("mv {f} {}/{a}.jsonl.x", usage.display()),
        format!(": > {f}"),
        format!("ln {f} {}/hard", usage.display()),
    ] {
        assert!(!user_does(USER_B, "sh", &["-c", &script]), "{script}");
    }
    assert_eq!(std::fs::read_to_string(file).unwrap(), text);
    // Past 16 MiB it becomes the same stem's .old as the next hold starts,
    // and the hold goes on under the same stem: one file and one .old.
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(17 << 20)
        .unwrap();
    let out = run_as(&s, USER_A, &usage, &["--step", "third", "r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(tagged_files(&usage, USER_A), files, "the same stem");
    let old = PathBuf::from(format!("{}.old", file.display()));
    assert_eq!(std::fs::metadata(&old).unwrap().len(), 17 << 20);
    assert_eq!(owner_mode(&old), (USER_A, 0o644));
    let text = std::fs::read_to_string(file).unwrap();
    assert_eq!(text.matches("\"event\":\"start\"").count(), 1, "{text}");
    // Root's report and A's count every job for A, and name the squat.
    for uid in [0, USER_A] {
        let (doc, err) = report_json(&s, uid, &usage);
        assert_eq!(
            steps_of(&doc, "nobody"),
            ["first", "second", "third"],
            "{doc}"
        );
        let notes = doc["notes"].to_string();
        assert!(
            notes.contains(&format!(
                "{a}.jsonl: skipped: owned by {USER_B}, not by the user"
            )),
            "{notes}"
        );
        assert_eq!(err, "");
    }
}

test!(an_open_usage_directory_another_user_made_is_not_used_and_report_names_it, needs: [Root, Tool("setpriv")]);
pub(crate) fn an_open_usage_directory_another_user_made_is_not_used_and_report_names_it() {
    let s = Scratch::new();
    // Root made the lock directory; B runs first: the open usage
    // directory is B's.
    let none = Path::new("none");
    assert!(run_as(&s, 0, none, &["r", "--", "true"]).status.success());
    let usage = s.work("open-usage");
    let out = run_as(&s, USER_B, &usage, &["--step", "bs", "r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(owner_mode(&usage), (USER_B, 0o1777));
    // A's run keeps nothing there, and says so once.
    let out = run_as(&s, USER_A, &usage, &["--step", "as", "r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!(
            "devlock: note: no usage record for this job: {} is owned by {USER_B}, who can \
             remove or replace any record in it; records are kept only in a usage directory \
             of root's or this user's",
            usage.display()
        )),
        "{err}"
    );
    let out = run_as(&s, USER_A, &usage, &["-q", "r", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stderr(&out), "", "-q says nothing");
    let names: Vec<String> = std::fs::read_dir(&usage)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, [format!("{USER_B}.jsonl")]);
    // Report reads it, and says what it could not trust.
    for uid in [0, USER_A] {
        let (doc, err) = report_json(&s, uid, &usage);
        assert_eq!(steps_of(&doc, &USER_B.to_string()), ["bs"], "{doc}");
        let note = format!(
            "{} is owned by {USER_B}, who can remove or replace any record in it: records may \
             be missing",
            usage.display()
        );
        assert_eq!(doc["notes"][0], note.as_str(), "{doc}");
        assert_eq!(err, "");
        let out = run_as(&s, uid, &usage, &["report"]);
        // (Shortened to a line's worth on stderr.)
        assert!(
            stderr(&out).contains(&format!("devlock: note: {}", &note[..note.len() / 2])),
            "{}",
            stderr(&out)
        );
    }
    // B's own runs go on being recorded there.
    let (doc, _) = report_json(&s, USER_B, &usage);
    assert_eq!(doc["notes"].as_array().unwrap().len(), 0, "{doc}");
}

test!(setup_and_forget_write_no_names_list_through_another_link, needs: [Root]);
pub(crate) fn setup_and_forget_write_no_names_list_through_another_link() {
    let s = Scratch::new();
    let none = Path::new("none");
    assert!(run_as(&s, 0, none, &["setup", "r"]).status.success());
    // Root's file elsewhere, linked in at `.names` (as anyone may link a
    // file they can write, where fs.protected_hardlinks is off).
    let outside = s.work("outside");
    std::fs::write(&outside, "# root's own\n").unwrap();
    let names = s.dir().join(".names");
    std::fs::remove_file(&names).unwrap();
    std::fs::hard_link(&outside, &names).unwrap();
    for args in [&["setup", "r2"][..], &["forget", "r2"]] {
        let out = run_as(&s, 0, none, args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert_eq!(
            std::fs::read_to_string(&outside).unwrap(),
            "# root's own\n",
            "{args:?}"
        );
        assert_eq!(std::fs::metadata(&outside).unwrap().nlink(), 1, "{args:?}");
        if args[0] == "setup" {
            assert_eq!(std::fs::read_to_string(&names).unwrap(), "r2\n");
            // Linked in again, for forget's turn.
            std::fs::remove_file(&names).unwrap();
            std::fs::hard_link(&outside, &names).unwrap();
        }
    }
}
