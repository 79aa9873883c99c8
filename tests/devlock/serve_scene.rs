//! The scene of doc/serve.png: a busy 8-GPU H200 machine, staged with real
//! devlock holders and waiters of ten users, the fake NVML as its driver,
//! and `devlock serve`'s page photographed by chromium-headless-shell. Run
//! on request (it writes into the repository):
//!
//!     cargo test --test devlock -- --ignored serve_scene::doc_screenshot
//!
//! What is staged, and how: the users are uids 2001-2010, named in a
//! passwd file bind-mounted over /etc/passwd for the server alone (in a
//! mount namespace of its own, where the scratch directory is also
//! mounted at /run/lock/devlock and its usage directory at the default
//! /var/lib/devlock/usage, with the host name `dgx-h200-01` in a UTS
//! namespace); the holds and waits are hours old because each devlock is
//! started under faketime(1) with its clock set back (the server's clock is
//! the real one); the GPUs' memory and processes are a scenario of the fake
//! NVML, written twice: empty while the jobs are admitted (their devlocks
//! see no memory in use, so the budgets go in), then with every worker's
//! real pid for the server; their utilisation is scripted for the jobs
//! from the start (`FAKE_NVML_UTIL`), so that only the one GPU that
//! computes nothing has an idle holder. The last day's holds that ended
//! are usage records written in devlock's format (each user's file, theirs)
//! before the jobs start, which then add their own. Everything else is
//! devlock as it runs: the site's idle policy (`setup --idle-timeout`), a
//! process outside devlock on a GPU nobody holds (gpu:7, in use, never
//! free), an idle notebook, a line.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::harness::*;
use crate::nvml::fake_nvml;
use crate::serve::{Server, artefact, screenshot, which};
use crate::usage::{end_line, now_ms, start_line};

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const H200: u64 = 143_771;
const GIB: u64 = 1024;

const USERS: [(&str, u32); 10] = [
    ("alice", 2001),
    ("bob", 2002),
    ("carol", 2003),
    ("dave", 2004),
    ("erin", 2005),
    ("frank", 2006),
    ("grace", 2007),
    ("mallory", 2008),
    ("henry", 2009),
    ("ivan", 2010),
];

fn uid(name: &str) -> u32 {
    USERS.iter().find(|(n, _)| *n == name).unwrap().1
}

/// The GPUs: index, used MiB and utilisation, as the server sees them.
const GPUS: [(u32, u64, u32); 8] = [
    (0, 134_656, 99),
    (1, 133_120, 98),
    (2, 79_872, 71),
    (3, 71_680, 88),
    (4, 0, 0),
    (5, 22_528, 0),
    (6, 45_568, 0),
    (7, 3_584, 2),
];

const HOUR: u64 = 3_600_000;

/// The machine's name, in the server's and the jobs' UTS namespaces.
const HOST: &str = "dgx-h200-01";

/// The holds of the last day that ended, as records: user, step, GPU,
/// start and end (hours ago), how it ended, and the share of it that
/// computed.
const PAST: [(&str, &str, u32, f64, f64, &str, f64); 12] = [
    ("alice", "data-prep", 4, 21.0, 15.5, "exit", 0.82),
    ("bob", "eval-harness", 0, 16.0, 15.0, "exit", 0.74),
    ("bob", "sweep-lr-1e-4", 3, 9.5, 5.0, "exit", 0.91),
    ("carol", "vllm-serve", 2, 23.0, 6.0, "signal", 0.55),
    ("dave", "embed-batch", 2, 12.0, 10.5, "exit", 0.68),
    ("erin", "finetune-7b", 4, 7.0, 2.0, "exit", 0.95),
    ("erin", "finetune-7b", 5, 7.0, 2.0, "exit", 0.94),
    ("frank", "notebook", 5, 20.0, 12.0, "idle", 0.03),
    ("grace", "mig-eval", 6, 6.5, 5.0, "exit", 0.61),
    ("henry", "plots", 7, 3.0, 2.5, "exit", 0.12),
    ("ivan", "simulink-batch", 1, 13.0, 11.0, "exit", 0.88),
    (
        "alice",
        "llama3-70b-sft",
        1,
        23.5,
        18.0,
        "over-budget",
        0.97,
    ),
];

