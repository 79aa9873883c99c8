//! `devlock serve`: the real server on a free loopback port, with real
//! holders and waiters and the fake NVML as the GPU source; `/status.json`
//! against `status --json`, `/metrics` through `promtool check metrics` and
//! by value, `/` in a real headless browser (chromium-headless-shell: its
//! DOM, and a screenshot left as an artefact), the HTTP limits, an
//! unprivileged server as the shipped systemd unit runs it, and the
//! documented lists against what is served.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use crate::harness::*;
use crate::nvml::{fake_nvml, scenario, with_nvml};

const MIB: f64 = 1024.0 * 1024.0;
const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// A `devlock serve` on a free loopback port (`--listen 127.0.0.1:0`),
/// its address read from the line it says once it listens; killed when
/// dropped.
pub struct Server {
    child: Mutex<Child>,
    pub addr: String,
}

impl Server {
    /// Starts `cmd` (a devlock with its environment) as `serve --listen
    /// 127.0.0.1:0 EXTRA...`.
    pub fn start(cmd: &mut Command, extra: &[&str]) -> Server {
        let mut child = cmd
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let seen = wait_for_line(&mut stderr, "devlock: serving http://");
        let addr = seen
            .split("http://")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or_else(|| panic!("no address in {seen:?}"))
            .to_owned();
        // Whatever it says later goes on being read, so it never blocks.
        std::thread::spawn(move || {
            let mut rest = String::new();
            while stderr.read_line(&mut rest).is_ok_and(|n| n > 0) {
                eprint!("serve: {rest}");
                rest.clear();
            }
        });
        Server {
            child: Mutex::new(child),
            addr,
        }
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap().id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(&self.addr).unwrap();
        stream.set_read_timeout(Some(HANG)).unwrap();
        stream
    }

    /// Sends `request` as it is and reads the answer to its end.
    pub fn raw(&self, request: &[u8]) -> Answer {
        let mut stream = self.connect();
        stream.write_all(request).unwrap();
        let answer = read_answer(&mut stream);
        if !request.starts_with(b"HEAD ")
            && let Some(length) = answer.header("content-length")
        {
            assert_eq!(length, answer.body.len().to_string(), "{answer:?}");
        }
        answer
    }

    /// `GET path` as a client sends it.
    pub fn get(&self, path: &str) -> Answer {
        let answer = self.raw(
            format!(
                "GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: test\r\n\r\n",
                self.addr
            )
            .as_bytes(),
        );
        assert!(self.alive(), "serve died answering {path}");
        answer
    }

    /// `GET path`, or `None` when the connection fails (refused, reset).
    fn try_get(&self, path: &str) -> Option<Answer> {
        let mut stream = TcpStream::connect(&self.addr).ok()?;
        stream.set_read_timeout(Some(HANG)).ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.addr);
        stream.write_all(request.as_bytes()).ok()?;
        let mut bytes = Vec::new();
        stream.read_to_end(&mut bytes).ok()?;
        let text = String::from_utf8(bytes).ok()?;
        let status = text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
        Some(Answer {
            status,
            headers: Vec::new(),
            body: text,
        })
    }

    fn alive(&self) -> bool {
        self.child.lock().unwrap().try_wait().unwrap().is_none()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap();
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// An HTTP answer: status, header fields (names in lower case), body.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body of a 200, parsed as JSON.
    fn json(&self) -> serde_json::Value {
        assert_eq!(self.status, 200, "{}", self.body);
        serde_json::from_str(&self.body).unwrap()
    }
}

fn read_answer(stream: &mut TcpStream) -> Answer {
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).unwrap();
    let text = String::from_utf8(bytes).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.strip_prefix("HTTP/1.1 "))
        .and_then(|l| l.get(..3))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// What every scene test starts from: a fake NVML (`several`: four H100s),
/// `train` holding gpu:0 with a worker on the GPU and a secret on its
/// command line, `eval` waiting for gpu:0, `solver` holding `licence`, and
/// a stranger outside the gate on GPU 2.
struct Scene {
    s: Scratch,
    library: PathBuf,
    pids: Vec<u32>,
    holder: Killed,
    waiter: Killed,
    solver: Killed,
    _stranger: Stranger,
}

