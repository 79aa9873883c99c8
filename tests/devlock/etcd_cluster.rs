//! A 3-member etcd cluster on loopback for the etcd tests: each member's
//! clients (devlock) come through a [`Proxy`], and its peers through a
//! [`PeerProxy`] that knows which member each connection comes from, so
//! that one member can be cut off from clients and peers alike, as in a
//! network partition.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::etcd_server::{Proxy, free_port};
use crate::harness::{HANG, signal};

/// Which member is cut off, if any, and each member's pid, shared with
/// every peer proxy.
#[derive(Default)]
struct Net {
    isolated: Mutex<Option<usize>>,
    pids: Mutex<Vec<Option<u32>>>,
}

pub struct Member {
    child: Option<Child>,
    args: Vec<String>,
    /// The member's own client URL, for etcdctl.
    pub direct: String,
    /// The proxy devlock talks through.
    pub proxy: Proxy,
}

/// Three etcd members; killed when dropped.
pub struct EtcdCluster {
    pub members: Vec<Member>,
    net: Arc<Net>,
    _data: tempfile::TempDir,
}

impl EtcdCluster {
    pub fn start() -> EtcdCluster {
        for _ in 0..3 {
            if let Some(cluster) = EtcdCluster::try_start() {
                return cluster;
            }
        }
        panic!("a 3-member etcd would not start on free ports");
    }

