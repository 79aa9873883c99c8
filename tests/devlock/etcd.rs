//! The etcd backend against a real etcd server: exclusion, arrival order,
//! leases that outlive devlock by at most their TTL, partitions, a frozen
//! server, nesting, signals and clear failures.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::etcd_server::{EtcdServer, Proxy, shared_etcd};
use crate::harness::*;

mod failures;
mod lease;

/// A resource name no other test (or earlier run on a shared server) uses.
pub(crate) fn name(test: &str) -> String {
    format!("{test}-{}", std::process::id())
}

pub(crate) fn devlock(s: &Scratch, url: &str) -> Command {
    let mut cmd = s.devlock();
    cmd.env("DEVLOCK_ETCD", url).env_remove("DEVLOCK_ETCD_USER");
    cmd
}

pub(crate) fn run(s: &Scratch, url: &str, args: &[&str]) -> Output {
    devlock(s, url)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

pub(crate) fn status(s: &Scratch, url: &str, resource: &str) -> serde_json::Value {
    let out = run(s, url, &["status", "--json", resource]);
    assert!(out.status.success(), "status failed: {}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["resources"][0].clone()
}

pub(crate) fn wait_for(
    s: &Scratch,
    url: &str,
    resource: &str,
    what: &str,
    accept: impl Fn(&serde_json::Value) -> bool,
) {
    poll_until(what, || status(s, url, resource), accept);
}

/// Waits for `resource` to be free: the watcher gives the lease back just
/// after the job has ended, not before devlock's process (the command) is
/// waited for.
pub(crate) fn wait_free(s: &Scratch, url: &str, resource: &str) {
    wait_for(s, url, resource, "the lock to be free", |v| {
        v["state"] == "free"
    });
}

pub(crate) fn waiters(view: &serde_json::Value) -> usize {
    view["waiters"].as_array().map_or(0, Vec::len)
}

/// `etcdctl ARGS` against `url`, which must succeed; its stdout.
pub(crate) fn etcdctl(url: &str, args: &[&str]) -> String {
    let out = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", url])
        .args(args)
        .output()
        .expect("etcdctl (Debian package etcd-client)");
    assert!(
        out.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Shell that writes `var` (`$$`, `$!`) to `path` in one rename, so a
/// reader never sees it half written.
pub(crate) fn write_pid(var: &str, path: &std::path::Path) -> String {
    format!("echo {var} > {p}.tmp; mv {p}.tmp {p}", p = path.display())
}

/// Starts `devlock ARGS -- sh -c SCRIPT` in the background.
pub(crate) fn spawn(s: &Scratch, url: &str, args: &[&str], script: &str) -> std::process::Child {
    devlock(s, url)
        .args(args)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

test!(etcd_holders_exclude_each_other, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_holders_exclude_each_other() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("excl");
    let counter = s.work("counter");
    std::fs::write(&counter, "0").unwrap();
    let section = format!(
        "n=$(cat {c}); sleep 0.01; echo $((n+1)) > {c}",
        c = counter.display()
    );
    let loops: Vec<_> = (0..4)
        .map(|_| {
            let script =
                format!("for i in 1 2 3 4 5; do {BIN} -q {r} -- sh -c '{section}' || exit 1; done");
            Command::new("sh")
                .args(["-c", &script])
                .env("DEVLOCK_ETCD", &url)
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in loops {
        assert!(wait_child(&mut child).success());
    }
    assert_eq!(std::fs::read_to_string(&counter).unwrap().trim(), "20");
    wait_free(&s, &url, &r);
}

test!(etcd_waiters_are_served_in_arrival_order, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_waiters_are_served_in_arrival_order() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("order");
    let (script, ready) = wait_for_release(&s, "h");
    let holder = spawn(&s, &url, &["--step", "holder", &r], &script);
    wait_for_file(&ready);
    let order = s.work("order");
    let mut line = Vec::new();
    for n in 1..=4 {
        let append = format!("echo {n} >> {}", order.display());
        line.push(spawn(
            &s,
            &url,
            &["-q", "--step", &format!("w{n}"), &r],
            &append,
        ));
        wait_for(&s, &url, &r, &format!("{n} waiters"), |v| waiters(v) == n);
    }
    let view = status(&s, &url, &r);
    assert_eq!(view["holders"][0]["step"], "holder");
    assert_eq!(view["waiters"][0]["step"], "w1");
    assert_eq!(view["waiters"][3]["position"], 4);
    release(&s, "h");
    assert!(holder.wait_with_output().unwrap().status.success());
    for mut waiter in line {
        assert!(wait_child(&mut waiter).success());
    }
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "1\n2\n3\n4\n");
}

test!(etcd_busy_names_the_holder_and_leaves_no_trace, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_busy_names_the_holder_and_leaves_no_trace() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("busy");
    let (script, ready) = wait_for_release(&s, "h");
    let holder = spawn(&s, &url, &["--step", "trainer", &r], &script);
    wait_for_file(&ready);

    let out = run(&s, &url, &["-n", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75));
    let err = stderr(&out);
    let host = nix_hostname();
    assert!(
        err.starts_with(&format!("devlock: {r} is busy: held by trainer (pid "))
            && err.contains(&format!(" on {host}, ")),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    let out = run(
        &s,
        &url,
        &["-w", "300ms", "--conflict-exit-code", "9", &r, "--", "true"],
    );
    assert_eq!(out.status.code(), Some(9));
    assert!(
        stderr(&out).contains(&format!("gave up on {r} after")),
        "{}",
        stderr(&out)
    );

    let view = status(&s, &url, &r);
    assert_eq!(waiters(&view), 0, "{view}");
    assert_eq!(view["holders"].as_array().unwrap().len(), 1);
    let holder_view = &view["holders"][0];
    assert_eq!(holder_view["host"], host.as_str());
    assert_eq!(holder_view["alive"], true);
    assert!(holder_view["lease_ttl_s"].as_i64().unwrap() > 0, "{view}");

    let table = stdout(&run(&s, &url, &["status", &r]));
    assert!(table.starts_with("RESOURCE"), "{table}");
    assert!(
        table.contains("trainer") && table.contains(&host),
        "{table}"
    );
    release(&s, "h");
    assert!(holder.wait_with_output().unwrap().status.success());
}

test!(etcd_kill_9_of_a_holder_ends_its_job_and_the_watcher_frees_the_lock, needs: [Tool("etcd"), Tool("etcdctl")]);
/// devlock became its command: a kill -9 of the process the caller started
/// is the command's end, and its watcher gives the lease back at once (the
/// TTL is long: a lease left to run out would hang the waiter).
pub(crate) fn etcd_kill_9_of_a_holder_ends_its_job_and_the_watcher_frees_the_lock() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("kill9");
    let pid_file = s.work("pid");
    let script = format!("{}; exec sleep 1000", write_pid("$$", &pid_file));
    let mut holder = spawn(&s, &url, &["--ttl", "600s", &r], &script);
    assert_eq!(pid_in(&pid_file), holder.id());
    let (mut waiter, verdict) = waiter_checking(&s, &url, &r, &[&pid_file]);
    signal(holder.id(), libc::SIGKILL);
    assert_eq!(wait_child(&mut holder).signal(), Some(libc::SIGKILL));
    assert!(wait_child(&mut waiter).success());
    assert_eq!(std::fs::read_to_string(&verdict).unwrap().trim(), "clean");
}

test!(etcd_a_group_sigkill_ends_the_whole_job, needs: [Tool("etcd"), Tool("etcdctl")]);
/// A supervisor's SIGKILL of an etcd holder's process group ends the
/// command's whole group, its child included, as with the file backend
/// (the parent-death signal alone would reach the command only).
pub(crate) fn etcd_a_group_sigkill_ends_the_whole_job() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("groupkill");
    let (parent, child) = (s.work("parent"), s.work("child"));
    let script = format!(
        "trap '' TERM; sleep 1000 & {}; {}; wait",
        write_pid("$!", &child),
        write_pid("$$", &parent)
    );
    let mut holder = devlock(&s, &url);
    holder
        .args([
            "--ttl",
            "3s",
            "--kill-after",
            "500ms",
            &r,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    std::os::unix::process::CommandExt::process_group(&mut holder, 0);
    let mut holder = holder.spawn().unwrap();
    let pids = [pid_in(&parent), pid_in(&child)];
    let (mut waiter, verdict) = waiter_checking(&s, &url, &r, &[&parent, &child]);
    // SAFETY: kill(2) of the process group this test started.
    let sent = unsafe { libc::kill(-(holder.id() as i32), libc::SIGKILL) };
    assert_eq!(sent, 0);
    wait_child(&mut holder);
    for pid in pids {
        wait_gone(pid);
    }
    assert!(wait_child(&mut waiter).success());
    assert_eq!(std::fs::read_to_string(&verdict).unwrap().trim(), "clean");
}

/// A shell test for "every pid in FILES is gone (or a zombie, or being reaped)", written to
/// `verdict` by the next holder as its first act.
pub(crate) fn verdict_script(pid_files: &[&std::path::Path], verdict: &std::path::Path) -> String {
    let checks: Vec<String> = pid_files
        .iter()
        .map(|f| {
            let pid = std::fs::read_to_string(f).unwrap().trim().to_owned();
            // Read once: a holder reaped between a look at its directory
            // and one at its status would read as alive (grep's error).
            format!(
                "{{ s=$(cat /proc/{pid}/status 2>/dev/null) && ! printf '%s' \"$s\" | grep -q '^State:.*[ZX]'; }}"
            )
        })
        .collect();
    format!(
        "if {}; then echo overlap; else echo clean; fi > {}",
        checks.join(" || "),
        verdict.display()
    )
}

/// Waits for a holder its watcher stopped on a lost lease: the command's
/// own status is SIGTERM's (the watcher's), and devlock said why.
pub(crate) fn stopped_on_lease_loss(holder: std::process::Child) {
    let out = holder.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGTERM),
        "{:?}: {err}",
        out.status
    );
    assert!(err.contains("lost the etcd lease"), "{err}");
}

/// Starts a waiter for `r` whose command first writes to the returned
/// verdict file whether the processes in `pid_files` are all gone, and
/// waits until it is in line.
pub(crate) fn waiter_checking(
    s: &Scratch,
    url: &str,
    r: &str,
    pid_files: &[&std::path::Path],
) -> (std::process::Child, std::path::PathBuf) {
    let verdict = s.work("verdict");
    let waiter = spawn(s, url, &["-q", r], &verdict_script(pid_files, &verdict));
    wait_for(s, url, r, "a waiter", |v| waiters(v) == 1);
    (waiter, verdict)
}

test!(etcd_waiters_ride_out_an_etcd_restart, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_waiters_ride_out_an_etcd_restart() {
    let mut server = EtcdServer::start();
    let url = server.url.clone();
    let s = Scratch::new();
    let r = name("restart");
    let (script, ready) = wait_for_release(&s, "h");
    let holder = spawn(&s, &url, &[&r], &script);
    wait_for_file(&ready);
    let ran = s.work("ran");
    let waiter = spawn(&s, &url, &["-q", &r], &format!("echo > {}", ran.display()));
    wait_for(&s, &url, &r, "a waiter", |v| waiters(v) == 1);
    server.restart();
    release(&s, "h");
    let out = holder.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = waiter.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(ran.exists());
}

test!(etcd_shared_holders_run_together_and_a_waiting_writer_goes_first, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_shared_holders_run_together_and_a_waiting_writer_goes_first() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("shared");
    let (script1, ready1) = wait_for_release(&s, "s1");
    let (script2, ready2) = wait_for_release(&s, "s2");
    let s1 = spawn(&s, &url, &["--shared", "--step", "s1", &r], &script1);
    let s2 = spawn(&s, &url, &["--shared", "--step", "s2", &r], &script2);
    wait_for_file(&ready1);
    wait_for_file(&ready2);
    let order = s.work("order");
    let append = |tag: &str| format!("echo {tag} >> {}", order.display());
    let mut writer = spawn(&s, &url, &["-q", "--step", "w", &r], &append("w"));
    wait_for(&s, &url, &r, "the writer waiting", |v| waiters(v) == 1);
    let mut reader = spawn(
        &s,
        &url,
        &["-q", "--shared", "--step", "s3", &r],
        &append("s3"),
    );
    wait_for(&s, &url, &r, "a reader behind the writer", |v| {
        waiters(v) == 2
    });
    let view = status(&s, &url, &r);
    assert_eq!(view["state"], "shared", "{view}");
    assert_eq!(view["waiters"][0]["step"], "w", "{view}");
    assert_eq!(view["waiters"][1]["step"], "s3", "{view}");
    // A member holds its group shared: the group alone waits for it.
    let member = format!("{r}x:0");
    let out = run(
        &s,
        &url,
        &[&member, "--", BIN, "-n", &format!("{r}x:1"), "--", "true"],
    );
    assert!(
        out.status.success(),
        "members run side by side: {}",
        stderr(&out)
    );
    release(&s, "s1");
    release(&s, "s2");
    assert!(s1.wait_with_output().unwrap().status.success());
    assert!(s2.wait_with_output().unwrap().status.success());
    assert!(wait_child(&mut writer).success());
    assert!(wait_child(&mut reader).success());
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "w\ns3\n");
}

test!(etcd_frozen_server_stops_the_command_and_the_lock_frees_after_thaw, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_frozen_server_stops_the_command_and_the_lock_frees_after_thaw() {
    let server = EtcdServer::start();
    let url = server.url.clone();
    let s = Scratch::new();
    let r = name("freeze");

    // A short freeze, well inside the margin, changes nothing.
    let (script, ready) = wait_for_release(&s, "calm");
    let calm = spawn(&s, &url, &["--ttl", "10s", &r], &script);
    wait_for_file(&ready);
    server.freeze();
    std::thread::sleep(Duration::from_millis(200));
    server.thaw();
    release(&s, "calm");
    let out = calm.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A long one: the command is stopped, and the watcher says why.
    let pid_file = s.work("pid");
    let script = format!("{}; exec sleep 1000", write_pid("$$", &pid_file));
    let holder = spawn(
        &s,
        &url,
        &["--ttl", "3s", "--kill-after", "500ms", &r],
        &script,
    );
    let command_pid = pid_in(&pid_file);
    server.freeze();
    stopped_on_lease_loss(holder);
    wait_gone(command_pid);
    server.thaw();
    // Once etcd runs again it expires the lease, and the lock is free.
    let out = run(&s, &url, &["-w", "30s", &r, "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

test!(etcd_nested_take_passes_through, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_nested_take_passes_through() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("nest");
    let out = run(&s, &url, &[&r, "--", BIN, "-n", &r, "--", "echo", "inner"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "inner\n");

    // A member holds its group only shared: an exclusive take of the group
    // inside it would wait for itself.
    let member = format!("{r}:0");
    let out = run(&s, &url, &[&member, "--", BIN, "-n", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("held only shared"),
        "{}",
        stderr(&out)
    );
}

test!(etcd_signals_while_waiting_leave_the_line_and_reach_the_command_while_holding, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_signals_while_waiting_leave_the_line_and_reach_the_command_while_holding() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("sig");
    let ready = s.work("ready");
    let got = s.work("got-term");
    let script = format!(
        "trap 'echo term > {g}; exit 3' TERM; echo > {ready}; while :; do sleep 0.01; done",
        g = got.display(),
        ready = ready.display()
    );
    let holder = spawn(&s, &url, &[&r], &script);
    wait_for_file(&ready);
    let mut waiter = spawn(&s, &url, &["-q", &r], "true");
    wait_for(&s, &url, &r, "a waiter", |v| waiters(v) == 1);
    signal(waiter.id(), libc::SIGTERM);
    assert_eq!(wait_child(&mut waiter).code(), Some(128 + libc::SIGTERM));
    assert_eq!(waiters(&status(&s, &url, &r)), 0);

    signal(holder.id(), libc::SIGTERM);
    let out = holder.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_to_string(&got).unwrap().trim(), "term");
    wait_free(&s, &url, &r);
}

fn nix_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned()
}
