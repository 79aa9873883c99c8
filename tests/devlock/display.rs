//! The waiting display on a real terminal (a pty of a set width) and in a
//! log: it fits, leaves no rows behind, draws in place only where the line
//! is devlock's, and every line that stays names the waiter's own step.

use std::io::BufReader;
use std::process::{Command, Stdio};

use crate::harness::*;

/// The waiting lines drawn in place before `end`: what follows each
/// `\r\x1b[K`.
fn redraws(out: &str, end: &str) -> Vec<String> {
    let before = &out[..out.find(end).unwrap_or(out.len())];
    before
        .split("\r\x1b[K")
        .skip(1)
        .map(str::to_owned)
        .collect()
}

test!(the_live_line_fits_a_narrow_terminal_and_follows_a_resize, needs: []);
pub(crate) fn the_live_line_fits_a_narrow_terminal_and_follows_a_resize() {
    let s = Scratch::new();
    let step = "a-step-name-far-longer-than-sixty-columns-of-terminal-width";
    let mut holder = hold_until_released(&s, &["--step", step, "r"], "h");
    let pty = Pty::new(60);
    let mut devlock =
        pty.spawn(
            s.devlock()
                .args(["--step", "mine", "r", "--", "echo", "COMMAND-OUTPUT"]),
        );
    pty.wait_for("1st in line");
    pty.narrowed_and_redrawn(45);
    release(&s, "h");
    let out = pty.wait_for("COMMAND-OUTPUT");
    assert!(wait_child(&mut devlock).success());
    wait_child(&mut holder);
    let lines = redraws(&out, "COMMAND-OUTPUT");
    assert!(!lines.is_empty(), "{out:?}");
    let waiting = &out[..out.find("COMMAND-OUTPUT").unwrap()];
    assert!(
        !waiting.contains('\n'),
        "the wait left a row behind: {waiting:?}"
    );
    for line in &lines {
        assert!(
            devlock::testing::text::columns(line) < 60,
            "wider than the terminal: {line:?}"
        );
    }
    assert!(
        lines[0].starts_with("devlock: r · waiting ") && lines[0].contains('…'),
        "{:?}",
        lines[0]
    );
    assert!(
        !out.contains("(mine)"),
        "a live line needs no step: {out:?}"
    );
    let last = lines.iter().rev().find(|l| !l.is_empty()).unwrap();
    assert!(devlock::testing::text::columns(last) < 45, "{last:?}");
    assert!(
        out.contains("\r\x1b[KCOMMAND-OUTPUT"),
        "line cleared before the command: {out:?}"
    );
}

test!(devlocks_sharing_a_terminal_say_one_line_each_at_the_start_and_the_end, needs: []);
pub(crate) fn devlocks_sharing_a_terminal_say_one_line_each_at_the_start_and_the_end() {
    // make -j, xargs -P, a script: one process group on the terminal, so
    // no devlock of it owns the line.
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "holder", "r"], "h");
    let pty = Pty::new(200);
    let script = format!(
        "{BIN} --step train-a r -- echo RAN-A & {BIN} --step train-b r -- echo RAN-B; wait"
    );
    let mut sh = pty.spawn(
        Command::new("sh")
            .args(["-c", &script])
            .env("DEVLOCK_DIR", s.dir()),
    );
    pty.wait_until("both waiting", |out| {
        out.contains("(train-a)\r\n") && out.contains("(train-b)\r\n")
    });
    release(&s, "h");
    let out = pty.wait_until("both done", |out| {
        out.contains("RAN-A") && out.contains("RAN-B")
    });
    assert!(wait_child(&mut sh).success());
    wait_child(&mut holder);
    assert!(!out.contains("\x1b[K"), "drawn in place: {out:?}");
    for step in ["train-a", "train-b"] {
        let waiting = out
            .lines()
            .filter(|l| l.contains("· waiting") && l.ends_with(&format!("({step})")))
            .count();
        let got = out
            .lines()
            .filter(|l| l.starts_with("devlock: got r after ") && l.ends_with(&format!("({step})")))
            .count();
        assert_eq!((waiting, got), (1, 1), "{step}: {out:?}");
        // On a terminal the last line comes before the command's output.
        let ran = format!(
            "RAN-{}",
            step.strip_prefix("train-").unwrap().to_uppercase()
        );
        let got_at = out
            .match_indices("devlock: got r after ")
            .map(|(i, _)| i)
            .find(|&i| {
                out[i..]
                    .lines()
                    .next()
                    .unwrap()
                    .ends_with(&format!("({step})"))
            })
            .unwrap();
        assert!(
            got_at < out.find(&ran).unwrap(),
            "{step}: got after its output: {out:?}"
        );
    }
}

