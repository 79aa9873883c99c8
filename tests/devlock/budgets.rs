//! `--mem`: sharing one GPU by memory budget, with a fake nvidia-smi whose
//! memory the jobs themselves play (a job "allocates" by writing a file
//! naming its pid): admission, fairness, the whole device, foreign memory,
//! kill -9, staggered start, the over-budget watch, `--any`, and every
//! failure.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use crate::harness::*;

const GIB: u64 = 1024;

/// A scratch directory and a fake GPU state beside it.
struct Gpus {
    s: Scratch,
    state: PathBuf,
}

impl Gpus {
    /// GPUs with these totals (MiB), indices 0, 1, ...
    fn new(totals: &[u64]) -> Gpus {
        let s = Scratch::new();
        let state = s.work("gpus");
        std::fs::create_dir(&state).unwrap();
        let lines: String = totals
            .iter()
            .enumerate()
            .map(|(i, t)| format!("{i} {t}\n"))
            .collect();
        std::fs::write(state.join("gpus"), lines).unwrap();
        Gpus { s, state }
    }

    fn devlock(&self) -> Command {
        let mut cmd = self.s.devlock();
        cmd.on_fake_gpu(&self.state)
            .env_remove("XLA_PYTHON_CLIENT_MEM_FRACTION")
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.devlock().args(args).output().unwrap()
    }

    /// A job under `devlock ARGS` that uses `mib` on GPU `gpu` (0: none)
    /// once `go-TAG` exists (at once when `gated` is false), says
    /// `ready-TAG` once it holds, and runs until `release-TAG`.
    fn job<S: AsRef<std::ffi::OsStr>>(
        &self,
        args: &[S],
        tag: &str,
        gpu: u32,
        mib: u64,
        gated: bool,
    ) -> Child {
        let script = self.script(tag, gpu, mib, gated);
        let mut cmd = self.devlock();
        cmd.args(args)
            .args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // A group of its own, for kill -9 of the whole job.
        cmd.process_group(0);
        cmd.spawn().unwrap()
    }

    fn script(&self, tag: &str, gpu: u32, mib: u64, gated: bool) -> String {
        let (ready, release, go) = (
            self.ready(tag),
            self.s.work(&format!("release-{tag}")),
            self.s.work(&format!("go-{tag}")),
        );
        let alloc = format!("echo {gpu} $$ {mib} > {}/use.{tag}", self.state.display());
        let alloc = match (mib, gated) {
            (0, _) => String::new(),
            (_, false) => format!("{alloc}; "),
            (_, true) => format!(
                "while [ ! -e {go} ]; do sleep 0.01; done; {alloc}; ",
                go = go.display()
            ),
        };
        format!(
            "echo \"$DEVLOCK_RESOURCES $DEVLOCK_MEM_MIB $XLA_PYTHON_CLIENT_MEM_FRACTION $$\" > {ready}.tmp; mv {ready}.tmp {ready}; \
             {alloc}while [ ! -e {release} ]; do sleep 0.01; done",
            ready = ready.display(),
            release = release.display()
        )
    }

    fn ready(&self, tag: &str) -> PathBuf {
        self.s.work(&format!("ready-{tag}"))
    }

    fn started(&self, tag: &str) -> bool {
        self.ready(tag).exists()
    }

    fn wait_ready(&self, tag: &str) -> String {
        wait_for_file(&self.ready(tag));
        std::fs::read_to_string(self.ready(tag)).unwrap()
    }

    /// kill -9 of the whole job, as a supervisor does: devlock's process
    /// group, whose guard ends the command's group.
    fn kill_job(&self, tag: &str, child: &mut Child) {
        let command: i32 = self
            .wait_ready(tag)
            .split_whitespace()
            .last()
            .unwrap()
            .parse()
            .unwrap();
        // SAFETY: kill(2) of devlock's process group; its guard ends the
        // command's.
        unsafe {
            libc::kill(-(child.id() as i32), libc::SIGKILL);
        }
        let _ = child.wait();
        wait_gone(command as u32);
    }

