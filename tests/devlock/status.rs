//! `devlock status` and the waiting display: kernel truth first, records as
//! labels, waiters that clean up after themselves, and several users.

use std::io::{BufReader, Read};
use std::process::{Child, Command, Stdio};

use devlock::testing::record::Record;

use crate::harness::*;

mod table;

/// Plain util-linux flock holding `resource` until released.
fn flock_holder(s: &Scratch, resource: &str, tag: &str) -> Child {
    std::fs::create_dir_all(s.dir()).unwrap();
    let (script, ready) = wait_for_release(s, tag);
    let child = Command::new("/usr/bin/flock")
        .arg(s.lock_path(resource))
        .args(["sh", "-c", &script])
        .spawn()
        .unwrap();
    wait_for_file(&ready);
    child
}

fn waiter(s: &Scratch, resource: &str, step: &str) -> Child {
    s.devlock()
        .args(["-q", "--step", step, resource, "--", "true"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn waiter_count(view: &serde_json::Value) -> usize {
    view["waiters"].as_array().map_or(0, Vec::len)
}

test!(status_names_the_holder_in_both_forms, needs: []);
pub(crate) fn status_names_the_holder_in_both_forms() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "trainer", "gpu"], "h");
    let json = s.status_json(&[]);
    assert_eq!(json["dir"], s.dir().display().to_string());
    let gpu = &json["resources"][0];
    assert_eq!(gpu["name"], "gpu");
    assert_eq!(gpu["state"], "held");
    let h = &gpu["holders"][0];
    assert_eq!(h["step"], "trainer");
    assert_eq!(h["pid"], holder.id());
    assert_eq!(h["user"], whoami());
    for field in ["since", "held_for_ms", "command"] {
        assert!(!h[field].is_null(), "{field} missing in {h}");
    }
    assert_eq!(h["command"][0], "sh");
    assert!(gpu["waiters"].as_array().unwrap().is_empty());

    let out = s.run(&["status"]);
    let table = stdout(&out);
    let mut lines = table.lines();
    let header = lines.next().unwrap();
    assert!(header.starts_with("RESOURCE  STATE"), "{table}");
    let row = lines.next().unwrap();
    assert!(
        row.starts_with("gpu") && row.contains("held") && row.contains("trainer"),
        "{table}"
    );
    assert!(row.contains(&holder.id().to_string()), "{table}");
    assert_eq!(
        header.find("STEP"),
        row.find("trainer"),
        "columns align:\n{table}"
    );
    assert!(!table.contains('\x1b'), "no colour when not a terminal");
    release(&s, "h");
    wait_child(&mut holder);
    assert_eq!(s.resource_status("gpu")["state"], "free");
}

fn whoami() -> String {
    devlock::testing::procfs::user_name(nix::unistd::getuid().as_raw())
}

test!(waiters_show_in_arrival_order_and_vanish_when_killed, needs: []);
pub(crate) fn waiters_show_in_arrival_order_and_vanish_when_killed() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let mut first = waiter(&s, "r", "first");
    s.wait_for_status("r", "first waiter", |v| registered_waiters(v) == 1);
    let mut second = waiter(&s, "r", "second");
    let view = s.wait_for_status("r", "second waiter", |v| registered_waiters(v) == 2);
    let w = &view["waiters"];
    assert_eq!(
        (w[0]["step"].as_str(), w[0]["position"].as_u64()),
        (Some("first"), Some(1))
    );
    assert_eq!(
        (w[1]["step"].as_str(), w[1]["position"].as_u64()),
        (Some("second"), Some(2))
    );
    assert_eq!(w[0]["pid"], first.id());
    for field in ["user", "since", "waiting_for_ms"] {
        assert!(!w[0][field].is_null(), "{field} missing in {w}");
    }
    let table = stdout(&s.run(&["status", "r"]));
    assert!(
        table.contains("waits #1") && table.contains("waits #2"),
        "{table}"
    );

    // kill -9 of a waiter: gone from status at once, and its file swept.
    first.kill().unwrap();
    first.wait().unwrap();
    let view = s.resource_status("r");
    assert_eq!(waiter_count(&view), 1, "{view}");
    assert_eq!(view["waiters"][0]["step"], "second");
    assert_eq!(view["waiters"][0]["position"], 1);
    let leftovers: Vec<_> = std::fs::read_dir(s.dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&format!("@{}.", first.id())))
        .collect();
    assert!(
        leftovers.is_empty(),
        "dead waiter's file left: {leftovers:?}"
    );

    release(&s, "h");
    wait_child(&mut holder);
    assert!(wait_child(&mut second).success());
    let view = s.resource_status("r");
    assert_eq!(
        (view["state"].as_str(), waiter_count(&view)),
        (Some("free"), 0)
    );
}

