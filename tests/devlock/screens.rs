//! The screens a lab looks at every day tell every user the truth (#34):
//! `status` and `/metrics` in the scene of the issue's case 1, as root and
//! as the other users (setpriv), with the fake GPU; a holder a user cannot
//! look into; and util-linux flock's own spellings.
//!
//! Handshakes only: holders write their pid into a ready file, and waiters
//! are awaited through status until their registrations show.

use std::path::PathBuf;
use std::process::{Output, Stdio};

use crate::harness::*;
use crate::serve::{Server, promtool_check, samples};
use crate::shared_machine::{devlock_as, hold_script};

/// A third user, for the `--any` job of the scene.
const USER_C: u32 = 65532;

/// The scene of case 1 on a managed directory and a fake 4-GPU machine:
/// alice (USER_A) holds gpu:0 and uses 11.7 GiB there, root holds gpu:1 to
/// gpu:3, bob (USER_B) waits for gpu:0, and carol (USER_C) waits with
/// `--any` for any of the four.
struct Lab {
    s: Scratch,
    gpus: PathBuf,
    /// The devlocks of bob's and carol's waits.
    bob: u32,
    carol: u32,
    guards: Vec<Killed>,
}

impl Lab {
    fn new() -> Lab {
        let s = Scratch::new();
        let gpus = s.work("gpus");
        std::fs::create_dir(&gpus).unwrap();
        std::fs::set_permissions(&gpus, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let mut table = String::new();
        for index in 0..4 {
            table.push_str(&format!("{index} 81920\n"));
            // Each GPU computes: no holder is labelled idle.
            std::fs::write(gpus.join(format!("util.{index}")), "40\n").unwrap();
        }
        std::fs::write(gpus.join("gpus"), table).unwrap();
        let setup = s.run(&["setup", "gpu", "gpu:0", "gpu:1", "gpu:2", "gpu:3"]);
        assert!(setup.status.success(), "{}", stderr(&setup));
        let mut lab = Lab {
            s,
            gpus,
            bob: 0,
            carol: 0,
            guards: Vec::new(),
        };
        let train = lab.hold(USER_A, &["--step", "train", "gpu:0"], "train");
        std::fs::write(lab.gpus.join("use.train"), format!("0 {train} 12000\n")).unwrap();
        let bench = lab.hold(0, &["--step", "bench", "gpu:1", "gpu:2", "gpu:3"], "bench");
        for index in 1..4 {
            let mib = 1000 * index;
            std::fs::write(
                lab.gpus.join(format!("use.bench{index}")),
                format!("{index} {bench} {mib}\n"),
            )
            .unwrap();
        }
        lab.bob = lab.wait(USER_B, &["--step", "eval", "gpu:0"]);
        lab.s
            .wait_for_status("gpu:0", "eval in line", |v| has_waiter(v, "eval"));
        lab.carol = lab.wait(
            USER_C,
            &[
                "--step", "sweep", "--any", "gpu:0", "gpu:1", "gpu:2", "gpu:3",
            ],
        );
        for gpu in ["gpu:0", "gpu:1", "gpu:2", "gpu:3"] {
            lab.s
                .wait_for_status(gpu, "sweep in line", |v| has_waiter(v, "sweep"));
        }
        lab
    }

    /// `devlock` as `uid`, with the fake GPU.
    fn devlock(&self, uid: u32) -> std::process::Command {
        let mut cmd = devlock_as(&self.s, uid);
        cmd.on_fake_gpu(&self.gpus).env("DEVLOCK_NVML", "none");
        cmd
    }

    fn run(&self, uid: u32, args: &[&str]) -> Output {
        self.devlock(uid).args(args).output().unwrap()
    }

    /// A holder as `uid` until the scene ends: its command's pid.
    fn hold(&mut self, uid: u32, args: &[&str], tag: &str) -> u32 {
        let (script, ready) = hold_script(&self.s, tag);
        let child = self
            .devlock(uid)
            .args(args)
            .args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.guards.push(Killed(child));
        pid_in(&ready)
    }

    /// A waiter as `uid` (its command never runs while the scene lasts):
    /// its devlock's pid.
    fn wait(&mut self, uid: u32, args: &[&str]) -> u32 {
        let child = self
            .devlock(uid)
            .args(args)
            .args(["--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        self.guards.push(Killed(child));
        pid
    }
}

fn has_waiter(view: &serde_json::Value, step: &str) -> bool {
    view["waiters"].as_array().is_some_and(|w| {
        w.iter()
            .any(|w| w["step"] == step && w["source"] == "registration")
    })
}

fn steps(list: &serde_json::Value) -> Vec<String> {
    list.as_array()
        .into_iter()
        .flatten()
        .map(|x| x["step"].as_str().unwrap_or("?").to_owned())
        .collect()
}

/// The lock table of a status: its lines before the first empty one.
fn lock_rows(table: &str) -> Vec<&str> {
    table.lines().take_while(|l| !l.is_empty()).collect()
}

test!(the_scene_of_case_one_shows_every_user_one_row_per_request_in_80_columns, needs: [Root, Tool("setpriv")]);
/// Every user, root or not, sees alice holding gpu:0 and root gpu:1-3, bob
/// as the one waiter of gpu:0's line, carol's `--any` as one row over the
/// four, nobody as a holder of `gpu` on a waiter's behalf, and nothing
/// hidden; the table fits 80 columns in a pipe for each of them.
pub(crate) fn the_scene_of_case_one_shows_every_user_one_row_per_request_in_80_columns() {
    let lab = Lab::new();
    for uid in [0, USER_A, USER_B, USER_C] {
        let out = lab.run(uid, &["status", "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let doc = json_of(&out);
        let view = |name: &str| {
            doc["resources"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["name"] == name)
                .unwrap_or_else(|| panic!("{name} in {doc}"))
                .clone()
        };
        let group = view("gpu");
        // The kernel lists a shared lock's holders in no fixed order.
        let mut holders = steps(&group["holders"]);
        holders.sort();
        assert_eq!(holders, ["bench", "train"], "as {uid}: {group}");
        for holder in group["holders"].as_array().unwrap() {
            assert_ne!(holder["source"], "unknown", "as {uid}: {group}");
            assert!(
                ![lab.bob, lab.carol].contains(&(holder["pid"].as_u64().unwrap_or(0) as u32)),
                "a waiter as a holder of gpu, as {uid}: {group}"
            );
        }
        assert_eq!(steps(&group["waiters"]), Vec::<String>::new(), "as {uid}");
        assert_eq!(
            steps(&view("gpu:0")["waiters"]),
            ["eval", "sweep"],
            "as {uid}"
        );
        for gpu in ["gpu:1", "gpu:2", "gpu:3"] {
            assert_eq!(steps(&view(gpu)["holders"]), ["bench"], "as {uid}");
            assert_eq!(steps(&view(gpu)["waiters"]), ["sweep"], "as {uid}");
        }

        let out = lab.run(uid, &["status"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let table = stdout(&out);
        let rows = lock_rows(&table);
        let with = |word: &str| -> Vec<&str> {
            rows.iter()
                .copied()
                .filter(|l| l.split_whitespace().any(|w| w == word))
                .collect()
        };
        let sweep = with("sweep");
        assert_eq!(
            sweep.len(),
            1,
            "one row for the --any request, as {uid}:\n{table}"
        );
        assert!(
            sweep[0].starts_with("gpu:0-3 ") && sweep[0].contains("waits (any)"),
            "as {uid}:\n{table}"
        );
        let eval = with("eval");
        assert_eq!(eval.len(), 1, "as {uid}:\n{table}");
        assert!(eval[0].contains("waits #1"), "as {uid}:\n{table}");
        assert!(
            rows.iter()
                .any(|l| l.starts_with("gpu ") && l.contains("shared by 2")),
            "as {uid}:\n{table}"
        );
        assert!(
            rows.iter().any(|l| l.starts_with("gpu:0 ")
                && l.contains(" held ")
                && l.contains(" train ")
                && l.contains("0: 11.7 GiB, 40%")),
            "as {uid}:\n{table}"
        );
        for word in ["hidden", "unknown", "warning"] {
            assert!(!table.contains(word), "{word}, as {uid}:\n{table}");
        }
        for row in &rows {
            assert!(row.chars().count() <= 80, "{row:?} as {uid}:\n{table}");
        }
    }
}

test!(the_scenes_metrics_count_holders_and_waiters_apart_with_no_minus_zero, needs: [Root, Tool("setpriv"), Tool("promtool")]);
/// `/metrics` of the same scene, served by root and by bob: `gpu` has the
/// two holders it has and no waiter, gpu:0 one holder and two waiters; no
/// value is `-0`; gpu:0, held whole, has no room for a budget.
pub(crate) fn the_scenes_metrics_count_holders_and_waiters_apart_with_no_minus_zero() {
    let lab = Lab::new();
    for uid in [0, USER_B] {
        let server = Server::start(&mut lab.devlock(uid), &[]);
        let answer = server.get("/metrics");
        assert_eq!(answer.status, 200);
        let text = &answer.body;
        promtool_check(text);
        for line in text.lines() {
            assert!(!line.ends_with(" -0"), "{line} as {uid}");
        }
        let values = samples(text);
        let value = |series: &str| {
            *values
                .get(series)
                .unwrap_or_else(|| panic!("no {series} as {uid}:\n{text}"))
        };
        assert_eq!(value(r#"devlock_lock_holders{resource="gpu"}"#), 2.0);
        assert_eq!(value(r#"devlock_lock_waiters{resource="gpu"}"#), 0.0);
        assert_eq!(value(r#"devlock_lock_holders{resource="gpu:0"}"#), 1.0);
        assert_eq!(value(r#"devlock_lock_waiters{resource="gpu:0"}"#), 2.0);
        assert_eq!(value(r#"devlock_lock_waiters{resource="gpu:3"}"#), 1.0);
        assert_eq!(value(r#"devlock_gpu_memory_room_bytes{gpu="0"}"#), 0.0);
        assert_eq!(value(r#"devlock_gpu_memory_ungated_bytes{gpu="3"}"#), 0.0);
        let waiting = values
            .keys()
            .filter(|k| k.starts_with("devlock_waiter_waiting_seconds{"))
            .count();
        assert_eq!(waiting, 5, "eval once, sweep in four lines, as {uid}");
        assert!(
            !values
                .keys()
                .any(|k| k.starts_with("devlock_holder_held_seconds{")
                    && (k.contains("step=\"eval\"") || k.contains("step=\"sweep\""))),
            "a waiter among the holders, as {uid}:\n{text}"
        );
    }
}

test!(a_holder_another_user_cannot_look_into_is_one_short_cell, needs: [Root, Tool("setpriv"), Tool("flock")]);
/// Plain flock as one user: to another, who may not read its descriptors,
/// the holder is one short cell in the table, and the pid and what cannot
/// be told are in --json's note; root sees the process.
pub(crate) fn a_holder_another_user_cannot_look_into_is_one_short_cell() {
    let s = Scratch::new();
    assert!(s.run(&["-n", "data", "--", "true"]).status.success());
    let (script, ready) = hold_script(&s, "f");
    let _flock = Killed(
        as_user(USER_A, "flock")
            .arg(s.lock_path("data"))
            .args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    pid_in(&ready);
    let out = devlock_as(&s, USER_B).args(["status"]).output().unwrap();
    let table = stdout(&out);
    let row = table
        .lines()
        .find(|l| l.starts_with("data "))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.contains(" held ") && row.contains("(owner hidden from you)"),
        "{table}"
    );
    for line in table.lines() {
        assert!(line.chars().count() <= 80, "{line:?}");
    }
    let out = devlock_as(&s, USER_B)
        .args(["status", "--json", "data"])
        .output()
        .unwrap();
    let holder = &json_of(&out)["resources"][0]["holders"][0];
    assert_eq!(holder["source"], "unknown", "{holder}");
    assert!(
        holder["note"]
            .as_str()
            .is_some_and(|n| n.contains("taken by pid") && n.contains("cannot see")),
        "{holder}"
    );
    let root = stdout(&s.run(&["status", "data"]));
    assert!(!root.contains("hidden"), "{root}");
}

test!(flocks_spellings_are_taken_or_refused_with_devlocks, needs: []);
/// `-x`, `-e` and `--exclusive` take the lock exclusive (the default);
/// `--nb`, `--nonblock`, `--wait` and `-E` are devlock's -n, -w and
/// --conflict-exit-code; flock's options without an equivalent are one-line
/// usage errors that say what devlock does instead, never a did-you-mean.
pub(crate) fn flocks_spellings_are_taken_or_refused_with_devlocks() {
    let s = Scratch::new();
    for flag in ["-x", "--exclusive", "-e"] {
        let out = s.run(&[flag, "gpu", "--", "true"]);
        assert!(out.status.success(), "{flag}: {}", stderr(&out));
    }
    let mut holder = hold_until_released(&s, &["-x", "gpu"], "x");
    assert_eq!(
        s.run(&["-n", "-s", "gpu", "--", "true"]).status.code(),
        Some(75),
        "-x is exclusive"
    );
    for flags in [&["--nb"][..], &["--nonblock"], &["--wait", "0.1"]] {
        let mut args = flags.to_vec();
        args.extend(["gpu", "--", "true"]);
        assert_eq!(s.run(&args).status.code(), Some(75), "{flags:?}");
    }
    assert_eq!(
        s.run(&["-n", "-E", "3", "gpu", "--", "true"]).status.code(),
        Some(3)
    );
    release(&s, "x");
    wait_child(&mut holder);
    for (args, says) in [
        (
            &["-c", "true", "gpu"][..],
            "devlock RESOURCE -- sh -c 'COMMAND'",
        ),
        (
            &["--command", "true", "gpu"],
            "devlock RESOURCE -- sh -c 'COMMAND'",
        ),
        (
            &["-u", "gpu", "--", "true"],
            "releases the lock when its command exits",
        ),
        (&["-o", "gpu", "--", "true"], "always inherits the lock"),
        (
            &["--close", "gpu", "--", "true"],
            "always inherits the lock",
        ),
        (
            &["-F", "gpu", "--", "true"],
            "runs the command as its child",
        ),
        (
            &["--no-fork", "gpu", "--", "true"],
            "runs the command as its child",
        ),
        (&["--verbose", "gpu", "--", "true"], "unless -q"),
        (&["-x", "-s", "gpu", "--", "true"], "cannot be used with"),
    ] {
        let out = s.run(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("did you mean"), "{args:?}: {err}");
    }
}

test!(a_gpus_budget_figures_follow_the_lock_rows, needs: []);
/// The `gpu:0 memory: …` line of a budgeted GPU comes after every lock
/// row, never between a holder and its line.
pub(crate) fn a_gpus_budget_figures_follow_the_lock_rows() {
    let s = Scratch::new();
    let gpus = s.work("gpus");
    std::fs::create_dir(&gpus).unwrap();
    std::fs::write(gpus.join("gpus"), "0 81920\n").unwrap();
    let devlock = || {
        let mut cmd = s.devlock();
        cmd.on_fake_gpu(&gpus).stdin(Stdio::null());
        cmd
    };
    let (script, ready) = hold_script(&s, "small");
    let _small = Killed(
        devlock()
            .args([
                "--step", "small", "--mem", "20GiB", "gpu:0", "--", "sh", "-c", &script,
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    pid_in(&ready);
    let _big = Killed(
        devlock()
            .args(["--step", "big", "--mem", "70GiB", "gpu:0", "--", "true"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    s.wait_for_status("gpu:0", "big in line", |v| has_waiter(v, "big"));
    let out = devlock().arg("status").output().unwrap();
    let table = stdout(&out);
    let rows = lock_rows(&table);
    let at = |needle: &str| {
        rows.iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("{needle} in:\n{table}"))
    };
    assert!(at("waits #1") < at("gpu:0 memory:"), "{table}");
    assert_eq!(at("gpu:0 memory:"), rows.len() - 1, "{table}");
}
