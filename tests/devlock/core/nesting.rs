//! Nested use: a nested take passes through, however far up the descriptor
//! table its hold is, and a copied environment is not a hold.

use super::*;

test!(nested_take_passes_through_instead_of_deadlocking, needs: []);
pub(crate) fn nested_take_passes_through_instead_of_deadlocking() {
    let s = Scratch::new();
    let out = s
        .devlock()
        .args([
            "-n",
            "r",
            "--",
            BIN,
            "-n",
            "r",
            "--",
            "sh",
            "-c",
            "echo inner",
        ])
        .output()
        .unwrap();
    assert_eq!(stdout(&out).trim(), "inner", "{}", stderr(&out));
    assert!(out.status.success());
    // Inside util-linux flock too: the kernel says the descriptor holds it.
    std::fs::create_dir_all(s.dir()).unwrap();
    let out = Command::new("/usr/bin/flock")
        .arg(s.lock_path("r"))
        .args([BIN, "-n", "r", "--", "sh", "-c", "exit 4"])
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
}

test!(a_nested_take_finds_a_hold_far_up_the_descriptor_table, needs: [Tool("bash"), Tool("flock")]);
pub(crate) fn a_nested_take_finds_a_hold_far_up_the_descriptor_table() {
    // Scripts lock on a descriptor of their choosing (`exec 9>f; flock 9`,
    // `exec 900>f`): the take inside finds the hold wherever it is.
    let s = Scratch::new();
    std::fs::create_dir_all(s.dir()).unwrap();
    for fd in [9, 900] {
        let script =
            format!("exec {fd}>\"$1\" && flock {fd} && exec \"$2\" -n r -- sh -c 'exit 4'");
        let out = Command::new("bash")
            .args(["-c", &script, "bash"])
            .arg(s.lock_path("r"))
            .arg(BIN)
            .env("DEVLOCK_DIR", s.dir())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(4), "fd {fd}: {}", stderr(&out));
    }
}

test!(a_copied_environment_is_not_mistaken_for_holding, needs: []);
pub(crate) fn a_copied_environment_is_not_mistaken_for_holding() {
    // Another job holds r; a process that merely copied a holder's
    // environment must still wait.
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let mut holder = s.hold(
        &["r"],
        &format!(
            "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
            ready.display(),
            release.display()
        ),
        &ready,
    );
    let out = s
        .devlock()
        .env("DEVLOCK_RESOURCES", "r")
        .args(["-n", "r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75));
    std::fs::write(&release, "").unwrap();
    wait_child(&mut holder);
}