test!(a_waiter_in_the_background_never_draws_over_the_prompt, needs: []);
pub(crate) fn a_waiter_in_the_background_never_draws_over_the_prompt() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "holder", "r"], "h");
    let pty = Pty::new(80);
    // With job control, `&` puts the job in a background process group.
    let script = format!("set -m; {BIN} --step bg r -- echo RAN-BG & wait");
    let mut sh = pty.spawn(
        Command::new("sh")
            .args(["-c", &script])
            .env("DEVLOCK_DIR", s.dir()),
    );
    pty.wait_for("(bg)\r\n");
    release(&s, "h");
    let out = pty.wait_for("RAN-BG");
    assert!(wait_child(&mut sh).success());
    wait_child(&mut holder);
    assert!(!out.contains("\x1b[K"), "drawn in place: {out:?}");
    assert!(out.contains("devlock: got r after "), "{out:?}");
}

test!(every_line_in_a_log_names_the_waiters_step, needs: []);
pub(crate) fn every_line_in_a_log_names_the_waiters_step() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "first", "r"], "h");
    let mut w = s
        .devlock()
        .args([
            "--step",
            "train-b",
            "--report-every",
            "50ms",
            "r",
            "--",
            "true",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(w.stderr.take().unwrap());
    let mut seen = wait_for_line(&mut err, "waiting");
    seen += &wait_for_line(&mut err, "waiting");
    release(&s, "h");
    seen += &wait_for_line(&mut err, "got r after");
    assert!(wait_child(&mut w).success());
    wait_child(&mut holder);
    for line in seen.lines() {
        assert!(line.ends_with(" (train-b)"), "{line:?} in {seen}");
    }
    assert!(
        seen.lines()
            .last()
            .unwrap()
            .starts_with("devlock: got r after "),
        "{seen}"
    );
}

/// Stops `waiter` (in a process group of its own, which a job-control shell
/// would continue) with SIGTSTP, as Ctrl-Z would, and waits until it has
/// left the line and stopped.
fn ctrl_z(s: &Scratch, waiter: &std::process::Child) {
    // SAFETY: a signal to the process group this test made for the waiter.
    let sent = unsafe { libc::kill(-(waiter.id() as i32), libc::SIGTSTP) };
    assert_eq!(sent, 0);
    poll_until(
        "the waiter to stop",
        || devlock::testing::procfs::is_stopped(waiter.id()),
        |stopped| *stopped,
    );
    let view = s.resource_status("r");
    assert_eq!(registered_waiters(&view), 0, "it left the line: {view}");
}

test!(back_in_line_after_ctrl_z_follows_the_rules_of_the_waiting_lines, needs: []);
pub(crate) fn back_in_line_after_ctrl_z_follows_the_rules_of_the_waiting_lines() {
    use std::os::unix::process::CommandExt;
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "holder", "r"], "h");
    // In a log: the line names the waiter's step.
    let mut w = s
        .devlock()
        .args(["--step", "mine", "r", "--", "true"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut err = BufReader::new(w.stderr.take().unwrap());
    wait_for_line(&mut err, "· waiting");
    ctrl_z(&s, &w);
    signal(w.id(), libc::SIGCONT);
    let said = wait_for_line(&mut err, "continued");
    assert!(
        said.lines()
            .any(|l| l == "devlock: continued; back in line for r, at the end (mine)"),
        "{said:?}"
    );
    s.wait_for_status("r", "the waiter back in line", |v| {
        registered_waiters(v) == 1
    });
    // With -q: nothing, and still back in line.
    let q = s
        .devlock()
        .args(["-q", "--step", "quiet", "r", "--", "true"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    s.wait_for_status("r", "the quiet waiter", |v| registered_waiters(v) == 2);
    // SAFETY: as in ctrl_z.
    assert_eq!(unsafe { libc::kill(-(q.id() as i32), libc::SIGTSTP) }, 0);
    poll_until(
        "the quiet waiter to stop",
        || devlock::testing::procfs::is_stopped(q.id()),
        |stopped| *stopped,
    );
    s.wait_for_status("r", "the quiet waiter out of line", |v| {
        registered_waiters(v) == 1
    });
    signal(q.id(), libc::SIGCONT);
    s.wait_for_status("r", "the quiet waiter back in line", |v| {
        registered_waiters(v) == 2
    });
    release(&s, "h");
    wait_child(&mut holder);
    assert!(wait_child(&mut w).success());
    let out = q.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr), "", "-q says nothing");
}

test!(back_in_line_fits_a_narrow_terminal, needs: [Tool("bash")]);
pub(crate) fn back_in_line_fits_a_narrow_terminal() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "holder", "r"], "h");
    let pty = Pty::new(40);
    let mut shell = pty.spawn(
        Command::new("bash")
            .args(["--norc", "--noprofile", "-i"])
            .env("PS1", "PROMPT> ")
            .env("DEVLOCK_DIR", s.dir())
            .env_remove("PROMPT_COMMAND"),
    );
    pty.wait_for("PROMPT> ");
    pty.type_in(format!("{BIN} --step mine r -- sh -c 'echo ran-$((6*7))'\n").as_bytes());
    pty.wait_for("1st in line");
    let mark = pty.output().len();
    pty.type_in(b"\x1a");
    pty.wait_until("the job stopped", |out| {
        out[mark..].contains("Stopped") && out[mark..].contains("PROMPT> ")
    });
    let mark = pty.output().len();
    pty.type_in(b"fg\n");
    pty.wait_until("back in line", |out| {
        out[mark..].contains("devlock: continued")
    });
    release(&s, "h");
    // Not the typed line's echo: the command's own output.
    let out = pty.wait_for("ran-42");
    let after = &out[mark..];
    let at = after.find("devlock: continued").unwrap();
    let line = after[at..].split(['\r', '\n']).next().unwrap();
    assert!(
        devlock::testing::text::columns(line) < 40
            && line.starts_with("devlock: continued; back in line"),
        "{line:?}"
    );
    assert!(
        !line.contains("(mine)"),
        "its own line needs no step: {line:?}"
    );
    wait_child(&mut holder);
    pty.type_in(b"exit\n");
    wait_child(&mut shell);
}

