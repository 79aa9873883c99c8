//! A real etcd server for the etcd tests (private, on loopback, data in a
//! temp dir), and a TCP proxy a test can cut.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::harness::{HANG, signal};

/// An etcd server of this test's own; killed when dropped.
pub struct EtcdServer {
    child: Child,
    pub url: String,
    peer_url: String,
    data: tempfile::TempDir,
    extra: Vec<String>,
}

impl EtcdServer {
    /// Starts `etcd` (or `$DEVLOCK_TEST_ETCD_BIN`) and waits for it to say
    /// it serves clients.
    pub fn start() -> EtcdServer {
        EtcdServer::start_with(&[])
    }

    /// [`EtcdServer::start`] with more flags for etcd.
    pub fn start_with(extra: &[&str]) -> EtcdServer {
        EtcdServer::start_serving("http", extra)
    }

    /// A server whose clients speak TLS; `extra` names its certificate
    /// (`--cert-file`, `--key-file`, and `--client-cert-auth
    /// --trusted-ca-file` to ask clients for theirs).
    pub fn start_tls(extra: &[&str]) -> EtcdServer {
        EtcdServer::start_serving("https", extra)
    }

    fn start_serving(scheme: &str, extra: &[&str]) -> EtcdServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        // A free port can be taken between asking and binding: try again.
        for _ in 0..5 {
            let data = tempfile::Builder::new()
                .prefix("devlock-etcd")
                .tempdir()
                .unwrap();
            let url = format!("{scheme}://127.0.0.1:{}", free_port());
            let peer_url = format!("http://127.0.0.1:{}", free_port());
            if let Some(child) = spawn_etcd(&url, &peer_url, data.path(), &extra) {
                return EtcdServer {
                    child,
                    url,
                    peer_url,
                    data,
                    extra,
                };
            }
        }
        panic!("etcd would not start on a free port");
    }

    /// Kills the server and starts it again on the same ports and data, as
    /// an etcd restart looks to its clients.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let start = Instant::now();
        self.child = loop {
            if let Some(child) =
                spawn_etcd(&self.url, &self.peer_url, self.data.path(), &self.extra)
            {
                break child;
            }
            assert!(start.elapsed() < HANG, "etcd would not restart");
        };
    }

    /// SIGSTOP: the server keeps its sockets but answers nothing.
    pub fn freeze(&self) {
        signal(self.child.id(), libc::SIGSTOP);
    }

    pub fn thaw(&self) {
        signal(self.child.id(), libc::SIGCONT);
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts etcd and waits for "ready to serve client requests"; None if it
/// exited first (its port was taken).
fn spawn_etcd(
    url: &str,
    peer_url: &str,
    data: &std::path::Path,
    extra: &[String],
) -> Option<Child> {
    let bin = std::env::var("DEVLOCK_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".to_owned());
    let mut child = Command::new(&bin)
        .args(["--name", "test", "--data-dir"])
        .arg(data)
        .args(["--listen-client-urls", url, "--advertise-client-urls", url])
        .args(["--listen-peer-urls", peer_url])
        .args(["--initial-advertise-peer-urls", peer_url])
        .args(["--initial-cluster", &format!("test={peer_url}")])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start {bin}: {e}; install etcd-server or set DEVLOCK_TEST_ETCD_BIN")
        });
    let mut log = BufReader::new(child.stderr.take().unwrap());
    let start = Instant::now();
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if log.read_line(&mut line).unwrap_or(0) == 0 {
            let _ = child.wait();
            return None;
        }
        seen.push_str(&line);
        if line.contains("ready to serve client requests") {
            break;
        }
        assert!(start.elapsed() < HANG, "etcd did not start: {seen}");
    }
    // Keep reading so etcd never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut log, &mut std::io::sink()));
    Some(child)
}

/// The etcd a test uses: the one `.ci/run` started (`DEVLOCK_TEST_ETCD`), or
/// a private one. Tests on the shared one use resource names of their own.
pub fn shared_etcd() -> (Option<EtcdServer>, String) {
    match std::env::var("DEVLOCK_TEST_ETCD") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let server = EtcdServer::start();
            let url = server.url.clone();
            (Some(server), url)
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A TCP proxy to `target`. `cut` turns it into a black hole: connections
/// stay open but nothing gets through, as in a network partition.
pub struct Proxy {
    pub url: String,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    pub fn to(target_url: &str) -> Proxy {
        let target = target_url.trim_start_matches("http://").to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let cut = Arc::new(AtomicBool::new(false));
        let cut_for_accept = cut.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let cut = cut_for_accept.clone();
                    std::thread::spawn(move || pump(from, to, &cut));
                }
            }
        });
        Proxy { url, cut }
    }

    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool) {
    let mut buf = [0u8; 16384];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) if !cut.load(Ordering::SeqCst) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Ok(_) => {} // dropped on the floor
        }
    }
    if !cut.load(Ordering::SeqCst) {
        let _ = to.shutdown(std::net::Shutdown::Write);
    }
}
