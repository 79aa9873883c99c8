//! `devlock report`'s figures for a scripted week against the hand-computed
//! ones, and the record lines the page's tests plant too.

use super::*;

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// 2026-11-23T00:00:00Z, a Monday.
const WEEK: u64 = 1_795_392_000_000;
pub(crate) const H: u64 = 3_600_000;
const D: u64 = 24 * H;

pub(crate) fn start_line(
    job: &str,
    step: &str,
    resources: &[&str],
    gpus: &[u32],
    at: u64,
    waited_s: u64,
    mem: Option<u64>,
) -> String {
    let mem = mem.map_or(String::new(), |m| format!(",\"mem_mib\":{m}"));
    format!(
        "{{\"event\":\"start\",\"v\":1,\"job\":\"{job}\",\"resources\":{},\"gpus\":{},\"step\":\"{step}\",\
         \"pid\":1,\"pid_start\":1,\"boot_id\":\"old-boot\",\"start_ms\":{at},\"waited_ms\":{}{mem},\"from\":\"cli\"}}\n",
        serde_json::json!(resources),
        serde_json::json!(gpus),
        waited_s * 1000
    )
}

pub(crate) fn end_line(
    job: &str,
    at: u64,
    how: &str,
    busy: u64,
    idle: u64,
    sampled: u64,
    peak: Option<u64>,
) -> String {
    let peak = peak.map_or(String::new(), |p| format!(",\"peak_mib\":{p}"));
    format!(
        "{{\"event\":\"end\",\"v\":1,\"job\":\"{job}\",\"end_ms\":{at},\"how\":\"{how}\",\"samples\":9,\
         \"busy_gpu_s\":{busy},\"idle_gpu_s\":{idle},\"sampled_gpu_s\":{sampled}{peak}}}\n"
    )
}

/// The scripted week's usage lines (and one that is no usage line): J1 to
/// J5, J4 outside the week.
fn scripted_week() -> String {
    let mut text = String::new();
    // J1 Monday 10:00-12:00 on gpu:0: 1 h of 2 computing, 0.5 idle, waited 60 s.
    text += &start_line("j1", "train", &["gpu:0"], &[0], WEEK + 10 * H, 60, None);
    text += &end_line("j1", WEEK + 12 * H, "exit", 3600, 1800, 7200, Some(5000));
    // J2 Tuesday 23:00 to Wednesday 01:00 on two GPUs, a 20 GiB budget
    // whose peak was 10 GiB, waited 5 min.
    text += &start_line(
        "j2",
        "eval",
        &["gpu:0", "gpu:1"],
        &[0, 1],
        WEEK + D + 23 * H,
        300,
        Some(20480),
    );
    text += &end_line(
        "j2",
        WEEK + 2 * D + H,
        "exit",
        7200,
        3600,
        14400,
        Some(10240),
    );
    // J3 Thursday 08:00, devlock killed: its last progress line at 09:30.
    text += &start_line(
        "j3",
        "train",
        &["gpu:1"],
        &[1],
        WEEK + 3 * D + 8 * H,
        0,
        None,
    );
    text += &format!(
        "{{\"event\":\"progress\",\"v\":1,\"job\":\"j3\",\"at_ms\":{},\"busy_gpu_s\":1800,\
         \"idle_gpu_s\":3600,\"sampled_gpu_s\":5400}}\n",
        WEEK + 3 * D + 9 * H + H / 2
    );
    // J5 Friday 10:00-11:00, stopped idle.
    text += &start_line(
        "j5",
        "notebook",
        &["gpu:1"],
        &[1],
        WEEK + 4 * D + 10 * H,
        0,
        None,
    );
    text += &end_line("j5", WEEK + 4 * D + 11 * H, "idle", 0, 3600, 3600, None);
    // J4 the Tuesday after: outside the window.
    text += &start_line("j4", "train", &["gpu:0"], &[0], WEEK + 8 * D, 0, None);
    text += &end_line("j4", WEEK + 8 * D + H, "exit", 3600, 0, 3600, None);
    text += "not json\n";
    text
}