    fn try_start() -> Option<EtcdCluster> {
        let data = tempfile::Builder::new()
            .prefix("devlock-etcd3")
            .tempdir()
            .unwrap();
        let net = Arc::new(Net::default());
        *net.pids.lock().unwrap() = vec![None; 3];
        let token = format!("devlock-test-{}-{}", std::process::id(), free_port());
        // Peers reach each member at its peer proxy's address.
        let peer_proxies: Vec<(String, u16)> = (0..3)
            .map(|i| {
                let listen_port = free_port();
                let advertised = PeerProxy::start(i, listen_port, net.clone());
                (advertised, listen_port)
            })
            .collect();
        let initial: Vec<String> = peer_proxies
            .iter()
            .enumerate()
            .map(|(i, (advertised, _))| format!("m{i}={advertised}"))
            .collect();
        let bin = std::env::var("DEVLOCK_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".to_owned());
        let mut members = Vec::new();
        for (i, (advertised, listen_port)) in peer_proxies.iter().enumerate() {
            let direct = format!("http://127.0.0.1:{}", free_port());
            let args: Vec<String> = [
                "--name",
                &format!("m{i}"),
                "--data-dir",
                &data.path().join(format!("m{i}")).display().to_string(),
                "--listen-client-urls",
                &direct,
                "--advertise-client-urls",
                &direct,
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{listen_port}"),
                "--initial-advertise-peer-urls",
                advertised,
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-token",
                &token,
                "--initial-cluster-state",
                "new",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let child = Command::new(&bin)
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
            net.pids.lock().unwrap()[i] = Some(child.id());
            members.push(Member {
                child: Some(child),
                args,
                proxy: Proxy::to(&direct),
                direct,
            });
        }
        let mut cluster = EtcdCluster {
            members,
            net,
            _data: data,
        };
        for i in 0..3 {
            if !cluster.wait_ready(i) {
                return None;
            }
        }
        Some(cluster)
    }

    /// Waits for member `i` to serve clients; false if it exited (a port
    /// taken between asking and binding).
    fn wait_ready(&mut self, i: usize) -> bool {
        let child = self.members[i].child.as_mut().unwrap();
        let mut log = BufReader::new(child.stderr.take().unwrap());
        let start = Instant::now();
        let mut seen = String::new();
        loop {
            let mut line = String::new();
            if log.read_line(&mut line).unwrap_or(0) == 0 {
                return false;
            }
            seen.push_str(&line);
            if line.contains("ready to serve client requests") {
                break;
            }
            assert!(start.elapsed() < HANG, "etcd m{i} did not start: {seen}");
        }
        std::thread::spawn(move || std::io::copy(&mut log, &mut std::io::sink()));
        true
    }

    /// The members' proxied client URLs in this order, as `--etcd` takes them.
    pub fn urls(&self, order: &[usize]) -> String {
        order
            .iter()
            .map(|&i| self.members[i].proxy.url.clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The leader, as the members that answer say, once all of them that
    /// answer agree on one (waiting through an election).
    pub fn leader(&self) -> usize {
        let start = Instant::now();
        loop {
            if let Some(leader) = self.agreed_leader() {
                return leader;
            }
            assert!(start.elapsed() < HANG, "the cluster elected no leader");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A leader other than `old`, once elected.
    pub fn new_leader(&self, old: usize) -> usize {
        let start = Instant::now();
        loop {
            match self.agreed_leader() {
                Some(leader) if leader != old => return leader,
                _ => {}
            }
            assert!(start.elapsed() < HANG, "no new leader was elected");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn agreed_leader(&self) -> Option<usize> {
        let isolated = *self.net.isolated.lock().unwrap();
        let mut ids: Vec<(usize, u64, u64)> = Vec::new();
        for (i, member) in self.members.iter().enumerate() {
            if member.child.is_none() || isolated == Some(i) {
                continue;
            }
            let out = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args([
                    "--endpoints",
                    &member.direct,
                    "endpoint",
                    "status",
                    "-w",
                    "json",
                ])
                .args(["--command-timeout", "2s"])
                .output()
                .ok()?;
            let json: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let status = &json[0]["Status"];
            let own = status["header"]["member_id"].as_u64()?;
            let leader = status["leader"].as_u64()?;
            ids.push((i, own, leader));
        }
        let leader = ids.first()?.2;
        if leader == 0 || ids.iter().any(|(_, _, l)| *l != leader) {
            return None;
        }
        ids.iter()
            .find(|(_, own, _)| *own == leader)
            .map(|(i, _, _)| *i)
    }

    /// SIGKILL to member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.net.pids.lock().unwrap()[i] = None;
    }

    /// Starts member `i` again on its data, after [`EtcdCluster::kill`].
    pub fn restart(&mut self, i: usize) {
        let bin = std::env::var("DEVLOCK_TEST_ETCD_BIN").unwrap_or_else(|_| "etcd".to_owned());
        let mut args = self.members[i].args.clone();
        let state = args
            .iter()
            .position(|a| a == "--initial-cluster-state")
            .unwrap();
        args[state + 1] = "existing".to_owned();
        let child = Command::new(bin)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        self.net.pids.lock().unwrap()[i] = Some(child.id());
        self.members[i].child = Some(child);
        assert!(self.wait_ready(i), "m{i} would not start again");
    }

    /// Cuts member `i` off from its clients and its peers: every connection
    /// to or from it becomes a black hole.
    pub fn partition(&self, i: usize) {
        *self.net.isolated.lock().unwrap() = Some(i);
        self.members[i].proxy.cut();
    }

    /// SIGKILL to every member.
    fn stop_all(&self) {
        for member in &self.members {
            if let Some(child) = &member.child {
                signal(child.id(), libc::SIGKILL);
            }
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.stop_all();
        for member in &mut self.members {
            if let Some(mut child) = member.child.take() {
                let _ = child.wait();
            }
        }
    }
}

/// The cluster the tests that leave it as they found it share; started by
/// the first, killed by [`stop_shared`] when every test is done.
static SHARED: std::sync::OnceLock<EtcdCluster> = std::sync::OnceLock::new();

pub fn shared_cluster() -> &'static EtcdCluster {
    SHARED.get_or_init(EtcdCluster::start)
}

pub fn stop_shared() {
    if let Some(cluster) = SHARED.get() {
        cluster.stop_all();
    }
}

/// A TCP proxy in front of one member's peer port. Each connection is
/// tagged with the member that opened it (found through /proc: the socket
/// of the connecting end, in that member's descriptors), so that cutting a
/// member off also cuts the connections it opened to the others.
struct PeerProxy;

impl PeerProxy {
    /// Starts the proxy for member `own`, forwarding to `target_port`;
    /// returns the URL its peers should use.
    fn start(own: usize, target_port: u16, net: Arc<Net>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
                    continue;
                };
                let from = client
                    .peer_addr()
                    .ok()
                    .and_then(|addr| origin(addr.port(), port, &net));
                let blocked = Arc::new(AtomicBool::new(false));
                let cut = {
                    let net = net.clone();
                    let blocked = blocked.clone();
                    move || {
                        blocked.load(Ordering::SeqCst) || {
                            let isolated = *net.isolated.lock().unwrap();
                            let now =
                                isolated.is_some() && (isolated == Some(own) || isolated == from);
                            if now {
                                blocked.store(true, Ordering::SeqCst);
                            }
                            now
                        }
                    }
                };
                for (a, b) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let cut = cut.clone();
                    std::thread::spawn(move || pump(a, b, &cut));
                }
            }
        });
        format!("http://127.0.0.1:{port}")
    }
}

/// Copies `from` to `to` until either ends, dropping everything once `cut`.
fn pump(mut from: TcpStream, mut to: TcpStream, cut: &dyn Fn() -> bool) {
    let mut buf = [0u8; 16384];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) if !cut() => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Ok(_) => {}
        }
    }
    if !cut() {
        let _ = to.shutdown(std::net::Shutdown::Write);
    }
}

/// The member whose socket is the other end of a connection from
/// 127.0.0.1:`port` to our `proxy_port`.
fn origin(port: u16, proxy_port: u16, net: &Net) -> Option<usize> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    let inode = table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let port_of = |f: &str| u16::from_str_radix(f.rsplit(':').next()?, 16).ok();
        (port_of(fields.get(1)?)? == port && port_of(fields.get(2)?)? == proxy_port)
            .then(|| fields.get(9).map(|s| s.to_string()))
            .flatten()
    })?;
    let socket = format!("socket:[{inode}]");
    let pids = net.pids.lock().unwrap().clone();
    pids.iter().position(|pid| {
        pid.is_some_and(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .any(|fd| {
                    std::fs::read_link(fd.path())
                        .is_ok_and(|target| target.to_string_lossy() == socket)
                })
        })
    })
}
