//! GPUs through NVML, against the fake library in tests/fixtures/fake-nvml
//! (built here with cc): the source named in status, gates and
//! --require-idle as with nvidia-smi, a hung driver call that devlock leaves
//! behind at the time limit, the fallback to nvidia-smi, and MIG instances
//! as devices.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Instant;

use crate::harness::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

/// Builds the fake NVML into the scratch's work directory, with `scenario`
/// beside it (where the fake looks for it), and returns the library's path.
pub fn fake_nvml(s: &Scratch, scenario: &str) -> PathBuf {
    let dir = s.work("fake-nvml");
    std::fs::create_dir_all(&dir).unwrap();
    let library = dir.join("libnvidia-ml.so.1");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-fvisibility=hidden", "-o"])
        .arg(&library)
        .arg(format!("{FIXTURES}/fake-nvml/fake_nvml.c"))
        .arg("-lpthread")
        .output()
        .expect("cc (the test's needs say it is installed)");
    assert!(out.status.success(), "cc: {}", stderr(&out));
    std::fs::write(dir.join("scenario"), scenario).unwrap();
    library
}

pub fn scenario(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/fake-nvml/{name}.scenario")).unwrap()
}

/// devlock asking the fake NVML at `library`, with `pids` for its `@PIDn@`s.
pub fn with_nvml(s: &Scratch, library: &Path, pids: &[u32]) -> Command {
    let mut cmd = s.devlock();
    cmd.env("DEVLOCK_NVML", library)
        .env_remove("DEVLOCK_NVIDIA_SMI")
        .env(
            "FAKE_NVML_PIDS",
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

/// A holder of `resource` whose background `sleep` stands for its work on
/// the GPU; returns the holder and the worker's pid.
fn holder_with_worker(s: &Scratch, resource: &str, tag: &str) -> (Child, u32) {
    let ready = s.work(&format!("{tag}.ready"));
    let release = s.work(&format!("{tag}.release"));
    let pidfile = s.work(&format!("{tag}.pid"));
    let holder = s.hold(
        &["--step", tag, resource],
        &format!(
            "sleep 1000 & echo $! > {pid}; echo > {ready}; while [ ! -e {release} ]; do sleep 0.01; done; kill $!",
            pid = pidfile.display(),
            ready = ready.display(),
            release = release.display()
        ),
        &ready,
    );
    (holder, pid_in(&pidfile))
}

fn let_go(s: &Scratch, tag: &str, holder: &mut Child) {
    std::fs::write(s.work(&format!("{tag}.release")), "").unwrap();
    wait_child(holder);
}

pub(crate) fn status_through_nvml_names_the_source_and_who_is_inside_the_gate() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario("several"));
    let (mut holder, worker) = holder_with_worker(&s, "gpu:0", "train");
    let stranger = Stranger::start();
    let pids = [worker, stranger.pid(), stranger.pid(), 4_000_000];
    let json = json_of(
        &with_nvml(&s, &library, &pids)
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    assert_eq!(json["device_source"], "nvml", "{json}");
    assert_eq!(json["device_info"]["status"], "ok");
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 4);
    assert_eq!(devices[0]["name"], "NVIDIA H100 80GB HBM3");
    assert_eq!(devices[0]["memory_used_mib"], 38925);
    assert_eq!(devices[0]["utilization_pct"], 97);
    let p = &devices[0]["processes"][0];
    assert_eq!(p["pid"], worker);
    assert_eq!(p["gated"], true, "{json}");
    assert_eq!(p["gate"], "gpu:0");
    assert_eq!(p["name"], "sleep", "NVML names no process: the kernel does");
    assert_eq!(devices[2]["processes"][0]["gated"], false);
    // nvidia-smi's shape, and what NVML adds: MIG is off, so no instances.
    assert_eq!(devices[1]["mig_mode"], false);
    assert!(devices[1].get("mig_instances").is_none());

    let table = stdout(
        &with_nvml(&s, &library, &pids)
            .arg("status")
            .output()
            .unwrap(),
    );
    assert!(table.contains("(GPUs as NVML reports them)"), "{table}");
    assert!(
        table.contains(&format!("warning: pid {} (sleep, ", stranger.pid())),
        "{table}"
    );
    // The same through nvidia-smi says so.
    let smi = s
        .devlock()
        .env(
            "DEVLOCK_NVIDIA_SMI",
            format!("{FIXTURES}/nvidia-smi/fake-nvidia-smi"),
        )
        .env("FAKE_SMI_SCENARIO", "idle")
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert_eq!(json_of(&smi)["device_source"], "nvidia-smi");
    let_go(&s, "train", &mut holder);
}

