//! The over-budget watch, `--any` by memory, the job told its budget, every
//! failure as one line, and a budget that outlives its killed watcher.

use super::*;

test!(over_budget_is_said_once_and_strict_stops_the_job, needs: []);
pub(crate) fn over_budget_is_said_once_and_strict_stops_the_job() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("greedy", "10GiB", "0.2s", "gpu:0");
    let mut greedy = g.job(&a, "greedy", 0, 15 * GIB, false);
    g.wait_ready("greedy");
    let view = g.wait_view("gpu:0", "greedy over budget", |v| {
        v["holders"][0]["over_budget"] == true
    });
    assert_eq!(view["holders"][0]["used_mib"], 15 * GIB);
    let table = stdout(&g.run(&["status"]));
    assert!(
        row_with(
            &table,
            &[" greedy ", "10 GiB, over budget: 15 GiB of 10 GiB"]
        ),
        "{table}"
    );
    g.release("greedy");
    let out = {
        let mut stderr_text = String::new();
        use std::io::Read;
        greedy
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr_text)
            .unwrap();
        assert!(wait_child(&mut greedy).success());
        stderr_text
    };
    assert_eq!(
        out.matches("greedy uses 15 GiB of its 10 GiB budget")
            .count(),
        1,
        "{out}"
    );
    // --mem-strict: stopped as a signal to devlock would, once over for --settle.
    let s = mem("strict", "10GiB", "0.5s");
    let mut s = args(&s);
    s.extend(["--mem-strict", "gpu:0"]);
    let mut strict = g.job(&s, "strict", 0, 15 * GIB, false);
    g.wait_ready("strict");
    let status = wait_child(&mut strict);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{status:?}"
    );
    let mut text = String::new();
    use std::io::Read;
    strict
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    assert!(
        text.contains("--mem-strict: gpu:0: stopping strict: over budget (15 GiB of 10 GiB)"),
        "{text}"
    );
}