    fn go(&self, tag: &str) {
        std::fs::write(self.s.work(&format!("go-{tag}")), "").unwrap();
    }

    fn release(&self, tag: &str) {
        std::fs::write(self.s.work(&format!("release-{tag}")), "").unwrap();
    }

    /// Memory a process outside every gate uses on `gpu`.
    fn foreign(&self, pid: u32, gpu: u32, mib: u64) {
        std::fs::write(
            self.state.join(format!("use.foreign{pid}")),
            format!("{gpu} {pid} {mib}\n"),
        )
        .unwrap();
    }

    /// `status --json` of one resource, with the fake GPUs.
    fn view(&self, name: &str) -> serde_json::Value {
        let out = self.run(&["status", "--json", name]);
        assert!(out.status.success(), "{}", stderr(&out));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        json["resources"][0].clone()
    }

    /// The directory's trust as status says it: (safe, managed).
    fn status_trust(&self) -> (bool, bool) {
        let out = self.run(&["status", "--json"]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            json["trust"]["safe"] == true,
            json["trust"]["managed"] == true,
        )
    }

    /// Polls status until `accept` holds.
    fn wait_view(
        &self,
        name: &str,
        what: &str,
        accept: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        poll_until(what, || self.view(name), accept)
    }

    /// Waits until `n` budget holders of `name` hold and none is starting.
    fn wait_settled(&self, name: &str, n: usize) -> serde_json::Value {
        self.wait_view(name, &format!("{n} settled budgets on {name}"), |v| {
            let holders = v["holders"].as_array().unwrap();
            holders.iter().filter(|h| h["starting"] == false).count() == n
                && holders.iter().all(|h| h["starting"] != true)
        })
    }