/// On the holder's command line only: it must never be served.
const SECRET: &str = "--token=hunter2-s3cr3t";

impl Scene {
    fn new() -> Scene {
        let s = Scratch::new();
        let library = fake_nvml(&s, &scenario("several"));
        let ready = s.work("train.ready");
        let pidfile = s.work("train.pid");
        let release = s.work("release-train");
        let holder = with_nvml(&s, &library, &[])
            .args(["--step", "train", "gpu:0", "--", "sh", "-c"])
            .arg(format!(
                "sleep 1000 & echo $! > {pid}; echo > {ready}; while [ ! -e {release} ]; do sleep 0.01; done; kill $!",
                pid = pidfile.display(),
                ready = ready.display(),
                release = release.display()
            ))
            .args(["train", SECRET])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let holder = Killed(holder);
        wait_for_file(&ready);
        let worker = pid_in(&pidfile);
        let waiter = Killed(
            s.devlock()
                .args(["-q", "--step", "eval", "gpu:0", "--", "true"])
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        s.wait_for_status("gpu:0", "eval in line", |v| registered_waiters(v) == 1);
        let (script, ready) = wait_for_release(&s, "solver");
        let solver = Killed(s.hold(&["--step", "solver", "licence"], &script, &ready));
        let stranger = Stranger::start();
        let pids = vec![worker, stranger.pid(), stranger.pid(), 4_000_000];
        Scene {
            s,
            library,
            pids,
            holder,
            waiter,
            solver,
            _stranger: stranger,
        }
    }

    /// devlock with this scene's GPU source.
    fn devlock(&self) -> Command {
        with_nvml(&self.s, &self.library, &self.pids)
    }

    fn serve(&self) -> Server {
        Server::start(&mut self.devlock(), &[])
    }
}

impl Drop for Scene {
    /// Lets the commands end, and waits for them before the scratch
    /// directory (and the release files in it) goes: killing a devlock
    /// would leave its command holding.
    fn drop(&mut self) {
        release(&self.s, "train");
        release(&self.s, "solver");
        let deadline = Instant::now() + HANG;
        for holder in [&mut self.holder, &mut self.solver] {
            while holder.0.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
}

/// A JSON document without what changes from one moment to the next (the
/// durations) and without `command`.
fn without_moments(value: &serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => map
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "held_for_ms" | "waiting_for_ms" | "idle_for_ms" | "kept_for_ms" | "command"
                )
            })
            .map(|(k, v)| (k.clone(), without_moments(v)))
            .collect(),
        serde_json::Value::Array(items) => items.iter().map(without_moments).collect(),
        other => other.clone(),
    }
}

/// Every holder of every resource of a status document.
fn holders(doc: &serde_json::Value) -> Vec<&serde_json::Value> {
    doc["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["holders"].as_array().unwrap())
        .collect()
}

test!(status_json_is_status_json_without_command_lines, needs: [Tool("cc")]);
pub(crate) fn status_json_is_status_json_without_command_lines() {
    let scene = Scene::new();
    let server = scene.serve();
    let answer = server.get("/status.json");
    assert_eq!(answer.header("content-type"), Some("application/json"));
    assert_eq!(answer.header("cache-control"), Some("no-store"));
    let served = answer.json();
    let status = json_of(&scene.devlock().args(["status", "--json"]).output().unwrap());
    // status shows the command line, secret and all; serve never does.
    assert!(status.to_string().contains(SECRET), "{status}");
    assert!(!answer.body.contains("hunter2"), "{}", answer.body);
    for holder in holders(&served) {
        assert!(holder["command"].is_null(), "{holder}");
    }
    assert_eq!(without_moments(&served), without_moments(&status));
    // The scene is all there: holder, waiter, the GPUs, the stranger.
    let gpu0 = served["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "gpu:0")
        .unwrap();
    assert_eq!(gpu0["state"], "held");
    assert_eq!(gpu0["holders"][0]["step"], "train");
    assert_eq!(gpu0["holders"][0]["pid"], scene.holder.id());
    assert_eq!(gpu0["waiters"][0]["step"], "eval");
    assert_eq!(gpu0["waiters"][0]["pid"], scene.waiter.id());
    assert_eq!(served["device_source"], "nvml");
    assert_eq!(served["devices"][2]["processes"][0]["gated"], false);
    // The same document, byte for byte in its shape, as status prints it.
    assert!(answer.body.ends_with("}\n") && answer.body.starts_with("{\n  \"dir\""));
    for path in ["/", "/metrics"] {
        assert!(!server.get(path).body.contains("hunter2"), "{path}");
    }
}

/// `/metrics` as `name{labels}` → value.
pub(crate) fn samples(text: &str) -> std::collections::HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            let value = if value == "NaN" {
                f64::NAN
            } else {
                value.parse().unwrap()
            };
            (series.to_owned(), value)
        })
        .collect()
}

