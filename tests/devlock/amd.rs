//! AMD GPUs with the recorded fake amd-smi: status, gates, --require-idle,
//! a hanging amd-smi killed at the time limit, and the ROCm variables.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use crate::harness::*;

fn fake_amd_smi() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/amd-smi/fake-amd-smi")
}

fn with_amd(s: &Scratch, scenario: &str, pids: &[u32]) -> Command {
    let mut cmd = s.devlock();
    cmd.env("DEVLOCK_AMD_SMI", fake_amd_smi())
        .env_remove("DEVLOCK_NVIDIA_SMI")
        .env("FAKE_AMDSMI_SCENARIO", scenario)
        .env("FAKE_AMDSMI_PIDS", pid_list(pids));
    cmd
}

test!(status_and_require_idle_through_amd_smi, needs: []);
pub(crate) fn status_and_require_idle_through_amd_smi() {
    let s = Scratch::new();
    let ready = s.work("ready");
    let release = s.work("release");
    let pidfile = s.work("pid");
    let mut holder = with_amd(&s, "several", &[])
        .args(["--step", "train", "gpu:0", "--", "sh", "-c"])
        .arg(format!(
            "sleep 1000 & echo $! > {pid}; echo > {ready}; while [ ! -e {release} ]; do sleep 0.01; done; kill $!",
            pid = pidfile.display(),
            ready = ready.display(),
            release = release.display()
        ))
        .spawn()
        .unwrap();
    wait_for_file(&ready);
    let worker = pid_in(&pidfile);
    let mut stranger = Command::new("sleep").arg("1000").spawn().unwrap();
    let pids = [worker, stranger.id(), stranger.id(), 4_000_000];
    let json = json_of(
        &with_amd(&s, "several", &pids)
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(json["device_source"], "amd-smi", "{json}");
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 4);
    assert_eq!(devices[0]["name"], "AMD Instinct MI300X");
    assert_eq!(devices[0]["memory_used_mib"], 38925);
    let p = &devices[0]["processes"][0];
    assert_eq!(
        (p["pid"].as_u64(), p["gated"].as_bool()),
        (Some(u64::from(worker)), Some(true))
    );
    assert_eq!(devices[2]["processes"][0]["gated"], false);
    let table = stdout(
        &with_amd(&s, "several", &pids)
            .arg("status")
            .output()
            .unwrap(),
    );
    assert!(table.contains("(GPUs as amd-smi reports them)"), "{table}");

    let out = with_amd(&s, "several", &pids)
        .args(["--require-idle", "gpu:2", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("gpu:2 is not idle: pid {}", stranger.id())),
        "{}",
        stderr(&out)
    );
    let out = with_amd(&s, "several", &pids)
        .args(["--require-idle", "gpu:1", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    std::fs::write(&release, "").unwrap();
    wait_child(&mut holder);
    let _ = stranger.kill();
    let _ = stranger.wait();
}

test!(a_hanging_amd_smi_is_killed_at_the_timeout, needs: []);
pub(crate) fn a_hanging_amd_smi_is_killed_at_the_timeout() {
    let s = Scratch::new();
    let pidfile = s.work("amd-pids");
    let started = Instant::now();
    let out = with_amd(&s, "hang", &[])
        .env("FAKE_AMDSMI_PIDFILE", &pidfile)
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
            .contains("amd-smi did not answer within 300ms"),
        "{json}"
    );
    for pid in std::fs::read_to_string(&pidfile)
        .unwrap()
        .split_whitespace()
    {
        wait_gone(pid.parse().unwrap());
    }
    let out = with_amd(&s, "fail", &[])
        .args(["--require-idle", "gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("amd-smi exited with status 255"),
        "{}",
        stderr(&out)
    );
}

test!(gpus_on_an_amd_machine_are_given_with_the_rocm_variables, needs: []);
pub(crate) fn gpus_on_an_amd_machine_are_given_with_the_rocm_variables() {
    let s = Scratch::new();
    let out = with_amd(&s, "several", &[])
        .args([
            "gpu:3",
            "gpu:1",
            "--",
            "sh",
            "-c",
            "echo $ROCR_VISIBLE_DEVICES $HIP_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES ${CUDA_DEVICE_ORDER:-unset}",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "1,3 0,1 0,1 unset");
    // A nested devlock stays inside its job's AMD GPUs.
    let out = with_amd(&s, "several", &[])
        .env("ROCR_VISIBLE_DEVICES", "1,3")
        .env("CUDA_VISIBLE_DEVICES", "0,1")
        .args(["gpu:3", "--", "sh", "-c", "echo $ROCR_VISIBLE_DEVICES"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "3");
    let out = with_amd(&s, "several", &[])
        .env("ROCR_VISIBLE_DEVICES", "1,3")
        .args(["gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gpu:0 is outside ROCR_VISIBLE_DEVICES=1,3"),
        "{}",
        stderr(&out)
    );
    // Without AMD's tool the NVIDIA variables, as before.
    let out = s
        .devlock()
        .args([
            "gpu:3",
            "--",
            "sh",
            "-c",
            "echo ${ROCR_VISIBLE_DEVICES:-unset} $CUDA_VISIBLE_DEVICES",
        ])
        .output()
        .unwrap();
    assert_eq!(stdout(&out).trim(), "unset 3");
}
