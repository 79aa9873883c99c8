//! The NVML source against the fake library in tests/fixtures/fake-nvml, built here with `cc`.

use super::*;

const FAKE_SOURCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/fake-nvml/fake_nvml.c"
);
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/fake-nvml");

/// A fake NVML of its own: the library, its scenario and its counters in one
/// temporary directory (the fake finds them beside itself), so tests in one
/// process never share one.
struct Fake {
    dir: tempfile::TempDir,
}

impl Fake {
    /// `None` (after saying why) when there is no C compiler; a failure
    /// instead under DEVLOCK_TEST_REQUIRE_TOOLS=1.
    fn new(scenario: &str) -> Option<Fake> {
        let dir = tempfile::tempdir().unwrap();
        let library = dir.path().join(LIBRARY);
        let built = std::process::Command::new("cc")
            .args([
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-Wall",
                "-Wextra",
                "-o",
            ])
            .arg(&library)
            .arg(FAKE_SOURCE)
            .arg("-lpthread")
            .output();
        match built {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "cc could not build the fake NVML: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => {
                let required =
                    std::env::var_os("DEVLOCK_TEST_REQUIRE_TOOLS").is_some_and(|v| v == "1");
                assert!(
                    !required,
                    "cc cannot be run ({e}), and DEVLOCK_TEST_REQUIRE_TOOLS=1"
                );
                eprintln!("skipped: cc cannot be run ({e}), so there is no fake NVML");
                return None;
            }
        }
        std::fs::write(dir.path().join("scenario"), scenario).unwrap();
        Some(Fake { dir })
    }

    fn fixture(name: &str) -> Option<Fake> {
        Fake::new(&std::fs::read_to_string(format!("{FIXTURES}/{name}.scenario")).unwrap())
    }

    fn location(&self) -> Location {
        Location::Path(self.dir.path().join(LIBRARY))
    }

    fn probe(&self) -> Outcome {
        probe_at(&self.location(), Duration::from_secs(30))
    }

    fn snapshot(&self) -> Snapshot {
        match self.probe() {
            Outcome::Devices(snapshot) => snapshot,
            other => panic!("expected devices, got {other:?}"),
        }
    }

    /// How many times this process called nvmlInit_v2 on this fake.
    fn inits(&self) -> usize {
        let me = std::process::id().to_string();
        std::fs::read_to_string(self.dir.path().join("init-count"))
            .unwrap_or_default()
            .lines()
            .filter(|line| *line == me)
            .count()
    }
}

fn unknown(outcome: Outcome) -> String {
    match outcome {
        Outcome::Unknown(why) => why.reason,
        other => panic!("expected unknown, got {other:?}"),
    }
}

fn reason<T: std::fmt::Debug>(result: &Result<T, Unknown>) -> &str {
    match result {
        Err(why) => &why.reason,
        Ok(value) => panic!("expected unknown, got {value:?}"),
    }
}

fn pids(processes: &Result<Vec<Process>, Unknown>) -> Vec<u32> {
    processes.as_ref().unwrap().iter().map(|p| p.pid).collect()
}

#[test]
fn the_variable_picks_the_library() {
    assert_eq!(Location::parse(None), Location::System);
    assert_eq!(Location::parse(Some("".into())), Location::System);
    assert_eq!(Location::parse(Some("none".into())), Location::Off);
    assert_eq!(
        Location::parse(Some("/opt/x/libnvidia-ml.so.1".into())),
        Location::Path("/opt/x/libnvidia-ml.so.1".into())
    );
    assert_eq!(
        probe_at(&Location::Off, Duration::from_secs(1)),
        Outcome::Off
    );
}

#[test]
fn reads_each_gpu_and_its_processes() {
    let Some(fake) = Fake::fixture("several") else {
        return;
    };
    let snapshot = fake.snapshot();
    assert_eq!(snapshot.driver_version.as_deref(), Ok("550.127.05"));
    assert_eq!(snapshot.gpus.len(), 4);
    let gpu0 = &snapshot.gpus[0];
    assert_eq!(gpu0.index, 0);
    assert_eq!(gpu0.uuid, "GPU-5f3c1a2b-7d4e-4c1f-9a8b-1c2d3e4f5a60");
    assert_eq!(gpu0.name, "NVIDIA H100 80GB HBM3");
    assert_eq!(
        gpu0.memory,
        Ok(Memory {
            used_mib: 38925,
            total_mib: 81559
        })
    );
    assert_eq!(gpu0.utilization_pct, Ok(97));
    assert_eq!(gpu0.mig, Mig::Off { pending_on: false });
    // Placeholders the scenario leaves unfilled read as fake-nvidia-smi's (424n).
    assert_eq!(
        gpu0.processes,
        Ok(vec![Process {
            pid: 4241,
            used_mib: Some(38912),
            gpu_instance_id: None,
            compute_instance_id: None,
        }])
    );
    let per_gpu: Vec<Vec<u32>> = snapshot.gpus.iter().map(|g| pids(&g.processes)).collect();
    assert_eq!(per_gpu, [vec![4241], vec![], vec![4242, 4243], vec![4244]]);
}