pub(crate) fn a_hung_nvml_call_never_hangs_devlock() {
    let s = Scratch::new();
    let mut text = scenario("several");
    text.push_str("hang nvmlDeviceGetComputeRunningProcesses_v3 *\n");
    let library = fake_nvml(&s, &text);
    let hung = s.work("fake-nvml/hung");
    let started = Instant::now();
    let out = with_nvml(&s, &library, &[])
        .args(["--probe-timeout", "300ms", "status", "--json"])
        .output()
        .unwrap();
    assert!(started.elapsed() < HANG);
    let json = json_of(&out);
    assert_eq!(json["device_info"]["status"], "unknown", "{json}");
    let reason = json["device_info"]["reason"].as_str().unwrap();
    assert!(reason.contains("did not answer within 300ms"), "{reason}");
    // It was the driver call that hung, not something before it.
    let line = std::fs::read_to_string(&hung).unwrap();
    assert!(
        line.contains("nvmlDeviceGetComputeRunningProcesses_v3"),
        "{line}"
    );

    // --require-idle cannot call the GPU idle, and says why, in time.
    let started = Instant::now();
    let out = with_nvml(&s, &library, &[])
        .args([
            "--probe-timeout",
            "300ms",
            "--require-idle",
            "gpu:1",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(started.elapsed() < HANG);
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot check that gpu:1 is idle"),
        "{}",
        stderr(&out)
    );
}

pub(crate) fn nvidia_smi_answers_when_nvml_is_off_or_fails() {
    let s = Scratch::new();
    let smi = format!("{FIXTURES}/nvidia-smi/fake-nvidia-smi");
    // NVML refuses to start (no driver loaded): nvidia-smi answers.
    let library = fake_nvml(&s, &format!("{}error nvmlInit_v2 - 9\n", scenario("idle")));
    let out = with_nvml(&s, &library, &[])
        .env("DEVLOCK_NVIDIA_SMI", &smi)
        .env("FAKE_SMI_SCENARIO", "several")
        .args(["status", "--json"])
        .output()
        .unwrap();
    let json = json_of(&out);
    assert_eq!(json["device_source"], "nvidia-smi", "{json}");
    assert_eq!(json["devices"].as_array().unwrap().len(), 4);
    // Without nvidia-smi, NVML's words are the reason.
    let out = with_nvml(&s, &library, &[])
        .args(["status", "--json"])
        .output()
        .unwrap();
    let json = json_of(&out);
    assert_eq!(json["device_info"]["status"], "unknown");
    let reason = json["device_info"]["reason"].as_str().unwrap();
    assert!(reason.contains("nvmlInit_v2 failed"), "{reason}");
    // DEVLOCK_NVML=none: nvidia-smi only.
    let out = s
        .devlock()
        .env("DEVLOCK_NVML", "none")
        .env("DEVLOCK_NVIDIA_SMI", &smi)
        .env("FAKE_SMI_SCENARIO", "idle")
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert_eq!(json_of(&out)["device_source"], "nvidia-smi");
}

pub(crate) fn a_process_list_nvml_refuses_is_unknown_not_idle() {
    let s = Scratch::new();
    let text = format!(
        "{}error nvmlDeviceGetComputeRunningProcesses_v3 1 4\n",
        scenario("idle")
    );
    let library = fake_nvml(&s, &text);
    let json = json_of(
        &with_nvml(&s, &library, &[])
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    let devices = json["devices"].as_array().unwrap();
    assert!(devices[0].get("processes_unknown").is_none(), "{json}");
    assert!(
        devices[1]["processes_unknown"]
            .as_str()
            .is_some_and(|r| r.contains("nvmlDeviceGetComputeRunningProcesses_v3")),
        "{json}"
    );
    let out = with_nvml(&s, &library, &[])
        .args(["--require-idle", "gpu:1", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("its processes are unknown"),
        "{}",
        stderr(&out)
    );
    let out = with_nvml(&s, &library, &[])
        .args(["--require-idle", "gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}
