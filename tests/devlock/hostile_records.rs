//! Usage records as hostile input (issue 32, cases 2 and 3), through the
//! real binary: what a user writes into their own usage file (a wait of
//! 2^64-1 ms, an end in the year 10000, a GPU listed 7,900 times, a day of
//! thousands of holds with the worst steps for HTML) never aborts, stalls or
//! balloons anyone's `devlock report` or `devlock serve`. Lines out of
//! bounds are skipped and counted in one note naming the file; `/` stays
//! under its stated size. Played by the test's own user, then across users
//! (USER_A writes, root and USER_B read) with the shared-machine helpers.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use crate::harness::*;
use crate::serve::Server;
use crate::shared_machine::{devlock_as, write_as};

const H: u64 = 3_600_000;

/// 10000-01-01T00:00:00Z: past what RFC 3339 can write.
const YEAR_10000_MS: u64 = 253_402_300_800_000;

/// The largest pid a line may name (Linux's `PID_MAX_LIMIT`), which no
/// process has (pids stay below it): no hold here reads as running.
const GONE_PID: u32 = 4 * 1024 * 1024;

/// What `/` may weigh for 8 GPUs whose locks are free, whatever the records
/// hold: 96 marks of at most 512 bytes per GPU (48 KiB), and the rest of
/// the page (devlock-serve(1), ENDPOINTS).
const PAGE_OF_8_GPUS: usize = 400 * 1024;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn start_line(
    job: &str,
    gpus: &serde_json::Value,
    start_ms: u64,
    waited_ms: u64,
    step: &str,
) -> String {
    let line = serde_json::json!({
        "event": "start", "v": 1, "job": job, "resources": ["gpu"], "gpus": gpus,
        "step": step, "pid": GONE_PID, "pid_start": 1, "start_ms": start_ms,
        "waited_ms": waited_ms, "from": "cli",
    });
    format!("{line}\n")
}

fn end_line(job: &str, end_ms: u64) -> String {
    let line = serde_json::json!({
        "event": "end", "v": 1, "job": job, "end_ms": end_ms, "how": "exit", "code": 0,
        "sampled_gpu_s": 60, "busy_gpu_s": 30, "idle_gpu_s": 0,
    });
    format!("{line}\n")
}

/// One honest hold an hour ago that waited 7 s, then 1,100 start lines
/// whose wait is 2^64-1 ms (their sum overflowed into an abort).
fn endless_waits(now: u64) -> String {
    let mut text = start_line("honest", &serde_json::json!([0]), now - H, 7000, "honest");
    text += &end_line("honest", now - H + 60_000);
    for i in 0..1100 {
        let job = format!("wait-{i}");
        text += &start_line(
            &job,
            &serde_json::json!([0]),
            now - H + i,
            u64::MAX,
            "endless",
        );
    }
    text
}

/// A hold whose end line says the year 10000 (whose formatting aborted
/// every `report --json`), and a hold that starts then.
fn ends_in_year_10000(now: u64) -> String {
    let mut text = start_line("far", &serde_json::json!([1]), now - 2 * H, 0, "far");
    text += &end_line("far", YEAR_10000_MS);
    text += &start_line("later", &serde_json::json!([1]), YEAR_10000_MS, 0, "later");
    text
}

/// 200 start lines each listing gpu 0 7,900 times (each made 7,900 marks
/// on the page: 800 MB a request).
fn gpu_0_listed_7900_times(now: u64) -> String {
    let gpus = serde_json::json!(vec![0; 7900]);
    (0..200)
        .map(|i| start_line(&format!("many-{i}"), &gpus, now - H + i, 0, "many"))
        .collect()
}

/// 2,000 holds of 8 GPUs spread over the last 24 hours, each with the
/// step that costs the page the most (256 quotes: 6 bytes each in HTML).
fn a_day_of_holds(now: u64) -> String {
    let step = "\"".repeat(256);
    let gpus = serde_json::json!((0..8).collect::<Vec<u32>>());
    let mut text = String::new();
    for i in 0..2000u64 {
        let (job, at) = (format!("day-{i}"), now - 23 * H + i * 40_000);
        text += &start_line(&job, &gpus, at, 0, &step);
        text += &end_line(&job, at + 20_000);
    }
    text
}

