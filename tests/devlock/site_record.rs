//! Issue #34.4's last point, played as root and two users (setpriv): the
//! usage directory an admin chose is found without anyone's environment.
//! `devlock setup` records it in the lock directory (`.usage-dir`, root's),
//! and every run, the library's holds, `report` and the boot snippet use
//! it; a record root did not write (a user's, in a lock directory of
//! theirs or planted in an open one of root's) is not believed.
//!
//! Every devlock here runs without `DEVLOCK_USAGE_DIR` (but where a test
//! says it overrides), in a mount namespace whose `/var/tmp` and `/var/lib`
//! are the test's own empty directories ([`Defaults`]): what a run keeps
//! where nothing was recorded lands there, where the test reads it, and
//! never in the machine's.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::harness::*;

/// This test's stand-ins for `/var/tmp` and `/var/lib`, mounted over them
/// for each devlock it starts.
struct Defaults {
    var_tmp: PathBuf,
    var_lib: PathBuf,
}

impl Defaults {
    fn new(s: &Scratch) -> Defaults {
        use std::os::unix::fs::PermissionsExt;
        let (var_tmp, var_lib) = (s.root.path().join("var-tmp"), s.root.path().join("var-lib"));
        for (dir, mode) in [(&var_tmp, 0o1777), (&var_lib, 0o755)] {
            std::fs::create_dir(dir).unwrap();
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        Defaults { var_tmp, var_lib }
    }

    /// Where the open default (`/var/tmp/devlock-usage`) really is.
    fn open_default(&self) -> PathBuf {
        self.var_tmp.join("devlock-usage")
    }

    /// Where the managed default (`/var/lib/devlock/usage`) really is.
    fn managed_default(&self) -> PathBuf {
        self.var_lib.join("devlock/usage")
    }

    /// `devlock` as `uid` (root for 0) with this scratch's lock directory,
    /// nothing naming a usage directory, and these defaults.
    fn devlock(&self, s: &Scratch, uid: u32) -> Command {
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--mount",
            "--",
            "sh",
            "-c",
            r#"mount --bind "$1" /var/tmp && mount --bind "$2" /var/lib && shift 2 && exec "$@""#,
            "sh",
        ])
        .arg(&self.var_tmp)
        .arg(&self.var_lib);
        if uid == 0 {
            cmd.arg(BIN);
        } else {
            let user = as_user(uid, BIN);
            cmd.arg(user.get_program()).args(user.get_args());
        }
        cmd.env("DEVLOCK_DIR", s.dir())
            .env_remove("DEVLOCK_USAGE_DIR")
            .env_remove("NO_COLOR")
            .env("DEVLOCK_NVML", "none")
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, s: &Scratch, uid: u32, args: &[&str]) -> Output {
        self.devlock(s, uid).args(args).output().unwrap()
    }

    /// `devlock --step STEP [--dir DIR] r -- true` as `uid`, which must
    /// succeed without a word.
    fn job(&self, s: &Scratch, uid: u32, dir: Option<&Path>, step: &str) {
        let mut cmd = self.devlock(s, uid);
        if let Some(dir) = dir {
            cmd.arg("--dir").arg(dir);
        }
        let out = cmd
            .args(["--no-setup-warning", "--step", step, "r", "--", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{step}: {}", stderr(&out));
        assert_eq!(stderr(&out), "", "{step}");
    }

    /// `report --json` as `uid` (with `--dir DIR`): the directory it read
    /// and the steps of its jobs.
    fn report(&self, s: &Scratch, uid: u32, dir: Option<&Path>) -> (String, Vec<String>) {
        let mut cmd = self.devlock(s, uid);
        if let Some(dir) = dir {
            cmd.arg("--dir").arg(dir);
        }
        let out = cmd.args(["report", "--json"]).output().unwrap();
        let doc = json_of(&out);
        (doc["dir"].as_str().unwrap().to_owned(), report_steps(&doc))
    }
}

/// Everything `uid`'s usage files in `dir` say (empty when there are none).
fn records(dir: &Path, uid: u32) -> String {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return String::new();
    };
    let mut text = String::new();
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if name.starts_with(&format!("{uid}.")) {
            assert_eq!(std::fs::metadata(&path).unwrap().uid(), uid, "{name}");
            text += &std::fs::read_to_string(&path).unwrap();
        }
    }
    text
}

