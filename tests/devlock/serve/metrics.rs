//! What is served as data: `/status.json` against `status --json`, and
//! `/metrics` through promtool and by value.

use super::*;

test!(status_json_is_status_json_without_command_lines, needs: [Tool("cc")]);
pub(crate) fn status_json_is_status_json_without_command_lines() {
    let scene = Scene::new();
    let server = scene.serve();
    let answer = server.get("/status.json");
    assert_eq!(answer.header("content-type"), Some("application/json"));
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    let served = answer.json();
    let status = json_of(&scene.devlock().args(["status", "--json"]).output().unwrap());
    // status shows the command line, secret and all; serve never does.
    assert!(status.to_string().contains(SECRET), "{status}");
    assert!(!answer.body.contains("hunter2"), "{}", answer.body);
    for holder in holders(&served) {
        assert!(holder["command"].is_null(), "{holder}");
    }
    assert_eq!(without_moments(&served), without_moments(&status));
    // The scene is all there: holder, waiter, the GPUs, the stranger.
    let gpu0 = served["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "gpu:0")
        .unwrap();
    assert_eq!(gpu0["state"], "held");
    assert_eq!(gpu0["holders"][0]["step"], "train");
    assert_eq!(gpu0["holders"][0]["pid"], scene.holder.id());
    assert_eq!(gpu0["waiters"][0]["step"], "eval");
    assert_eq!(gpu0["waiters"][0]["pid"], scene.waiter.id());
    assert_eq!(served["device_source"], "nvml");
    assert_eq!(served["devices"][2]["processes"][0]["gated"], false);
    // The same document, byte for byte in its shape, as status prints it.
    assert!(answer.body.ends_with("}\n") && answer.body.starts_with("{\n  \"dir\""));
    for path in ["/", "/metrics"] {
        assert!(!server.get(path).body.contains("hunter2"), "{path}");
    }
}

/// `/metrics` as `name{labels}` → value.
pub(crate) fn samples(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            let value = if value == "NaN" {
                f64::NAN
            } else {
                value.parse().unwrap()
            };
            (series.to_owned(), value)
        })
        .collect()
}

pub(crate) fn promtool_check(text: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        stdout(&out),
        stderr(&out)
    );
}

test!(metrics_pass_promtool_and_carry_the_values, needs: [Tool("cc"), Tool("promtool")]);
pub(crate) fn metrics_pass_promtool_and_carry_the_values() {
    let scene = Scene::new();
    let server = scene.serve();
    let answer = server.get("/metrics");
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    promtool_check(&answer.body);
    let m = samples(&answer.body);
    let value = |series: &str| -> f64 {
        *m.get(series)
            .unwrap_or_else(|| panic!("no {series} in\n{}", answer.body))
    };
    the_lock_and_holder_series_carry_the_scene(&scene, &value);
    the_gpu_series_carry_the_fakes_figures(&value);
    let status = json_of(&scene.devlock().args(["status", "--json"]).output().unwrap());
    let managed = status["trust"]["managed"].as_bool().unwrap();
    assert_eq!(
        value("devlock_dir_managed"),
        if managed { 1.0 } else { 0.0 }
    );
    assert!(value("devlock_status_duration_seconds") > 0.0);
    a_failing_gpu_source_is_unknown();
}

