//! The etcd backend against a real etcd server: exclusion, arrival order,
//! leases that outlive devlock by at most their TTL, partitions, a frozen
//! server, nesting, signals and clear failures.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::etcd_server::{EtcdServer, Proxy, shared_etcd};
use crate::harness::*;

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

/// A shell test for "every pid in FILES is gone (or a zombie)", written to
/// `verdict` by the next holder as its first act.
pub(crate) fn verdict_script(pid_files: &[&std::path::Path], verdict: &std::path::Path) -> String {
    let checks: Vec<String> = pid_files
        .iter()
        .map(|f| {
            let pid = std::fs::read_to_string(f).unwrap().trim().to_owned();
            format!("{{ [ -d /proc/{pid} ] && ! grep -q '^State:.*Z' /proc/{pid}/status; }}")
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

test!(etcd_holder_cut_off_stops_its_work_before_the_next_one_starts, needs: [Tool("etcd"), Tool("etcdctl")]);
/// The holder talks to etcd through a proxy that the test cuts: its
/// command, and what the command left running, must be dead before the
/// waiter (on the direct address) starts.
pub(crate) fn etcd_holder_cut_off_stops_its_work_before_the_next_one_starts() {
    let (_server, url) = shared_etcd();
    let proxy = Proxy::to(&url);
    let s = Scratch::new();
    let r = name("cut");
    let (shell, orphan) = (s.work("shell"), s.work("orphan"));
    // The shell starts a process that ignores SIGTERM, so only the SIGKILL
    // after --kill-after ends it, and that the shell leaves behind when
    // SIGTERM ends the shell.
    let script = format!(
        "(trap '' TERM; exec sleep 1000) & {}; {}; wait",
        write_pid("$!", &orphan),
        write_pid("$$", &shell)
    );
    let holder = spawn(
        &s,
        &proxy.url,
        &["--ttl", "3s", "--kill-after", "500ms", &r],
        &script,
    );
    wait_for_file(&shell);
    let (mut waiter, verdict) = waiter_checking(&s, &url, &r, &[&shell, &orphan]);
    proxy.cut();
    stopped_on_lease_loss(holder);
    assert!(wait_child(&mut waiter).success());
    assert_eq!(std::fs::read_to_string(&verdict).unwrap().trim(), "clean");
}

test!(etcd_a_stuck_stderr_does_not_delay_the_stop, needs: [Tool("etcd"), Tool("etcdctl")]);
/// devlock's stderr is a pipe nobody reads, filled by the command: saying
/// that the lease is lost must not hold up stopping the command.
pub(crate) fn etcd_a_stuck_stderr_does_not_delay_the_stop() {
    use std::io::Read;
    let (_server, url) = shared_etcd();
    let proxy = Proxy::to(&url);
    let s = Scratch::new();
    let r = name("stderr");
    let (shell, filler) = (s.work("shell"), s.work("filler"));
    let script = format!(
        "head -c 1000000 /dev/zero >&2 & {}; {}; wait",
        write_pid("$!", &filler),
        write_pid("$$", &shell)
    );
    let mut holder = spawn(
        &s,
        &proxy.url,
        &["--ttl", "3s", "--kill-after", "500ms", &r],
        &script,
    );
    wait_for_file(&shell);
    let filler_pid = std::fs::read_to_string(&filler).unwrap().trim().to_owned();
    let start = Instant::now();
    while !std::fs::read_to_string(format!("/proc/{filler_pid}/wchan"))
        .unwrap_or_default()
        .contains("pipe")
    {
        assert!(start.elapsed() < HANG, "the pipe never filled");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (mut waiter, verdict) = waiter_checking(&s, &url, &r, &[&shell, &filler]);
    proxy.cut();
    assert!(wait_child(&mut waiter).success());
    assert_eq!(std::fs::read_to_string(&verdict).unwrap().trim(), "clean");
    // Only now is the pipe read, and devlock can say why it ended.
    let mut err = Vec::new();
    holder.stderr.take().unwrap().read_to_end(&mut err).unwrap();
    assert_eq!(wait_child(&mut holder).signal(), Some(libc::SIGTERM));
    assert!(String::from_utf8_lossy(&err).contains("lost the etcd lease"));
}

test!(etcd_what_the_command_leaves_running_keeps_the_lock, needs: [Tool("etcd"), Tool("etcdctl")]);
/// The command exits (its own status is devlock's), what it started
/// inherited the job's descriptor and keeps the lock, as a lock file's
/// descriptor would; once that is gone too, the watcher lets go.
pub(crate) fn etcd_what_the_command_leaves_running_keeps_the_lock() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("left");
    let orphan = s.work("orphan");
    let script = format!("sleep 1000 & {}; exit 3", write_pid("$!", &orphan));
    let mut holder = spawn(&s, &url, &[&r], &script);
    let orphan_pid = pid_in(&orphan);
    assert_eq!(wait_child(&mut holder).code(), Some(3));
    let out = run(&s, &url, &["-n", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    // Status counts the job alive while its watcher is (the label names it).
    wait_for(&s, &url, &r, "the job alive", |v| {
        v["holders"][0]["alive"] == true && v["holders"][0]["pid"] == holder.id()
    });
    let table = stdout(&run(&s, &url, &["status", &r]));
    assert!(!table.contains("gone"), "{table}");
    signal(orphan_pid, libc::SIGTERM);
    wait_gone(orphan_pid);
    wait_free(&s, &url, &r);
}

test!(etcd_a_revoked_lease_stops_the_command_at_once, needs: [Tool("etcd"), Tool("etcdctl")]);
/// Somebody revokes the holder's lease: etcd frees the lock at once, so the
/// command (which ignores SIGTERM) must be killed at once, not at the next
/// renewal or the holder's own deadline.
pub(crate) fn etcd_a_revoked_lease_stops_the_command_at_once() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("revoked");
    let shell = s.work("shell");
    let script = format!("trap '' TERM; {}; exec sleep 1000", write_pid("$$", &shell));
    // Renewals 200s apart: only a watch of its own key can tell devlock
    // within the test's hang bound.
    let mut holder = spawn(&s, &url, &["--ttl", "600s", &r], &script);
    let command_pid = pid_in(&shell);
    let mut waiter = spawn(&s, &url, &["-q", &r], "true");
    wait_for(&s, &url, &r, "a waiter", |v| waiters(v) == 1);
    let lease = status(&s, &url, &r)["holders"][0]["lease"]
        .as_str()
        .unwrap()
        .to_owned();
    etcdctl(&url, &["lease", "revoke", &lease]);
    // The waiter may start in the same instant: a lock revoked by hand is
    // broken, and only how fast devlock reacts is up to devlock.
    // SIGKILL at once: the lock was free the moment the lease went.
    assert_eq!(wait_child(&mut holder).signal(), Some(libc::SIGKILL));
    wait_gone(command_pid);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut holder.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("was removed from etcd"), "{err}");
    assert!(wait_child(&mut waiter).success());
}

test!(etcd_a_waiter_whose_key_is_removed_does_not_run, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_a_waiter_whose_key_is_removed_does_not_run() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("removed");
    let (script, ready) = wait_for_release(&s, "h");
    let holder = spawn(&s, &url, &[&r], &script);
    wait_for_file(&ready);
    let ran = s.work("ran");
    let waiter = spawn(&s, &url, &["-q", &r], &format!("echo > {}", ran.display()));
    wait_for(&s, &url, &r, "a waiter", |v| waiters(v) == 1);
    let key = status(&s, &url, &r)["waiters"][0]["key"]
        .as_str()
        .unwrap()
        .to_owned();
    etcdctl(&url, &["del", &key]);
    release(&s, "h");
    assert!(holder.wait_with_output().unwrap().status.success());
    let out = waiter.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(68), "{err}");
    assert!(err.contains("place in line"), "{err}");
    assert!(!ran.exists());
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

test!(etcd_bad_urls_and_dead_endpoints_fail_in_one_line, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_bad_urls_and_dead_endpoints_fail_in_one_line() {
    let s = Scratch::new();
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    // Speaks TCP, not etcd.
    let not_etcd = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let not_etcd_url = format!("http://{}", not_etcd.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut conn in not_etcd.incoming().flatten() {
            use std::io::Write;
            let _ = conn.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
        }
    });
    for (url, code) in [
        ("ftp://127.0.0.1:1", 2),
        ("127.0.0.1:port", 2),
        ("unix:///run/etcd.sock", 2),
        (dead.as_str(), 68),
        (not_etcd_url.as_str(), 68),
    ] {
        for args in [&["r", "--", "true"][..], &["status"][..]] {
            let out = run(&s, url, args);
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(code), "{url} {args:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{url}: {err}");
            assert!(err.starts_with("devlock: "), "{err}");
        }
    }
    let out = run(
        &s,
        "http://127.0.0.1:1",
        &["--ttl", "3s", "--kill-after", "2s", "r", "--", "true"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("too short"), "{}", stderr(&out));
}

test!(etcd_refused_credentials_fail_in_one_line_and_leave_nothing, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_refused_credentials_fail_in_one_line_and_leave_nothing() {
    // Tokens that expire after a second: a hold that outlives its token
    // must still renew and give back its lease.
    let server = EtcdServer::start_with(&["--auth-token-ttl", "1"]);
    let url = server.url.clone();
    etcdctl(&url, &["user", "add", "root:rootpw"]);
    etcdctl(&url, &["auth", "enable"]);
    let s = Scratch::new();
    for user in [None, Some("root:wrong")] {
        let mut cmd = devlock(&s, &url);
        if let Some(user) = user {
            cmd.env("DEVLOCK_ETCD_USER", user);
        }
        let out = cmd.args(["r", "--", "true"]).output().unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(77), "{user:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("refused"), "{err}");
    }
    let out = devlock(&s, &url)
        .env("DEVLOCK_ETCD_USER", "root:rootpw")
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["resources"], serde_json::json!([]));
    let out = devlock(&s, &url)
        .env("DEVLOCK_ETCD_USER", "root:rootpw")
        .args(["r", "--", "echo", "in"])
        .output()
        .unwrap();
    assert_eq!(stdout(&out), "in\n", "{}", stderr(&out));

    // Waiting for etcd's own token timeout is the point here: no handshake
    // can stand in for the clock of another process.
    let out = devlock(&s, &url)
        .env("DEVLOCK_ETCD_USER", "root:rootpw")
        .args([
            "--ttl",
            "3s",
            "--kill-after",
            "500ms",
            "r",
            "--",
            "sleep",
            "2.5",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let out = devlock(&s, &url)
        .env("DEVLOCK_ETCD_USER", "root:rootpw")
        .args(["status", "--json", "r"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        json["resources"][0]["state"], "free",
        "the lease was given back: {json}"
    );
}

fn nix_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned()
}

test!(etcd_a_key_removed_after_a_compaction_still_stops_the_holder, needs: [Tool("etcd"), Tool("etcdctl")]);
/// etcd compacts away the history a holder's watch of its own key starts
/// from: the watch is cancelled, and devlock must still see its key go.
pub(crate) fn etcd_a_key_removed_after_a_compaction_still_stops_the_holder() {
    let server = EtcdServer::start();
    let url = server.url.clone();
    let s = Scratch::new();
    let r = name("compact");
    let (script, ready) = wait_for_release(&s, "a");
    let first = spawn(&s, &url, &[&r], &script);
    wait_for_file(&ready);
    let shell = s.work("shell");
    let script = format!("{}; exec sleep 1000", write_pid("$$", &shell));
    let mut second = spawn(&s, &url, &["--ttl", "600s", &r], &script);
    wait_for(&s, &url, &r, "a waiter", |v| waiters(v) == 1);
    // History after the waiter joined, compacted away.
    etcdctl(&url, &["put", "/unrelated", "1"]);
    etcdctl(&url, &["put", "/unrelated", "2"]);
    let json: serde_json::Value = serde_json::from_str(&etcdctl(
        &url,
        &["get", "/", "--prefix", "--keys-only", "-w", "json"],
    ))
    .unwrap();
    let revision = json["header"]["revision"].as_i64().unwrap().to_string();
    etcdctl(&url, &["compact", &revision]);
    release(&s, "a");
    assert!(first.wait_with_output().unwrap().status.success());
    let command_pid = pid_in(&shell);
    let key = status(&s, &url, &r)["holders"][0]["key"]
        .as_str()
        .unwrap()
        .to_owned();
    etcdctl(&url, &["del", &key]);
    // SIGTERM and SIGKILL together: the lock was free the moment the key went.
    let ended = wait_child(&mut second).signal();
    assert!(
        ended == Some(libc::SIGTERM) || ended == Some(libc::SIGKILL),
        "{ended:?}"
    );
    wait_gone(command_pid);
}

test!(etcd_flags_it_cannot_honour_are_usage_errors, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_flags_it_cannot_honour_are_usage_errors() {
    let s = Scratch::new();
    let url = "http://127.0.0.1:1";
    for args in [
        &["--mem", "1GiB", "gpu:0", "--", "true"][..],
        &["--require-idle", "gpu", "--", "true"][..],
        &["--etcd-user", "no-colon", "a", "--", "true"][..],
    ] {
        let out = run(&s, url, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    }
}
