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
//! mounted at /run/lock/devlock, with the host name `dgx-h200-01` in a UTS
//! namespace); the holds and waits are hours old because each devlock is
//! started under faketime(1) with its clock set back (the server's clock is
//! the real one); the GPUs' memory and processes are a scenario of the fake
//! NVML, written twice: empty while the jobs are admitted (their devlocks
//! see no memory in use, so the budgets go in), then with every worker's
//! real pid for the server. Everything else is devlock as it runs.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::harness::*;
use crate::nvml::fake_nvml;
use crate::serve::{Server, artefact, screenshot, which};

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
    jobs: Vec<Killed>,
}

impl Stage<'_> {
    /// `devlock ARGS -- sh -c ...` as `user`, its clock `ago` seconds back;
    /// its worker (`sleep`) writes its pid to `TAG.pid`. Waits for the hold
    /// unless `waits`.
    fn job(&mut self, user: &str, ago: u64, tag: &str, args: &[&str], waits: bool) {
        let pidfile = self.s.work(&format!("{tag}.pid"));
        let ready = self.s.work(&format!("{tag}.ready"));
        let mut cmd = as_user(uid(user), "faketime");
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
        .args(["setup", "--gpus", "dataset-imagenet", "licence-matlab"])
        .output()
        .unwrap();
    assert!(setup.status.success(), "{}", stderr(&setup));
    let mut stage = Stage {
        s: &s,
        library: &library,
        jobs: Vec::new(),
    };
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
        183600,
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
    // The workers' pids, in PROCESSES order ("alice-0" and "alice-1" are
    // alice's one job on two GPUs: its worker and the shell around it).
    let pid = |tag: &str| pid_in(&s.work(&format!("{tag}.pid")));
    let alice = pid("alice");
    let pids: Vec<u32> = PROCESSES
        .iter()
        .map(|(_, tag, _, _)| match *tag {
            "alice-0" => alice,
            "alice-1" => parent_of(alice),
            tag => pid(tag),
        })
        .collect();
    std::fs::write(library.with_file_name("scenario"), scenario(true)).unwrap();
    // The server: the users' names and the machine's in namespaces of its own.
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
            "hostname dgx-h200-01 && mount --bind {} /etc/passwd && mount -t tmpfs tmpfs /run/lock \
             && mkdir /run/lock/devlock && mount --bind {} /run/lock/devlock && exec \"$0\" \"$@\"",
            passwd_file.display(),
            s.dir().display()
        ))
        .arg(BIN)
        .env_remove("DEVLOCK_DIR")
        .env("DEVLOCK_NVML", &library)
        .env("FAKE_NVML_PIDS", pid_list(&pids));
    let server = Server::start(&mut serve, &[]);
    let chromium = which("chromium-headless-shell");
    let png = artefact("serve-doc.png");
    screenshot(
        &chromium,
        &s.work("chromium"),
        &server.url("/"),
        &png,
        (1600, 985),
    );
    std::fs::copy(&png, format!("{REPO}/doc/serve.png")).unwrap();
    eprintln!("wrote {REPO}/doc/serve.png");
    drop(server);
    drop(stage);
}

/// A process's parent, from /proc.
fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}
