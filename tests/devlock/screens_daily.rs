//! The daily screens of #34 that the administrator and every user rely on:
//! a site idle policy that is a ceiling and a boot snippet that keeps it,
//! one short warning before setup. Through the real binary, as root and
//! as the other users (setpriv).

use std::os::unix::fs::PermissionsExt;
use std::process::Output;

use crate::harness::*;
use crate::shared_machine::devlock_as;

fn run_as(s: &Scratch, uid: u32, args: &[&str]) -> Output {
    devlock_as(s, uid)
        .env("DEVLOCK_NVML", "none")
        .args(args)
        .output()
        .unwrap()
}

// ----------------------------------------------------------------------------
// 5. A site policy is a ceiling.

test!(a_longer_idle_timeout_than_the_sites_is_refused_before_the_take, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_longer_idle_timeout_than_the_sites_is_refused_before_the_take() {
    let s = Scratch::new();
    let setup = s.run(&["setup", "--idle-timeout", "8s", "gpu:1"]);
    assert!(setup.status.success(), "{}", stderr(&setup));
    let ran = s.work("ran");
    let touch = format!("touch {}", ran.display());
    for uid in [USER_A, 0] {
        let out = run_as(
            &s,
            uid,
            &["--idle-timeout", "1000h", "gpu:1", "--", "sh", "-c", &touch],
        );
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        let said = stderr(&out);
        assert!(
            said.contains("--idle-timeout 1month 11days 5h 26m 24s is longer than this machine's idle policy, 8s")
                && said.contains(".idle-timeout"),
            "{said}"
        );
        assert_eq!(said.lines().count(), 1, "{said}");
        assert!(!ran.exists(), "the command must not run");
        assert!(
            !s.lock_path("gpu:1").exists() || s.run(&["status", "gpu:1"]).status.success(),
            "nothing held"
        );
    }
    // Shorter than the policy, or none (the policy then): it runs.
    for asked in [&["--idle-timeout", "2s"][..], &[]] {
        let mut args: Vec<&str> = asked.to_vec();
        args.extend(["gpu:1", "--", "sh", "-c", &touch]);
        let out = run_as(&s, USER_B, &args);
        assert!(out.status.success(), "{asked:?}: {}", stderr(&out));
        assert!(ran.exists(), "{asked:?}");
        std::fs::remove_file(&ran).unwrap();
    }
}

test!(the_boot_snippet_carries_the_policy_and_only_the_declared_devices, needs: [Root, Tool("systemd-tmpfiles")]);
pub(crate) fn the_boot_snippet_carries_the_policy_and_only_the_declared_devices() {
    let s = Scratch::new();
    let setup = s.run(&["setup", "--idle-timeout", "8s", "gpu", "gpu:0", "gpu:1"]);
    assert!(setup.status.success(), "{}", stderr(&setup));
    // Printed later without repeating the policy or the names: both come
    // from the directory as setup left it.
    let printed = s.run(&["setup", "--print-tmpfiles"]);
    assert!(printed.status.success(), "{}", stderr(&printed));
    let snippet = stdout(&printed);
    let dir = s.dir().display().to_string();
    assert!(
        snippet.contains(&format!("f {dir}/.idle-timeout 0644 root root - 8s\n")),
        "{snippet}"
    );
    for name in ["gpu", "gpu:0", "gpu:1"] {
        assert!(
            snippet.contains(&format!("f {dir}/{name}.lock ")),
            "{name}: {snippet}"
        );
    }
    assert!(!snippet.contains("gpu:2"), "{snippet}");
    // A policy asked for now wins over the one in force.
    let asked = s.run(&["setup", "--print-tmpfiles", "--idle-timeout", "2h"]);
    assert!(stdout(&asked).contains("/.idle-timeout 0644 root root - 2h\n"));
    // systemd-tmpfiles makes from it what setup made: the policy holds
    // after a reboot (a fresh root here).
    let root = s.work("root");
    std::fs::create_dir(&root).unwrap();
    let conf = s.work("devlock.conf");
    std::fs::write(&conf, &snippet).unwrap();
    let made = std::process::Command::new("systemd-tmpfiles")
        .arg("--create")
        .arg(format!("--root={}", root.display()))
        .arg(&conf)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", stderr(&made));
    let rebooted = root.join(s.dir().strip_prefix("/").unwrap());
    assert_eq!(
        std::fs::read_to_string(rebooted.join(".idle-timeout")).unwrap(),
        "8s"
    );
    let out = std::process::Command::new(BIN)
        .arg("--dir")
        .arg(&rebooted)
        .args(["--idle-timeout", "1h", "gpu:0", "--", "true"])
        .env("DEVLOCK_NVML", "none")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

// ----------------------------------------------------------------------------
// 6. Warnings that fit a line.

/// The `devlock: warning:` lines of `said`.
fn warnings(said: &str) -> Vec<&str> {
    said.lines()
        .filter(|l| l.starts_with("devlock: warning:"))
        .collect()
}

test!(the_open_directory_warning_is_one_short_line_with_the_fix, needs: [Root, Tool("setpriv")]);
pub(crate) fn the_open_directory_warning_is_one_short_line_with_the_fix() {
    let s = Scratch::new();
    // An open directory, as the first user's devlock makes one in /run/lock.
    std::fs::create_dir(s.dir()).unwrap();
    std::fs::set_permissions(s.dir(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    // Alice's runs make the open directory and every GPU's files hers.
    let gpus: Vec<String> = (0..8).map(|i| format!("gpu:{i}")).collect();
    let mut args: Vec<&str> = vec!["--any", "--count", "8"];
    args.extend(gpus.iter().map(String::as_str));
    args.extend(["--", "true"]);
    let out = run_as(&s, USER_A, &args);
    assert!(out.status.success(), "{}", stderr(&out));
    // Bob's run over all of them: one line, under 160 characters, the fix.
    let out = run_as(&s, USER_B, &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stderr(&out);
    let lines = warnings(&said);
    assert_eq!(lines.len(), 1, "{said}");
    let line = lines[0];
    assert!(line.chars().count() < 160, "{} chars: {line}", line.len());
    assert!(
        line.contains("is not set up") && line.contains("fix: sudo devlock setup --dir"),
        "{line}"
    );
    // The full list stays in status (every file, its owner, what they can do).
    let status = run_as(&s, USER_B, &["status", "--json", "gpu:0", "gpu:7"]);
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let issues = json["trust"]["issues"].as_array().unwrap().len()
        + json["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["trust"]["issues"].as_array().unwrap().len())
            .sum::<usize>();
    assert!(issues >= 3, "{json}");
    // Silenced by a flag or a variable; the waiting line stays.
    let (guard, _) = crate::shared_machine::hold_as(&s, USER_A, &["gpu:3"], "holder");
    // Bob's line about who is in the way stays (`-q` would hide it too).
    let busy = devlock_as(&s, USER_B)
        .env("DEVLOCK_NVML", "none")
        .env("DEVLOCK_NO_SETUP_WARNING", "1")
        .args(["-n", "gpu:3", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(busy.status.code(), Some(75), "{}", stderr(&busy));
    let out = stderr(&busy);
    assert!(out.contains("gpu:3") && out.contains("held by"), "{out}");
    assert!(warnings(&out).is_empty(), "{out}");
    drop(guard);
    let out = run_as(&s, USER_B, &["--no-setup-warning", "gpu:3", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(warnings(&stderr(&out)).is_empty(), "{}", stderr(&out));
}

// ----------------------------------------------------------------------------
// 4. report answers the admin's questions (the filters).

test!(report_user_and_resource_list_exactly_those_jobs, needs: [Root, Tool("setpriv")]);
pub(crate) fn report_user_and_resource_list_exactly_those_jobs() {
    let s = Scratch::new();
    for open in [s.dir(), s.usage_dir()] {
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    }
    let job = |uid: u32, step: &str, resource: &str| {
        let out = devlock_as(&s, uid)
            .env("DEVLOCK_NVML", "none")
            .env("DEVLOCK_USAGE_DIR", s.usage_dir())
            .args(["--step", step, resource, "--", "true"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    };
    job(USER_A, "alice-1", "gpu:0");
    job(USER_A, "alice-2", "gpu:1");
    job(USER_B, "bob-1", "gpu:1");
    let steps = |filter: &[&str]| -> Vec<String> {
        let mut args = vec!["report", "--json"];
        args.extend(filter);
        report_steps(&json_of(&s.devlock().args(&args).output().unwrap()))
    };
    assert_eq!(steps(&[]), ["alice-1", "alice-2", "bob-1"]);
    assert_eq!(steps(&["--user", "nobody"]), ["alice-1", "alice-2"]);
    assert_eq!(steps(&["--user", &USER_B.to_string()]), ["bob-1"]);
    assert_eq!(steps(&["--resource", "gpu:1"]), ["alice-2", "bob-1"]);
    assert_eq!(
        steps(&["--resource", "gpu"]),
        ["alice-1", "alice-2", "bob-1"]
    );
    assert_eq!(
        steps(&["--user", "nobody", "--resource", "gpu:1"]),
        ["alice-2"]
    );
    assert!(steps(&["--user", "no-such-user"]).is_empty());
    // The per-job table: one row per job of that user, nobody else's.
    let out = s
        .devlock()
        .args(["report", "--jobs", "--user", "nobody"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("USER") && lines[0].contains("HELD") && lines[0].ends_with("ENDED"),
        "{table}"
    );
    assert_eq!(lines.len(), 3, "{table}");
    for (line, step, gpu) in [
        (lines[1], "alice-1", "gpu:0"),
        (lines[2], "alice-2", "gpu:1"),
    ] {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            (cells[0], cells[1], cells[2]),
            ("nobody", step, gpu),
            "{table}"
        );
        assert!(line.ends_with("exit 0"), "{table}");
    }
    assert!(!table.contains("bob-1"), "{table}");
}
