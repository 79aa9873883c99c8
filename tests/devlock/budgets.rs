//! `--mem`: sharing one GPU by memory budget, with a fake nvidia-smi whose
//! memory the jobs themselves play (a job "allocates" by writing a file
//! naming its pid): admission, fairness, the whole device, foreign memory,
//! kill -9, staggered start, the over-budget watch, `--any`, and every
//! failure.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

use crate::harness::*;

mod sharing;
mod strangers;
mod table;
mod watch;

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

/// Whether one line of a status table holds every one of `words` (a
/// holder's step, and its figures in the BUDGET column).
fn row_with(table: &str, words: &[&str]) -> bool {
    table.lines().any(|l| words.iter().all(|w| l.contains(w)))
}
