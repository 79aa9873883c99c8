//! GPUs beside the locks, with a recorded fake nvidia-smi: gated and ungated
//! processes, unknown fields, a failing and a hanging probe, no probe at all,
//! and --require-idle.

use std::path::PathBuf;
use std::process::{Child, Command, Output};
use std::time::Instant;

use crate::harness::*;

fn fake_smi() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nvidia-smi/fake-nvidia-smi")
}

/// devlock with the fake nvidia-smi playing `scenario`, naming `pids` as the
/// processes on the GPUs.
fn with_smi(s: &Scratch, scenario: &str, pids: &[u32]) -> Command {
    let mut cmd = s.devlock();
    cmd.env("DEVLOCK_NVIDIA_SMI", fake_smi())
        .env("FAKE_SMI_SCENARIO", scenario)
        .env(
            "FAKE_SMI_PIDS",
            pids.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" "),
        );
    cmd
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A process outside any gate, standing in for someone's notebook.
struct Stranger(Child);

impl Stranger {
    fn start() -> Stranger {
        Stranger(Command::new("sleep").arg("1000").spawn().unwrap())
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn status_shows_each_gpu_and_who_is_inside_the_gate() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let pidfile = s.work("pid");
    let mut holder = s.hold(
        &["--step", "train", "gpu:0"],
        &format!(
            "sleep 1000 & echo $! > {pid}; echo > {ready}; while [ ! -e {release} ]; do sleep 0.01; done; kill $!",
            pid = pidfile.display(),
            ready = ready.display(),
            release = release.display()
        ),
        &ready,
    );
    let trainer = pid_in(&pidfile);
    let stranger = Stranger::start();
    let pids = [trainer, stranger.pid(), stranger.pid(), 4_000_000];
    let json = json_of(
        &with_smi(&s, "several", &pids)
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(json["device_info"]["status"], "ok");
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 4);
    let gpu0 = &devices[0];
    assert_eq!(
        (gpu0["index"].as_u64(), gpu0["name"].as_str()),
        (Some(0), Some("NVIDIA H100 80GB HBM3"))
    );
    assert_eq!(
        (
            gpu0["memory_used_mib"].as_u64(),
            gpu0["memory_total_mib"].as_u64()
        ),
        (Some(38925), Some(81559))
    );
    assert_eq!(gpu0["utilization_pct"], 97);
    let p = &gpu0["processes"][0];
    assert_eq!(
        (p["pid"].as_u64(), p["gated"].as_bool()),
        (Some(u64::from(trainer)), Some(true))
    );
    assert_eq!(p["gate"], "gpu:0");
    assert_eq!(p["used_mib"], 38912);
    assert!(!p["user"].is_null());
    let gpu2 = &devices[2]["processes"];
    assert_eq!(gpu2[0]["gated"], false);
    assert_eq!(
        gpu2[1]["name"], "python3 -c import a,b",
        "a comma in a name survives"
    );
    // The holder's footprint, for spotting a hung job.
    let gpu0_lock = json["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "gpu:0")
        .unwrap();
    let holder_view = &gpu0_lock["holders"][0];
    assert_eq!(holder_view["devices"][0]["used_mib"], 38912);
    assert_eq!(holder_view["devices"][0]["utilization_pct"], 97);

    let table = stdout(
        &with_smi(&s, "several", &pids)
            .arg("status")
            .output()
            .unwrap(),
    );
    assert!(table.contains("NOT GATED"), "{table}");
    assert!(
        table.contains(&format!(
            "warning: pid {} (/usr/bin/python3, ",
            stranger.pid()
        )),
        "ungated processes are called out:\n{table}"
    );
    assert!(table.contains("0: 38.0 GiB, 97%"), "{table}");
    std::fs::write(&release, "").unwrap();
    wait_child(&mut holder);
}

#[test]
fn unknown_fields_stay_unknown() {
    let s = Scratch::new();
    let json = json_of(
        &with_smi(&s, "na", &[])
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    let devices = json["devices"].as_array().unwrap();
    assert!(
        devices.iter().any(|d| d["memory_used_mib"].is_null()),
        "{json}"
    );
    assert!(
        devices.iter().any(|d| d["utilization_pct"].is_null()),
        "{json}"
    );
    let procs: Vec<_> = devices
        .iter()
        .flat_map(|d| d["processes"].as_array().unwrap().clone())
        .collect();
    assert!(procs.iter().any(|p| p["used_mib"].is_null()), "{json}");
    let table = stdout(&with_smi(&s, "na", &[]).arg("status").output().unwrap());
    assert!(table.contains("? / "), "{table}");
}

#[test]
fn idle_gpus_list_no_processes() {
    let s = Scratch::new();
    let json = json_of(
        &with_smi(&s, "idle", &[])
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    assert!(
        devices
            .iter()
            .all(|d| d["processes"].as_array().unwrap().is_empty())
    );
}

#[test]
fn a_failing_probe_makes_devices_unknown_not_free() {
    let s = Scratch::new();
    let json = json_of(
        &with_smi(&s, "fail", &[])
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(json["device_info"]["status"], "unknown");
    assert!(
        json["device_info"]["reason"]
            .as_str()
            .unwrap()
            .contains("status 9"),
        "{json}"
    );
    let table = stdout(&with_smi(&s, "fail", &[]).arg("status").output().unwrap());
    assert!(
        table.contains("GPUs: unknown (nvidia-smi exited with status 9"),
        "{table}"
    );
}

#[test]
fn a_hanging_probe_is_killed_at_the_timeout() {
    let s = Scratch::new();
    let pidfile = s.work("smi-pids");
    let started = Instant::now();
    let out = with_smi(&s, "hang", &[])
        .env("FAKE_SMI_PIDFILE", &pidfile)
        .args(["--probe-timeout", "300ms", "status", "--json"])
        .output()
        .unwrap();
    assert!(started.elapsed() < HANG);
    let json = json_of(&out);
    assert_eq!(json["device_info"]["status"], "unknown");
    assert!(
        json["device_info"]["reason"]
            .as_str()
            .unwrap()
            .contains("within 300ms"),
        "{json}"
    );
    for pid in std::fs::read_to_string(&pidfile)
        .unwrap()
        .split_whitespace()
    {
        wait_gone(pid.parse().unwrap());
    }
}

#[test]
fn without_nvidia_smi_there_is_quietly_no_device_information() {
    let s = Scratch::new();
    let empty = s.work("empty-path");
    std::fs::create_dir(&empty).unwrap();
    let out = s
        .devlock()
        .env_remove("DEVLOCK_NVIDIA_SMI")
        .env("PATH", &empty)
        .args(["status", "--json"])
        .output()
        .unwrap();
    let json = json_of(&out);
    assert_eq!(json["device_info"]["status"], "none");
    assert!(stderr(&out).is_empty());
    let out = s
        .devlock()
        .env_remove("DEVLOCK_NVIDIA_SMI")
        .env("PATH", &empty)
        .arg("status")
        .output()
        .unwrap();
    assert!(!stdout(&out).contains("GPU"), "{}", stdout(&out));
}

#[test]
fn require_idle_refuses_a_gpu_with_work_outside_the_gate() {
    let s = Scratch::new();
    let stranger = Stranger::start();
    let ran = s.work("ran");
    let out = with_smi(&s, "several", &[stranger.pid()])
        .args(["--require-idle", "gpu:0", "--", "touch"])
        .arg(&ran)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    let err = stderr(&out);
    let user = devlock::procfs::user_name(nix::unistd::getuid().as_raw());
    assert_eq!(
        err.trim(),
        format!(
            "devlock: gpu:0 is not idle: pid {} (python3, {user}) holds 38.0 GiB on it without holding the lock; \
             not starting. Stop it or run without --require-idle.",
            stranger.pid()
        )
    );
    assert!(!ran.exists());
    assert!(
        flock_is_free(&s.lock_path("gpu:0")),
        "released before exiting"
    );
}

#[test]
fn require_idle_passes_an_idle_gpu_and_small_users_under_the_threshold() {
    let s = Scratch::new();
    let stranger = Stranger::start();
    let pids = [
        stranger.pid(),
        stranger.pid(),
        stranger.pid(),
        stranger.pid(),
    ];
    let ok = |scenario: &str, args: &[&str]| {
        with_smi(&s, scenario, &pids)
            .args(args)
            .args(["--", "true"])
            .output()
            .unwrap()
    };
    assert!(ok("idle", &["--require-idle", "gpu:1"]).status.success());
    assert!(
        ok("several", &["--require-idle", "gpu:1"]).status.success(),
        "gpu 1 has no processes"
    );
    let small = ok("several", &["--require-idle", "gpu:3"]);
    assert_eq!(
        small.status.code(),
        Some(69),
        "1014 MiB is over the 256 MiB default"
    );
    assert!(
        ok(
            "several",
            &["--require-idle", "--idle-threshold", "2GiB", "gpu:3"]
        )
        .status
        .success()
    );
    let whole = ok("several", &["--require-idle", "gpu"]);
    assert_eq!(whole.status.code(), Some(69), "the group maps to every GPU");
}

#[test]
fn require_idle_fails_when_the_gpu_cannot_be_checked() {
    let s = Scratch::new();
    for (scenario, want) in [("fail", "status 9"), ("hang", "within 200ms")] {
        let out = with_smi(&s, scenario, &[])
            .args([
                "--probe-timeout",
                "200ms",
                "--require-idle",
                "gpu:0",
                "--",
                "true",
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(69), "{scenario}");
        assert!(stderr(&out).contains(want), "{scenario}: {}", stderr(&out));
    }
    let empty = s.work("empty-path");
    std::fs::create_dir(&empty).unwrap();
    let out = s
        .devlock()
        .env("PATH", &empty)
        .args(["--require-idle", "gpu:0", "--", "/bin/true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69));
    assert!(
        stderr(&out).contains("no nvidia-smi found"),
        "{}",
        stderr(&out)
    );
    let missing = with_smi(&s, "idle", &[])
        .args(["--require-idle", "gpu:7", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(69));
    assert!(stderr(&missing).contains("GPU 7"), "{}", stderr(&missing));
    let not_gpu = with_smi(&s, "idle", &[])
        .args(["--require-idle", "dataset", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(not_gpu.status.code(), Some(2));
}

#[test]
fn work_inside_the_gate_does_not_count_against_idle() {
    // The outer job holds gpu:0 and has a process on it; a nested devlock
    // with --require-idle sees that process as its own.
    let s = Scratch::new();
    let ran = s.work("ran");
    let script = format!(
        "sleep 1000 & p=$!; FAKE_SMI_PIDS=$p {bin} --require-idle gpu:0 -- touch {ran}; rc=$?; kill $p; exit $rc",
        bin = BIN,
        ran = ran.display()
    );
    let out = with_smi(&s, "several", &[])
        .args(["gpu:0", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(ran.exists());
}

#[test]
fn acquiring_without_require_idle_never_runs_the_probe() {
    let s = Scratch::new();
    let pidfile = s.work("smi-pids");
    let out = with_smi(&s, "hang", &[])
        .env("FAKE_SMI_PIDFILE", &pidfile)
        .args(["gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!pidfile.exists(), "nvidia-smi was started");
}