/// The scene's locks, holders and waiters, each a series of its own.
fn the_lock_and_holder_series_carry_the_scene(scene: &Scene, value: &dyn Fn(&str) -> f64) {
    let (holder, waiter, solver) = (scene.holder.id(), scene.waiter.id(), scene.solver.id());
    assert_eq!(
        value(r#"devlock_lock_state{resource="gpu:0",state="held"}"#),
        1.0
    );
    assert_eq!(
        value(r#"devlock_lock_state{resource="gpu:0",state="free"}"#),
        0.0
    );
    assert_eq!(
        value(r#"devlock_lock_state{resource="licence",state="held"}"#),
        1.0
    );
    assert_eq!(value(r#"devlock_lock_holders{resource="gpu:0"}"#), 1.0);
    assert_eq!(value(r#"devlock_lock_waiters{resource="gpu:0"}"#), 1.0);
    assert_eq!(value(r#"devlock_lock_waiters{resource="licence"}"#), 0.0);
    let held = value(&format!(
        r#"devlock_holder_held_seconds{{resource="gpu:0",step="train",user="root",pid="{holder}",via=""}}"#
    ));
    assert!((0.0..3600.0).contains(&held), "{held}");
    // The group's row, held for the member.
    value(&format!(
        r#"devlock_holder_held_seconds{{resource="gpu",step="train",user="root",pid="{holder}",via="gpu:0"}}"#
    ));
    value(&format!(
        r#"devlock_holder_held_seconds{{resource="licence",step="solver",user="root",pid="{solver}",via=""}}"#
    ));
    let waited = value(&format!(
        r#"devlock_waiter_waiting_seconds{{resource="gpu:0",step="eval",user="root",pid="{waiter}",position="1"}}"#
    ));
    assert!(waited.is_finite() && waited >= 0.0, "{waited}");
    assert_eq!(
        value(&format!(
            r#"devlock_holder_gpu_memory_used_bytes{{resource="gpu:0",step="train",user="root",pid="{holder}",gpu="0"}}"#
        )),
        38912.0 * MIB
    );
}

/// The fake's GPUs, in base units.
fn the_gpu_series_carry_the_fakes_figures(value: &dyn Fn(&str) -> f64) {
    assert_eq!(
        value(r#"devlock_gpu_memory_total_bytes{gpu="0"}"#),
        81559.0 * MIB
    );
    assert_eq!(
        value(r#"devlock_gpu_memory_used_bytes{gpu="0"}"#),
        38925.0 * MIB
    );
    assert_eq!(
        value(r#"devlock_gpu_memory_gated_bytes{gpu="0"}"#),
        38912.0 * MIB
    );
    assert_eq!(value(r#"devlock_gpu_memory_ungated_bytes{gpu="0"}"#), 0.0);
    assert_eq!(value(r#"devlock_gpu_utilization_ratio{gpu="0"}"#), 0.97);
    assert_eq!(value(r#"devlock_gpu_processes{gpu="0",gated="true"}"#), 1.0);
    assert_eq!(
        value(r#"devlock_gpu_processes{gpu="2",gated="false"}"#),
        2.0
    );
    assert_eq!(
        value(r#"devlock_gpu_memory_ungated_bytes{gpu="2"}"#),
        (30720.0 + 30716.0) * MIB
    );
    assert_eq!(value(r#"devlock_gpu_utilization_ratio{gpu="1"}"#), 0.0);
    value(
        r#"devlock_gpu_info{gpu="0",uuid="GPU-5f3c1a2b-7d4e-4c1f-9a8b-1c2d3e4f5a60",name="NVIDIA H100 80GB HBM3"}"#,
    );
    assert_eq!(value(r#"devlock_device_source_info{source="nvml"}"#), 1.0);
    assert_eq!(value(r#"devlock_device_status{status="ok"}"#), 1.0);
    assert_eq!(value(r#"devlock_device_status{status="unknown"}"#), 0.0);
}

/// A GPU source that fails is unknown, not a GPU with nothing on it.
fn a_failing_gpu_source_is_unknown() {
    let other = Scratch::new();
    let failing = fake_nvml(&other, "error nvmlInit_v2 - 999\n");
    let broken = Server::start(
        with_nvml(&other, &failing, &[]).env("DEVLOCK_NVIDIA_SMI", "/nonexistent"),
        &[],
    );
    let text = broken.get("/metrics").body;
    promtool_check(&text);
    let m = samples(&text);
    assert_eq!(
        m[r#"devlock_device_status{status="unknown"}"#], 1.0,
        "{text}"
    );
    assert!(!text.contains("devlock_gpu_memory_used_bytes{"), "{text}");
}
