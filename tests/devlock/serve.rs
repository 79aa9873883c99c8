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

mod documented;
mod limits;
mod metrics;
mod page;

pub(crate) use metrics::{promtool_check, samples};
pub(crate) use page::{artefact, dump_dom, screenshot, which};

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