/// Writes [`PAST`] into each user's usage file in `dir`, theirs.
fn past_records(dir: &Path) {
    let now = now_ms();
    let ago = |hours: f64| now - (hours * HOUR as f64) as u64;
    for (user, _) in USERS {
        let mut text = String::new();
        for (n, (_, step, gpu, from, to, how, busy)) in
            PAST.iter().enumerate().filter(|(_, p)| p.0 == user)
        {
            let job = format!("past-{n}");
            let seconds = ((from - to) * 3600.0) as u64;
            let computing = (seconds as f64 * busy) as u64;
            text += &start_line(
                &job,
                step,
                &[&format!("gpu:{gpu}")],
                &[*gpu],
                ago(*from),
                40,
                None,
            );
            text += &end_line(
                &job,
                ago(*to),
                how,
                computing,
                seconds - computing,
                seconds,
                None,
            );
        }
        if text.is_empty() {
            continue;
        }
        let file = dir.join(format!("{}.jsonl", uid(user)));
        std::fs::write(&file, text).unwrap();
        std::os::unix::fs::chown(&file, Some(uid(user)), Some(uid(user))).unwrap();
    }
}

/// A worker on a GPU: its GPU, the tag of its pid file, its MiB, and its
/// MIG instance (GPU and compute instance ids).
type Worker = (u32, &'static str, u64, Option<(u32, u32)>);

const PROCESSES: [Worker; 9] = [
    (0, "alice-0", 134_144, None),
    (1, "alice-1", 132_608, None),
    (2, "carol", 59_392, None),
    (2, "dave", 19_968, None),
    (3, "bob", 65_536, None),
    (3, "mallory", 6_144, None),
    (5, "frank", 22_016, None),
    (6, "grace", 40_448, Some((1, 0))),
    (7, "henry", 3_072, None),
];

/// The fake NVML's scenario; with `busy`, the memory in use and a
/// `@PIDn@` per worker, in [`PROCESSES`] order.
fn scenario(busy: bool) -> String {
    let mut text = String::from("driver 580.159.04\n");
    for (index, used, util) in GPUS {
        let (used, util) = if busy { (used, util) } else { (0, 0) };
        text += &format!(
            "gpu {index} GPU-{index:x}3a1c7e2-5b9d-4f60-8e2a-1c4d7f9b0e3{index} {H200} {used} {util} NVIDIA H200\n"
        );
        text += &format!(
            "mig {index} {} {} 7\n",
            u8::from(index == 6),
            u8::from(index == 6)
        );
    }
    let instance_used = if busy { 40_960 } else { 0 };
    text += &format!(
        "instance 6 0 1 0 MIG-6f1e0d2c-3b4a-5968-8776-a5b4c3d2e1f0 69632 {instance_used} NVIDIA H200 MIG 3g.71gb\n\
         instance 6 1 2 0 MIG-6a7b8c9d-0e1f-5a2b-9c3d-4e5f6a7b8c9d 69632 0 NVIDIA H200 MIG 3g.71gb\n"
    );
    if busy {
        for (n, (gpu, _, mib, mig)) in PROCESSES.iter().enumerate() {
            let place = mig.map_or(String::new(), |(gi, ci)| format!(" {gi} {ci}"));
            text += &format!("process {gpu} @PID{}@ {mib}{place}\n", n + 1);
        }
    }
    text
}

struct Stage<'a> {
    s: &'a Scratch,
    library: &'a Path,
    /// Each GPU's utilisation as the jobs' samplers read it.
    util: &'a Path,
    jobs: Vec<Killed>,
}

