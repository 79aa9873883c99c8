//! `devlock status`'s table: the locks in use shown, the unused ones counted
//! (never one it cannot call free), and names nothing uses flagged once.

use super::*;

test!(the_table_shows_locks_in_use_and_counts_the_unused_ones, needs: []);
pub(crate) fn the_table_shows_locks_in_use_and_counts_the_unused_ones() {
    let s = Scratch::new();
    for typo in ["gup", "gpu0", "gpu-0"] {
        assert!(s.run(&[typo, "--", "true"]).status.success());
    }
    let only_unused = stdout(&s.run(&["status"]));
    assert_eq!(
        only_unused,
        "(no lock is held or waited for; 3 unused locks not shown: devlock status --all lists them)\n"
    );
    let mut holder = hold_until_released(&s, &["--step", "trainer", "gpu"], "h");
    let table = stdout(&s.run(&["status"]));
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("RESOURCE"), "{table}");
    assert!(
        lines[1].starts_with("gpu ") && lines[1].contains("trainer"),
        "{table}"
    );
    assert_eq!(
        lines[2],
        "(3 unused locks not shown: devlock status --all lists them)"
    );
    let all = stdout(&s.run(&["status", "--all"]));
    for name in ["gup", "gpu0", "gpu-0", "gpu "] {
        assert!(all.contains(name), "--all lacks {name}: {all}");
    }
    assert!(!all.contains("idle") && !all.contains("unused"), "{all}");
    // Asked for by name: shown, held or not.
    let named = stdout(&s.run(&["status", "gup"]));
    assert!(
        named
            .lines()
            .any(|l| l.starts_with("gup ") && l.contains("free")),
        "{named}"
    );
    // JSON keeps listing everything.
    assert_eq!(s.status_json(&[])["resources"].as_array().unwrap().len(), 4);
    release(&s, "h");
    wait_child(&mut holder);
}

test!(the_table_never_counts_a_lock_it_cannot_call_free_among_the_unused, needs: []);
pub(crate) fn the_table_never_counts_a_lock_it_cannot_call_free_among_the_unused() {
    let s = Scratch::new();
    assert!(s.run(&["quiet", "--", "true"]).status.success());
    // A FIFO where a lock file should be: status cannot say it is free.
    nix::unistd::mkfifo(
        &s.lock_path("odd"),
        nix::sys::stat::Mode::from_bits_truncate(0o666),
    )
    .unwrap();
    let table = stdout(&s.run(&["status"]));
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("odd ") && l.contains("unknown")),
        "{table}"
    );
    assert!(
        table.contains("(1 unused lock not shown: devlock status --all lists them)"),
        "{table}"
    );
}

test!(names_nothing_uses_are_flagged_said_once_and_forgotten, needs: []);
/// A name that nothing has used, or a `gpu:N` the driver does not list, is
/// `unknown name` in status (never `free`, never counted among the unused);
/// a new name close to a known one is said once as it is first used, with
/// the name it may have meant; `forget` removes an unused name's files and
/// refuses one in use.
pub(crate) fn names_nothing_uses_are_flagged_said_once_and_forgotten() {
    let s = Scratch::new();
    let state = s.work("gpus");
    std::fs::create_dir(&state).unwrap();
    std::fs::write(state.join("gpus"), "0 81920\n1 81920\n").unwrap();
    let run = |args: &[&str]| {
        s.devlock()
            .on_fake_gpu(&state)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    assert!(run(&["gpu:0", "--", "true"]).status.success());
    // Never used: flagged, not free.
    let view = s.resource_status("gpu:5");
    assert_eq!(view["state"], "free");
    assert!(
        view["unknown_name"]
            .as_str()
            .unwrap()
            .starts_with("never used in"),
        "{view}"
    );
    let table = stdout(&run(&["status", "gpu:5"]));
    assert!(table.contains("gpu:5     unknown name"), "{table}");
    // First use of a name close to a known one: said once.
    let first = run(&["GPU0", "--", "true"]);
    assert!(first.status.success());
    assert!(
        stderr(&first).contains("GPU0 is a new name in")
            && stderr(&first).contains("did you mean gpu:0?"),
        "{}",
        stderr(&first)
    );
    let again = run(&["GPU0", "--", "true"]);
    assert_eq!(stderr(&again), "", "said once");
    assert_eq!(
        stderr(&run(&["--new", "gpu-0", "--", "true"])),
        "",
        "--new says it is meant"
    );
    assert_eq!(
        stderr(&run(&["-q", "Gpu0", "--", "true"])),
        "",
        "-q says nothing"
    );
    // A GPU the driver does not list, used anyway: flagged in status, and
    // not counted away among the unused.
    assert!(run(&["gpu:7", "--", "true"]).status.success());
    let table = stdout(&run(&["status"]));
    let row = table
        .lines()
        .find(|l| l.starts_with("gpu:7"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.contains("unknown name")
            && row.contains("the driver lists no GPU 7, only gpu:0 to gpu:1"),
        "{table}"
    );
    // forget: an unused name goes, a held one stays and its holder is named.
    let forgot = run(&["forget", "GPU0", "gpu-0", "Gpu0"]);
    assert!(forgot.status.success(), "{}", stderr(&forgot));
    assert!(!s.lock_path("GPU0").exists());
    assert!(!stdout(&run(&["status", "--all"])).contains("GPU0"));
    let mut holder = hold_until_released(&s, &["--step", "train", "gpu:7"], "h");
    let busy = run(&["forget", "gpu:7"]);
    assert_eq!(busy.status.code(), Some(75), "{}", stderr(&busy));
    assert!(
        stderr(&busy).contains("gpu:7 is in use: held by train"),
        "{}",
        stderr(&busy)
    );
    assert!(s.lock_path("gpu:7").exists());
    release(&s, "h");
    assert!(wait_child(&mut holder).success());
    let nothing = run(&["forget", "never-made"]);
    assert_eq!(nothing.status.code(), Some(2), "{}", stderr(&nothing));
}
