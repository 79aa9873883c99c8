//! The AMD parsers on the reconstructed amd-smi output, the fake amd-smi, and recorded DRM fdinfo and sysfs text.

use super::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap()
}

/// `@PIDn@` filled the way the fake does by default (`424n`).
fn filled(text: &str) -> String {
    (1..=9).fold(text.to_owned(), |text, n| {
        text.replace(&format!("@PID{n}@"), &format!("424{n}"))
    })
}

fn several() -> Vec<AmdGpu> {
    join(
        parse_list(&fixture("amd-smi/several.list.json")).unwrap(),
        &parse_static(&fixture("amd-smi/several.static.json")).unwrap(),
        &parse_metric(&fixture("amd-smi/several.metric.json")).unwrap(),
        parse_process(&filled(&fixture("amd-smi/several.process.json"))).unwrap(),
    )
}

#[test]
fn amd_smi_answers_join_into_gpus() {
    let gpus = several();
    assert_eq!(gpus.len(), 4);
    let gpu0 = &gpus[0];
    assert_eq!(gpu0.index, 0);
    assert_eq!(gpu0.bdf.as_deref(), Some("0000:0c:00.0"));
    assert_eq!(
        gpu0.uuid.as_deref(),
        Some("c3ff74a1-0000-1000-803c-5b8d1b8e3f21")
    );
    assert_eq!(gpu0.name.as_deref(), Some("AMD Instinct MI300X"));
    assert_eq!(
        (
            gpu0.memory_used_mib,
            gpu0.memory_total_mib,
            gpu0.utilization_pct
        ),
        (Some(38925), Some(196592), Some(97))
    );
    assert_eq!(
        gpu0.processes,
        [AmdProcess {
            pid: 4241,
            name: "python3".into(),
            vram_mib: Some(38912)
        }]
    );
    let pids: Vec<Vec<u32>> = gpus
        .iter()
        .map(|g| g.processes.iter().map(|p| p.pid).collect())
        .collect();
    assert_eq!(pids, [vec![4241], vec![], vec![4242, 4243], vec![4244]]);
    assert_eq!(gpus[2].processes[1].name, "python3 -c import a,b");
    assert_eq!(gpus[1].utilization_pct, Some(0));
}

#[test]
fn amd_smi_unknowns_stay_unknown() {
    let gpus = join(
        parse_list(&fixture("amd-smi/na.list.json")).unwrap(),
        &parse_static(&fixture("amd-smi/na.static.json")).unwrap(),
        &parse_metric(&fixture("amd-smi/na.metric.json")).unwrap(),
        parse_process(&filled(&fixture("amd-smi/na.process.json"))).unwrap(),
    );
    let [gpu0, gpu1] = &gpus[..] else {
        panic!("{gpus:?}")
    };
    assert_eq!(gpu0.uuid, None);
    assert_eq!(gpu0.name, None);
    assert_eq!(
        (
            gpu0.memory_used_mib,
            gpu0.memory_total_mib,
            gpu0.utilization_pct
        ),
        (None, None, None)
    );
    assert_eq!(gpu0.processes[0].vram_mib, None, "N/A is not 0 MiB");
    assert_eq!(gpu1.memory_used_mib, Some(2061));
    assert_eq!(gpu1.utilization_pct, None);
    assert_eq!(gpu1.processes[0].name, "N/A");
    assert_eq!(gpu1.processes[0].vram_mib, Some(2048));
    // Idle: amd-smi's placeholder is no process.
    let idle = parse_process(&fixture("amd-smi/idle.process.json")).unwrap();
    assert_eq!(idle, [(0, vec![]), (1, vec![])]);
}

