//! The HTTP limits, an unprivileged server as the shipped systemd unit runs
//! it, and usage errors.

use super::*;

test!(requests_are_bounded_and_only_get_and_head_are_answered, needs: []);
pub(crate) fn requests_are_bounded_and_only_get_and_head_are_answered() {
    let s = Scratch::new();
    let server = Server::start(&mut s.devlock(), &[]);
    let host = format!("Host: {}\r\n", server.addr);
    let head = server.raw(format!("HEAD /metrics HTTP/1.1\r\n{host}\r\n").as_bytes());
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_ne!(head.header("content-length"), Some("0"));
    let post = server.raw(format!("POST / HTTP/1.1\r\n{host}Content-Length: 0\r\n\r\n").as_bytes());
    assert_eq!(
        (post.status, post.header("allow")),
        (405, Some("GET, HEAD"))
    );
    assert!(post.body.contains("read-only"), "{}", post.body);
    let missing = server.get("/etc/passwd");
    assert_eq!(missing.status, 404);
    assert!(missing.body.contains("/metrics"), "{}", missing.body);
    assert_eq!(server.raw(b"GET / HTTP/1.0\r\n\r\n").status, 200);
    assert_eq!(server.raw(b"GET / HTTP/1.1\r\n\r\n").status, 400, "no Host");
    assert_eq!(server.raw(b"GET / HTTP/3\r\nHost: x\r\n\r\n").status, 505);
    // DNS rebinding: a name of another site, pointed at 127.0.0.1.
    let port = server.addr.rsplit_once(':').unwrap().1;
    let rebound =
        server.raw(format!("GET / HTTP/1.1\r\nHost: evil.example:{port}\r\n\r\n").as_bytes());
    assert_eq!(rebound.status, 403);
    assert!(rebound.body.contains("DNS rebinding"), "{}", rebound.body);
    for local in [format!("localhost:{port}"), format!("[::1]:{port}")] {
        let answer = server.raw(format!("GET / HTTP/1.1\r\nHost: {local}\r\n\r\n").as_bytes());
        assert_eq!(answer.status, 200, "{local}");
    }
    let huge = format!(
        "GET / HTTP/1.1\r\n{host}X-Pad: {}\r\n\r\n",
        "x".repeat(9000)
    );
    assert_eq!(server.raw(huge.as_bytes()).status, 431);
    // A request that never ends is answered 408 and closed.
    let mut slow = server.connect();
    slow.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    let started = Instant::now();
    assert_eq!(read_answer(&mut slow).status, 408);
    assert!(started.elapsed() < HANG);
    // Clients that go away before the answer cost the server nothing (no
    // SIGPIPE).
    for _ in 0..20 {
        let mut gone = server.connect();
        gone.write_all(format!("GET /metrics HTTP/1.1\r\n{host}\r\n").as_bytes())
            .unwrap();
        drop(gone);
    }
    poll_until(
        "an answer after the clients that went away",
        || server.try_get("/").map_or(0, |a| a.status),
        |status| *status == 200,
    );
    assert!(server.alive());
}

/// The systemd unit's command line, after the program.
fn unit_arguments() -> Vec<String> {
    let unit =
        std::fs::read_to_string(format!("{REPO}/contrib/systemd/devlock-serve.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart");
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some("/usr/bin/devlock"), "{exec}");
    words.map(str::to_owned).collect()
}

test!(the_shipped_unit_serves_as_an_unprivileged_user_what_status_shows_that_user, needs: [Root, Tool("setpriv"), Tool("cc")]);
pub(crate) fn the_shipped_unit_serves_as_an_unprivileged_user_what_status_shows_that_user() {
    let scene = Scene::new();
    let args = unit_arguments();
    assert_eq!(args, ["serve"], "the unit runs `devlock serve` as it is");
    // What DynamicUser= gives the unit: a user of its own, no groups.
    let mut serve = as_user(USER_A, BIN);
    serve
        .env("DEVLOCK_DIR", scene.s.dir())
        .env("DEVLOCK_NVML", &scene.library)
        .env("FAKE_NVML_PIDS", pid_list(&scene.pids));
    let server = Server::start(&mut serve, &[]);
    let served = server.get("/status.json").json();
    let mut status = as_user(USER_A, BIN);
    status
        .env("DEVLOCK_DIR", scene.s.dir())
        .env("DEVLOCK_NVML", &scene.library)
        .env("FAKE_NVML_PIDS", pid_list(&scene.pids))
        .args(["status", "--json"]);
    let status = json_of(&status.output().unwrap());
    assert_eq!(without_moments(&served), without_moments(&status));
    // Not root, it still names root's holders, their steps and their
    // GPU memory: /proc/locks, the records and NVML are everyone's.
    let gpu0 = served["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "gpu:0")
        .unwrap();
    assert_eq!(gpu0["holders"][0]["step"], "train");
    assert_eq!(gpu0["holders"][0]["user"], "root");
    assert_eq!(gpu0["waiters"][0]["step"], "eval");
    assert_eq!(
        served["devices"][0]["processes"][0]["gated"], true,
        "{served}"
    );
    for holder in holders(&served) {
        assert!(holder["command"].is_null(), "{holder}");
    }
}

test!(listen_and_usage_errors_are_one_line, needs: []);
pub(crate) fn listen_and_usage_errors_are_one_line() {
    let s = Scratch::new();
    let out = s.run(&["serve", "--listen", "nowhere"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("not an address to listen on: \"nowhere\""),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = s.run(&["serve", "--listen", &addr]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.starts_with(&format!("devlock: cannot listen on {addr}: "))
            && err.contains("choose another with --listen"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let out = s.run(&["serve", "--", "sleep", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    // Serve shows the lock directory; etcd's locks are status --etcd's.
    let out = s.run(&[
        "serve",
        "--etcd",
        "http://127.0.0.1:1",
        "--listen",
        "127.0.0.1:0",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
}
