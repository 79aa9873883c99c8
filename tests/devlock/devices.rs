//! GPUs beside the locks, with a recorded fake nvidia-smi: gated and ungated
//! processes, unknown fields, a failing and a hanging probe, no probe at all,
//! and --require-idle.

use std::path::PathBuf;
use std::process::{Command, Output};
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
        .env("FAKE_SMI_PIDS", pid_list(pids));
    cmd
}

test!(status_shows_each_gpu_and_who_is_inside_the_gate, needs: []);
pub(crate) fn status_shows_each_gpu_and_who_is_inside_the_gate() {
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

test!(unknown_fields_stay_unknown, needs: []);
pub(crate) fn unknown_fields_stay_unknown() {
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

test!(idle_gpus_list_no_processes, needs: []);
pub(crate) fn idle_gpus_list_no_processes() {
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

test!(a_failing_probe_makes_devices_unknown_not_free, needs: []);
pub(crate) fn a_failing_probe_makes_devices_unknown_not_free() {
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

test!(a_hanging_probe_is_killed_at_the_timeout, needs: []);
pub(crate) fn a_hanging_probe_is_killed_at_the_timeout() {
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

test!(without_nvidia_smi_there_is_quietly_no_device_information, needs: []);
pub(crate) fn without_nvidia_smi_there_is_quietly_no_device_information() {
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

test!(require_idle_refuses_a_gpu_with_work_outside_the_gate, needs: []);
pub(crate) fn require_idle_refuses_a_gpu_with_work_outside_the_gate() {
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
    let user = devlock::testing::procfs::user_name(nix::unistd::getuid().as_raw());
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

test!(require_idle_passes_an_idle_gpu_and_small_users_under_the_threshold, needs: []);
pub(crate) fn require_idle_passes_an_idle_gpu_and_small_users_under_the_threshold() {
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

test!(require_idle_fails_when_the_gpu_cannot_be_checked, needs: []);
pub(crate) fn require_idle_fails_when_the_gpu_cannot_be_checked() {
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

test!(work_inside_the_gate_does_not_count_against_idle, needs: []);
pub(crate) fn work_inside_the_gate_does_not_count_against_idle() {
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

test!(acquiring_without_require_idle_never_runs_the_probe, needs: []);
pub(crate) fn acquiring_without_require_idle_never_runs_the_probe() {
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

/// `devlock ARGS -- sh -c 'echo $DEVLOCK_RESOURCES $CUDA_VISIBLE_DEVICES'`
/// with the caller's `CUDA_VISIBLE_DEVICES` set to `visible`.
fn under_visible(s: &Scratch, visible: &str, args: &[&str]) -> Output {
    with_smi(s, "several", &[])
        .env("CUDA_VISIBLE_DEVICES", visible)
        .args(args)
        .args([
            "--",
            "sh",
            "-c",
            "echo $DEVLOCK_RESOURCES $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER",
        ])
        .output()
        .unwrap()
}

test!(the_callers_cuda_visible_devices_is_respected, needs: []);
pub(crate) fn the_callers_cuda_visible_devices_is_respected() {
    let s = Scratch::new();
    // --any skips the candidates outside the caller's set.
    let any = under_visible(&s, "2,3", &["--any", "gpu:0", "gpu:1", "gpu:2", "gpu:3"]);
    assert_eq!(
        stdout(&any).trim(),
        "gpu:2 2 PCI_BUS_ID",
        "{}",
        stderr(&any)
    );
    // A GPU outside it is a usage error naming both.
    let outside = under_visible(&s, "2,3", &["gpu:0"]);
    assert_eq!(outside.status.code(), Some(2));
    let err = stderr(&outside);
    assert!(
        err.contains("gpu:0 is outside CUDA_VISIBLE_DEVICES=2,3") && err.contains("gpu:2 or gpu:3"),
        "{err}"
    );
    assert!(stdout(&outside).is_empty());
    let none_inside = under_visible(&s, "2,3", &["--any", "gpu:0", "gpu:1"]);
    assert_eq!(none_inside.status.code(), Some(2));
    assert!(
        stderr(&none_inside).contains("none of gpu:0, gpu:1 is inside CUDA_VISIBLE_DEVICES=2,3"),
        "{}",
        stderr(&none_inside)
    );
    // UUIDs (and unique prefixes of them) are mapped through the probe:
    // GPU-c47a0e93... is GPU 2 in the fixture. The child is told the
    // physical index, with the order that makes it mean what nvidia-smi says.
    let uuid = under_visible(
        &s,
        "GPU-c47a0e93,GPU-2d8f5b17-a9c4-4e3b-9d62-4f0e1a7b8c33",
        &["gpu:3"],
    );
    assert_eq!(
        stdout(&uuid).trim(),
        "gpu:3 3 PCI_BUS_ID",
        "{}",
        stderr(&uuid)
    );
    let by_uuid_outside = under_visible(&s, "GPU-c47a0e93", &["gpu:0"]);
    assert_eq!(by_uuid_outside.status.code(), Some(2));
    assert!(
        stderr(&by_uuid_outside).contains("outside CUDA_VISIBLE_DEVICES=GPU-c47a0e93 (GPU 2)"),
        "{}",
        stderr(&by_uuid_outside)
    );
    let unknown = under_visible(&s, "GPU-ffffffff", &["gpu:0"]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(stderr(&unknown).contains("which nvidia-smi does not list"));
    // The whole group and other resources are not restricted.
    let whole = under_visible(&s, "2,3", &["gpu", "dataset"]);
    assert_eq!(
        stdout(&whole).trim(),
        "dataset gpu 2,3",
        "{}",
        stderr(&whole)
    );
}

test!(several_gpus_are_exported_in_numeric_order, needs: []);
pub(crate) fn several_gpus_are_exported_in_numeric_order() {
    let s = Scratch::new();
    let out = s.run(&[
        "gpu:10",
        "gpu:2",
        "--",
        "sh",
        "-c",
        "echo $CUDA_VISIBLE_DEVICES",
    ]);
    assert_eq!(stdout(&out).trim(), "2,10", "{}", stderr(&out));
}

test!(indices_in_cuda_visible_devices_never_run_the_probe, needs: []);
pub(crate) fn indices_in_cuda_visible_devices_never_run_the_probe() {
    let s = Scratch::new();
    let pidfile = s.work("smi-pids");
    let out = with_smi(&s, "several", &[])
        .env("FAKE_SMI_PIDFILE", &pidfile)
        .env("CUDA_VISIBLE_DEVICES", "0,1")
        .args(["gpu:1", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!pidfile.exists(), "nvidia-smi was started");
}

test!(a_nested_devlock_stays_inside_the_gpus_its_job_was_given, needs: []);
pub(crate) fn a_nested_devlock_stays_inside_the_gpus_its_job_was_given() {
    let s = Scratch::new();
    let out = s.run(&["gpu:3", "--", BIN, "-n", "gpu:2", "--", "echo", "ran"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gpu:2 is outside CUDA_VISIBLE_DEVICES=3"),
        "{}",
        stderr(&out)
    );
    let same = s.run(&[
        "gpu:3",
        "--",
        BIN,
        "-n",
        "gpu:3",
        "--",
        "sh",
        "-c",
        "echo $CUDA_VISIBLE_DEVICES",
    ]);
    assert_eq!(stdout(&same).trim(), "3", "{}", stderr(&same));
}

test!(require_idle_with_any_takes_the_first_candidate_that_is_free_and_idle, needs: []);
pub(crate) fn require_idle_with_any_takes_the_first_candidate_that_is_free_and_idle() {
    let s = Scratch::new();
    let stranger = Stranger::start();
    // In the fixture, GPU 0 runs the stranger outside any gate; GPU 1 is
    // empty; GPUs 2 and 3 run it too.
    let pids = [stranger.pid(); 4];
    let out = with_smi(&s, "several", &pids)
        .args(["--require-idle", "--any", "gpu:0", "gpu:1", "--"])
        .args(["sh", "-c", "echo $DEVLOCK_RESOURCES"])
        .output()
        .unwrap();
    assert_eq!(stdout(&out).trim(), "gpu:1", "{}", stderr(&out));
    // gpu:1 busy with a devlock job, gpu:0 free but not idle: waits for
    // gpu:1 rather than refusing or taking gpu:0.
    let mut holder = hold_until_released(&s, &["--step", "other", "gpu:1"], "h");
    let mut waiter = with_smi(&s, "several", &pids)
        .args(["--require-idle", "--any", "gpu:0", "gpu:1", "--"])
        .args(["sh", "-c", "echo $DEVLOCK_RESOURCES"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("gpu:1"), 1);
    assert!(flock_is_free(&s.lock_path("gpu:0")), "gpu:0 was not taken");
    release(&s, "h");
    wait_child(&mut holder);
    assert!(wait_child(&mut waiter).success());
    let mut got = String::new();
    std::io::Read::read_to_string(&mut waiter.stdout.take().unwrap(), &mut got).unwrap();
    assert_eq!(got.trim(), "gpu:1");
    // None idle: exit 69 at once, naming why.
    let none = with_smi(&s, "several", &pids)
        .args(["--require-idle", "--any", "gpu:0", "gpu:2", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(69), "{}", stderr(&none));
    let err = stderr(&none);
    assert!(
        err.contains("none of them is idle")
            && err.contains("gpu:0 is not idle")
            && err.contains("gpu:2 is not idle"),
        "{err}"
    );
}