test!(a_waiters_time_counts_from_its_wait_not_its_registration, needs: []);
/// A plain waiter registers once it has waited 100 ms, and its record says
/// when its wait began: status counts its time from then, never from the
/// registration (read at once, it would say 0 ms).
pub(crate) fn a_waiters_time_counts_from_its_wait_not_its_registration() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    let mut w = Killed(waiter(&s, "r", "w"));
    let view = s.wait_for_status("r", "the waiter", |v| registered_waiters(v) == 1);
    let waited = view["waiters"][0]["waiting_for_ms"].as_u64().unwrap();
    assert!(waited >= 100, "waited {waited} ms by its record: {view}");
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut w.0).success());
}

test!(a_killed_holder_leaves_nothing_behind, needs: []);
pub(crate) fn a_killed_holder_leaves_nothing_behind() {
    let s = Scratch::new();
    let pidfile = s.work("pid");
    let ready = s.work("ready");
    let mut holder = s.hold(
        &["r"],
        &format!(
            "echo $$ > {}; echo > {}; exec sleep 1000",
            pidfile.display(),
            ready.display()
        ),
        &ready,
    );
    let command = pid_in(&pidfile);
    // The command is devlock's process: one SIGKILL ends the hold.
    assert_eq!(command, holder.id());
    holder.kill().unwrap();
    holder.wait().unwrap();
    wait_gone(command);
    let view = s.resource_status("r");
    assert_eq!(view["state"], "free", "{view}");
    assert!(view["holders"].as_array().unwrap().is_empty());
}

test!(plain_flock_holder_shows_as_the_pid_the_kernel_names, needs: []);
pub(crate) fn plain_flock_holder_shows_as_the_pid_the_kernel_names() {
    let s = Scratch::new();
    let mut holder = flock_holder(&s, "r", "f");
    let view = s.resource_status("r");
    assert_eq!(view["state"], "held");
    let h = &view["holders"][0];
    assert_eq!(h["pid"], holder.id());
    assert_eq!(h["source"], "no-record");
    assert!(h["step"].is_null());
    assert_eq!(h["name"], "flock");
    assert_eq!(h["command"][0], "/usr/bin/flock", "the live command line");
    let table = stdout(&s.run(&["status"]));
    assert!(table.contains("(flock, no record)"), "{table}");
    release(&s, "f");
    wait_child(&mut holder);
}

fn plant_record(s: &Scratch, resource: &str, record: &Record) {
    std::fs::create_dir_all(s.dir()).unwrap();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(s.lock_path(resource))
        .unwrap();
    record.write_to(&file).unwrap();
}

test!(a_record_of_a_dead_or_recycled_pid_is_stale_never_the_holder, needs: []);
pub(crate) fn a_record_of_a_dead_or_recycled_pid_is_stale_never_the_holder() {
    let s = Scratch::new();
    // A dead pid.
    let mut dead = Record::for_this_process("ghost");
    dead.pid = 4_000_000;
    dead.pid_start = 1;
    plant_record(&s, "r", &dead);
    let mut holder = flock_holder(&s, "r", "a");
    let view = s.resource_status("r");
    assert_eq!(view["holders"][0]["pid"], holder.id());
    assert!(view["holders"][0]["step"].is_null(), "{view}");
    assert_eq!(view["stale_record"]["step"], "ghost");
    assert!(stdout(&s.run(&["status"])).contains("(flock, no record)"));
    release(&s, "a");
    wait_child(&mut holder);

    // A recycled pid: the record names the very pid that holds the lock now,
    // but with another start time.
    let mut holder = flock_holder(&s, "r", "b");
    let mut reused = Record::for_this_process("ghost");
    reused.pid = holder.id();
    reused.pid_start = 1;
    plant_record(&s, "r", &reused);
    let view = s.resource_status("r");
    assert!(view["holders"][0]["step"].is_null(), "{view}");
    assert_eq!(view["holders"][0]["source"], "no-record");
    assert_eq!(view["stale_record"]["step"], "ghost");
    release(&s, "b");
    wait_child(&mut holder);
}