/// `text` written to `path` as `uid` (a file of theirs, made if missing).
fn write_as(uid: u32, path: &Path, text: &str) {
    assert!(
        as_user(uid, "sh")
            .args(["-c", r#"printf %s "$1" > "$2""#, "sh", text])
            .arg(path)
            .status()
            .unwrap()
            .success(),
        "writing {}",
        path.display()
    );
}

fn owner_mode(path: &Path) -> (u32, u32) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    (meta.uid(), meta.mode() & 0o7777)
}

test!(a_usage_directory_setup_recorded_is_every_users_without_the_variable, needs: [Root, Tool("setpriv"), Tool("unshare")]);
pub(crate) fn a_usage_directory_setup_recorded_is_every_users_without_the_variable() {
    let s = Scratch::new();
    let d = Defaults::new(&s);
    let site = s.root.path().join("site usage");
    let shown = site.display().to_string();
    let out = d.run(&s, 0, &["setup", "--usage-dir", &shown, "r"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("/.usage-dir: usage directory recorded: {shown}\n")),
        "{}",
        stdout(&out)
    );
    let record = s.dir().join(".usage-dir");
    assert_eq!(owner_mode(&record), (0, 0o644));
    assert_eq!(
        std::fs::read_to_string(&record).unwrap(),
        format!("{shown}\n")
    );
    assert_eq!(owner_mode(&site), (0, 0o1777));
    // A user with nothing in the environment keeps their records there.
    d.job(&s, USER_A, None, "alices-job");
    assert!(records(&site, USER_A).contains(r#""step":"alices-job""#));
    // Another user's report finds them, and root's.
    for uid in [USER_B, 0] {
        let (dir, steps) = d.report(&s, uid, None);
        assert_eq!(
            (dir.as_str(), &steps[..]),
            (shown.as_str(), &["alices-job".to_owned()][..])
        );
    }
    // Nothing went to the open default.
    assert!(!d.open_default().exists());
    assert!(!d.managed_default().exists());
    // The variable still overrides the record.
    let own = s.work("own-usage");
    let out = d
        .devlock(&s, USER_A)
        .env("DEVLOCK_USAGE_DIR", &own)
        .args(["--step", "by-variable", "r", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(records(&own, USER_A).contains(r#""step":"by-variable""#));
    assert!(!records(&site, USER_A).contains("by-variable"));
    // Setup again, asked nothing of it: the record stays.
    let again = d.run(&s, 0, &["setup", "r"]);
    assert!(
        stdout(&again).contains("nothing changed"),
        "{}",
        stdout(&again)
    );
    assert_eq!(
        std::fs::read_to_string(&record).unwrap(),
        format!("{shown}\n")
    );
    // `none`: nobody's records are kept, and report says so.
    let out = d.run(&s, 0, &["setup", "--usage-dir", "none"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("no usage records kept"),
        "{}",
        stdout(&out)
    );
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "none\n");
    let before = records(&site, USER_A);
    d.job(&s, USER_A, None, "kept-nowhere");
    assert_eq!(records(&site, USER_A), before);
    assert!(!d.open_default().exists());
    let report = d.run(&s, USER_B, &["report"]);
    assert_eq!(report.status.code(), Some(2), "{}", stderr(&report));
    assert!(
        stderr(&report).contains("no usage records are kept"),
        "{}",
        stderr(&report)
    );
}

test!(a_usage_record_root_did_not_write_is_not_believed, needs: [Root, Tool("setpriv"), Tool("unshare")]);
pub(crate) fn a_usage_record_root_did_not_write_is_not_believed() {
    let s = Scratch::new();
    let d = Defaults::new(&s);
    // Alice's lock directory and usage directory, with a job of hers in it
    // and a record naming it.
    let (locks, hers) = (s.work("alices-locks"), s.work("alices-usage"));
    let out = d
        .devlock(&s, USER_A)
        .env("DEVLOCK_USAGE_DIR", &hers)
        .arg("--dir")
        .arg(&locks)
        .args(["--step", "planted", "r", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    write_as(
        USER_A,
        &locks.join(".usage-dir"),
        &hers.display().to_string(),
    );
    // Bob's job there goes to the default, not to her directory; root's
    // report there reads the default, not hers.
    d.job(&s, USER_B, Some(&locks), "bob-in-alices");
    assert_eq!(records(&hers, USER_B), "");
    assert!(records(&d.open_default(), USER_B).contains(r#""step":"bob-in-alices""#));
    let (dir, steps) = d.report(&s, 0, Some(&locks));
    assert_eq!(dir, "/var/tmp/devlock-usage");
    assert_eq!(steps, ["bob-in-alices"]);
    // An open lock directory of root's (root ran devlock first; sticky,
    // 1777), where she plants one before setup writes its own.
    let out = d
        .devlock(&s, 0)
        .env("DEVLOCK_USAGE_DIR", "none")
        .args(["--no-setup-warning", "r", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(owner_mode(&s.dir()), (0, 0o1777));
    let record = s.dir().join(".usage-dir");
    write_as(USER_A, &record, &hers.display().to_string());
    d.job(&s, USER_B, None, "bob-before-setup");
    assert_eq!(records(&hers, USER_B), "");
    assert!(records(&d.open_default(), USER_B).contains("bob-before-setup"));
    let (dir, _) = d.report(&s, USER_B, None);
    assert_eq!(dir, "/var/tmp/devlock-usage");
    // Setup puts its own in its place.
    let out = d.run(&s, 0, &["setup", "r"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(owner_mode(&record), (0, 0o644));
    assert_eq!(
        std::fs::read_to_string(&record).unwrap(),
        "/var/lib/devlock/usage\n"
    );
    d.job(&s, USER_B, None, "bob-after-setup");
    assert!(records(&d.managed_default(), USER_B).contains("bob-after-setup"));
    assert_eq!(records(&hers, USER_B), "");
}

test!(a_directory_planted_at_a_site_records_name_does_not_stop_setup, needs: [Root, Tool("setpriv"), Tool("unshare")]);
/// Before setup, an open lock directory (1777) lets a user make a
/// non-empty directory at `.usage-dir` or `.idle-timeout`, which no rename
/// of a file can replace: setup moves it aside, says so, and writes its
/// records; it does not stop half-way.
pub(crate) fn a_directory_planted_at_a_site_records_name_does_not_stop_setup() {
    let s = Scratch::new();
    let d = Defaults::new(&s);
    let out = d
        .devlock(&s, 0)
        .env("DEVLOCK_USAGE_DIR", "none")
        .args(["--no-setup-warning", "r", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    for name in [".usage-dir", ".idle-timeout"] {
        let planted = s.dir().join(name).join("x");
        let made = as_user(USER_A, "mkdir")
            .arg("-p")
            .arg(&planted)
            .output()
            .unwrap();
        assert!(made.status.success(), "{}", stderr(&made));
    }
    let out = d.run(&s, 0, &["setup", "--idle-timeout", "1h", "r"]);
    assert!(out.status.success(), "{}", stderr(&out));
    for name in [".usage-dir", ".idle-timeout"] {
        let record = s.dir().join(name);
        assert_eq!(owner_mode(&record), (0, 0o644), "{name}");
        assert!(
            stderr(&out).contains(&format!("{name} was a directory of ")),
            "{name}: {}",
            stderr(&out)
        );
    }
    assert_eq!(
        std::fs::read_to_string(s.dir().join(".usage-dir")).unwrap(),
        "/var/lib/devlock/usage\n"
    );
    d.job(&s, USER_B, None, "after-the-plant");
    assert!(records(&d.managed_default(), USER_B).contains("after-the-plant"));
}

test!(the_boot_snippet_carries_the_usage_directory_and_its_record, needs: [Root, Tool("setpriv"), Tool("unshare"), Tool("systemd-tmpfiles")]);
pub(crate) fn the_boot_snippet_carries_the_usage_directory_and_its_record() {
    let s = Scratch::new();
    let d = Defaults::new(&s);
    // A space and a `%`: both must come through the snippet's lines.
    let site = s.root.path().join("site usage 50%");
    let shown = site.display().to_string();
    let out = d.run(&s, 0, &["setup", "--usage-dir", &shown, "r"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Printed later without repeating it, by a user whose variable names a
    // directory of theirs: it comes from the record.
    let printed = d
        .devlock(&s, USER_A)
        .env("DEVLOCK_USAGE_DIR", s.work("alices-usage"))
        .args(["setup", "--print-tmpfiles"])
        .output()
        .unwrap();
    assert!(printed.status.success(), "{}", stderr(&printed));
    let snippet = stdout(&printed);
    let escaped = shown.replace('%', "%%");
    let dir = s.dir().display().to_string();
    assert!(
        snippet.contains(&format!("d \"{escaped}\" 1777 root root -\n"))
            && snippet.contains(&format!("f {dir}/.usage-dir 0644 root root - {escaped}\n")),
        "{snippet}"
    );
    // systemd-tmpfiles makes from it what setup made (a fresh root here).
    let root = s.work("root");
    std::fs::create_dir(&root).unwrap();
    let conf = s.work("devlock.conf");
    std::fs::write(&conf, &snippet).unwrap();
    let made = Command::new("systemd-tmpfiles")
        .arg("--create")
        .arg(format!("--root={}", root.display()))
        .arg(&conf)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", stderr(&made));
    let rebooted = root.join(s.dir().strip_prefix("/").unwrap());
    let record = rebooted.join(".usage-dir");
    assert_eq!(owner_mode(&record), (0, 0o644));
    assert_eq!(std::fs::read_to_string(&record).unwrap(), shown);
    assert_eq!(
        owner_mode(&root.join(site.strip_prefix("/").unwrap())),
        (0, 0o1777)
    );
    // After the "reboot", a user without the variable keeps records in the
    // directory recorded, and another's report there finds them.
    d.job(&s, USER_A, Some(&rebooted), "after-reboot");
    assert!(records(&site, USER_A).contains(r#""step":"after-reboot""#));
    let (dir, steps) = d.report(&s, USER_B, Some(&rebooted));
    assert_eq!((dir, steps), (shown, vec!["after-reboot".to_owned()]));
    assert!(!d.open_default().exists());
}

test!(the_librarys_holds_find_the_recorded_usage_directory_too, needs: [Root, Tool("setpriv"), Tool("unshare")]);
pub(crate) fn the_librarys_holds_find_the_recorded_usage_directory_too() {
    let s = Scratch::new();
    let d = Defaults::new(&s);
    let site = s.root.path().join("site");
    let out = d.run(
        &s,
        0,
        &["setup", "--usage-dir", site.to_str().unwrap(), "r"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // This test binary holds `r` through the library (what the Python
    // package takes through), as a user with nothing in the environment.
    let held = as_user(USER_A, std::env::current_exe().unwrap().to_str().unwrap())
        .env(LIBRARY_HOLD, s.dir())
        .env_remove("DEVLOCK_USAGE_DIR")
        .output()
        .unwrap();
    assert!(held.status.success(), "{}", stderr(&held));
    let text = records(&site, USER_A);
    assert!(
        text.contains(r#""step":"library-hold""#) && text.contains(r#""from":"library""#),
        "{text}"
    );
    assert!(text.contains(r#""how":"released""#), "{text}");
    let (_, steps) = d.report(&s, USER_B, None);
    assert_eq!(steps, ["library-hold"]);
}

/// The variable that makes this binary [`library_hold`] instead of testing.
pub(crate) const LIBRARY_HOLD: &str = "DEVLOCK_TEST_LIBRARY_HOLD";

/// Holds `r` in the lock directory `dir` through the library, then lets
/// it go (the test binary run as a user's program).
pub(crate) fn library_hold(dir: PathBuf) {
    let options = devlock::Options {
        dir,
        wait: devlock::Wait::NoWait,
        step: "library-hold".into(),
    };
    let held = devlock::Acquiring::start(&"r".into(), &options, &[])
        .and_then(devlock::Acquiring::hold)
        .unwrap();
    drop(held);
}
