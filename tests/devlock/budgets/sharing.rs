//! Budgets sharing one device: admission with figures, the whole device,
//! fairness, memory outside the gate, kill -9, and one job starting at a time.

use super::*;

test!(three_budgets_share_a_device_and_a_fourth_is_refused_with_figures, needs: []);
pub(crate) fn three_budgets_share_a_device_and_a_fourth_is_refused_with_figures() {
    let g = Gpus::new(&[80 * GIB]);
    let mut jobs = Vec::new();
    for tag in ["a", "b", "c"] {
        let a = mem_on(&format!("eval-{tag}"), "20GiB", "0.2s", "gpu:0");
        jobs.push((tag, g.job(&a, tag, 0, 20 * GIB, false)));
    }
    for (tag, _) in &jobs {
        g.wait_ready(tag);
    }
    let view = g.wait_settled("gpu:0", 3);
    assert_eq!(view["memory"]["budgets_mib"], 60 * GIB, "{view}");
    assert_eq!(view["memory"]["used_inside_mib"], 60 * GIB, "{view}");
    assert_eq!(view["memory"]["used_outside_mib"], 0, "{view}");
    for h in view["holders"].as_array().unwrap() {
        assert_eq!(
            (h["mem_mib"].as_u64(), h["used_mib"].as_u64()),
            (Some(20 * GIB), Some(20 * GIB))
        );
        assert_eq!(h["over_budget"], false);
    }
    let out = g.run(&["-n", "--mem", "30GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("60 GiB of 80 GiB budgeted (eval-")
            && err.contains("0 MiB outside the gate; 30 GiB asked, 2 GiB headroom"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // -w names the same figures when it gives up.
    let out = g.run(&["-w", "0.5", "--mem", "30GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("waiting for gpu:0: 60 GiB of 80 GiB budgeted (eval-"),
        "{}",
        stderr(&out)
    );
    // 10 GiB still fit (60 + 10 + 2 <= 80).
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The whole device and plain flock are refused while budgets are held.
    let out = g.run(&["-n", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let out = g.run(&["-n", "gpu", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(!flock_is_free(&g.s.lock_path("gpu:0")));
    for (tag, mut child) in jobs {
        finish(&g, tag, &mut child);
    }
    assert!(flock_is_free(&g.s.lock_path("gpu:0")));
}

test!(the_whole_device_waits_for_budgets_and_budgets_wait_for_it, needs: [Tool("flock")]);
pub(crate) fn the_whole_device_waits_for_budgets_and_budgets_wait_for_it() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("small", "10GiB", "0.2s", "gpu:0");
    let mut small = g.job(&a, "small", 0, 0, false);
    g.wait_ready("small");
    g.wait_settled("gpu:0", 1);
    let mut whole = g.job(&["--step", "whole", "gpu:0"], "whole", 0, 0, false);
    wait_blocked(&g.s.lock_path("gpu:0"), 1);
    assert!(!g.started("whole"));
    // Budgets that would fit do not overtake the waiting whole device.
    let l = mem_on("later", "10GiB", "0.2s", "gpu:0");
    let mut later = g.job(&l, "later", 0, 0, false);
    g.wait_waiting("gpu:0", "later");
    let out = g.run(&["-n", "--mem", "1GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(!g.started("later"));
    finish(&g, "small", &mut small);
    g.wait_ready("whole");
    // And a budget waits for the whole device.
    let out = g.run(&["-n", "--mem", "1GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(!g.started("later"));
    // Plain flock on the device also excludes budget holders.
    finish(&g, "whole", &mut whole);
    g.wait_ready("later");
    let mut flock = Command::new("/usr/bin/flock")
        .arg(g.s.lock_path("gpu:0"))
        .arg("true")
        .spawn()
        .unwrap();
    wait_blocked(&g.s.lock_path("gpu:0"), 1);
    finish(&g, "later", &mut later);
    assert!(wait_child(&mut flock).success());
}

test!(a_big_waiter_is_not_overtaken_by_later_small_ones, needs: []);
pub(crate) fn a_big_waiter_is_not_overtaken_by_later_small_ones() {
    let g = Gpus::new(&[80 * GIB]);
    let mut held = Vec::new();
    for tag in ["a", "b"] {
        let a = mem_on(tag, "20GiB", "0.2s", "gpu:0");
        held.push(g.job(&a, tag, 0, 20 * GIB, false));
        g.wait_ready(tag);
    }
    g.wait_settled("gpu:0", 2);
    let big_args = mem_on("big", "50GiB", "0.2s", "gpu:0");
    let mut big = g.job(&big_args, "big", 0, 0, false);
    g.wait_waiting("gpu:0", "big");
    let small_args = mem_on("small", "10GiB", "0.2s", "gpu:0");
    let mut small = g.job(&small_args, "small", 0, 0, false);
    g.wait_view("gpu:0", "small behind big", |v| {
        let w = v["waiters"].as_array().unwrap();
        w.len() == 2 && w[0]["step"] == "big" && w[1]["step"] == "small"
    });
    // 10 GiB would fit now (40 + 10 + 2 <= 80), but big came first.
    assert!(!g.started("small") && !g.started("big"));
    let view = g.view("gpu:0");
    assert_eq!(view["waiters"][0]["mem_mib"], 50 * GIB, "{view}");
    let table = stdout(&g.run(&["status"]));
    assert!(row_with(&table, &[" big ", "asks 50 GiB"]), "{table}");
    let mut a = held.remove(0);
    finish(&g, "a", &mut a);
    g.wait_ready("big");
    // 20 + 50 + 10 + 2 > 80: small waits for b.
    g.wait_settled("gpu:0", 2);
    g.wait_waiting("gpu:0", "small");
    assert!(!g.started("small"));
    let mut b = held.remove(0);
    finish(&g, "b", &mut b);
    g.wait_ready("small");
    finish(&g, "big", &mut big);
    finish(&g, "small", &mut small);
}

test!(memory_outside_the_gate_is_counted, needs: []);
pub(crate) fn memory_outside_the_gate_is_counted() {
    let g = Gpus::new(&[80 * GIB]);
    let stranger = Stranger::start();
    g.foreign(stranger.pid(), 0, 50 * GIB);
    let out = g.run(&["-n", "--mem", "30GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("0 MiB of 80 GiB budgeted, 50 GiB outside the gate; 30 GiB asked"),
        "{}",
        stderr(&out)
    );
    let out = g.run(&["-n", "--mem", "28GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // A waiter is admitted once the stranger is gone (its next look).
    let a = mem_on("after", "30GiB", "0.2s", "gpu:0");
    let mut after = g.job(&a, "after", 0, 0, false);
    g.wait_waiting("gpu:0", "after");
    drop(stranger);
    g.wait_ready("after");
    finish(&g, "after", &mut after);
}

test!(kill_9_of_a_holder_returns_its_budget_to_a_waiter, needs: []);
pub(crate) fn kill_9_of_a_holder_returns_its_budget_to_a_waiter() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("victim", "60GiB", "0.2s", "gpu:0");
    let mut victim = g.job(&a, "victim", 0, 60 * GIB, false);
    g.wait_ready("victim");
    g.wait_settled("gpu:0", 1);
    let w = mem_on("next", "30GiB", "0.2s", "gpu:0");
    let mut next = g.job(&w, "next", 0, 0, false);
    g.wait_waiting("gpu:0", "next");
    assert!(!g.started("next"));
    g.kill_job("victim", &mut victim);
    g.wait_ready("next");
    finish(&g, "next", &mut next);
}

test!(a_starting_job_is_the_only_one_starting, needs: []);
pub(crate) fn a_starting_job_is_the_only_one_starting() {
    let g = Gpus::new(&[80 * GIB]);
    // --settle far away: only its memory settling lets the next in.
    let a = mem_on("first", "20GiB", "10m", "gpu:0");
    let mut first = g.job(&a, "first", 0, 20 * GIB, true);
    g.wait_ready("first");
    let view = g.view("gpu:0");
    assert_eq!(view["holders"][0]["starting"], true, "{view}");
    let b = mem_on("second", "20GiB", "10m", "gpu:0");
    let mut second = g.job(&b, "second", 0, 0, false);
    g.wait_waiting("gpu:0", "second");
    let table = stdout(&g.run(&["status"]));
    assert!(
        row_with(&table, &[" first ", "20 GiB, starting"]),
        "{table}"
    );
    let out = g.run(&["-n", "--mem", "1GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gpu:0 is busy: first (pid ")
            && stderr(&out).contains("is starting under its 20 GiB budget"),
        "{}",
        stderr(&out)
    );
    assert!(!g.started("second"));
    // It allocates; once its memory stops growing, the next starts.
    g.go("first");
    g.wait_ready("second");
    let view = g.view("gpu:0");
    let first_view = view["holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["step"] == "first")
        .unwrap()
        .clone();
    assert_eq!(first_view["starting"], false, "{view}");
    // A starter that dies frees its place at once: a third waits for
    // "second" (starting, no memory yet) and gets in when it is killed.
    let c = mem_on("third", "20GiB", "10m", "gpu:0");
    let mut third = g.job(&c, "third", 0, 0, false);
    g.wait_waiting("gpu:0", "third");
    g.kill_job("second", &mut second);
    g.wait_ready("third");
    finish(&g, "first", &mut first);
    finish(&g, "third", &mut third);
}