#[test]
fn quantities_and_units() {
    let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
    assert_eq!(
        mib(Some(&v(r#"{"value": 2, "unit": "GB"}"#)), "MB"),
        Some(2048)
    );
    assert_eq!(
        mib(Some(&v(r#"{"value": 1048575, "unit": "B"}"#)), "MB"),
        Some(0)
    );
    assert_eq!(mib(Some(&v(r#"{"value": 3, "unit": "MB"}"#)), "B"), Some(3));
    assert_eq!(mib(Some(&v("5")), "MB"), Some(5));
    assert_eq!(mib(Some(&v("2097152")), "B"), Some(2));
    for unknown in [
        r#""N/A""#,
        r#"{"value": -1, "unit": "MB"}"#,
        r#"{"value": 1.5, "unit": "MB"}"#,
        r#"{"value": 1, "unit": "furlong"}"#,
        r#"{"value": 18446744073709551615, "unit": "GB"}"#,
        r#"{"unit": "MB"}"#,
    ] {
        assert_eq!(mib(Some(&v(unknown)), "MB"), None, "{unknown}");
    }
    assert_eq!(mib(None, "MB"), None);
    assert_eq!(percent(Some(&v(r#"{"value": 42, "unit": "%"}"#))), Some(42));
    assert_eq!(percent(Some(&v(r#"{"value": 101, "unit": "%"}"#))), None);
    assert_eq!(percent(Some(&v(r#"{"value": 4, "unit": "W"}"#))), None);
    assert_eq!(percent(Some(&v(r#""N/A""#))), None);
}

#[test]
fn output_of_another_shape_is_an_error() {
    for (text, want) in [
        ("", "not JSON"),
        ("{}", "expected a JSON array"),
        (r#"{"gpu_data": []}"#, "expected a JSON array"),
        ("[1]", "entry 0 is not an object"),
        (r#"[{"bdf": "x"}]"#, "has no \"gpu\" index"),
        (r#"[{"gpu": -1}]"#, "has no \"gpu\" index"),
        (r#"[{"gpu": 0}, {"gpu": 0}]"#, "GPU 0 appears twice"),
    ] {
        let err = format!("{:#}", parse_list(text).unwrap_err());
        assert!(err.contains(want), "{text:?}: {err}");
    }
    for (text, want) in [
        (r#"[{"gpu": 0}]"#, "no \"process_list\""),
        (
            r#"[{"gpu": 0, "process_list": [{}]}]"#,
            "no \"process_info\"",
        ),
        (
            r#"[{"gpu": 0, "process_list": [{"process_info": {"name": "x"}}]}]"#,
            "process 0 has no pid",
        ),
        (
            r#"[{"gpu": 0, "process_list": [{"process_info": "Permission denied"}]}]"#,
            "unexpected",
        ),
    ] {
        let err = format!("{:#}", parse_process(text).unwrap_err());
        assert!(err.contains(want), "{text:?}: {err}");
    }
    assert!(parse_list("[]").unwrap().is_empty());
}

#[test]
fn the_fake_amd_smi_answers_the_four_queries() {
    let fake = format!("{FIXTURES}/amd-smi/fake-amd-smi");
    let run = |args: &[&str], scenario: &str| {
        std::process::Command::new(&fake)
            .args(args)
            .env("FAKE_AMDSMI_SCENARIO", scenario)
            .env("FAKE_AMDSMI_PIDS", "7 8")
            .output()
            .unwrap()
    };
    let text = |args: &[&str]| {
        let out = run(args, "several");
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let gpus = join(
        parse_list(&text(&LIST_ARGS)).unwrap(),
        &parse_static(&text(&STATIC_ARGS)).unwrap(),
        &parse_metric(&text(&METRIC_ARGS)).unwrap(),
        parse_process(&text(&PROCESS_ARGS)).unwrap(),
    );
    let pids: Vec<Vec<u32>> = gpus
        .iter()
        .map(|g| g.processes.iter().map(|p| p.pid).collect())
        .collect();
    assert_eq!(pids, [vec![7], vec![], vec![8, 4243], vec![4244]]);
    let failed = run(&LIST_ARGS, "fail");
    assert_eq!(failed.status.code(), Some(255));
    assert!(
        String::from_utf8_lossy(&failed.stderr).contains("Driver not loaded"),
        "{failed:?}"
    );
    assert_eq!(run(&["static", "--json"], "several").status.code(), Some(2));
}

#[test]
fn fdinfo_of_drm_files() {
    let new = parse_fdinfo(&fixture("drm-fdinfo/amdgpu-6.12.txt")).unwrap();
    assert_eq!(
        new,
        DrmClient {
            driver: "amdgpu".into(),
            pdev: Some("0000:0c:00.0".into()),
            client_id: Some(42),
            vram_kib: Some(39_845_888),
        }
    );
    let old = parse_fdinfo(&fixture("drm-fdinfo/amdgpu-6.1.txt")).unwrap();
    assert_eq!(
        (old.pdev.as_deref(), old.client_id, old.vram_kib),
        (Some("0000:22:00.0"), Some(7), Some(1_048_576))
    );
    let intel = parse_fdinfo(&fixture("drm-fdinfo/i915.txt")).unwrap();
    assert_eq!((intel.driver.as_str(), intel.vram_kib), ("i915", None));
    assert_eq!(parse_fdinfo(&fixture("drm-fdinfo/regular-file.txt")), None);
    // The standard key wins over amdgpu's own when both are there.
    let both =
        parse_fdinfo("drm-driver:\tamdgpu\ndrm-memory-vram:\t9 KiB\ndrm-resident-vram:\t2 MiB\n")
            .unwrap();
    assert_eq!(both.vram_kib, Some(2048));
    assert_eq!(kib("4096"), Some(4));
    assert_eq!(kib("3 GiB"), Some(3 * 1024 * 1024));
    assert_eq!(kib("3 TiB"), None);
    assert_eq!(kib("x KiB"), None);
    assert_eq!(kib("1 KiB extra"), None);
}

fn client(pdev: &str, id: Option<u64>, vram_kib: Option<u64>) -> DrmClient {
    DrmClient {
        driver: "amdgpu".into(),
        pdev: Some(pdev.into()),
        client_id: id,
        vram_kib,
    }
}

#[test]
fn an_open_file_counts_once_per_process() {
    let a = "0000:0c:00.0";
    let b = "0000:22:00.0";
    let clients = vec![
        // Two descriptors of one file (dup), and a second file.
        (100, client(a, Some(1), Some(2048))),
        (100, client(a, Some(1), Some(2048))),
        (100, client(a, Some(2), Some(1024))),
        // A child that inherited the same file: it holds it too.
        (101, client(a, Some(1), Some(2048))),
        // A file that does not say.
        (102, client(b, Some(5), None)),
        (102, client(b, Some(6), Some(4096))),
        (
            103,
            DrmClient {
                driver: "i915".into(),
                ..client(a, Some(9), Some(1))
            },
        ),
    ];
    let usage = vram_by_device(&clients, "amdgpu");
    assert_eq!(usage[a], [(100, Some(3)), (101, Some(2))]);
    assert_eq!(usage[b], [(102, None)], "unknown, not 4 MiB");
    assert_eq!(usage.len(), 2);
}

#[test]
fn a_scan_of_proc_finds_drm_files_and_says_what_it_could_not_read() {
    use std::os::unix::fs::symlink;
    let root = tempfile::tempdir().unwrap();
    let proc_dir = |pid: &str| {
        let dir = root.path().join(pid);
        std::fs::create_dir_all(dir.join("fd")).unwrap();
        std::fs::create_dir_all(dir.join("fdinfo")).unwrap();
        dir
    };
    let p = proc_dir("4242");
    symlink("/dev/dri/renderD128", p.join("fd/7")).unwrap();
    std::fs::write(p.join("fdinfo/7"), fixture("drm-fdinfo/amdgpu-6.12.txt")).unwrap();
    symlink("socket:[1234]", p.join("fd/3")).unwrap();
    std::fs::write(p.join("fdinfo/3"), fixture("drm-fdinfo/regular-file.txt")).unwrap();
    symlink("/dev/dri/card1", p.join("fd/8")).unwrap();
    std::fs::write(p.join("fdinfo/8"), fixture("drm-fdinfo/amdgpu-6.1.txt")).unwrap();
    // Another user's process, as a non-root reader sees it: no fd listing.
    let hidden = root.path().join("4343");
    std::fs::create_dir_all(&hidden).unwrap();
    std::fs::write(hidden.join("fd"), "").unwrap();
    std::fs::create_dir_all(root.path().join("self")).unwrap();
    std::fs::write(root.path().join("uptime"), "1 1\n").unwrap();

    let mut scan = scan_fdinfo(root.path()).unwrap();
    scan.clients.sort_by_key(|(_, c)| c.client_id);
    let found: Vec<(u32, Option<u64>)> = scan
        .clients
        .iter()
        .map(|(pid, c)| (*pid, c.client_id))
        .collect();
    assert_eq!(found, [(4242, Some(7)), (4242, Some(42))]);
    assert_eq!(scan.unreadable, [4343]);
    let usage = vram_by_device(&scan.clients, "amdgpu");
    assert_eq!(usage["0000:0c:00.0"], [(4242, Some(38912))]);
}

#[test]
fn sysfs_gives_each_amdgpu_cards_memory_and_activity() {
    let root = tempfile::tempdir().unwrap();
    let card = |name: &str, driver: &str, files: &[(&str, &str)]| {
        let device = root.path().join(name).join("device");
        std::fs::create_dir_all(&device).unwrap();
        std::fs::write(
            device.join("uevent"),
            format!("DRIVER={driver}\nPCI_CLASS=38000\nPCI_SLOT_NAME=0000:0c:00.0\n"),
        )
        .unwrap();
        for (file, text) in files {
            std::fs::write(device.join(file), text).unwrap();
        }
    };
    card(
        "card1",
        "amdgpu",
        &[
            ("mem_info_vram_total", "206141652992\n"),
            ("mem_info_vram_used", "297795584\n"),
            ("gpu_busy_percent", "7\n"),
        ],
    );
    card("card0", "i915", &[("gpu_busy_percent", "1\n")]);
    card("card2", "amdgpu", &[("gpu_busy_percent", "250\n")]);
    std::fs::create_dir_all(root.path().join("card1-DP-1")).unwrap();
    std::fs::create_dir_all(root.path().join("renderD128")).unwrap();
    let cards = read_sysfs(root.path()).unwrap();
    assert_eq!(
        cards,
        [
            SysfsGpu {
                card: "card1".into(),
                pdev: Some("0000:0c:00.0".into()),
                vram_total_mib: Some(196592),
                vram_used_mib: Some(284),
                busy_pct: Some(7),
            },
            SysfsGpu {
                card: "card2".into(),
                pdev: Some("0000:0c:00.0".into()),
                vram_total_mib: None,
                vram_used_mib: None,
                busy_pct: None,
            },
        ]
    );
}

#[test]
fn a_command_sees_only_its_amd_gpus() {
    assert_eq!(
        child_env(&[3, 2, 3]),
        [
            ("ROCR_VISIBLE_DEVICES", "2,3".to_owned()),
            ("HIP_VISIBLE_DEVICES", "0,1".to_owned()),
            ("CUDA_VISIBLE_DEVICES", "0,1".to_owned()),
        ]
    );
    assert!(child_env(&[]).is_empty());
}

#[test]
fn the_kernel_alone_describes_amd_gpus_and_says_when_it_cannot_see_everyone() {
    use std::os::unix::fs::symlink;
    let sys = tempfile::tempdir().unwrap();
    let device = sys.path().join("card1/device");
    std::fs::create_dir_all(&device).unwrap();
    std::fs::write(
        device.join("uevent"),
        "DRIVER=amdgpu\nPCI_SLOT_NAME=0000:0c:00.0\n",
    )
    .unwrap();
    std::fs::write(device.join("mem_info_vram_total"), "206141652992\n").unwrap();
    std::fs::write(device.join("mem_info_vram_used"), "40802189312\n").unwrap();
    let proc_root = tempfile::tempdir().unwrap();
    let p = proc_root.path().join("4242");
    std::fs::create_dir_all(p.join("fd")).unwrap();
    std::fs::create_dir_all(p.join("fdinfo")).unwrap();
    symlink("/dev/dri/renderD128", p.join("fd/7")).unwrap();
    std::fs::write(p.join("fdinfo/7"), fixture("drm-fdinfo/amdgpu-6.12.txt")).unwrap();
    let DeviceReport::Devices(devices) = drm_devices(sys.path(), proc_root.path()).unwrap() else {
        panic!("expected devices");
    };
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].uuid, "0000:0c:00.0");
    assert_eq!(devices[0].memory_total_mib, Some(196592));
    let on: Vec<(u32, Option<u64>)> = devices[0]
        .processes
        .iter()
        .map(|p| (p.pid, p.used_mib))
        .collect();
    assert_eq!(on, [(4242, Some(38912))]);
    assert_eq!(devices[0].processes_unknown, None);
    // Another user's process whose descriptors cannot be read: unknown.
    let hidden = proc_root.path().join("4343");
    std::fs::create_dir_all(&hidden).unwrap();
    std::fs::write(hidden.join("fd"), "").unwrap();
    let DeviceReport::Devices(devices) = drm_devices(sys.path(), proc_root.path()).unwrap() else {
        panic!("expected devices");
    };
    assert!(devices[0].processes_unknown.is_some());
    // No amdgpu card: nothing to say.
    let empty = tempfile::tempdir().unwrap();
    assert_eq!(drm_devices(empty.path(), proc_root.path()), None);
}
