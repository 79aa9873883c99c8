//! Exclusion broken by a rename; a squatted directory and lock file, named
//! and then taken over by setup; setup's own refusals and its tmpfiles snippet.

use super::*;

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
    a_squatted_directory_is_named_in_one_warning(&s, &dir);
    // A holds q through a lock file of A's own while root sets up.
    let (mut a_holds, _) = hold_as(&s, USER_A, &["--dir", d, "q"], "a");
    a_waiter_is_warned_before_it_waits(&s, &dir);
    setup_takes_the_directory_and_lock_file_over_in_place(&s, &dir);
    release(&s, "a");
    assert!(wait_child(&mut a_holds.0).success());
}

/// A directory another user made: one warning line (none with -q), and
/// status says whose it is.
fn a_squatted_directory_is_named_in_one_warning(s: &Scratch, dir: &Path) {
    let d = dir.to_str().unwrap();
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
}

/// A waiter is told before it waits, not once it is through.
fn a_waiter_is_warned_before_it_waits(s: &Scratch, dir: &Path) {
    let d = dir.to_str().unwrap();
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
}

/// setup takes the directory and the lock file over in place, with A
/// still holding q; a second setup changes nothing.
fn setup_takes_the_directory_and_lock_file_over_in_place(s: &Scratch, dir: &Path) {
    let d = dir.to_str().unwrap();
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
    let meta = std::fs::metadata(dir).unwrap();
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
    the_declared_names_came_with_it(&dir);
    only_root_forgets_a_name(&dir);
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

/// The declared names came with it: a name they do not list is a typo
/// until --new says it is meant.
fn the_declared_names_came_with_it(dir: &Path) {
    assert_eq!(
        std::fs::read_to_string(dir.join(".names")).unwrap(),
        "gpu\ngpu:0\ngpu:1\ngpu:2\ngpu:3\ngpu:4\ngpu:5\ngpu:6\ngpu:7\n"
    );
    let typo = Command::new(BIN)
        .arg("--dir")
        .arg(dir)
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
        .arg(dir)
        .args(["--new", "scratch-disk", "--", "true"])
        .output()
        .unwrap();
    assert!(meant.status.success(), "{}", stderr(&meant));
}

/// Only root forgets a name in a managed directory; a declared one
/// leaves the list.
fn only_root_forgets_a_name(dir: &Path) {
    let user = as_user(USER_A, BIN)
        .arg("--dir")
        .arg(dir)
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
        .arg(dir)
        .args(["forget", "scratch-disk"])
        .output()
        .unwrap();
    assert!(forgot.status.success(), "{}", stderr(&forgot));
    assert!(!dir.join("scratch-disk.lock").exists());
}
