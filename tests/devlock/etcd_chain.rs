//! The etcd backend chain-loads its command too (issue 35): after the grant
//! devlock hands the lease to a watcher and becomes the command. The
//! watcher keeps the lease while the job runs (the command and whatever
//! holds the job's descriptor), stops the whole job before a lost lease
//! could let the next holder in, survives the job's own signals, and gives
//! the lease back once the job has ended. Killed alone, it leaves the job
//! running, and the lease runs out under it within its TTL.

use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};

use crate::etcd::{
    devlock, name, spawn, stopped_on_lease_loss, verdict_script, wait_for, wait_free,
    waiter_checking, write_pid,
};
use crate::etcd_server::{Proxy, shared_etcd};
use crate::harness::*;

/// `devlock --etcd URL ARGS -- sh -c SCRIPT` in a process group of its own,
/// as a shell starts a job (stderr kept for the watcher's words).
fn job(s: &Scratch, url: &str, args: &[&str], script: &str) -> Child {
    devlock(s, url)
        .args(args)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap()
}

/// The parent pid, process group and name of `pid`.
fn stat_of(pid: u32) -> Option<(u32, u32, String)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let mut fields = rest.split_whitespace().skip(1);
    Some((
        fields.next()?.parse().ok()?,
        fields.next()?.parse().ok()?,
        comm,
    ))
}

/// The job's watcher: the process of process group `group` named
/// devlock-watch (it is there from before the exec).
fn watcher_in(group: u32) -> u32 {
    let found: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&pid| {
            stat_of(pid).is_some_and(|(_, g, comm)| g == group && comm == "devlock-watch")
        })
        .collect();
    assert_eq!(found.len(), 1, "one watcher in group {group}: {found:?}");
    found[0]
}

/// What `pid`'s descriptors above the standard three are (their
/// /proc/PID/fd links).
fn descriptors(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| n > 2)
        })
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .collect()
}

test!(etcd_chain_the_command_has_devlocks_pid_and_no_socket, needs: [Tool("etcd"), Tool("etcdctl")]);
/// The command runs as the process devlock's caller started: status names
/// it, its parent is the caller, and it inherits no connection to etcd
/// (the session's are gone before the exec). The watcher is in the job's
/// group, no child of the command's, and holds the job's pipe, not the
/// command's end of it.
pub(crate) fn etcd_chain_the_command_has_devlocks_pid_and_no_socket() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("chain-pid");
    let (script, ready) = wait_for_release(&s, "h");
    let pid_file = s.work("pid");
    let script = format!("{}; {script}", write_pid("$$", &pid_file));
    let mut holder = job(&s, &url, &[&r], &script);
    wait_for_file(&ready);
    let command = holder.id();
    assert_eq!(pid_in(&pid_file), command);
    let (parent, _, _) = stat_of(command).unwrap();
    assert_eq!(parent, std::process::id());
    wait_for(&s, &url, &r, "the holder", |v| {
        v["holders"][0]["pid"] == command && v["holders"][0]["child"] == command
    });
    let fds = descriptors(command);
    assert!(
        !fds.iter().any(|l| l.starts_with("socket:")),
        "the command inherited a socket: {fds:?}"
    );
    let pipes: Vec<&String> = fds.iter().filter(|l| l.starts_with("pipe:")).collect();
    let watcher = watcher_in(command);
    let (watchers_parent, _, _) = stat_of(watcher).unwrap();
    assert_ne!(watchers_parent, command);
    // The job's pipe (not one this test passed on to both): the command's
    // end in the command, the other end in the watcher.
    let watchers = descriptors(watcher);
    let ours = descriptors(std::process::id());
    let shared: Vec<&&String> = pipes
        .iter()
        .filter(|p| watchers.contains(p) && !ours.contains(p))
        .collect();
    assert_eq!(shared.len(), 1, "{fds:?} / {watchers:?}");
    release(&s, "h");
    assert!(wait_child(&mut holder).success());
    wait_free(&s, &url, &r);
    wait_gone(watcher);
}

test!(etcd_chain_a_lease_loss_stops_the_whole_job_before_the_next_holder_starts, needs: [Tool("etcd"), Tool("etcdctl")]);
/// Cut off from etcd (a partition through the proxy), the watcher stops
/// the whole job before the lease can run out: the command, and what it
/// started in a session of its own that ignores SIGTERM (it holds the job's
/// descriptor, so it is the job's), SIGKILLed after --kill-after. The next
/// holder, on the direct address, finds them all gone.
pub(crate) fn etcd_chain_a_lease_loss_stops_the_whole_job_before_the_next_holder_starts() {
    let (_server, url) = shared_etcd();
    let proxy = Proxy::to(&url);
    let s = Scratch::new();
    let r = name("chain-cut");
    let (shell, away) = (s.work("shell"), s.work("away"));
    let script = format!(
        "setsid sh -c \"trap '' TERM; exec sleep 1000\" & {}; {}; wait",
        write_pid("$!", &away),
        write_pid("$$", &shell)
    );
    let holder = job(
        &s,
        &proxy.url,
        &["--ttl", "3s", "--kill-after", "500ms", &r],
        &script,
    );
    wait_for_file(&shell);
    let away_pid = pid_in(&away);
    // It left the job's process group: only the descriptor says it is the job's.
    poll_until(
        "the session of its own",
        || stat_of(away_pid).map_or(0, |(_, group, _)| group),
        |&group| group == away_pid,
    );
    let (mut waiter, verdict) = waiter_checking(&s, &url, &r, &[&shell, &away]);
    proxy.cut();
    stopped_on_lease_loss(holder);
    wait_gone(away_pid);
    assert!(wait_child(&mut waiter).success());
    assert_eq!(std::fs::read_to_string(&verdict).unwrap().trim(), "clean");
}