test!(got_is_said_only_when_the_command_is_about_to_start, needs: []);
/// A waiter whose turn comes and that is then stopped before its command
/// starts (here: Ctrl-C's SIGINT during --require-idle's look at the GPU,
/// which a fake nvidia-smi holds until the signal is sent) never says `got`
/// in the log, only that it was stopped.
pub(crate) fn got_is_said_only_when_the_command_is_about_to_start() {
    let s = Scratch::new();
    let state = s.work("gpus");
    std::fs::create_dir(&state).unwrap();
    std::fs::write(state.join("gpus"), "0 81920\n").unwrap();
    let (probing, go) = (s.work("probing"), s.work("go"));
    let fake = s.work("slow-nvidia-smi");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\ntouch {probing}\nwhile [ ! -e {go} ]; do sleep 0.01; done\nexec {real} \"$@\"\n",
            probing = probing.display(),
            go = go.display(),
            real = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("contrib/fake-gpu/nvidia-smi")
                .display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut holder = hold_until_released(&s, &["gpu:0"], "h");
    let mut waiter = s
        .devlock()
        .args(["--step", "c", "--require-idle", "gpu:0", "--", "true"])
        .env("DEVLOCK_NVIDIA_SMI", &fake)
        .env("FAKE_GPU_DIR", &state)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(waiter.stderr.take().unwrap());
    // The wait is shown (its first line), so a `got` would be due.
    wait_for_line(&mut err, "waiting");
    release(&s, "h");
    assert!(wait_child(&mut holder).success());
    wait_for_file(&probing);
    signal(waiter.id(), libc::SIGINT);
    std::fs::write(&go, "").unwrap();
    let status = wait_child(&mut waiter);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert_eq!(status.code(), Some(130), "{rest}");
    assert!(
        !rest.contains("got gpu:0"),
        "said got though the command never ran: {rest}"
    );
    assert!(
        rest.contains("stopped by signal 2 before the command started"),
        "{rest}"
    );
}

