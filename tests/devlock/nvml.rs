//! GPUs through NVML, against the fake library in tests/fixtures/fake-nvml
//! (built here with cc): the source named in status, gates and
//! --require-idle as with nvidia-smi, a hung driver call that devlock leaves
//! behind at the time limit, the fallback to nvidia-smi, and MIG instances
//! as devices.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
        .env("FAKE_NVML_PIDS", pid_list(pids));
    cmd
}

/// `s.hold`, with the fake NVML at `library` (a MIG instance's holder asks
/// it for the instance's UUID).
fn hold_nvml(s: &Scratch, library: &Path, args: &[&str], script: &str, ready: &Path) -> Child {
    let child = with_nvml(s, library, &[])
        .args(args)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_for_file(ready);
    child
}

/// `hold_until_released` with the fake NVML.
fn hold_nvml_until_released(s: &Scratch, library: &Path, args: &[&str], tag: &str) -> Child {
    let (script, ready) = wait_for_release(s, tag);
    hold_nvml(s, library, args, &script, &ready)
}

/// A holder of `resource` whose background `sleep` stands for its work on
/// the GPU; returns the holder and the worker's pid.
fn holder_with_worker(s: &Scratch, library: &Path, resource: &str, tag: &str) -> (Child, u32) {
    let ready = s.work(&format!("{tag}.ready"));
    let release = s.work(&format!("{tag}.release"));
    let pidfile = s.work(&format!("{tag}.pid"));
    let holder = hold_nvml(
        s,
        library,
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

test!(status_through_nvml_names_the_source_and_who_is_inside_the_gate, needs: [Tool("cc")]);
pub(crate) fn status_through_nvml_names_the_source_and_who_is_inside_the_gate() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario("several"));
    let (mut holder, worker) = holder_with_worker(&s, &library, "gpu:0", "train");
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

test!(a_hung_nvml_call_never_hangs_devlock, needs: [Tool("cc")]);
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

test!(nvidia_smi_answers_when_nvml_is_off_or_fails, needs: [Tool("cc")]);
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

test!(a_process_list_nvml_refuses_is_unknown_not_idle, needs: [Tool("cc")]);
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

const GI9: &str = "gpu:0:1g.18gb:gi9.ci0";
const GI10: &str = "gpu:0:1g.18gb:gi10.ci0";
const GI1_CI0: &str = "gpu:0:1c.3g.71gb:gi1.ci0";
const GI10_UUID: &str = "MIG-0f1e2d3c-4b5a-5968-8776-a5b4c3d2e1f0";

test!(mig_instances_are_devices_with_their_own_processes, needs: [Tool("cc")]);
pub(crate) fn mig_instances_are_devices_with_their_own_processes() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario("mig"));
    let (mut holder, worker) = holder_with_worker(&s, &library, GI9, "small");
    let stranger = Stranger::start();
    // @PID1@ runs in gi1.ci0, @PID2@ in gi9.ci0 (mig.scenario).
    let pids = [stranger.pid(), worker];
    let json = json_of(
        &with_nvml(&s, &library, &pids)
            .args(["status", "--json"])
            .output()
            .unwrap(),
    );
    let gpu0 = &json["devices"][0];
    assert_eq!(gpu0["mig_mode"], true, "{json}");
    let names: Vec<&str> = gpu0["mig_instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            GI1_CI0,
            "gpu:0:1c.3g.71gb:gi1.ci1",
            GI9,
            GI10,
            "gpu:0:1g.18gb_me:gi13.ci0"
        ]
    );
    let instance = |name: &str| {
        gpu0["mig_instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == name)
            .unwrap()
            .clone()
    };
    let small = instance(GI9);
    assert_eq!(small["uuid"], "MIG-c1d2e3f4-a5b6-5c7d-8e9f-0a1b2c3d4e5f");
    assert_eq!(small["processes"][0]["pid"], worker);
    assert_eq!(small["processes"][0]["gated"], true, "{json}");
    assert_eq!(small["processes"][0]["gate"], GI9);
    let big = instance(GI1_CI0);
    assert_eq!(big["processes"][0]["pid"], stranger.pid());
    assert_eq!(big["processes"][0]["gated"], false);
    assert!(instance(GI10)["processes"].as_array().unwrap().is_empty());
    let table = stdout(
        &with_nvml(&s, &library, &pids)
            .arg("status")
            .output()
            .unwrap(),
    );
    assert!(
        table.contains(GI10) && table.contains("MIG 1g.18gb"),
        "{table}"
    );
    assert!(
        table.contains(&format!(
            "warning: pid {} (sleep, root) uses 39.5 GiB on {GI1_CI0} without holding its lock",
            stranger.pid()
        )),
        "{table}"
    );

    // --require-idle looks at the instance only: gi10 is idle although its
    // GPU has a stranger on another instance; gi1.ci0 is not.
    let out = with_nvml(&s, &library, &pids)
        .args([
            "--require-idle",
            GI10,
            "--",
            "sh",
            "-c",
            "echo $CUDA_VISIBLE_DEVICES",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out).trim(),
        GI10_UUID,
        "CUDA gets the instance's UUID"
    );
    let out = with_nvml(&s, &library, &pids)
        .args(["--require-idle", GI1_CI0, "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("{GI1_CI0} is not idle: pid {}", stranger.pid())),
        "{}",
        stderr(&out)
    );
    let_go(&s, "small", &mut holder);
}

test!(an_instance_holds_its_gpu_shared_and_the_gpu_excludes_it, needs: [Tool("cc")]);
pub(crate) fn an_instance_holds_its_gpu_shared_and_the_gpu_excludes_it() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario("mig"));
    let mut holder = hold_nvml_until_released(&s, &library, &[GI9], "small");
    let try_now = |resource: &str| {
        with_nvml(&s, &library, &[])
            .args(["-n", resource, "--", "true"])
            .output()
            .unwrap()
    };
    // The GPU and the whole group wait for the instance; its sibling, the
    // other GPU and the instance's own parent shared do not.
    for busy in ["gpu:0", "gpu", GI9] {
        let out = try_now(busy);
        assert_eq!(out.status.code(), Some(75), "{busy}: {}", stderr(&out));
    }
    for free in [GI10, "gpu:1"] {
        let out = try_now(free);
        assert!(out.status.success(), "{free}: {}", stderr(&out));
    }
    let out = with_nvml(&s, &library, &[])
        .args(["-n", "--shared", "gpu:0", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json = s.status_json(&["gpu:0"]);
    assert_eq!(json["resources"][0]["holders"][0]["via"], GI9, "{json}");
    // --any takes instance names: the free one.
    let out = with_nvml(&s, &library, &[])
        .args([
            "-n",
            "--any",
            GI9,
            GI10,
            "--",
            "sh",
            "-c",
            "echo $DEVLOCK_RESOURCES $CUDA_VISIBLE_DEVICES",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), format!("{GI10} {GI10_UUID}"));
    release(&s, "small");
    assert!(wait_child(&mut holder).success());
    // Then the GPU excludes the instances.
    let mut whole = hold_nvml_until_released(&s, &library, &["gpu:0"], "whole");
    let out = try_now(GI10);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    release(&s, "whole");
    assert!(wait_child(&mut whole).success());
}

test!(two_mig_instances_for_one_command_are_refused_with_the_reason, needs: []);
pub(crate) fn two_mig_instances_for_one_command_are_refused_with_the_reason() {
    let s = Scratch::new();
    for args in [
        vec![GI9, GI10],
        vec![GI9, "gpu:1"],
        vec![
            "--any",
            "--count",
            "2",
            GI9,
            GI10,
            "gpu:0:1c.3g.71gb:gi1.ci1",
        ],
    ] {
        let mut full = args.clone();
        full.extend(["--", "true"]);
        let out = s.run(&full);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("only one MIG instance per process")
                || err.contains("cannot give one command a MIG"),
            "{args:?}: {err}"
        );
        assert!(!s.dir().exists(), "refused before any file is touched");
    }
    // A name not in the canonical form is no resource.
    let out = s.run(&["gpu:0:1g.18gb:gi09.ci0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("gpu:N:PROFILE:giG.ciC"),
        "{}",
        stderr(&out)
    );
}

test!(setup_gpus_declares_the_mig_instances, needs: [Root, Tool("cc")]);
pub(crate) fn setup_gpus_declares_the_mig_instances() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario("mig"));
    let out = with_nvml(&s, &library, &[])
        .args(["setup", "--gpus"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(
        said.contains(&format!(
            "8 resources declared: gpu gpu:0 {GI1_CI0} gpu:0:1c.3g.71gb:gi1.ci1 {GI10} {GI9} gpu:0:1g.18gb_me:gi13.ci0 gpu:1"
        )),
        "{said}"
    );
    for name in [GI9, "gpu:0:1g.18gb_me:gi13.ci0", "gpu:1"] {
        assert!(s.lock_path(name).exists(), "{name}");
    }
}

test!(the_systems_nvml_is_found_as_the_loader_finds_it_and_a_named_nvidia_smi_wins, needs: [Tool("cc")]);
pub(crate) fn the_systems_nvml_is_found_as_the_loader_finds_it_and_a_named_nvidia_smi_wins() {
    let s = Scratch::new();
    let library = fake_nvml(&s, &scenario("idle"));
    let system = |cmd: &mut Command| {
        cmd.env_remove("DEVLOCK_NVML")
            .env("LD_LIBRARY_PATH", library.parent().unwrap())
            .args(["status", "--json"]);
    };
    // DEVLOCK_NVML unset: libnvidia-ml.so.1 wherever the dynamic loader
    // finds it (here LD_LIBRARY_PATH leads it to the fake).
    let mut cmd = s.devlock();
    system(&mut cmd);
    let json = json_of(&cmd.env_remove("DEVLOCK_NVIDIA_SMI").output().unwrap());
    assert_eq!(json["device_source"], "nvml", "{json}");
    assert_eq!(json["devices"].as_array().unwrap().len(), 2);
    // An explicit DEVLOCK_NVIDIA_SMI names the tool to ask (a site's wrapper).
    let mut cmd = s.devlock();
    system(&mut cmd);
    let json = json_of(
        &cmd.env(
            "DEVLOCK_NVIDIA_SMI",
            format!("{FIXTURES}/nvidia-smi/fake-nvidia-smi"),
        )
        .env("FAKE_SMI_SCENARIO", "several")
        .output()
        .unwrap(),
    );
    assert_eq!(json["device_source"], "nvidia-smi", "{json}");
    assert_eq!(json["devices"].as_array().unwrap().len(), 4);
}
