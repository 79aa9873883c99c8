//! Status believes only what the kernel backs: forged and replayed records
//! and registrations, and what a record keeps.

use super::*;

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
    let lock = s.lock_path("gpu:0");
    a_rewritten_record_is_cleaned_and_its_child_not_gated(&s, &lock, devlock_pid, notebook.id());
    a_record_naming_a_strangers_process_names_no_holder(&s, &lock, devlock_pid, notebook.id());
    let (_planted, _replayed, mut waiter) =
        planted_and_replayed_registrations_name_nobody(&s, devlock_pid);
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut waiter.0).success());
    let view = s.resource_status("gpu:0");
    assert_eq!(array_len(&view["waiters"]), 0, "{view}");
    let _ = command;
    let _ = notebook.0.kill();
}

/// A rewrites root's record: another step, A's notebook as the child,
/// escapes and a right-to-left override in the via.
fn a_rewritten_record_is_cleaned_and_its_child_not_gated(
    s: &Scratch,
    lock: &Path,
    devlock_pid: u32,
    notebook: u32,
) {
    let gpu_status = || {
        let out = s
            .devlock()
            .env("DEVLOCK_NVIDIA_SMI", fixture("nvidia-smi/fake-nvidia-smi"))
            .env("FAKE_SMI_PIDS", notebook.to_string())
            .args(["status", "--json"])
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    write_as(
        USER_A,
        lock,
        &forged_record(devlock_pid, |r| {
            r.step = "evil\u{202e}gol".into();
            r.child = Some(notebook);
            r.child_start = devlock::testing::procfs::start_time(notebook);
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
    assert_eq!(p["pid"], notebook);
    assert_eq!(p["gated"], false, "a forged child is not gated: {json}");
    let table = stdout(&s.run(&["status", "gpu:0"]));
    assert!(
        !table.contains('\x1b') && !table.contains('\u{202e}') && !table.contains('\u{2067}'),
        "{table:?}"
    );
}

/// A record naming A's own process: not the kernel's holder, no label.
fn a_record_naming_a_strangers_process_names_no_holder(
    s: &Scratch,
    lock: &Path,
    devlock_pid: u32,
    notebook: u32,
) {
    write_as(USER_A, lock, &forged_record(notebook, |_| {}));
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
    assert_eq!(view["stale_record"]["pid"], notebook);
}

/// Planted registrations: a waiter naming root's devlock, flocked by A,
/// and a copy of a real waiter's registration, flocked by A. Returns the
/// two strangers' holders and the real waiter, still waiting.
fn planted_and_replayed_registrations_name_nobody(
    s: &Scratch,
    devlock_pid: u32,
) -> (Killed, Killed, Killed) {
    let planted = s.dir().join(format!(".gpu:0@{devlock_pid}.7.wait"));
    std::fs::write(&planted, forged_record(devlock_pid, |_| {})).unwrap();
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (planted_holder, _) =
        stranger_holds(s, USER_A, &["flock", planted.to_str().unwrap()], "reg");
    let waiter = Killed(
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
    // (A waiter registers in the wait directory; the replay is planted in
    // the lock directory, which readers read too.)
    let real = s
        .dir()
        .join(".waiting")
        .join(made_by(s, waiter.id()).pop().unwrap());
    let replay = s.dir().join(format!(".gpu:0@{}.99.wait", waiter.id()));
    std::fs::copy(&real, &replay).unwrap();
    std::fs::set_permissions(&replay, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (replay_holder, _) =
        stranger_holds(s, USER_A, &["flock", replay.to_str().unwrap()], "replay");
    let view = s.resource_status("gpu:0");
    assert_eq!(
        array_len(&view["waiters"]),
        1,
        "a replay names nobody: {view}"
    );
    (planted_holder, replay_holder, waiter)
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
