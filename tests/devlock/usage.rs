//! Usage records and the idle policy, through the real binary against the
//! fake nvidia-smi (contrib/fake-gpu) with scripted utilization: how each
//! job ended (exit, signal, kill -9 of devlock, over-budget stop, idle
//! stop), records forged by another user, `devlock report`'s figures for a
//! scripted week, and idle jobs warned and stopped while busy ones are not.

use std::io::{BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use crate::harness::*;

mod report;

pub(crate) use report::{H, end_line, now_ms, start_line};

/// A scratch directory and a fake GPU state beside it, sampled fast.
struct Gpus {
    s: Scratch,
    state: PathBuf,
}

impl Gpus {
    fn new(count: u32) -> Gpus {
        let s = Scratch::new();
        let state = s.work("gpus");
        std::fs::create_dir(&state).unwrap();
        let lines: String = (0..count).map(|i| format!("{i} 81920\n")).collect();
        std::fs::write(state.join("gpus"), lines).unwrap();
        Gpus { s, state }
    }

    fn devlock(&self) -> Command {
        let mut cmd = self.s.devlock();
        cmd.on_fake_gpu(&self.state)
            .env("DEVLOCK_SAMPLE_EVERY", "200ms")
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.devlock().args(args).output().unwrap()
    }

    /// GPU `gpu` computes `pct` percent from now on.
    fn util(&self, gpu: u32, pct: u32) {
        std::fs::write(self.state.join(format!("util.{gpu}")), format!("{pct}\n")).unwrap();
    }

    /// `devlock ARGS -- sh -c SCRIPT'`, where the script first uses `mib`
    /// on `gpu` (none when 0), writes `ready-TAG` (its pid) and then runs
    /// `then` (default: waits for `release-TAG`).
    fn job(&self, args: &[&str], tag: &str, gpu: u32, mib: u64, then: Option<&str>) -> Child {
        let ready = self.s.work(&format!("ready-{tag}"));
        let release = self.s.work(&format!("release-{tag}"));
        let alloc = if mib > 0 {
            format!("echo {gpu} $$ {mib} > {}/use.{tag}; ", self.state.display())
        } else {
            String::new()
        };
        let then = then.map_or_else(
            || format!("while [ ! -e {} ]; do sleep 0.01; done", release.display()),
            str::to_owned,
        );
        let script = format!(
            "{alloc}echo $$ > {r}.tmp; mv {r}.tmp {r}; {then}",
            r = ready.display()
        );
        let mut cmd = self.devlock();
        cmd.args(args)
            .args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd.process_group(0);
        cmd.spawn().unwrap()
    }

    fn wait_ready(&self, tag: &str) -> u32 {
        pid_in(&self.s.work(&format!("ready-{tag}")))
    }

    fn release(&self, tag: &str) {
        std::fs::write(self.s.work(&format!("release-{tag}")), "").unwrap();
    }

    /// `devlock report --json ARGS`, parsed.
    fn report(&self, args: &[&str]) -> serde_json::Value {
        let out = self
            .devlock()
            .args(["report", "--json", "--since", "1d"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "report failed: {}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The one job of the report whose step is `step`, once its end is
    /// recorded if it has ended (the watcher writes the end line just after
    /// the command's end).
    fn job_of(&self, step: &str) -> serde_json::Value {
        let report = poll_until(
            "the end lines",
            || self.report(&[]),
            |r| {
                r["jobs"].as_array().is_some_and(|jobs| {
                    jobs.iter().all(|j| {
                        j["ending"] != "observed-later"
                            || j["gpus"].as_array().is_some_and(Vec::is_empty)
                    })
                })
            },
        );
        let jobs: Vec<_> = report["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|j| j["step"] == step)
            .cloned()
            .collect();
        assert_eq!(jobs.len(), 1, "{report:#}");
        jobs[0].clone()
    }
}

fn all_stderr(child: &mut Child) -> String {
    let mut text = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    text
}

test!(records_say_how_each_job_ended, needs: []);
pub(crate) fn records_say_how_each_job_ended() {
    let g = Gpus::new(1);
    g.util(0, 40);
    // Each probe appends a line per query (two): after four the first
    // sample is in.
    let probes = g.state.join("probes");
    std::fs::write(&probes, "").unwrap();
    let out = g.run(&[
        "--step",
        "exits",
        "gpu:0",
        "--",
        "sh",
        "-c",
        &format!(
            "echo 0 $$ 700 > {s}/use.a; while [ $(wc -l < {s}/probes) -lt 4 ]; do sleep 0.01; done; exit 3",
            s = g.state.display()
        ),
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let out = g.run(&["--step", "killed", "gpu:0", "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&out.status),
        Some(9),
        "{}",
        stderr(&out)
    );
    let exits = g.job_of("exits");
    assert_eq!(exits["how"], "exit", "{exits:#}");
    assert_eq!(exits["code"], 3);
    assert_eq!(exits["ending"], "recorded");
    assert_eq!(exits["resources"], serde_json::json!(["gpu:0"]));
    assert_eq!(exits["gpus"], serde_json::json!([0]));
    assert_eq!(exits["peak_mib"], 700, "{exits:#}");
    assert_eq!(exits["from"], "cli");
    let (busy, sampled) = (
        exits["busy_gpu_s"].as_f64().unwrap(),
        exits["sampled_gpu_s"].as_f64().unwrap(),
    );
    // Each sample while the job had its process there saw 40 %.
    assert!(sampled > 0.0 && busy <= 0.4 * sampled + 1e-9, "{exits:#}");
    let killed = g.job_of("killed");
    assert_eq!(killed["how"], "signal", "{killed:#}");
    assert_eq!(killed["signal"], 9);
    let user = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .unwrap()
        .unwrap()
        .name;
    assert_eq!(killed["user"], user);
    // The file is the user's, one line per event, plain JSON.
    let file =
        g.s.usage_dir()
            .join(format!("{}.jsonl", nix::unistd::geteuid()));
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text.lines().count(), 4, "{text}");
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["event"] == "start" || v["event"] == "end", "{line}");
    }
    // `devlock busy` outside a hold is a usage error that says why.
    let out = g
        .devlock()
        .env_remove("DEVLOCK_BUSY_FILE")
        .args(["busy", "1m"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not inside a devlock hold"),
        "{}",
        stderr(&out)
    );
    // In a hold nothing watches (no GPU: no idle policy, nobody to remove a
    // file at its end) the job is named no file, and `devlock busy` there
    // succeeds doing nothing.
    let tmp = g.s.work("busy-tmp");
    std::fs::create_dir(&tmp).unwrap();
    let out = g
        .devlock()
        .env("TMPDIR", &tmp)
        .args(["r", "--", "sh", "-c"])
        .arg(format!(
            "test -z \"$DEVLOCK_BUSY_FILE\" && {BIN} busy 1m && echo said"
        ))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "said");
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0, "no file left");
}

test!(a_killed_devlock_leaves_a_record_observed_later, needs: []);
pub(crate) fn a_killed_devlock_leaves_a_record_observed_later() {
    let g = Gpus::new(1);
    let mut child = g.job(&["--step", "doomed", "gpu:0"], "doomed", 0, 0, None);
    g.wait_ready("doomed");
    // The start line is there once the command runs; the running job counts.
    let running = poll_until(
        "the start line",
        || g.report(&[]),
        |r| r["jobs"].as_array().is_some_and(|j| j.len() == 1),
    );
    assert_eq!(running["jobs"][0]["ending"], "running", "{running:#}");
    // kill -9 of the job's group: the command and its watcher.
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_child(&mut child);
    // The watcher went with the group: nobody wrote an end line.
    let doomed = g.report(&[])["jobs"][0].clone();
    assert_eq!(doomed["step"], "doomed", "{doomed:#}");
    assert_eq!(doomed["ending"], "observed-later", "{doomed:#}");
    assert_eq!(doomed["how"], serde_json::Value::Null);
    assert_eq!(g.report(&[])["total"]["observed_later"], 1);
}

test!(an_over_budget_stop_is_recorded, needs: []);
pub(crate) fn an_over_budget_stop_is_recorded() {
    let g = Gpus::new(1);
    let mut child = g.job(
        &[
            "--step",
            "greedy",
            "--mem",
            "1GiB",
            "--settle",
            "0.3s",
            "--mem-strict",
            "gpu:0",
        ],
        "greedy",
        0,
        4096,
        None,
    );
    let status = wait_child(&mut child);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{status:?}"
    );
    let greedy = g.job_of("greedy");
    assert_eq!(greedy["how"], "stopped: over budget", "{greedy:#}");
    assert_eq!(greedy["mem_mib"], 1024);
    assert_eq!(greedy["peak_mib"], 4096);
}

test!(an_idle_job_is_warned_then_stopped_and_busy_ones_are_not, needs: []);
pub(crate) fn an_idle_job_is_warned_then_stopped_and_busy_ones_are_not() {
    let g = Gpus::new(3);
    g.util(0, 0);
    g.util(1, 60);
    g.util(2, 0);
    // Busy by the GPU, and busy by its own word (no GPU work).
    let mut computing = g.job(
        &["--step", "computing", "--idle-timeout", "1s", "gpu:1"],
        "computing",
        1,
        500,
        None,
    );
    let said = g.s.work("said-busy");
    let mut loading = g.job(
        &["--step", "loading", "--idle-timeout", "1s", "gpu:2"],
        "loading",
        2,
        500,
        Some(&format!(
            "{BIN} busy 1h && touch {}; while [ ! -e {} ]; do sleep 0.01; done",
            said.display(),
            g.s.work("release-loading").display()
        )),
    );
    g.wait_ready("computing");
    wait_for_file(&said);
    // Idle: its process is on the GPU, which computes nothing.
    let mut idle = g.job(
        &["--step", "idler", "--idle-timeout", "1s", "gpu:0"],
        "idler",
        0,
        500,
        None,
    );
    g.wait_ready("idler");
    let mut err = BufReader::new(idle.stderr.take().unwrap());
    let warned = wait_for_line(&mut err, "idle");
    // How long it was idle when the warning came is what the watcher
    // measured: the 1 s timeout, or more where a busy machine ran its tick
    // late.
    assert!(
        warned.contains("gpu:0: idler is idle: its GPUs computed nothing for ")
            && warned.contains("(idle timeout); it is stopped in "),
        "{warned}"
    );
    // Status says so too, while it waits out its grace.
    let view = g.s.resource_status("gpu:0");
    assert!(
        view["holders"][0]["idle_for_ms"].as_u64().is_some(),
        "{view:#}"
    );
    let status = wait_child(&mut idle);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{status:?}"
    );
    let mut rest = String::new();
    err.read_to_string(&mut rest).unwrap();
    assert!(
        rest.contains("--idle-timeout: gpu:0: stopping idler"),
        "{rest}"
    );
    assert_eq!(g.job_of("idler")["how"], "stopped: idle");
    // The busy ones ran through the same time (and more) untouched.
    g.release("computing");
    g.release("loading");
    for (child, name) in [(&mut computing, "computing"), (&mut loading, "loading")] {
        let text = all_stderr(child);
        assert!(wait_child(child).success(), "{name}: {text}");
        assert!(!text.contains("idle"), "{name}: {text}");
        assert_eq!(g.job_of(name)["how"], "exit");
    }
}

test!(a_job_without_a_gpu_process_is_idle, needs: []);
pub(crate) fn a_job_without_a_gpu_process_is_idle() {
    let g = Gpus::new(1);
    // The GPU computes, but for nobody of this job's.
    g.util(0, 90);
    let mut child = g.job(
        &["--step", "away", "--idle-timeout", "1s", "gpu:0"],
        "away",
        0,
        0,
        None,
    );
    let status = wait_child(&mut child);
    let text = all_stderr(&mut child);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{text}"
    );
    assert!(text.contains("away is idle"), "{text}");
    let away = g.job_of("away");
    assert_eq!(away["how"], "stopped: idle");
    assert_eq!(away["busy_gpu_s"], 0.0, "{away:#}");
    assert!(away["idle_gpu_s"].as_f64().unwrap() > 0.0, "{away:#}");
}

test!(a_forged_record_is_counted_for_nobody_else, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_forged_record_is_counted_for_nobody_else() {
    let g = Gpus::new(1);
    let out = g.run(&["--step", "mine", "gpu:0", "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let usage = g.s.usage_dir();
    let forged = |name: &str| {
        format!(
            "{{\"event\":\"start\",\"v\":1,\"job\":\"x-1-1\",\"resources\":[\"gpu:0\"],\"gpus\":[0],\
             \"step\":\"forged\",\"pid\":1,\"pid_start\":1,\"start_ms\":{},\"waited_ms\":0,\"from\":\"cli\"}}\n\
             {{\"event\":\"end\",\"v\":1,\"job\":\"x-1-1\",\"end_ms\":{},\"how\":\"exit\",\"code\":0}}\n\
             # {name}\n",
            now_ms() - 3_600_000,
            now_ms()
        )
    };
    // As nobody: a file named for root (its .old), one named for another
    // user, and a real job of its own.
    let script = format!(
        "printf '%s' '{}' > {u}/0.jsonl.old; printf '%s' '{}' > {u}/65533.jsonl; \
         {BIN} --step theirs gpu:0 -- true",
        forged("root"),
        forged("other"),
        u = usage.display()
    );
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &script,
        ])
        .envs(g.devlock().get_envs().filter_map(|(k, v)| Some((k, v?))))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let report = g.report(&["--by", "user"]);
    let rows = report["rows"].as_array().unwrap();
    let keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    let nobody = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(65534))
        .unwrap()
        .map_or("65534".to_owned(), |u| u.name);
    let root = nix::unistd::User::from_uid(nix::unistd::geteuid())
        .unwrap()
        .unwrap()
        .name;
    assert_eq!(keys.len(), 2, "{report:#}");
    assert!(
        keys.contains(&root.as_str()) && keys.contains(&nobody.as_str()),
        "{report:#}"
    );
    for row in rows {
        assert_eq!(row["jobs"], 1, "{report:#}");
    }
    let steps: Vec<&str> = report["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["step"].as_str().unwrap())
        .collect();
    assert!(!steps.contains(&"forged"), "{report:#}");
    let notes = report["notes"].to_string();
    assert!(
        notes.contains("0.jsonl.old: skipped: owned by") && notes.contains("65533.jsonl: skipped"),
        "{notes}"
    );
}

test!(the_sites_idle_timeout_stops_a_job_that_sets_none, needs: [Root]);
pub(crate) fn the_sites_idle_timeout_stops_a_job_that_sets_none() {
    use std::os::unix::fs::MetadataExt;
    let g = Gpus::new(1);
    let out = g.run(&["setup", "--idle-timeout", "1s", "gpu:0"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("site idle timeout 1s"), "{text}");
    assert!(text.contains("usage directory (root:root 1777)"), "{text}");
    let usage = std::fs::metadata(g.s.usage_dir()).unwrap();
    assert_eq!((usage.uid(), usage.mode() & 0o7777), (0, 0o1777));
    let site = std::fs::metadata(g.s.dir().join(".idle-timeout")).unwrap();
    assert_eq!((site.uid(), site.mode() & 0o777), (0, 0o644));
    // Again: nothing to change.
    let again = stdout(&g.run(&["setup", "--idle-timeout", "1s", "gpu:0"]));
    assert!(again.contains("nothing changed"), "{again}");
    let mut child = g.job(&["--step", "forgotten", "gpu:0"], "forgotten", 0, 100, None);
    let status = wait_child(&mut child);
    let err = all_stderr(&mut child);
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM),
        "{err}"
    );
    assert!(err.contains("forgotten is idle"), "{err}");
    let job = g.job_of("forgotten");
    assert_eq!(
        (job["how"].as_str(), job["idle_timeout_s"].as_u64()),
        (Some("stopped: idle"), Some(1))
    );
    // The site's timeout is a ceiling: a job's longer one is refused (the
    // whole case in screens_daily).
    let out = g.run(&[
        "--idle-timeout",
        "1h",
        "--step",
        "patient",
        "gpu:0",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let printed = stdout(&g.run(&["setup", "--print-tmpfiles", "--idle-timeout", "2h", "gpu:0"]));
    assert!(
        printed.contains("/.idle-timeout 0644 root root - 2h\n"),
        "{printed}"
    );
}

test!(serve_shows_idle_holders_and_each_gpus_last_day, needs: []);
pub(crate) fn serve_shows_idle_holders_and_each_gpus_last_day() {
    let g = Gpus::new(2);
    std::fs::create_dir(g.s.usage_dir()).unwrap();
    // A hold of gpu:1 that ended an hour ago, after two hours, idle.
    let now = now_ms();
    let mut text = start_line("past", "overnight", &["gpu:1"], &[1], now - 3 * H, 0, None);
    text += &end_line("past", now - H, "idle", 0, 7200, 7200, None);
    let uid = nix::unistd::geteuid();
    std::fs::write(g.s.usage_dir().join(format!("{uid}.jsonl")), text).unwrap();
    // A live holder of gpu:0 whose GPU computes nothing (its timeout far off).
    g.util(0, 0);
    let mut idler = g.job(
        &["--step", "idler", "--idle-timeout", "1h", "gpu:0"],
        "idler",
        0,
        300,
        None,
    );
    g.wait_ready("idler");
    g.s.wait_for_status("gpu:0", "the holder marked idle", |v| {
        v["holders"][0]["idle_for_ms"].is_u64()
    });
    let server = crate::serve::Server::start(&mut g.devlock(), &[]);
    let metrics = server.get("/metrics").body;
    let line = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in {metrics}"))
            .to_owned()
    };
    assert!(
        line("devlock_holder_idle_seconds{").contains("step=\"idler\""),
        "{metrics}"
    );
    let held = |gpu: &str| -> f64 {
        line(&format!("devlock_gpu_held_seconds_24h{{gpu=\"{gpu}\"}}"))
            .rsplit_once(' ')
            .unwrap()
            .1
            .parse()
            .unwrap()
    };
    assert!((held("1") - 7200.0).abs() < 1.0, "{metrics}");
    assert!(held("0") < 3600.0, "the live hold, so far: {metrics}");
    let page = server.get("/").body;
    assert!(page.contains("<div class=\"day\""), "{page}");
    assert!(
        page.contains("overnight · ") && page.contains("stopped: idle"),
        "{page}"
    );
    assert!(page.contains("last 24 h: held 2h00m by 1 hold"), "{page}");
    assert!(page.contains("idle "), "{page}");
    drop(server);
    g.release("idler");
    assert!(wait_child(&mut idler).success());
}
