//! Unsafe files and bad input: planted symlinks and FIFOs, a symlinked
//! directory, the umask, bad names, an unusable directory.

use super::*;

fn assert_refused(s: &Scratch, victim: &std::path::Path, what: &str) {
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(74), "{what}: {}", stderr(&out));
    let err = stderr(&out);
    assert!(err.starts_with("devlock: "), "{err}");
    assert!(
        err.contains(&s.lock_path("r").display().to_string()),
        "names the path: {err}"
    );
    assert_eq!(
        std::fs::read_to_string(victim).unwrap(),
        "precious",
        "{what}: victim changed"
    );
}

test!(planted_symlink_and_fifo_are_refused_and_a_hard_link_is_never_written, needs: []);
pub(crate) fn planted_symlink_and_fifo_are_refused_and_a_hard_link_is_never_written() {
    let s = Scratch::new();
    std::fs::create_dir(s.dir()).unwrap();
    // Made for locks (sticky, as devlock makes it): a record would go into
    // the lock file itself (see hostile_takes.rs for elsewhere).
    std::fs::set_permissions(s.dir(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = s.work("victim");
    std::fs::write(&victim, "precious").unwrap();

    std::os::unix::fs::symlink(&victim, s.lock_path("r")).unwrap();
    assert_refused(&s, &victim, "symlink");
    std::fs::remove_file(s.lock_path("r")).unwrap();

    std::os::unix::fs::symlink(s.work("dangling"), s.lock_path("r")).unwrap();
    assert_refused(&s, &victim, "dangling symlink");
    assert!(
        !s.work("dangling").exists(),
        "must not create through a dangling link"
    );
    std::fs::remove_file(s.lock_path("r")).unwrap();

    // A hard link is used as a gate (refusing it would let anyone who can
    // link a lock file disable it), but nothing is written into it.
    std::fs::hard_link(&victim, s.lock_path("r")).unwrap();
    let out = s.run(&["-n", "r", "--", "true"]);
    assert_eq!(out.status.code(), Some(0), "hard link: {}", stderr(&out));
    assert!(
        stderr(&out).contains("holding it without"),
        "says it keeps no record: {}",
        stderr(&out)
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    std::fs::remove_file(s.lock_path("r")).unwrap();

    nix::unistd::mkfifo(
        &s.lock_path("r"),
        nix::sys::stat::Mode::from_bits_truncate(0o666),
    )
    .unwrap();
    assert_refused(&s, &victim, "fifo");
}

test!(a_symlinked_scratch_directory_is_refused, needs: []);
pub(crate) fn a_symlinked_scratch_directory_is_refused() {
    let s = Scratch::new();
    let real = s.work("real");
    std::fs::create_dir(&real).unwrap();
    std::os::unix::fs::symlink(&real, s.dir()).unwrap();
    let out = s.run(&["r", "--", "true"]);
    assert_eq!(out.status.code(), Some(74));
    assert!(stderr(&out).contains("symbolic link"), "{}", stderr(&out));
    assert!(std::fs::read_dir(&real).unwrap().next().is_none());
}

test!(lock_files_and_directory_are_usable_by_everyone_whatever_the_umask, needs: []);
pub(crate) fn lock_files_and_directory_are_usable_by_everyone_whatever_the_umask() {
    let s = Scratch::new();
    let out = Command::new("sh")
        .args(["-c", &format!("umask 077; exec {BIN} r -- true")])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(std::fs::metadata(s.dir()).unwrap().mode() & 0o7777, 0o1777);
    assert_eq!(
        std::fs::metadata(s.lock_path("r")).unwrap().mode() & 0o777,
        0o666
    );
}

test!(bad_input_is_refused_before_any_file_is_touched, needs: []);
pub(crate) fn bad_input_is_refused_before_any_file_is_touched() {
    let s = Scratch::new();
    let long = "x".repeat(65);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["", "--", "true"], "invalid resource name"),
        (vec!["../x", "--", "true"], "invalid resource name"),
        (vec!["a/b", "--", "true"], "invalid resource name"),
        (vec!["a\x1bb", "--", "true"], "invalid resource name"),
        (vec![".hidden", "--", "true"], "invalid resource name"),
        (vec![&long, "--", "true"], "invalid resource name"),
        (vec!["r", "true"], "missing `-- COMMAND`"),
        (vec!["r", "--"], "missing `-- COMMAND`"),
        (vec!["--", "true"], "missing RESOURCE"),
        (
            vec!["-w", "soon", "r", "--", "true"],
            "invalid value 'soon'",
        ),
        (
            vec!["--report-every", "x", "r", "--", "true"],
            "invalid value",
        ),
        (
            vec!["--no-such-flag", "r", "--", "true"],
            "unexpected argument",
        ),
    ];
    for (args, want) in cases {
        let out = s.run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("devlock: ") && err.contains(want),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(!err.contains('\x1b'), "escape echoed back: {err:?}");
        assert!(!s.dir().exists(), "{args:?} touched the scratch dir");
    }
    use std::os::unix::ffi::OsStrExt;
    let out = s
        .devlock()
        .arg(std::ffi::OsStr::from_bytes(b"gp\xffu"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not valid UTF-8"));
    assert!(!s.dir().exists());
}

test!(an_unusable_directory_is_one_clear_line, needs: []);
pub(crate) fn an_unusable_directory_is_one_clear_line() {
    let s = Scratch::new();
    let file = s.work("plain-file");
    std::fs::write(&file, "").unwrap();
    let out = Command::new(BIN)
        .args(["--dir", file.to_str().unwrap(), "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(74));
    let err = stderr(&out);
    assert!(
        err.starts_with("devlock: ") && err.contains("not a directory"),
        "{err}"
    );
    let missing_parent = s.work("no/such/dir");
    let out = Command::new(BIN)
        .args(["--dir", missing_parent.to_str().unwrap(), "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(74));
    assert!(
        stderr(&out).contains("cannot create scratch directory"),
        "{}",
        stderr(&out)
    );
}