test!(escapes_and_garbage_in_records_never_reach_the_terminal, needs: []);
pub(crate) fn escapes_and_garbage_in_records_never_reach_the_terminal() {
    let s = Scratch::new();
    let mut holder = flock_holder(&s, "evil", "e");
    let mut record = Record::for_this_process("\x1b[2J\x1b]0;pwned\x07step\u{202e}txt");
    record.pid = holder.id();
    record.pid_start = devlock::testing::procfs::start_time(holder.id()).unwrap();
    record.via = Some("\x1b[31mvia\u{2066}".into());
    plant_record(&s, "evil", &record);
    let view = s.resource_status("evil");
    assert_eq!(
        view["holders"][0]["step"], "?[2J?]0;pwned?step?txt",
        "JSON carries the text cleaned too"
    );
    assert_eq!(view["holders"][0]["via"], "?[31mvia?");
    let table = stdout(&s.run(&["status"]));
    assert!(table.contains("?[2J?]0;pwned?step"), "{table}");
    assert!(
        !table.contains('\x1b') && !table.contains('\x07') && !table.contains('\u{202e}'),
        "{table:?}"
    );
    assert!(table.contains("(via ?[31mvia?)"), "{table}");
    // The waiting line and the busy message are sanitised too.
    let busy = s.run(&["-n", "evil", "--", "true"]);
    assert!(!stderr(&busy).contains('\x1b'), "{:?}", stderr(&busy));
    // Garbage instead of a record.
    std::fs::write(s.lock_path("evil"), b"\x1b[31m{\"v\":1,garbage\xff\xfe").unwrap();
    let view = s.resource_status("evil");
    assert_eq!(view["record"], "unreadable");
    assert_eq!(view["holders"][0]["pid"], holder.id());
    let table = stdout(&s.run(&["status"]));
    assert!(!table.contains('\x1b'), "{table:?}");
    release(&s, "e");
    wait_child(&mut holder);
}