/// `devlock report ARGS` from `devlock` exits 0, and says once that it
/// skipped `skipped` lines of `file`: on stderr, or in --json's notes.
fn report_skips(
    devlock: &dyn Fn() -> Command,
    args: &[&str],
    file: &str,
    skipped: usize,
) -> String {
    let out = devlock().arg("report").args(args).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "report {args:?}: {}",
        stderr(&out)
    );
    let said = format!("{file}: {skipped} lines skipped, unreadable or out of bounds");
    let notes = if args.contains(&"--json") {
        json_of(&out)["notes"].to_string()
    } else {
        stderr(&out)
    };
    assert_eq!(notes.matches(&said).count(), 1, "{args:?}: {notes}");
    stdout(&out)
}

/// Every form of the report over a usage directory holding `file`.
fn every_report_skips(devlock: &dyn Fn() -> Command, file: &str, skipped: usize) {
    for by in ["user", "resource", "step", "day"] {
        report_skips(devlock, &["--since", "2d", "--by", by], file, skipped);
        report_skips(
            devlock,
            &["--since", "2d", "--csv", "--by", by],
            file,
            skipped,
        );
        report_skips(
            devlock,
            &["--since", "2d", "--json", "--by", by],
            file,
            skipped,
        );
    }
}

test!(waits_of_2_64_ms_are_skipped_and_counted_and_report_exits_0, needs: []);
pub(crate) fn waits_of_2_64_ms_are_skipped_and_counted_and_report_exits_0() {
    let s = Scratch::new();
    std::fs::create_dir(s.usage_dir()).unwrap();
    let file = format!("{}.jsonl", nix::unistd::geteuid());
    std::fs::write(s.usage_dir().join(&file), endless_waits(now_ms())).unwrap();
    let devlock = || s.devlock();
    every_report_skips(&devlock, &file, 1100);
    // The honest hold counts, with its own wait only.
    let doc: serde_json::Value = serde_json::from_str(&report_skips(
        &devlock,
        &["--json", "--since", "2d"],
        &file,
        1100,
    ))
    .unwrap();
    assert_eq!(doc["total"]["jobs"], 1, "{doc:#}");
    assert_eq!(doc["total"]["wait_s"], 7.0, "{doc:#}");
    assert_eq!(doc["jobs"][0]["step"], "honest");
    assert!(
        doc["notes"][0]
            .as_str()
            .unwrap()
            .ends_with("(line 3: waited_ms: longer than since the epoch)"),
        "{doc:#}"
    );
}

test!(an_end_in_the_year_10000_leaves_report_json_working, needs: []);
pub(crate) fn an_end_in_the_year_10000_leaves_report_json_working() {
    let s = Scratch::new();
    std::fs::create_dir(s.usage_dir()).unwrap();
    let file = format!("{}.jsonl", nix::unistd::geteuid());
    std::fs::write(s.usage_dir().join(&file), ends_in_year_10000(now_ms())).unwrap();
    let devlock = || s.devlock();
    every_report_skips(&devlock, &file, 2);
    // The hold counts up to its start (its end line is not believed), and
    // a window to the last day RFC 3339 can write is still written.
    let out = report_skips(
        &devlock,
        &["--json", "--since", "2d", "--until", "9999-12-31T23:59:59Z"],
        &file,
        2,
    );
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["until"], "9999-12-31T23:59:59Z", "{doc:#}");
    let jobs = doc["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{doc:#}");
    assert_eq!(jobs[0]["step"], "far");
    assert_eq!(jobs[0]["ending"], "observed-later");
    assert_eq!(jobs[0]["start"], jobs[0]["end"]);
}