/// `devlock report --json` over the scripted week, with `args`.
fn week_report(s: &Scratch, args: &[&str]) -> serde_json::Value {
    let out = s
        .devlock()
        .args([
            "report",
            "--json",
            "--since",
            "2026-11-23",
            "--until",
            "2026-11-30",
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Whether a figure is `want`, to a millionth.
fn close(v: &serde_json::Value, want: f64) -> bool {
    (v.as_f64().unwrap() - want).abs() < 1e-6
}

/// The week's totals, and the note on the line it skipped.
fn assert_week_totals(s: &Scratch, uid: nix::unistd::Uid) {
    let r = week_report(s, &[]);
    let t = &r["total"];
    assert_eq!(t["jobs"], 4, "{r:#}");
    assert!(close(&t["gpu_hours"], 8.5), "{t:#}");
    assert!(close(&t["gpu_hours_computing"], 3.5), "{t:#}");
    assert!(close(&t["gpu_hours_idle"], 3.5), "{t:#}");
    assert!(
        close(&t["wait_s"], 360.0) && close(&t["longest_wait_s"], 300.0),
        "{t:#}"
    );
    assert_eq!(t["budget_mib"], 20480);
    assert_eq!(t["peak_mib_of_budgeted"], 10240);
    assert_eq!(t["peak_mib"], 10240);
    assert_eq!(t["stopped_idle"], 1);
    assert_eq!(t["observed_later"], 1);
    assert_eq!(
        r["notes"],
        serde_json::json!([format!(
            "{uid}.jsonl: 1 line skipped, unreadable or out of bounds \
             (line 11: not a usage line (JSON))"
        )])
    );
}

/// The week by day, by resource and by step.
fn assert_week_rows(s: &Scratch) {
    let rows = |r: &serde_json::Value| -> Vec<(String, f64, f64, u64)> {
        r["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                (
                    row["key"].as_str().unwrap().to_owned(),
                    (row["gpu_hours"].as_f64().unwrap() * 1e6).round() / 1e6,
                    (row["gpu_hours_computing"].as_f64().unwrap() * 1e6).round() / 1e6,
                    row["jobs"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let row = |k: &str, g: f64, c: f64, j: u64| (k.to_owned(), g, c, j);
    assert_eq!(
        rows(&week_report(s, &["--by", "day"])),
        vec![
            row("2026-11-23", 2.0, 1.0, 1),
            row("2026-11-24", 2.0, 1.0, 1),
            row("2026-11-25", 2.0, 1.0, 1),
            row("2026-11-26", 1.5, 0.5, 1),
            row("2026-11-27", 1.0, 0.0, 1),
        ]
    );
    assert_eq!(
        rows(&week_report(s, &["--by", "resource"])),
        vec![row("gpu:0", 4.0, 2.0, 2), row("gpu:1", 4.5, 1.5, 3)]
    );
    assert_eq!(
        rows(&week_report(s, &["--by", "step"])),
        vec![
            row("eval", 4.0, 2.0, 1),
            row("notebook", 1.0, 0.0, 1),
            row("train", 3.5, 1.5, 2)
        ]
    );
}

/// A window that cuts J2 at midnight counts its first hour.
fn assert_a_window_cuts_a_job(s: &Scratch) {
    let out = s
        .devlock()
        .args([
            "report",
            "--json",
            "--since",
            "2026-11-24T00:00:00Z",
            "--until",
            "2026-11-25T00:00:00Z",
        ])
        .output()
        .unwrap();
    let cut: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(close(&cut["total"]["gpu_hours"], 2.0), "{cut:#}");
    assert!(close(&cut["total"]["gpu_hours_computing"], 1.0), "{cut:#}");
    assert!(close(&cut["total"]["wait_s"], 300.0), "{cut:#}");
}

/// CSV and the table carry the same figures.
fn assert_csv_and_table_agree(s: &Scratch, uid: nix::unistd::Uid) {
    let out = s
        .devlock()
        .args([
            "report",
            "--csv",
            "--by",
            "step",
            "--since",
            "2026-11-23",
            "--until",
            "2026-11-30",
        ])
        .output()
        .unwrap();
    let csv = stdout(&out);
    assert!(csv.starts_with("key,jobs,hours,gpu_hours,"), "{csv}");
    assert!(
        csv.lines()
            .any(|l| l.starts_with("total,4,") && l.contains(",8.5000,3.5000,3.5000,")),
        "{csv}"
    );
    let out = s
        .devlock()
        .args(["report", "--since", "2026-11-23", "--until", "2026-11-30"])
        .output()
        .unwrap();
    let table = stdout(&out);
    let total = table.lines().find(|l| l.starts_with("total")).unwrap();
    let cells: Vec<&str> = total.split_whitespace().collect();
    assert_eq!(
        &cells[..6],
        ["total", "4", "8.50", "41%", "3.50", "6m00s"],
        "{table}"
    );
    assert!(
        total.contains("20GiB/10GiB") && total.contains("1 idle, 1 killed"),
        "{table}"
    );
    assert!(
        stderr(&out).contains(&format!(
            "devlock: note: {uid}.jsonl: 1 line skipped, unreadable or out of bounds"
        )),
        "{}",
        stderr(&out)
    );
}

test!(report_figures_for_a_scripted_week_match_the_hand_computed_ones, needs: []);
pub(crate) fn report_figures_for_a_scripted_week_match_the_hand_computed_ones() {
    let s = Scratch::new();
    std::fs::create_dir(s.usage_dir()).unwrap();
    let text = scripted_week();
    let uid = nix::unistd::geteuid();
    std::fs::write(s.usage_dir().join(format!("{uid}.jsonl")), text).unwrap();
    assert_week_totals(&s, uid);
    assert_week_rows(&s);
    assert_a_window_cuts_a_job(&s);
    assert_csv_and_table_agree(&s, uid);
}
