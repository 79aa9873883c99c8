//! Stop signals sent twice to a holding supervisor with three waiters
//! queued behind it: the command hears each once, cleans up, and only
//! then does the next waiter start; every waiter runs.

use super::*;

/// Starts three waiters that keep looking at the lock (a status line every
/// 10ms) while they wait, each once it waits.
fn start_waiters(s: &Scratch, procs: &Procs, log: &Path, what: &str) -> Vec<u32> {
    (0..3)
        .map(|k| {
            let mut cmd = s.devlock();
            cmd.args(["--report-every", "10ms", "r", "--", "sh", "-c"])
                .arg(format!(
                    "echo 'enter W{k}' >> {log}; sleep 0.02; echo 'leave W{k}' >> {log}",
                    log = log.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(s.work(&format!("W{k}.err"))).unwrap());
            let pid = procs.start(&format!("W{k}"), &mut cmd);
            wait_until(&format!("{what}: W{k} to wait"), || {
                sleeping_in_lock_call(pid)
            });
            pid
        })
        .collect()
}

/// The command is devlock's process (chain-loaded): each signal reaches
/// it once, as sent; nobody forwards or repeats one. Two sent back to
/// back may merge in the kernel where they are the same signal.
fn assert_each_signal_heard_once(
    lines: &[String],
    first: i32,
    second: i32,
    after_handshake: bool,
    what: &str,
) {
    let heard: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("sig "))
        .collect();
    if after_handshake {
        assert_eq!(
            heard,
            [signal_name(first), signal_name(second)],
            "{what}: each heard once, in order: {lines:?}"
        );
    } else {
        let mut sent = vec![signal_name(first), signal_name(second)];
        sent.dedup();
        let mut distinct = heard.clone();
        distinct.sort_unstable();
        distinct.dedup();
        sent.sort_unstable();
        assert!(
            heard.len() <= 2 && distinct == sent,
            "{what}: each signal sent heard, none more often than sent: {lines:?}"
        );
    }
}

/// Every waiter ran once, one at a time, and none before the holder's
/// cleanup finished.
fn assert_waiters_ran_in_turn_after_cleanup(lines: &[String], what: &str) {
    // Missing counts as never: a waiter that started is then too early.
    let cleaned = lines
        .iter()
        .position(|l| l == "cleaned")
        .unwrap_or(lines.len());
    let mut open: Option<&str> = None;
    let mut ran = HashSet::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some(w) = line.strip_prefix("enter ") {
            assert!(
                i > cleaned,
                "{what}: {w} started before the holder's cleanup finished: {lines:?}"
            );
            assert!(open.is_none(), "{what}: waiters overlapped: {lines:?}");
            assert!(ran.insert(w), "{what}: {w} ran twice: {lines:?}");
            open = Some(w);
        } else if let Some(w) = line.strip_prefix("leave ") {
            assert_eq!(open, Some(w), "{what}: {lines:?}");
            open = None;
        }
    }
    assert_eq!(ran.len(), 3, "{what}: every waiter ran: {lines:?}");
    assert!(cleaned < lines.len(), "{what}: no cleanup: {lines:?}");
}

fn signal_round(round: usize, procs: &Procs) {
    let first = [libc::SIGTERM, libc::SIGINT][round % 2];
    let second = [libc::SIGTERM, libc::SIGINT][(round / 2) % 2];
    // Most rounds send the second signal once the command has taken the
    // first (so a second delivery could not merge with the first); the rest
    // send both back to back.
    let after_handshake = !round.is_multiple_of(3);
    let what = format!(
        "round {round} ({} then {}, {})",
        signal_name(first),
        signal_name(second),
        if after_handshake {
            "after the first was heard"
        } else {
            "back to back"
        }
    );

    let s = Scratch::new();
    let log = s.work("log");
    let ready = s.work("ready");
    let holder_script = format!(
        "trap 'echo sig TERM >> {log}; got=1' TERM; trap 'echo sig INT >> {log}; got=1' INT; \
         echo > {ready}; while [ -z \"$got\" ]; do sleep 0.01; done; \
         sleep 0.2; echo cleaned >> {log}",
        log = log.display(),
        ready = ready.display()
    );
    let mut cmd = s.devlock();
    cmd.args(["-q", "r", "--", "sh", "-c", &holder_script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(s.work("H.err")).unwrap());
    let h = procs.start("holder", &mut cmd);
    wait_for_file(&ready);

    let waiters = start_waiters(&s, procs, &log, &what);

    assert!(procs.signal(h, &[first], false));
    if after_handshake {
        wait_until(&format!("{what}: the command to hear the signal"), || {
            log_lines(&log).iter().any(|l| l.starts_with("sig "))
        });
    }
    assert!(procs.signal(h, &[second], false));
    let status = procs.wait(h);
    assert_eq!(
        status.code(),
        Some(0),
        "{what}: devlock ends with the command's status: {}",
        err_text(&s.work("H.err"))
    );
    for (k, &w) in waiters.iter().enumerate() {
        let status = procs.wait(w);
        assert!(
            status.success(),
            "{what}: W{k} ended {status:?}: {}",
            err_text(&s.work(&format!("W{k}.err")))
        );
    }

    let lines = log_lines(&log);
    assert_each_signal_heard_once(&lines, first, second, after_handshake, &what);
    assert_waiters_ran_in_turn_after_cleanup(&lines, &what);
}

test!(signals_to_supervisors_under_load, needs: []);
pub(crate) fn signals_to_supervisors_under_load() {
    let procs = Procs::default();
    let _cleanup = Cleanup(procs.clone());
    // Background load: two busy loops at a lower priority.
    for n in 0..2 {
        procs.start(
            &format!("burner{n}"),
            Command::new("nice")
                .args(["-n", "10", "sh", "-c", "while :; do :; done"])
                .stdin(Stdio::null()),
        );
    }
    for round in 0..if soak() { 120 } else { 20 } {
        signal_round(round, &procs);
    }
}