#[test]
fn nvml_is_initialised_once_per_process() {
    let Some(fake) = Fake::fixture("idle") else {
        return;
    };
    for _ in 0..3 {
        assert_eq!(fake.snapshot().gpus.len(), 2);
    }
    assert_eq!(fake.inits(), 1);
}

#[test]
fn probes_at_once_in_one_process_queue_and_all_get_an_answer() {
    let Some(fake) = Fake::fixture("several") else {
        return;
    };
    let location = fake.location();
    let answers: Vec<Outcome> = thread::scope(|s| {
        let probes: Vec<_> = (0..8)
            .map(|_| s.spawn(|| probe_at(&location, Duration::from_secs(30))))
            .collect();
        probes.into_iter().map(|p| p.join().unwrap()).collect()
    });
    for answer in answers {
        assert!(
            matches!(&answer, Outcome::Devices(s) if s.gpus.len() == 4),
            "{answer:?}"
        );
    }
    assert_eq!(fake.inits(), 1);
}

#[test]
fn a_failed_initialisation_is_unknown_and_not_retried() {
    let Some(fake) = Fake::new("gpu 0 GPU-a 100 0 0 X\nerror nvmlInit_v2 - 9\n") else {
        return;
    };
    for _ in 0..2 {
        assert_eq!(
            unknown(fake.probe()),
            "nvmlInit_v2 failed: Driver Not Loaded (NVML error 9)"
        );
    }
    assert_eq!(fake.inits(), 1);
}

#[test]
fn a_library_that_is_missing_or_no_nvml() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join(LIBRARY);
    let why = unknown(probe_at(
        &Location::Path(missing.clone()),
        Duration::from_secs(30),
    ));
    assert!(
        why.starts_with(&format!("cannot use {} as NVML: ", missing.display())),
        "{why}"
    );
    // The system's library missing is no error: the caller falls back.
    assert!(matches!(
        start(Path::new("libnvidia-ml-devlock-test-absent.so.1"), false),
        Err(Failure::NotInstalled(_))
    ));
    // A library that loads but is not NVML.
    let why = unknown(probe_at(
        &Location::Path("libm.so.6".into()),
        Duration::from_secs(30),
    ));
    assert_eq!(
        why,
        "cannot use libm.so.6 as NVML: it has no nvmlInit_v2, so it is no NVML"
    );
}

#[test]
fn errors_are_unknown_with_the_reason_never_zero() {
    let scenario = "\
gpu 0 GPU-a 81559 100 5 NVIDIA H100 80GB HBM3
gpu 1 GPU-b 81559 200 6 NVIDIA H100 80GB HBM3
gpu 2 GPU-c 81559 300 7 NVIDIA H100 80GB HBM3
process 0 4000 na
process 2 4001 10
error nvmlDeviceGetMemoryInfo 1 15
error nvmlDeviceGetUtilizationRates 0 3
error nvmlDeviceGetComputeRunningProcesses_v3 2 4
error nvmlDeviceGetMigMode 1 999
error nvmlSystemGetDriverVersion - 999
";
    let Some(fake) = Fake::new(scenario) else {
        return;
    };
    let snapshot = fake.snapshot();
    assert_eq!(
        reason(&snapshot.driver_version),
        "nvmlSystemGetDriverVersion on the system: Unknown Error (NVML error 999)"
    );
    let [gpu0, gpu1, gpu2] = &snapshot.gpus[..] else {
        panic!("{snapshot:?}")
    };
    assert_eq!(
        reason(&gpu1.memory),
        "nvmlDeviceGetMemoryInfo on GPU 1: GPU is lost (NVML error 15)"
    );
    assert_eq!(
        reason(&gpu0.utilization_pct),
        "nvmlDeviceGetUtilizationRates on GPU 0: Not Supported (NVML error 3)"
    );
    // A list NVML would not give is not an empty list.
    assert_eq!(
        reason(&gpu2.processes),
        "nvmlDeviceGetComputeRunningProcesses_v3 on GPU 2: Insufficient Permissions (NVML error 4)"
    );
    // NVML_VALUE_NOT_AVAILABLE is unknown, not 0 MiB.
    assert_eq!(gpu0.processes.as_ref().unwrap()[0].used_mib, None);
    assert_eq!(
        gpu1.mig,
        Mig::Unknown(Unknown::new(
            "nvmlDeviceGetMigMode on GPU 1: Unknown Error (NVML error 999)"
        ))
    );
    assert_eq!(gpu0.mig, Mig::NotSupported);
    assert_eq!(gpu2.utilization_pct, Ok(7));
}