/// Makes `gpu:0` to `gpu:7` lock files (a card each on the page).
fn eight_gpus(s: &Scratch) {
    for n in 0..8 {
        let out = s.run(&["-n", &format!("gpu:{n}"), "--", "true"]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

/// `/` from `server`: within [`PAGE_OF_8_GPUS`], a card for each of the
/// 8 GPUs, GPU N's day counting `holds[N]` holds.
fn page_is_bounded(server: &Server, holds: [usize; 8]) -> String {
    let page = server.get("/");
    assert_eq!(page.status, 200, "{}", page.body);
    let page = page.body;
    assert!(page.len() < PAGE_OF_8_GPUS, "/ is {} bytes", page.len());
    for (n, holds) in holds.iter().enumerate() {
        let card = page
            .split(&format!("id=\"gpu-{n}\""))
            .nth(1)
            .unwrap_or_else(|| panic!("no gpu:{n}"));
        let card = card.split("</article>").next().unwrap();
        assert!(
            card.contains(&format!("by {holds} holds</p>")),
            "gpu:{n}: {card}"
        );
    }
    assert!(!page.contains("\"\"\""), "the steps' quotes are escaped");
    page
}

test!(a_gpu_listed_7900_times_leaves_the_page_small, needs: []);
pub(crate) fn a_gpu_listed_7900_times_leaves_the_page_small() {
    let s = Scratch::new();
    eight_gpus(&s);
    let now = now_ms();
    let file = s
        .usage_dir()
        .join(format!("{}.jsonl", nix::unistd::geteuid()));
    std::fs::write(&file, gpu_0_listed_7900_times(now) + &a_day_of_holds(now)).unwrap();
    let server = Server::start(&mut s.devlock(), &[]);
    let page = page_is_bounded(&server, [2000; 8]);
    // Past 96 holds a GPU's day is drawn a mark per quarter of an hour.
    let marks = page.matches("<span class=\"hold").count();
    assert!((8..=8 * 96).contains(&marks), "{marks} marks");
    assert!(page.contains(" holds, "), "merged marks say how many");
    // The 200 lines were skipped, not drawn: the report says so.
    let out = s.run(&["report", "--since", "2d"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("jsonl: 200 lines skipped, unreadable or out of bounds (line 1: gpus:"),
        "{}",
        stderr(&out)
    );
}

test!(one_users_hostile_records_leave_root_and_others_report_and_serve_working, needs: [Root, Tool("setpriv")]);
pub(crate) fn one_users_hostile_records_leave_root_and_others_report_and_serve_working() {
    let s = Scratch::new();
    // The usage directory as root's devlock makes it: sticky, open to all.
    std::fs::create_dir(s.usage_dir()).unwrap();
    std::fs::set_permissions(s.usage_dir(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    eight_gpus(&s);
    // Only USER_A's records, below.
    std::fs::remove_file(s.usage_dir().join("0.jsonl")).unwrap();
    let as_user = |uid: u32| {
        let mut cmd = devlock_as(&s, uid);
        cmd.env("DEVLOCK_USAGE_DIR", s.usage_dir())
            .env("DEVLOCK_NVML", "none");
        cmd
    };
    // USER_A's own devlock makes USER_A's file; USER_A then fills it.
    let out = as_user(USER_A)
        .args(["-n", "mine", "--", "true"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let file = format!("{USER_A}.jsonl");
    let now = now_ms();
    let text = endless_waits(now)
        + &ends_in_year_10000(now)
        + &gpu_0_listed_7900_times(now)
        + &a_day_of_holds(now);
    write_as(USER_A, &s.usage_dir().join(&file), text.as_bytes());
    // 1,100 waits, the end in 10000 and the hold then, the 200 lists.
    let skipped = 1100 + 2 + 200;
    let by_root = || as_user(0);
    every_report_skips(&by_root, &file, skipped);
    let by_user_b = || as_user(USER_B);
    every_report_skips(&by_user_b, &file, skipped);
    // The records count for USER_A alone, as the kernel says.
    let doc: serde_json::Value = serde_json::from_str(&report_skips(
        &by_user_b,
        &["--json", "--since", "2d"],
        &file,
        skipped,
    ))
    .unwrap();
    let users: Vec<&str> = doc["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    let user_a = nix::unistd::User::from_uid(USER_A.into())
        .ok()
        .flatten()
        .map_or(USER_A.to_string(), |u| u.name);
    assert_eq!(users, [user_a.as_str()], "{doc:#}");
    // An unprivileged serve (as the shipped unit runs it) stays small too.
    let server = Server::start(&mut as_user(USER_B), &[]);
    // The day's holds, and on gpu:0 the honest one, on gpu:1 the one that
    // ended "in 10000" (counted to its start).
    page_is_bounded(&server, [2001, 2001, 2000, 2000, 2000, 2000, 2000, 2000]);
}