impl Stage<'_> {
    /// `devlock ARGS -- sh -c ...` as `user`, its clock `ago` seconds back;
    /// its worker (`sleep`) writes its pid to `TAG.pid`. Waits for the hold
    /// unless `waits`.
    fn job(&mut self, user: &str, ago: u64, tag: &str, args: &[&str], waits: bool) {
        let pidfile = self.s.work(&format!("{tag}.pid"));
        let ready = self.s.work(&format!("{tag}.ready"));
        // On the server's host name, so that the usage records of the
        // holds name the host the server reads them on (a hold that runs
        // elsewhere is not running here).
        let mut cmd = Command::new("unshare");
        cmd.args(["--uts", "sh", "-c"])
            .arg(format!("hostname {HOST} && exec \"$0\" \"$@\""))
            .args([
                "setpriv",
                &format!("--reuid={}", uid(user)),
                &format!("--regid={}", uid(user)),
                "--clear-groups",
                "--",
                "faketime",
            ]);
        cmd.args(["-f", &format!("-{ago}"), BIN])
            .args(args)
            .args(["--", "sh", "-c"])
            .arg(format!(
                "sleep 100000 & echo $! > {pid}.tmp; mv {pid}.tmp {pid}; echo > {ready}; wait",
                pid = pidfile.display(),
                ready = ready.display()
            ))
            .env("DEVLOCK_DIR", self.s.dir())
            .env("DEVLOCK_NVML", self.library)
            .env("DEVLOCK_USAGE_DIR", self.s.usage_dir())
            .env("FAKE_NVML_UTIL", self.util)
            .env("FAKE_NVML_PROCESSES", self.s.work("processes"))
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("HOME", "/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd.process_group(0);
        self.jobs.push(Killed(cmd.spawn().unwrap()));
        if !waits {
            wait_for_file(&ready);
        }
    }

    /// Waits until `resource` has `n` registered waiters.
    fn in_line(&self, resource: &str, n: usize) {
        self.s
            .wait_for_status(resource, "the line", |v| registered_waiters(v) == n);
    }

    /// A process outside any gate, as `user`, called `name` (a copy of
    /// sleep(1), for the kernel's process name).
    fn stranger(&mut self, user: &str, tag: &str, name: &str) {
        let program = self.s.work(name);
        std::fs::copy(which("sleep"), &program).unwrap();
        let mut cmd = as_user(uid(user), "sh");
        let pidfile = self.s.work(&format!("{tag}.pid"));
        cmd.args([
            "-c",
            &format!(
                "{} 100000 & echo $! > {p}.tmp; mv {p}.tmp {p}; wait",
                program.display(),
                p = pidfile.display()
            ),
        ]);
        cmd.process_group(0);
        self.jobs.push(Killed(cmd.spawn().unwrap()));
        wait_for_file(&pidfile);
    }
}

impl Drop for Stage<'_> {
    /// Ends the devlocks first (each job's group: faketime and its
    /// devlock), so that none in line is let in to start its command, then
    /// the workers, whose shells then end.
    fn drop(&mut self) {
        for job in &self.jobs {
            // SAFETY: kill(2) of a process group this test started.
            unsafe { libc::kill(-(job.id() as i32), libc::SIGKILL) };
        }
        for entry in std::fs::read_dir(self.s.root.path().join("work"))
            .unwrap()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".pid")
                && let Ok(pid) = std::fs::read_to_string(entry.path())
                    .unwrap()
                    .trim()
                    .parse()
            {
                // SAFETY: kill(2) of a worker this test started.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }
}

test!(doc_screenshot, ignored: "on request: writes doc/serve.png", needs: [Root, Tool("setpriv"), Tool("unshare"), Tool("faketime"), Tool("cc"), Tool("chromium-headless-shell")]);
pub(crate) fn doc_screenshot() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario(false));
    let setup = s
        .devlock()
        .env("DEVLOCK_NVML", &library)
        .args([
            "setup",
            "--idle-timeout",
            "4h",
            "--gpus",
            "dataset-imagenet",
            "licence-matlab",
        ])
        .output()
        .unwrap();
    assert!(setup.status.success(), "{}", stderr(&setup));
    past_records(&s.usage_dir());
    let util = s.work("util");
    let utils: String = GPUS.iter().map(|(i, _, u)| format!("{i} {u}\n")).collect();
    std::fs::write(&util, utils).unwrap();
    let mut stage = Stage {
        s: &s,
        library: &library,
        util: &util,
        jobs: Vec::new(),
    };
    stage_the_scene(&mut stage);
    let pids = worker_pids(&s);
    show_the_workers(&s, &library, &pids);
    let server = serve_as_the_machine(&s, &library, &pids);
    let chromium = which("chromium-headless-shell");
    let png = artefact("serve-doc.png");
    screenshot(
        &chromium,
        &s.work("chromium"),
        &server.url("/"),
        &png,
        (1600, 1640),
    );
    std::fs::copy(&png, format!("{REPO}/doc/serve.png")).unwrap();
    eprintln!("wrote {REPO}/doc/serve.png");
    drop(server);
    drop(stage);
}