#[test]
fn a_gpu_without_its_identity_makes_the_whole_answer_unknown() {
    let Some(fake) =
        Fake::new("gpu 0 GPU-a 1 0 0 A\ngpu 1 GPU-b 1 0 0 B\nerror nvmlDeviceGetUUID 1 15\n")
    else {
        return;
    };
    assert_eq!(
        unknown(fake.probe()),
        "nvmlDeviceGetUUID on GPU 1: GPU is lost (NVML error 15)"
    );
    let Some(fake) = Fake::new("gpu 0 GPU-a 1 0 0 A\nerror nvmlDeviceGetCount_v2 - 999\n") else {
        return;
    };
    assert_eq!(
        unknown(fake.probe()),
        "nvmlDeviceGetCount_v2 on the system: Unknown Error (NVML error 999)"
    );
}

#[test]
fn mig_instances_are_devices_with_their_own_processes() {
    let Some(fake) = Fake::fixture("mig") else {
        return;
    };
    let snapshot = fake.snapshot();
    let [gpu0, gpu1] = &snapshot.gpus[..] else {
        panic!("{snapshot:?}")
    };
    assert_eq!(gpu1.mig, Mig::Off { pending_on: false });
    assert_eq!(gpu1.utilization_pct, Ok(0));
    assert!(
        reason(&gpu0.utilization_pct).contains("in MIG mode"),
        "{gpu0:?}"
    );
    let Mig::On {
        pending_off,
        instances: Ok(instances),
    } = &gpu0.mig
    else {
        panic!("{:?}", gpu0.mig)
    };
    assert!(!pending_off);
    let names: Vec<&str> = instances
        .iter()
        .map(|i| i.name.as_deref().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "gpu:0:1c.3g.71gb:gi1.ci0",
            "gpu:0:1c.3g.71gb:gi1.ci1",
            "gpu:0:1g.18gb:gi9.ci0",
            "gpu:0:1g.18gb:gi10.ci0",
            "gpu:0:1g.18gb_me:gi13.ci0",
        ]
    );
    let first = &instances[0];
    assert_eq!(first.uuid, "MIG-3f0a9c1e-58b2-5d47-a1e6-0c9b8d7e6f51");
    assert_eq!(first.profile.as_deref(), Some("1c.3g.71gb"));
    assert_eq!(first.device_name, "NVIDIA H200 MIG 1c.3g.71gb");
    assert_eq!((first.mig_index, first.gpu_instance_id), (0, 1));
    assert_eq!(
        first.memory,
        Ok(Memory {
            used_mib: 40960,
            total_mib: 69632
        })
    );
    assert_eq!(instances[4].mig_index, 5, "slot 4 is empty");
    // Processes are attributed per instance; the GPU lists them all.
    let per_instance: Vec<Vec<u32>> = instances.iter().map(|i| pids(&i.processes)).collect();
    assert_eq!(
        per_instance,
        [vec![4241], vec![], vec![4242], vec![], vec![]]
    );
    assert_eq!(pids(&gpu0.processes), [4241, 4242]);
    let p = &instances[2].processes.as_ref().unwrap()[0];
    assert_eq!(
        (p.gpu_instance_id, p.compute_instance_id, p.used_mib),
        (Some(9), Some(0), Some(4096))
    );
}

const MIG_ONE: &str = "\
gpu 0 GPU-a 143771 0 0 NVIDIA H200
mig 0 1 1 7
instance 0 0 9 0 MIG-a 16384 0 NVIDIA H200 MIG 1g.18gb
instance 0 1 10 0 MIG-b 16384 0 NVIDIA H200 MIG 1g.18gb
process 0 7001 100 9 0
process 0 7002 200 10 0
";

#[test]
fn mig_process_lists_complete_each_other() {
    // An instance whose own list fails takes its share of the GPU's list.
    let scenario = format!("{MIG_ONE}error nvmlDeviceGetComputeRunningProcesses_v3 0/1 4\n");
    let Some(fake) = Fake::new(&scenario) else {
        return;
    };
    let gpu = &fake.snapshot().gpus[0];
    let Mig::On {
        instances: Ok(instances),
        ..
    } = &gpu.mig
    else {
        panic!("{gpu:?}")
    };
    assert_eq!(pids(&instances[1].processes), [7002]);
    // The GPU's aggregate list needs privileges; without, the instances' lists add up.
    let scenario = format!("{MIG_ONE}error nvmlDeviceGetComputeRunningProcesses_v3 0 4\n");
    let Some(fake) = Fake::new(&scenario) else {
        return;
    };
    assert_eq!(pids(&fake.snapshot().gpus[0].processes), [7001, 7002]);
    // Both unknown: unknown, not empty.
    let scenario = format!(
        "{MIG_ONE}error nvmlDeviceGetComputeRunningProcesses_v3 0 4\n\
         error nvmlDeviceGetComputeRunningProcesses_v3 0/1 4\n"
    );
    let Some(fake) = Fake::new(&scenario) else {
        return;
    };
    let gpu = &fake.snapshot().gpus[0];
    assert!(reason(&gpu.processes).contains("on GPU 0"));
    let Mig::On {
        instances: Ok(instances),
        ..
    } = &gpu.mig
    else {
        panic!("{gpu:?}")
    };
    assert!(reason(&instances[1].processes).contains("on MIG device 1 of GPU 0"));
    assert_eq!(pids(&instances[0].processes), [7001]);
}