test!(etcd_chain_the_jobs_signals_reach_the_command_once_and_the_watcher_keeps_the_lease, needs: [Tool("etcd"), Tool("etcdctl")]);
/// A SIGTERM to the job's whole group (a supervisor's, a terminal's Ctrl-C)
/// reaches the command once, from the sender, and not the watcher: the
/// lease is kept while the command cleans up, and given back once it ends.
pub(crate) fn etcd_chain_the_jobs_signals_reach_the_command_once_and_the_watcher_keeps_the_lease() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("chain-term");
    let (ready, got) = (s.work("ready"), s.work("got"));
    let release_file = s.work("release-h");
    let script = format!(
        "trap 'echo term >> {g}; while [ ! -e {rel} ]; do sleep 0.01; done; exit 3' TERM; \
         echo > {ready}; while :; do sleep 0.01; done",
        g = got.display(),
        rel = release_file.display(),
        ready = ready.display()
    );
    let mut holder = job(&s, &url, &[&r], &script);
    wait_for_file(&ready);
    let watcher = watcher_in(holder.id());
    signal_group(holder.id(), libc::SIGTERM);
    wait_for_file(&got);
    // Cleaning up, still holding: the watcher lives, the lock is taken.
    let out = crate::etcd::run(&s, &url, &["-n", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(std::path::Path::new(&format!("/proc/{watcher}")).exists());
    release(&s, "h");
    assert_eq!(wait_child(&mut holder).code(), Some(3));
    assert_eq!(std::fs::read_to_string(&got).unwrap(), "term\n");
    wait_free(&s, &url, &r);
    wait_gone(watcher);
}

test!(etcd_chain_a_watcher_killed_alone_leaves_the_job_running_and_its_lease_runs_out, needs: [Tool("etcd"), Tool("etcdctl")]);
/// Nobody keeps the lease of a job whose watcher was killed alone: the job
/// runs on (nothing of devlock's is left to stop it), the lease runs out
/// within its TTL, and the next holder is let in beside it. Said here so
/// that it is a choice: the watcher is the one process that cannot go.
pub(crate) fn etcd_chain_a_watcher_killed_alone_leaves_the_job_running_and_its_lease_runs_out() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("chain-watcher");
    let (script, ready) = wait_for_release(&s, "h");
    let pid_file = s.work("pid");
    let script = format!("{}; {script}", write_pid("$$", &pid_file));
    let mut holder = job(
        &s,
        &url,
        &["--ttl", "3s", "--kill-after", "500ms", &r],
        &script,
    );
    wait_for_file(&ready);
    let watcher = watcher_in(holder.id());
    signal(watcher, libc::SIGKILL);
    wait_gone(watcher);
    let verdict = s.work("verdict");
    let mut waiter = spawn(
        &s,
        &url,
        &["-q", &r],
        &verdict_script(&[&pid_file], &verdict),
    );
    assert!(wait_child(&mut waiter).success());
    assert_eq!(std::fs::read_to_string(&verdict).unwrap().trim(), "overlap");
    assert!(holder.try_wait().unwrap().is_none(), "the job still runs");
    release(&s, "h");
    assert!(wait_child(&mut holder).success());
}

/// kill(2) of the process group `group`.
fn signal_group(group: u32, sig: i32) {
    // SAFETY: kill(2) of a process group this test started.
    assert_eq!(unsafe { libc::kill(-(group as i32), sig) }, 0);
}

test!(etcd_chain_a_take_with_no_wait_right_after_the_last_one_ended_gets_the_lock, needs: [Tool("etcd"), Tool("etcdctl")]);
/// The watcher gives the lease back just after the command's parent saw it
/// end: a `-n` take in the same instant (the next line of a script) waits
/// for that hand-back rather than failing as busy. 100 in a row, each
/// right after the one before.
pub(crate) fn etcd_chain_a_take_with_no_wait_right_after_the_last_one_ended_gets_the_lock() {
    let (_server, url) = shared_etcd();
    let r = name("chain-seq");
    let script = format!("for i in $(seq 100); do {BIN} -q -n {r} -- true || exit 1; done");
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .env("DEVLOCK_ETCD", &url)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

test!(etcd_chain_the_watcher_holds_no_lock_of_a_hold_it_runs_under, needs: [Tool("etcd"), Tool("etcdctl")]);
/// An etcd take inside a lock-file hold (`devlock gpu -- devlock --etcd r
/// -- ...`): the outer lock's descriptor is the job's; the etcd watcher,
/// which outlives the command by a round trip to etcd, does not keep it.
pub(crate) fn etcd_chain_the_watcher_holds_no_lock_of_a_hold_it_runs_under() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("chain-nested");
    let (script, ready) = wait_for_release(&s, "h");
    let mut holder = s
        .devlock()
        .args([
            "outer", "--", BIN, "--etcd", &url, &r, "--", "sh", "-c", &script,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    wait_for_file(&ready);
    let watcher = watcher_in(holder.id());
    let locks = std::fs::read_dir(format!("/proc/{watcher}/fdinfo"))
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .lines()
                .any(|l| l.starts_with("lock:"))
        })
        .count();
    assert_eq!(locks, 0, "the watcher holds a lock");
    // The command does: the outer hold's descriptor is the job's.
    let out = s
        .devlock()
        .args(["-n", "outer", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    release(&s, "h");
    assert!(wait_child(&mut holder).success());
    wait_free(&s, &url, &r);
}
