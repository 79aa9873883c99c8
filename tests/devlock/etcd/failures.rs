//! Clear failures: bad URLs, dead endpoints, refused credentials, flags the
//! etcd backend cannot honour, and a key removed after a compaction.

use super::*;

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
