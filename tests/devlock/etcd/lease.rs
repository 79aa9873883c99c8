//! A holder that loses its lease (cut off, revoked, its key removed) stops
//! its work, and what the work left running, before the next one starts.

use super::*;

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