    /// Waits until a waiter with this step is in line for `name`.
    fn wait_waiting(&self, name: &str, step: &str) {
        self.wait_view(name, &format!("{step} waiting for {name}"), |v| {
            v["waiters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|w| w["step"] == step)
        });
    }
}

fn finish(g: &Gpus, tag: &str, child: &mut Child) {
    g.release(tag);
    let status = wait_child(child);
    assert!(status.success(), "{tag}: {status:?}");
}

fn mem(step: &str, size: &str, settle: &str) -> Vec<String> {
    ["--step", step, "--mem", size, "--settle", settle]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// `mem`'s flags and the resource, ready for [`Gpus::job`].
fn mem_on(step: &str, size: &str, settle: &str, resource: &str) -> Vec<String> {
    let mut v = mem(step, size, settle);
    v.push(resource.to_owned());
    v
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

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

test!(budgets_of_another_user_count_and_are_counted, needs: [Root, Tool("setpriv")]);
pub(crate) fn budgets_of_another_user_count_and_are_counted() {
    let g = Gpus::new(&[80 * GIB]);
    std::fs::set_permissions(
        &g.state,
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    // In the managed directory: root's gpu and gpu:0 files, from the probe.
    let out = g.run(&["setup", "--gpus"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let a = mem_on("root-job", "60GiB", "0.2s", "gpu:0");
    let mut root_job = g.job(&a, "root", 0, 0, false);
    g.wait_ready("root");
    g.wait_settled("gpu:0", 1);
    let nobody = |args: &[&str]| {
        let mut cmd = as_user(USER_A, BIN);
        cmd.args(args)
            .env("DEVLOCK_DIR", g.s.dir())
            .on_fake_gpu(&g.state)
            .stdin(Stdio::null());
        cmd
    };
    let out = nobody(&["-n", "--mem", "30GiB", "gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("60 GiB of 80 GiB budgeted (root-job 60 GiB)"),
        "{}",
        stderr(&out)
    );
    // Another user's budget counts for root in turn.
    let ready = g.s.work("ready-nobody");
    let release = g.s.work("release-nobody");
    let script = format!(
        "echo > {r}.tmp; mv {r}.tmp {r}; while [ ! -e {release} ]; do sleep 0.01; done",
        r = ready.display(),
        release = release.display()
    );
    let mut theirs = nobody(&[
        "--step",
        "nobody-job",
        "--mem",
        "10GiB",
        "--settle",
        "0.2s",
        "gpu:0",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_file(&ready);
    let view = g.wait_settled("gpu:0", 2);
    assert!(
        view["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["user"] == "nobody" && h["mem_mib"] == 10 * GIB),
        "{view}"
    );
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("70 GiB of 80 GiB budgeted"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        g.status_trust(),
        (true, true),
        "the managed directory stays safe and managed"
    );
    std::fs::write(&release, "").unwrap();
    assert!(wait_child(&mut theirs).success());
    finish(&g, "root", &mut root_job);
}

/// A process's start time, clock ticks since boot (field 22 of its stat).
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = stat.rsplit_once(')').unwrap().1;
    after_name
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap()
}

/// A version 2 record with these members, as devlock writes one.
fn forged_record(members: &str) -> String {
    let body = format!("{{{members}}}");
    let check = body.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{{\"magic\":\"devlock-record\",\"v\":2,\"check\":\"{check:016x}\",{members}}}\n")
}

test!(a_forged_budget_cannot_claim_another_holders_job, needs: []);
pub(crate) fn a_forged_budget_cannot_claim_another_holders_job() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("theirs", "20GiB", "0.2s", "gpu:0");
    let mut job = g.job(&a, "a", 0, 20 * GIB, false);
    let command: u32 = g
        .wait_ready("a")
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap();
    g.wait_settled("gpu:0", 1);
    // A forger (no ancestor of that job) holds the device shared, as anyone
    // may, and labels its own 1 MiB budget with the other holder's command
    // as its "child".
    let lock = std::fs::File::open(g.s.dir().join("gpu:0.lock")).unwrap();
    let young = g.s.dir().join(".forged");
    let label = std::fs::File::create_new(&young).unwrap();
    let forger = Forger::hold(&lock, &label);
    let me = forger.0;
    std::fs::rename(&young, g.s.dir().join(format!(".gpu:0@{me}.0.hold"))).unwrap();
    let members = format!(
        "\"step\":\"forger\",\"pid\":{me},\"pid_start\":{},\"child\":{command},\"child_start\":{},\"since_ms\":1,\"ticket\":1,\"mem_mib\":1",
        start_time(me),
        start_time(command)
    );
    std::io::Write::write_all(&mut &label, forged_record(&members).as_bytes()).unwrap();
    let view = g.wait_view("gpu:0", "the forger's budget believed", |v| {
        v["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["mem_mib"] == 1)
    });
    assert_eq!(view["memory"]["budgets_mib"], 20 * GIB + 1, "{view}");
    // 20 GiB + 1 MiB budgeted, 40 GiB and 2 GiB headroom asked: it fits,
    // unless the other job's 20 GiB were counted twice.
    let out = g.run(&["-n", "--mem", "40GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // The forger's own budget still counts.
    let out = g.run(&["-n", "--mem", "58GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains("forger 1 MiB"), "{}", stderr(&out));
    assert!(!stderr(&out).contains("using"), "{}", stderr(&out));
    drop(forger);
    finish(&g, "a", &mut job);
}

/// A forked process that holds `lock` shared and `label` exclusive (flock,
/// on the descriptors it inherits) until dropped: killed and reaped.
struct Forger(u32);

impl Forger {
    fn hold(lock: &std::fs::File, label: &std::fs::File) -> Forger {
        use std::os::fd::AsRawFd;
        let (lock, label) = (lock.as_raw_fd(), label.as_raw_fd());
        let mut ready = [0; 2];
        // SAFETY: pipe(2) into a two-int array.
        assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
        // SAFETY: the child makes only async-signal-safe calls (flock,
        // write, pause, _exit) on descriptors it inherited.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                if libc::flock(lock, libc::LOCK_SH) != 0 || libc::flock(label, libc::LOCK_EX) != 0 {
                    libc::_exit(1);
                }
                libc::write(ready[1], b"r".as_ptr().cast(), 1);
                loop {
                    libc::pause();
                }
            }
        }
        let mut byte = [0u8; 1];
        // SAFETY: read(2) of one byte; the fds are the pipe's.
        unsafe {
            libc::close(ready[1]);
            assert_eq!(
                libc::read(ready[0], byte.as_mut_ptr().cast(), 1),
                1,
                "forger ready"
            );
            libc::close(ready[0]);
        }
        Forger(pid as u32)
    }
}

impl Drop for Forger {
    fn drop(&mut self) {
        // SAFETY: kill(2) and waitpid(2) of our own child.
        unsafe {
            libc::kill(self.0 as i32, libc::SIGKILL);
            libc::waitpid(self.0 as i32, std::ptr::null_mut(), 0);
        }
    }
}

test!(a_starting_job_stopped_by_ctrl_z_lets_the_next_budget_start, needs: [Tool("bash")]);
pub(crate) fn a_starting_job_stopped_by_ctrl_z_lets_the_next_budget_start() {
    let g = Gpus::new(&[80 * GIB]);
    let pty = Pty::new(120);
    let mut shell = pty.spawn(
        Command::new("bash")
            .args(["--norc", "--noprofile", "-i"])
            .env("PS1", "PROMPT> ")
            .env_remove("PROMPT_COMMAND")
            .env("DEVLOCK_DIR", g.s.dir())
            .env("DEVLOCK_NVML", "none")
            .on_fake_gpu(&g.state),
    );
    pty.wait_for("PROMPT> ");
    // Starting for an hour unless it steps aside: its memory never shows.
    pty.type_in(
        format!(
            "'{BIN}' --step slow --mem 10GiB --settle 1h gpu:0 -- sh -c 'echo job-started; read x; echo job-read-$x'\n"
        )
        .as_bytes(),
    );
    pty.wait_for("job-started");
    let view = g.wait_view("gpu:0", "the job starting", |v| {
        v["holders"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["starting"] == true)
    });
    assert_eq!(view["holders"][0]["step"], "slow", "{view}");
    let mark = pty.output().len();
    pty.type_in(b"\x1a");
    pty.wait_until("the job stopped", |out| {
        out[mark..].contains("Stopped") && out[mark..].contains("PROMPT> ")
    });
    // The hold's watcher (which ignores the terminal's stop) sees the job
    // stopped at its next look and steps aside for it.
    g.wait_settled("gpu:0", 1);
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let view = g.wait_settled("gpu:0", 1);
    assert_eq!(
        view["holders"][0]["mem_mib"],
        10 * GIB,
        "the stopped job keeps its budget: {view}"
    );
    let mark = pty.output().len();
    pty.type_in(b"fg\n");
    pty.type_in(b"on\n");
    pty.wait_until("the job to read on, then the prompt", |out| {
        let after = &out[mark..];
        after
            .find("job-read-on")
            .is_some_and(|at| after[at..].contains("PROMPT> "))
    });
    pty.type_in(b"exit\n");
    wait_child(&mut shell);
}

test!(a_lock_on_a_started_budgets_ticket_is_shown_as_a_place_of_its_own, needs: []);
pub(crate) fn a_lock_on_a_started_budgets_ticket_is_shown_as_a_place_of_its_own() {
    let g = Gpus::new(&[80 * GIB]);
    let a = mem_on("theirs", "20GiB", "0.2s", "gpu:0");
    let mut job = g.job(&a, "a", 0, 20 * GIB, false);
    g.wait_ready("a");
    let view = g.wait_settled("gpu:0", 1);
    assert_eq!(view["waiters"], serde_json::json!([]), "{view}");
    // Anyone may lock the byte of the ticket the holder took (the first,
    // in an empty line) once its job started and it let go of it.
    let queue = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(g.s.dir().join(".gpu:0.queue"))
        .unwrap();
    let place = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: (1 << 20) + 1,
        l_len: 1,
        l_pid: 0,
    };
    // SAFETY: F_OFD_SETLK reads one struct flock.
    let set = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&queue),
            libc::F_OFD_SETLK,
            &place,
        )
    };
    assert_eq!(set, 0, "{}", std::io::Error::last_os_error());
    // That lock is in line ahead of every newcomer: shown as what it is,
    // not hidden behind the holder whose ticket number it has.
    let view = g.view("gpu:0");
    assert_eq!(view["holders"][0]["starting"], false, "{view}");
    assert_eq!(view["waiters"][0]["source"], "unregistered", "{view}");
    assert_eq!(view["waiters"][0]["pid"], std::process::id(), "{view}");
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not a registered devlock"),
        "{}",
        stderr(&out)
    );
    drop(queue);
    let out = g.run(&["-n", "--mem", "10GiB", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    finish(&g, "a", &mut job);
}

/// Whether one line of a status table holds every one of `words` (a
/// holder's step, and its figures in the BUDGET column).
fn row_with(table: &str, words: &[&str]) -> bool {
    table.lines().any(|l| words.iter().all(|w| l.contains(w)))
}

test!(status_with_budgets_fits_the_terminal_and_keeps_one_record_a_line, needs: []);
/// `status` with a budget fits a terminal: the figures have a column
/// (BUDGET) and a line of their own, the longest cells give way with `…`,
/// and no line is wider than the terminal; in a pipe every row stays whole
/// on one line, the memory figures on one greppable line of their own.
pub(crate) fn status_with_budgets_fits_the_terminal_and_keeps_one_record_a_line() {
    let g = Gpus::new(&[140 * GIB]);
    let long = "a-training-run-with-a-rather-long-step-name-for-the-table";
    // The holder computes, as a training run does: however long a loaded
    // machine keeps it holding, its row gains no `(idle ...)` label (whose
    // width would depend on how long that was).
    std::fs::write(g.state.join("util.0"), "50\n").unwrap();
    let a = mem_on(long, "20GiB", "0.2s", "gpu:0");
    let mut holder = g.job(&a, "a", 0, GIB, false);
    g.wait_ready("a");
    g.wait_settled("gpu:0", 1);
    let b = mem_on("big", "130GiB", "0.2s", "gpu:0");
    let mut big = g.job(&b, "b", 0, 0, false);
    g.wait_waiting("gpu:0", "big");
    let piped = stdout(&g.run(&["status"]));
    assert!(row_with(&piped, &[long, "20 GiB"]), "{piped}");
    assert!(!piped.contains("(idle"), "{piped}");
    assert!(row_with(&piped, &[" big ", "asks 130 GiB"]), "{piped}");
    let memory: Vec<&str> = piped.lines().filter(|l| l.contains("budgeted")).collect();
    assert_eq!(memory.len(), 1, "{piped}");
    assert!(
        memory[0].starts_with("gpu:0 memory: 20 GiB of 140 GiB budgeted,")
            && memory[0].ends_with(" room"),
        "{piped}"
    );
    // The step column is as wide as the step, not as the figures.
    let header = piped.lines().next().unwrap();
    let step_width = header.find("PID").unwrap() - header.find("STEP").unwrap();
    assert!(step_width < long.len() + 20, "{piped}");
    let pty = Pty::new(80);
    let mut status = pty.spawn(
        g.devlock()
            .env("NO_COLOR", "1")
            .args(["status"])
            .stdin(Stdio::null()),
    );
    assert!(wait_child(&mut status).success());
    let shown = pty.wait_for("(GPUs as");
    for line in shown.lines() {
        assert!(
            line.trim_end_matches('\r').chars().count() <= 80,
            "{line:?} in:\n{shown}"
        );
    }
    assert!(shown.contains('…'), "{shown}");
    assert!(row_with(&shown, &[" big ", "asks 130 GiB"]), "{shown}");
    finish(&g, "a", &mut holder);
    finish(&g, "b", &mut big);
}