pub(crate) fn promtool_check(text: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        stdout(&out),
        stderr(&out)
    );
}

test!(metrics_pass_promtool_and_carry_the_values, needs: [Tool("cc"), Tool("promtool")]);
pub(crate) fn metrics_pass_promtool_and_carry_the_values() {
    let scene = Scene::new();
    let server = scene.serve();
    let answer = server.get("/metrics");
    assert_eq!(answer.status, 200);
    assert_eq!(
        answer.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    promtool_check(&answer.body);
    let m = samples(&answer.body);
    let value = |series: &str| -> f64 {
        *m.get(series)
            .unwrap_or_else(|| panic!("no {series} in\n{}", answer.body))
    };
    let (holder, waiter, solver) = (scene.holder.id(), scene.waiter.id(), scene.solver.id());
    assert_eq!(
        value(r#"devlock_lock_state{resource="gpu:0",state="held"}"#),
        1.0
    );
    assert_eq!(
        value(r#"devlock_lock_state{resource="gpu:0",state="free"}"#),
        0.0
    );
    assert_eq!(
        value(r#"devlock_lock_state{resource="licence",state="held"}"#),
        1.0
    );
    assert_eq!(value(r#"devlock_lock_holders{resource="gpu:0"}"#), 1.0);
    assert_eq!(value(r#"devlock_lock_waiters{resource="gpu:0"}"#), 1.0);
    assert_eq!(value(r#"devlock_lock_waiters{resource="licence"}"#), 0.0);
    let held = value(&format!(
        r#"devlock_holder_held_seconds{{resource="gpu:0",step="train",user="root",pid="{holder}",via=""}}"#
    ));
    assert!((0.0..3600.0).contains(&held), "{held}");
    // The group's row, held for the member.
    value(&format!(
        r#"devlock_holder_held_seconds{{resource="gpu",step="train",user="root",pid="{holder}",via="gpu:0"}}"#
    ));
    value(&format!(
        r#"devlock_holder_held_seconds{{resource="licence",step="solver",user="root",pid="{solver}",via=""}}"#
    ));
    let waited = value(&format!(
        r#"devlock_waiter_waiting_seconds{{resource="gpu:0",step="eval",user="root",pid="{waiter}",position="1"}}"#
    ));
    assert!(waited.is_finite() && waited >= 0.0, "{waited}");
    assert_eq!(
        value(&format!(
            r#"devlock_holder_gpu_memory_used_bytes{{resource="gpu:0",step="train",user="root",pid="{holder}",gpu="0"}}"#
        )),
        38912.0 * MIB
    );
    // The fake's GPUs, in base units.
    assert_eq!(
        value(r#"devlock_gpu_memory_total_bytes{gpu="0"}"#),
        81559.0 * MIB
    );
    assert_eq!(
        value(r#"devlock_gpu_memory_used_bytes{gpu="0"}"#),
        38925.0 * MIB
    );
    assert_eq!(
        value(r#"devlock_gpu_memory_gated_bytes{gpu="0"}"#),
        38912.0 * MIB
    );
    assert_eq!(value(r#"devlock_gpu_memory_ungated_bytes{gpu="0"}"#), 0.0);
    assert_eq!(value(r#"devlock_gpu_utilization_ratio{gpu="0"}"#), 0.97);
    assert_eq!(value(r#"devlock_gpu_processes{gpu="0",gated="true"}"#), 1.0);
    assert_eq!(
        value(r#"devlock_gpu_processes{gpu="2",gated="false"}"#),
        2.0
    );
    assert_eq!(
        value(r#"devlock_gpu_memory_ungated_bytes{gpu="2"}"#),
        (30720.0 + 30716.0) * MIB
    );
    assert_eq!(value(r#"devlock_gpu_utilization_ratio{gpu="1"}"#), 0.0);
    value(
        r#"devlock_gpu_info{gpu="0",uuid="GPU-5f3c1a2b-7d4e-4c1f-9a8b-1c2d3e4f5a60",name="NVIDIA H100 80GB HBM3"}"#,
    );
    assert_eq!(value(r#"devlock_device_source_info{source="nvml"}"#), 1.0);
    assert_eq!(value(r#"devlock_device_status{status="ok"}"#), 1.0);
    assert_eq!(value(r#"devlock_device_status{status="unknown"}"#), 0.0);
    let status = json_of(&scene.devlock().args(["status", "--json"]).output().unwrap());
    let managed = status["trust"]["managed"].as_bool().unwrap();
    assert_eq!(
        value("devlock_dir_managed"),
        if managed { 1.0 } else { 0.0 }
    );
    assert!(value("devlock_status_duration_seconds") > 0.0);
    // A GPU source that fails is unknown, not a GPU with nothing on it.
    let other = Scratch::new();
    let failing = fake_nvml(&other, "error nvmlInit_v2 - 999\n");
    let broken = Server::start(
        with_nvml(&other, &failing, &[]).env("DEVLOCK_NVIDIA_SMI", "/nonexistent"),
        &[],
    );
    let text = broken.get("/metrics").body;
    promtool_check(&text);
    let m = samples(&text);
    assert_eq!(
        m[r#"devlock_device_status{status="unknown"}"#], 1.0,
        "{text}"
    );
    assert!(!text.contains("devlock_gpu_memory_used_bytes{"), "{text}");
}

/// The DOM after chromium has loaded `url`.
pub fn dump_dom(chromium: &Path, user_data: &Path, url: &str) -> String {
    let out = browser(chromium, user_data, &["--dump-dom", url]);
    String::from_utf8(out).unwrap()
}

/// The headless browser, as root needs it, with a profile of its own.
fn browser(chromium: &Path, user_data: &Path, args: &[&str]) -> Vec<u8> {
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", user_data.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    let status = wait_child(&mut child);
    assert!(status.success(), "{chromium:?} {args:?}: {status}");
    out
}

/// Where the test leaves its screenshot: the target directory's tmp.
pub fn artefact(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// Takes a screenshot of `url` into `png`, `width` by `height`.
pub fn screenshot(chromium: &Path, user_data: &Path, url: &str, png: &Path, size: (u32, u32)) {
    let _ = std::fs::remove_file(png);
    browser(
        chromium,
        user_data,
        &[
            &format!("--window-size={},{}", size.0, size.1),
            &format!("--screenshot={}", png.display()),
            url,
        ],
    );
    let bytes = std::fs::read(png).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 4096,
        "{} is no screenshot",
        png.display()
    );
}

const CHROMIUM: &str = "chromium-headless-shell";

test!(the_page_in_a_headless_browser_shows_the_holder_and_the_line, needs: [Tool("cc"), Tool("chromium-headless-shell")]);
pub(crate) fn the_page_in_a_headless_browser_shows_the_holder_and_the_line() {
    let scene = Scene::new();
    let server = scene.serve();
    let page = server.get("/");
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(
        !page.body.contains("<script") && !page.body.contains("src=\"http"),
        "nothing to run, nothing fetched: {}",
        page.body
    );
    let chromium = which(CHROMIUM);
    let profile = scene.s.work("chromium");
    let dom = dump_dom(&chromium, &profile, &server.url("/"));
    // The browser built the page: gpu:0's card names its holder and its line.
    let card = dom
        .split("id=\"gpu-0\"")
        .nth(1)
        .and_then(|rest| rest.split("</article>").next())
        .unwrap_or_else(|| panic!("no card for gpu:0 in {dom}"));
    assert!(card.contains("<b>train</b>"), "{card}");
    assert!(
        card.contains("waits #1") && card.contains("<b>eval</b>"),
        "{card}"
    );
    assert!(
        card.contains("NVIDIA H100 80GB HBM3") && card.contains("97% busy"),
        "{card}"
    );
    let gpu2 = dom.split("id=\"gpu-2\"").nth(1).unwrap();
    assert!(
        gpu2.split("</article>")
            .next()
            .unwrap()
            .contains("NOT GATED"),
        "{gpu2}"
    );
    assert!(
        dom.contains("<b>solver</b>") && dom.contains("Other locks in use"),
        "{dom}"
    );
    assert!(dom.contains("http-equiv=\"refresh\""), "{dom}");
    let png = artefact("serve-page.png");
    screenshot(&chromium, &profile, &server.url("/"), &png, (1280, 900));
    eprintln!("the page, as chromium shows it: {}", png.display());
}

/// The full path of `program` on PATH.
pub fn which(program: &str) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{program} is not on PATH"))
}

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

/// The `devlock_...` names in `text`.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for (at, _) in text.match_indices("devlock_") {
        let name: String = text[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // DEVLOCK_DIR and friends are variables, not metrics.
        if at == 0 || !text[..at].ends_with(|c: char| c.is_ascii_alphanumeric()) {
            names.insert(name);
        }
    }
    names.retain(|n| n.len() > "devlock_".len() && n.to_ascii_lowercase() == *n);
    names
}

test!(every_metric_family_is_documented_and_every_documented_one_served, needs: []);
pub(crate) fn every_metric_family_is_documented_and_every_documented_one_served() {
    let s = Scratch::new();
    let server = Server::start(&mut s.devlock(), &[]);
    let text = server.get("/metrics").body;
    let served: std::collections::BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split(' ').next().unwrap().to_owned())
        .collect();
    assert!(served.len() > 20, "{text}");
    let page = std::fs::read_to_string(format!("{REPO}/man/devlock-serve.1")).unwrap();
    let metrics_section = xtask::sections(&page)
        .into_iter()
        .find(|(title, _)| title == "METRICS")
        .expect("devlock-serve(1) has a METRICS section")
        .1
        .replace("\\_", "_")
        .replace("\\-", "-");
    assert_eq!(
        metric_names(&metrics_section),
        served,
        "man/devlock-serve.1's METRICS"
    );
    // What the contrib files ask for is served.
    for file in [
        "contrib/grafana/devlock.json",
        "contrib/prometheus/devlock-rules.yml",
    ] {
        let text = std::fs::read_to_string(format!("{REPO}/{file}")).unwrap();
        let asked = metric_names(&text);
        assert!(!asked.is_empty(), "{file}");
        let unknown: Vec<_> = asked.difference(&served).collect();
        assert!(unknown.is_empty(), "{file} asks for {unknown:?}");
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{REPO}/contrib/grafana/devlock.json")).unwrap(),
    )
    .unwrap();
    assert!(!dashboard["panels"].as_array().unwrap().is_empty());
}

test!(the_prometheus_examples_pass_promtool, needs: [Tool("promtool")]);
pub(crate) fn the_prometheus_examples_pass_promtool() {
    let config = format!("{REPO}/contrib/prometheus/prometheus.yml");
    let out = Command::new("promtool")
        .args(["check", "config", &config])
        .current_dir(format!("{REPO}/contrib/prometheus"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
    let rules = format!("{REPO}/contrib/prometheus/devlock-rules.yml");
    let out = Command::new("promtool")
        .args(["check", "rules", &rules])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
}