/// The scene the picture shows: each user's jobs, lines and strangers.
fn stage_the_scene(stage: &mut Stage) {
    let gib = |n: u64| format!("{}MiB", n * GIB);
    stage.job(
        "alice",
        18720,
        "alice",
        &["--step", "llama3-70b-sft", "gpu:0", "gpu:1"],
        false,
    );
    stage.job(
        "bob",
        2460,
        "bob-eval",
        &["--step", "eval-harness", "gpu:0"],
        true,
    );
    stage.in_line("gpu:0", 1);
    stage.job(
        "carol",
        12000,
        "carol",
        &["--step", "vllm-serve", "--mem", &gib(60), "gpu:2"],
        false,
    );
    stage.job(
        "dave",
        1500,
        "dave",
        &["--step", "embed-batch", "--mem", &gib(20), "gpu:2"],
        false,
    );
    stage.job(
        "erin",
        720,
        "erin",
        &["--step", "finetune-13b", "--mem", &gib(64), "gpu:2"],
        true,
    );
    stage.in_line("gpu:2", 1);
    stage.job(
        "bob",
        3900,
        "bob",
        &["--step", "sweep-lr-3e-4", "gpu:3"],
        false,
    );
    stage.job(
        "frank",
        10800,
        "frank",
        &["--step", "notebook", "gpu:5"],
        false,
    );
    stage.job(
        "grace",
        2880,
        "grace",
        &["--step", "mig-eval", "gpu:6:3g.71gb:gi1.ci0"],
        false,
    );
    stage.job(
        "alice",
        7200,
        "alice-pre",
        &["--step", "preprocess", "--shared", "dataset-imagenet"],
        false,
    );
    stage.job(
        "bob",
        3000,
        "bob-tok",
        &["--step", "tokenize", "--shared", "dataset-imagenet"],
        false,
    );
    stage.job(
        "ivan",
        5400,
        "ivan",
        &["--step", "simulink-batch", "licence-matlab"],
        false,
    );
    stage.job(
        "henry",
        180,
        "henry-report",
        &["--step", "matlab-report", "licence-matlab"],
        true,
    );
    stage.in_line("licence-matlab", 1);
    stage.stranger("mallory", "mallory", "python3");
    stage.stranger("henry", "henry", "jupyter-lab");
}

/// The workers' pids, in PROCESSES order ("alice-0" and "alice-1" are
/// alice's one job on two GPUs: its worker and the shell around it).
fn worker_pids(s: &Scratch) -> Vec<u32> {
    let pid = |tag: &str| pid_in(&s.work(&format!("{tag}.pid")));
    let alice = pid("alice");
    PROCESSES
        .iter()
        .map(|(_, tag, _, _)| match *tag {
            "alice-0" => alice,
            "alice-1" => parent_of(alice),
            tag => pid(tag),
        })
        .collect()
}

/// From now on the jobs' samplers see their workers: every holder but the
/// notebook on gpu:5 (which computes nothing) is busy again at its next
/// sample.
fn show_the_workers(s: &Scratch, library: &Path, pids: &[u32]) {
    std::fs::write(library.with_file_name("scenario"), scenario(true)).unwrap();
    let processes: String = PROCESSES
        .iter()
        .zip(pids)
        .map(|((gpu, _, mib, _), pid)| format!("{gpu} {pid} {mib}\n"))
        .collect();
    let listed = s.work("processes.tmp");
    std::fs::write(&listed, processes).unwrap();
    std::fs::rename(&listed, s.work("processes")).unwrap();
    poll_until(
        "only the notebook idle",
        || {
            let json = s.status_json(&[]);
            let mut idle: Vec<String> = json["resources"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r["holders"].as_array().unwrap().clone())
                .filter(|h| h.get("idle_for_ms").is_some())
                .map(|h| h["step"].as_str().unwrap_or("?").to_owned())
                .collect();
            idle.sort();
            idle.dedup();
            serde_json::json!(idle)
        },
        |idle| idle == &serde_json::json!(["notebook"]),
    );
}

/// The server, with the users' names and the machine's in namespaces of its
/// own.
fn serve_as_the_machine(s: &Scratch, library: &Path, pids: &[u32]) -> Server {
    let mut passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    for (name, uid) in USERS {
        passwd += &format!("{name}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n");
    }
    let passwd_file = s.work("passwd");
    std::fs::write(&passwd_file, passwd).unwrap();
    let mut serve = Command::new("unshare");
    serve
        .args(["--mount", "--uts", "sh", "-c"])
        .arg(format!(
            "hostname {HOST} && mount --bind {} /etc/passwd && mount -t tmpfs tmpfs /run/lock \
             && mkdir /run/lock/devlock && mount --bind {} /run/lock/devlock \
             && mount -t tmpfs tmpfs /var/lib && mkdir -p /var/lib/devlock/usage \
             && mount --bind {} /var/lib/devlock/usage && exec \"$0\" \"$@\"",
            passwd_file.display(),
            s.dir().display(),
            s.usage_dir().display()
        ))
        .arg(BIN)
        .env_remove("DEVLOCK_DIR")
        .env_remove("DEVLOCK_USAGE_DIR")
        .env("DEVLOCK_NVML", library)
        .env("FAKE_NVML_PIDS", pid_list(pids));
    Server::start(&mut serve, &[])
}

/// A process's parent, from /proc.
fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}