#[test]
fn mig_instances_nvml_cannot_name_or_list() {
    // A name without a profile: listed, but with no resource name.
    let scenario = "\
gpu 0 GPU-a 143771 0 0 NVIDIA H200
mig 0 1 0 7
instance 0 0 9 0 MIG-a 16384 0 NVIDIA H200
";
    let Some(fake) = Fake::new(scenario) else {
        return;
    };
    let gpu = &fake.snapshot().gpus[0];
    let Mig::On {
        pending_off,
        instances: Ok(instances),
    } = &gpu.mig
    else {
        panic!("{gpu:?}")
    };
    assert!(pending_off);
    assert_eq!(
        reason(&instances[0].name),
        "NVML's name for MIG device 0 of GPU 0, \"NVIDIA H200\", names no MIG profile"
    );
    // A failing handle (not an empty slot) makes the instances unknown.
    let scenario = format!("{MIG_ONE}error nvmlDeviceGetMigDeviceHandleByIndex 0/1 999\n");
    let Some(fake) = Fake::new(&scenario) else {
        return;
    };
    let gpu = &fake.snapshot().gpus[0];
    let Mig::On { instances, .. } = &gpu.mig else {
        panic!("{gpu:?}")
    };
    assert_eq!(
        reason(instances),
        "nvmlDeviceGetMigDeviceHandleByIndex on MIG device 1 of GPU 0: Unknown Error (NVML error 999)"
    );
    // MIG switched on at the next reset.
    let Some(fake) = Fake::new("gpu 0 GPU-a 1 0 0 NVIDIA H200\nmig 0 0 1\n") else {
        return;
    };
    assert_eq!(fake.snapshot().gpus[0].mig, Mig::Off { pending_on: true });
}

#[test]
fn a_hung_call_never_holds_the_caller() {
    let scenario = "\
gpu 0 GPU-a 81559 0 0 NVIDIA H100 80GB HBM3
gpu 1 GPU-b 81559 0 0 NVIDIA H100 80GB HBM3
hang nvmlDeviceGetComputeRunningProcesses_v3 1
";
    let Some(fake) = Fake::new(scenario) else {
        return;
    };
    let location = fake.location();
    assert_eq!(
        unknown(probe_at(&location, Duration::from_millis(300))),
        "NVML did not answer within 300ms (the call is left on a thread of its own)"
    );
    // The call is stuck where the scenario says: the fake writes so before
    // hanging (it may get there after the caller gave up).
    let hung_file = fake.dir.path().join("hung");
    let since = std::time::Instant::now();
    while !hung_file.exists() {
        assert!(
            since.elapsed() < Duration::from_secs(60),
            "the fake never hung"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let hung = std::fs::read_to_string(&hung_file).unwrap();
    assert_eq!(
        hung,
        format!(
            "{} nvmlDeviceGetComputeRunningProcesses_v3 1\n",
            std::process::id()
        )
    );
    // The next probe does not queue behind it: it says so without waiting.
    let why = unknown(probe_at(&location, Duration::from_secs(3600)));
    assert!(
        why.starts_with("an earlier NVML call has not returned for ")
            && why.ends_with("not asking again until it does"),
        "{why}"
    );
    assert_eq!(fake.inits(), 1);
}

#[test]
fn a_hung_initialisation_never_holds_the_caller() {
    let Some(fake) = Fake::new("gpu 0 GPU-a 1 0 0 A\nhang nvmlInit_v2 -\n") else {
        return;
    };
    assert!(
        unknown(probe_at(&fake.location(), Duration::from_millis(200)))
            .starts_with("NVML did not answer within 200ms")
    );
}

#[test]
fn unknown_reads_as_a_reason() {
    assert_eq!(
        Unknown::new("the GPU is lost").to_string(),
        "unknown, because the GPU is lost"
    );
    assert_eq!(
        round_ms(Duration::from_nanos(1_234_567_891)),
        Duration::from_millis(1234)
    );
}
