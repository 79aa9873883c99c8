//! A lock directory shared with a container: a PID namespace with a mount
//! namespace and its own /proc (`unshare --pid --fork --mount-proc`), the
//! directory the same one on both sides, as a bind mount gives a container.
//! One gate either way; each side names the other's holders as well as it
//! can; NVML's host pids mapped into the container.

use std::process::{Child, Command, Stdio};

use crate::harness::*;
use crate::nvml::{fake_nvml, scenario};

/// `devlock ARGS` started inside a fresh PID and mount namespace with its
/// own /proc, sharing the scratch directory.
fn in_container(s: &Scratch, args: &[&str]) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", BIN])
        .args(args)
        .env("DEVLOCK_DIR", s.dir())
        .env("DEVLOCK_NVML", "none")
        .env_remove("CUDA_VISIBLE_DEVICES");
    cmd
}

/// `devlock ARGS` run inside the namespaces of the process `pid`.
fn beside(s: &Scratch, pid: u32, args: &[&str]) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--pid=/proc/{pid}/ns/pid"))
        .arg(format!("--mount=/proc/{pid}/ns/mnt"))
        .arg("--")
        .arg(BIN)
        .args(args)
        .env("DEVLOCK_DIR", s.dir())
        .env("DEVLOCK_NVML", "none")
        .env_remove("CUDA_VISIBLE_DEVICES");
    cmd
}

/// The `NSpid` pids of a process, outermost first.
fn nspids(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

/// The host pid of a descendant of `root` whose command line is `argv`
/// (NUL-separated, as /proc/PID/cmdline has it).
fn descendant_running(root: u32, comm: &str) -> u32 {
    let find = || {
        let mut stack = vec![root];
        while let Some(pid) = stack.pop() {
            if pid != root
                && std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.strip_suffix(b"\0") == Some(comm.as_bytes()))
            {
                return pid;
            }
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            stack.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
        0
    };
    poll_until(&format!("a {comm} under {root}"), find, |pid| *pid != 0)
}

/// A holder inside a container, let go (and its namespace's processes with
/// it) when dropped, so that a failing test leaves nothing running.
struct Contained {
    child: Child,
    release: std::path::PathBuf,
}

impl Contained {
    fn id(&self) -> u32 {
        self.child.id()
    }

    fn finish(mut self) -> bool {
        std::fs::write(&self.release, "").unwrap();
        wait_child(&mut self.child).success()
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.release, "");
        let _ = self.child.wait();
    }
}

fn hold_in_container(s: &Scratch, resource: &str, tag: &str) -> Contained {
    let (script, ready) = wait_for_release(s, tag);
    let child = in_container(s, &["--step", tag, resource, "--", "sh", "-c"])
        .arg(format!("sleep 1000 & {script}; kill $!"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let held = Contained {
        child,
        release: s.work(&format!("release-{tag}")),
    };
    wait_for_file(&ready);
    held
}

test!(a_lock_dir_shared_with_a_container_is_one_gate_named_on_both_sides, needs: [Root, Tool("unshare")]);
pub(crate) fn a_lock_dir_shared_with_a_container_is_one_gate_named_on_both_sides() {
    let s = Scratch::new();
    // A holder inside: the host cannot take it, and names the container.
    let inside = hold_in_container(&s, "gpu:0", "in");
    let out = s.run(&["-n", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(", in PID namespace, pid "),
        "the busy line names the container: {}",
        stderr(&out)
    );
    let json = s.status_json(&["gpu:0"]);
    let view = &json["resources"][0];
    assert_eq!(view["state"], "held", "{json}");
    let holder = &view["holders"][0];
    assert!(
        holder["container"]
            .as_str()
            .is_some_and(|c| c.starts_with("PID namespace, pid ") && c.ends_with(" there")),
        "{json}"
    );
    let table = stdout(&s.run(&["status", "gpu:0"]));
    assert!(table.contains("(in PID namespace, pid "), "{table}");

    // And the container cannot take what the host holds: it says the holder
    // is outside rather than calling the lock free.
    let mut host = hold_until_released(&s, &["dataset"], "host");
    let out = in_container(&s, &["-n", "dataset", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("outside this container"),
        "{}",
        stderr(&out)
    );
    let out = in_container(&s, &["status", "--json", "dataset"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["resources"][0]["state"], "held", "{json}");
    assert_eq!(
        json["resources"][0]["holders"][0]["note"],
        "outside this container or PID namespace"
    );
    release(&s, "host");
    assert!(wait_child(&mut host).success());
    assert!(inside.finish());
    assert!(s.run(&["-n", "gpu:0", "--", "true"]).status.success());
}

test!(nvml_host_pids_are_named_with_their_container_and_never_guessed_inside_one, needs: [Root, Tool("unshare"), Tool("nsenter"), Tool("cc")]);
pub(crate) fn nvml_host_pids_are_named_with_their_container_and_never_guessed_inside_one() {
    let s = Scratch::new();
    let library = fake_nvml(
        &s,
        &format!(
            "{}process 0 @PID1@ 2048\nprocess 1 @PID2@ 1024\n",
            scenario("idle")
        ),
    );
    let inside = hold_in_container(&s, "gpu:0", "in");
    let worker = descendant_running(inside.id(), "sleep\x001000");
    let inner = *nspids(worker).last().unwrap();
    assert_ne!(inner, worker, "the worker is in a PID namespace of its own");
    let outsider = std::process::id();
    // Inside: a host pid cannot be told from a local pid of the same number
    // (the kernel shows a container only its own numbers), so none is taken
    // for one: each is listed by its host pid, never inside a gate, and
    // counts against --require-idle.
    let out = beside(&s, worker, &["status", "--json"])
        .env("DEVLOCK_NVML", &library)
        .env("FAKE_NVML_PIDS", format!("{inner} {outsider}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let on_gpu0 = &json["devices"][0]["processes"][0];
    assert_eq!(on_gpu0["pid"], 0, "{json}");
    assert_eq!(
        on_gpu0["name"],
        format!("[host pid {inner}, not visible inside this container]"),
        "the local process numbered {inner} is not taken for it"
    );
    assert_eq!(on_gpu0["gated"], false);
    let out = beside(&s, worker, &["--require-idle", "gpu:1", "--", "true"])
        .env("DEVLOCK_NVML", &library)
        .env("FAKE_NVML_PIDS", format!("{inner} {outsider}"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    // On the host: NVML's pids are the host's own, and each process on a
    // GPU is named with the container it runs in.
    let out = s
        .devlock()
        .env("DEVLOCK_NVML", &library)
        .env("FAKE_NVML_PIDS", format!("{worker} {outsider}"))
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let on_gpu0 = &json["devices"][0]["processes"][0];
    assert_eq!(on_gpu0["pid"], worker, "{json}");
    assert_eq!(on_gpu0["name"], "sleep");
    assert_eq!(
        on_gpu0["gated"], true,
        "its holder is in the container: {json}"
    );
    assert_eq!(
        on_gpu0["container"],
        format!("PID namespace, pid {inner} there")
    );
    let on_gpu1 = &json["devices"][1]["processes"][0];
    assert_eq!(on_gpu1["pid"], outsider);
    assert!(on_gpu1.get("container").is_none(), "{json}");
    assert!(inside.finish());
}