test!(a_waiter_reports_every_interval_when_not_on_a_terminal, needs: []);
pub(crate) fn a_waiter_reports_every_interval_when_not_on_a_terminal() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "long", "r"], "h");
    let mut w = s
        .devlock()
        .args(["--report-every", "50ms", "r", "--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(w.stderr.take().unwrap());
    let seen = wait_for_line(&mut err, "waiting");
    let seen = seen + &wait_for_line(&mut err, "waiting");
    assert!(
        seen.lines().all(|l| l.starts_with("devlock: r · waiting ")),
        "{seen}"
    );
    assert!(seen.contains("for long (pid "), "{seen}");
    release(&s, "h");
    wait_for_line(&mut err, "devlock: got r after ");
    assert!(wait_child(&mut w).success());
    wait_child(&mut holder);
}

/// How often a thread was woken so far (its voluntary context switches).
fn wakeups(pid: u32, tid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

test!(a_long_wait_sleeps_between_reports, needs: []);
pub(crate) fn a_long_wait_sleeps_between_reports() {
    // The waiting thread sleeps in the kernel between its reports (it looks
    // and draws itself when its alarm is due); nothing else may interrupt
    // it (an alarm that kept repeating woke it 50 times a second). In the
    // second after a report it is woken a handful of times at most, not
    // fifty. The next report is an hour away: a look, which may sleep
    // often on a busy machine's /proc/locks, is not in the window.
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let mut w = s
        .devlock()
        .args(["--report-every", "1h", "r", "--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(w.stderr.take().unwrap());
    wait_for_line(&mut err, "waiting");
    let before = wakeups(w.id(), w.id());
    // Not a handshake: a window in which nothing should happen.
    let start = std::time::Instant::now();
    poll_until(
        "a second of the wait",
        || start.elapsed().as_millis(),
        |ms| *ms >= 1000,
    );
    let woken = wakeups(w.id(), w.id()) - before;
    assert!(
        woken < 10,
        "the waiting thread was woken {woken} times in a second"
    );
    release(&s, "h");
    wait_for_line(&mut err, "devlock: got r after ");
    assert!(wait_child(&mut w).success());
    wait_child(&mut holder);
}

test!(quiet_waiters_print_nothing, needs: []);
pub(crate) fn quiet_waiters_print_nothing() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let mut w = s
        .devlock()
        .args(["-q", "--report-every", "10ms", "r", "--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 1);
    release(&s, "h");
    wait_child(&mut holder);
    assert!(wait_child(&mut w).success());
    let mut text = String::new();
    w.stderr.take().unwrap().read_to_string(&mut text).unwrap();
    assert_eq!(text, "");
}

test!(the_live_line_is_cleared_before_the_command_owns_the_terminal, needs: []);
pub(crate) fn the_live_line_is_cleared_before_the_command_owns_the_terminal() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "first", "r"], "h");
    let inner = format!("{BIN} r -- echo COMMAND-OUTPUT");
    let mut script = on_a_pty(&inner)
        .env("DEVLOCK_DIR", s.dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = script.stdout.take().unwrap();
    // Read until the live line shows, then let the holder go.
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("1st in line") {
        let n = out.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "script ended early: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    release(&s, "h");
    out.read_to_end(&mut seen).unwrap();
    wait_child(&mut script);
    wait_child(&mut holder);
    let text = String::from_utf8_lossy(&seen);
    assert!(
        text.contains("\r\x1b[Kdevlock: r · waiting 0s for first (pid "),
        "{text:?}"
    );
    assert!(
        text.contains("\r\x1b[KCOMMAND-OUTPUT"),
        "line cleared before the command: {text:?}"
    );
    assert!(
        !text.contains("got r after"),
        "no extra line on a terminal: {text:?}"
    );
}

/// Runs `args` as the unprivileged user `nobody` (the test needs root and
/// setpriv).
fn as_nobody(args: &[&str]) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .args(args);
    cmd
}

test!(locks_of_one_user_are_seen_and_shared_by_another, needs: [Root, Tool("setpriv")]);
pub(crate) fn locks_of_one_user_are_seen_and_shared_by_another() {
    let s = Scratch::new();
    // Root holds, nobody looks and waits.
    let mut holder = hold_until_released(&s, &["--step", "root-job", "r"], "h");
    let mut status_as_nobody = as_nobody(&[BIN, "status", "--json", "r"]);
    let out = status_as_nobody
        .env("DEVLOCK_DIR", s.dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let h = &json["resources"][0]["holders"][0];
    assert_eq!(
        (h["step"].as_str(), h["user"].as_str()),
        (Some("root-job"), Some("root")),
        "{json}"
    );
    let mut nobody_waits = as_nobody(&[BIN, "-q", "--step", "nobody-job", "r", "--", "true"]);
    let mut nobody_waits = nobody_waits.env("DEVLOCK_DIR", s.dir()).spawn().unwrap();
    let view = s.wait_for_status("r", "nobody waiting", |v| registered_waiters(v) == 1);
    assert_eq!(view["waiters"][0]["user"], "nobody");
    release(&s, "h");
    wait_child(&mut holder);
    assert!(
        wait_child(&mut nobody_waits).success(),
        "nobody could take root's lock file"
    );

    // Nobody holds a lock file nobody created; root sees it.
    let ready = s.work("ready-n");
    let release_n = s.work("release-n");
    let script = format!(
        "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
        ready.display(),
        release_n.display()
    );
    let mut nobody_holds = as_nobody(&[
        BIN,
        "--step",
        "nobody-job",
        "fresh",
        "--",
        "sh",
        "-c",
        &script,
    ])
    .env("DEVLOCK_DIR", s.dir())
    .spawn()
    .unwrap();
    wait_for_file(&ready);
    let view = s.resource_status("fresh");
    assert_eq!(view["holders"][0]["user"], "nobody", "{view}");
    assert_eq!(view["holders"][0]["step"], "nobody-job");
    std::fs::write(&release_n, "").unwrap();
    assert!(wait_child(&mut nobody_holds).success());
    // And root can use the file nobody created.
    assert!(s.run(&["-n", "fresh", "--", "true"]).status.success());
}

test!(colour_only_on_a_terminal_and_never_with_no_color, needs: []);
pub(crate) fn colour_only_on_a_terminal_and_never_with_no_color() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let on_tty = |no_color: bool| {
        let mut cmd = on_a_pty(&format!("{BIN} status"));
        cmd.env("DEVLOCK_DIR", s.dir()).stdin(Stdio::null());
        if no_color {
            cmd.env("NO_COLOR", "1");
        }
        String::from_utf8_lossy(&cmd.output().unwrap().stdout).into_owned()
    };
    let coloured = on_tty(false);
    assert!(coloured.contains("\x1b[33mheld"), "{coloured:?}");
    let plain = on_tty(true);
    assert!(
        plain.contains("held") && !plain.contains('\x1b'),
        "{plain:?}"
    );
    release(&s, "h");
    wait_child(&mut holder);
}