test!(any_mem_takes_the_first_device_with_room, needs: []);
pub(crate) fn any_mem_takes_the_first_device_with_room() {
    let g = Gpus::new(&[80 * GIB, 80 * GIB]);
    let stranger = Stranger::start();
    g.foreign(stranger.pid(), 0, 70 * GIB);
    let a = mem("pick", "20GiB", "0.2s");
    let mut a = args(&a);
    a.extend(["--any", "gpu:0", "gpu:1"]);
    let mut pick = g.job(&a, "pick", 0, 0, false);
    assert!(
        g.wait_ready("pick").starts_with("gpu:1 20480"),
        "{}",
        g.wait_ready("pick")
    );
    // Both full now: a second waits, holding neither, and takes the first
    // that admits it.
    let b = mem("later", "60GiB", "0.2s");
    let mut b = args(&b);
    b.extend(["--any", "gpu:0", "gpu:1"]);
    let mut later = g.job(&b, "later", 0, 0, false);
    g.wait_waiting("gpu:1", "later");
    g.wait_waiting("gpu:0", "later");
    assert!(!g.started("later"));
    finish(&g, "pick", &mut pick);
    assert!(g.wait_ready("later").starts_with("gpu:1 "));
    g.wait_settled("gpu:1", 1);
    assert_eq!(
        g.view("gpu:0")["waiters"].as_array().unwrap().len(),
        0,
        "left gpu:0's line"
    );
    // -n: none admits, each named with its figures.
    let out = g.run(&[
        "-n", "--any", "--mem", "30GiB", "gpu:0", "gpu:1", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("gpu:0: 0 MiB of 80 GiB budgeted, 70 GiB outside the gate")
            && err.contains("gpu:1: 60 GiB of 80 GiB budgeted (later 60 GiB)"),
        "{err}"
    );
    finish(&g, "later", &mut later);
    drop(stranger);
}

test!(the_job_learns_its_budget, needs: []);
pub(crate) fn the_job_learns_its_budget() {
    let g = Gpus::new(&[80 * GIB]);
    let out = g.run(&[
        "--mem",
        "20GiB",
        "gpu:0",
        "--",
        "sh",
        "-c",
        "echo $DEVLOCK_MEM_MIB $XLA_PYTHON_CLIENT_MEM_FRACTION $CUDA_VISIBLE_DEVICES",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "20480 0.250 0\n");
    let out = g
        .devlock()
        .env("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
        .args([
            "--mem",
            "20GiB",
            "gpu:0",
            "--",
            "sh",
            "-c",
            "echo $XLA_PYTHON_CLIENT_MEM_FRACTION",
        ])
        .output()
        .unwrap();
    assert_eq!(stdout(&out), "0.9\n", "the caller's setting stays");
}

test!(every_failure_is_one_line_with_its_code, needs: []);
pub(crate) fn every_failure_is_one_line_with_its_code() {
    let g = Gpus::new(&[80 * GIB]);
    let cases: &[(&[&str], i32, &str)] = &[
        (&["--mem", "0", "gpu:0"], 2, "--mem must be more than 0"),
        (
            &["--mem", "100GiB", "gpu:0"],
            2,
            "can never fit on gpu:0, which has 80 GiB",
        ),
        (
            &["--mem", "79GiB", "gpu:0"],
            2,
            "with 2 GiB headroom can never fit",
        ),
        (
            &["--mem", "1GiB", "--shared", "gpu:0"],
            2,
            "cannot be combined with --shared or --slots",
        ),
        (
            &["--mem", "1GiB", "--slots", "2", "gpu:0"],
            2,
            "cannot be combined with --shared or --slots",
        ),
        (&["--mem", "1GiB", "gpu"], 2, "give gpu:N, not gpu"),
        (
            &["--mem", "1GiB", "gpu:0", "gpu:1"],
            2,
            "--mem takes one gpu:N",
        ),
        (&["--settle", "1s", "gpu:0"], 2, "need --mem"),
        (
            &["--mem", "1GiB", "gpu:3"],
            69,
            "which nvidia-smi does not list",
        ),
    ];
    for (args, code, words) in cases {
        let out = g
            .devlock()
            .args(*args)
            .args(["--", "true"])
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {err}");
        assert!(err.contains(words), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
    std::fs::write(g.state.join("fail"), "").unwrap();
    let out = g.run(&["--mem", "1GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("which cannot be learned: nvidia-smi exited with status 9"),
        "{}",
        stderr(&out)
    );
    assert_eq!(stderr(&out).lines().count(), 1);
    let out =
        g.s.devlock()
            .env("DEVLOCK_NVIDIA_SMI", g.s.work("no-such-smi"))
            .args(["--mem", "1GiB", "gpu:0", "--", "true"])
            .output()
            .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot run"), "{}", stderr(&out));
}

test!(a_budget_outlives_its_killed_watcher_while_its_command_runs, needs: []);
/// The hold's watcher (which watches the budget) SIGKILLed alone: the
/// command holds the lock and the registration on, and its budget counts
/// for as long.
pub(crate) fn a_budget_outlives_its_killed_watcher_while_its_command_runs() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("orphan", "60GiB", "0.2s", "gpu:0");
    let mut orphan = g.job(&a, "orphan", 0, 0, false);
    g.wait_ready("orphan");
    g.wait_settled("gpu:0", 1);
    // The watcher: the process of the job's group named devlock-watch.
    let group = std::collections::HashSet::from([orphan.id()]);
    let watcher = group_members(&group)
        .into_iter()
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "devlock-watch")
        })
        .expect("the hold's watcher in the job's group");
    signal(watcher, libc::SIGKILL);
    wait_gone(watcher);
    g.wait_view("gpu:0", "the watch gone", |v| {
        v["holders"][0]["watch_gone"] == true
    });
    let out = g.run(&["-n", "--mem", "30GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("60 GiB of 80 GiB budgeted (orphan 60 GiB)"),
        "{}",
        stderr(&out)
    );
    let w = mem_on("next", "30GiB", "0.2s", "gpu:0");
    let mut next = g.job(&w, "next", 0, 0, false);
    g.wait_waiting("gpu:0", "next");
    finish(&g, "orphan", &mut orphan);
    g.wait_ready("next");
    finish(&g, "next", &mut next);
}