/// Processes with many descriptors each, standing in for a busy machine's
/// workers; killed (the whole group) when dropped.
struct Crowd(std::process::Child);

impl Crowd {
    fn start(processes: u32, descriptors: u32) -> Crowd {
        use std::os::unix::process::CommandExt;
        let script = format!(
            "for i in $(seq 10 $((10 + {descriptors}))); do eval \"exec $i</dev/null\"; done; \
             for i in $(seq {processes}); do sleep 1000 & done; echo ready; wait"
        );
        let mut child = Command::new("bash")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        wait_for_line(&mut BufReader::new(child.stdout.take().unwrap()), "ready");
        Crowd(child)
    }
}

impl Drop for Crowd {
    fn drop(&mut self) {
        // SAFETY: kill(2) of the group we made.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

/// `syscr` of `/proc/PID/io`: the read calls a process made so far.
fn read_calls(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("syscr: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Read calls a waiting line makes per redraw, over three redraws.
fn reads_per_redraw(pty: &Pty, waiter: u32) -> u64 {
    let redraws = |out: &str| out.matches("\r\x1b[K").count();
    let from = redraws(&pty.output());
    pty.wait_until("a redraw", |out| redraws(out) > from);
    let (first, before) = (redraws(&pty.output()), read_calls(waiter));
    pty.wait_until("three more redraws", |out| redraws(out) >= first + 3);
    let looks = (redraws(&pty.output()) - first) as u64;
    (read_calls(waiter) - before) / looks
}

test!(a_waiting_line_reads_no_more_on_a_busy_machine, needs: [Tool("bash")]);
/// A waiting devlock looks again every second (live) or at each report: a
/// look reads what concerns its lock (the kernel's lock table, the holder's
/// descriptors and record), never every process's descriptors, so a
/// machine with thousands of busy processes costs it nothing more. Counted
/// in read calls (a scan of the crowd below is over 2000 a look).
pub(crate) fn a_waiting_line_reads_no_more_on_a_busy_machine() {
    looks_stay_local(0);
}

test!(a_waiting_line_further_back_reads_no_more_on_a_busy_machine, needs: [Tool("bash")]);
/// The same, for a waiter with others ahead of it: its look also names the
/// waiters in front (their registrations), still never a scan of the crowd.
pub(crate) fn a_waiting_line_further_back_reads_no_more_on_a_busy_machine() {
    looks_stay_local(2);
}

/// A pty waiter behind `ahead` other waiters: its reads per redraw alone,
/// then with 80 more processes of 25 descriptors each.
fn looks_stay_local(ahead: usize) {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["r"], "h");
    let mut in_front: Vec<_> = (0..ahead)
        .map(|i| {
            let child = s
                .devlock()
                .args(["r", "--", "true"])
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            wait_blocked(&s.lock_path("r"), i + 1);
            child
        })
        .collect();
    let pty = Pty::new(100);
    let mut waiter = pty.spawn(s.devlock().args(["r", "--", "true"]));
    let place = ["1st", "2nd", "3rd"][ahead];
    pty.wait_for(&format!("{place} in line"));
    let idle = reads_per_redraw(&pty, waiter.id());
    let crowd = Crowd::start(80, 25);
    let busy = reads_per_redraw(&pty, waiter.id());
    drop(crowd);
    release(&s, "h");
    for child in &mut in_front {
        assert!(wait_child(child).success());
    }
    assert!(wait_child(&mut waiter).success());
    wait_child(&mut holder);
    assert!(
        busy < idle + 300,
        "a look {ahead} behind the front read {busy} times with 80 more processes of 25 \
         descriptors each, {idle} without"
    );
}
