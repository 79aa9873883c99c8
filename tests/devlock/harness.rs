//! A small builder over a temp scratch directory, and handshakes between
//! processes: wait for a file or a line, with a generous bound that only
//! fails on a hang. The pty, the runner's needs and the process table of
//! the torture tests are its children, re-exported here.

use std::io::BufRead;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod procs;
mod pty;
mod trials;

pub use procs::*;
pub use pty::*;
pub use trials::*;

/// Upper bound for any handshake: long enough for a loaded 2-core machine,
/// short enough that a hang fails the test instead of the CI run.
pub const HANG: Duration = Duration::from_secs(60);

pub const BIN: &str = env!("CARGO_BIN_EXE_devlock");

/// A scratch directory of our own plus a work directory for handshake files.
pub struct Scratch {
    pub root: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Scratch {
        let root = tempfile::Builder::new()
            .prefix("devlock-test")
            .tempdir()
            .unwrap();
        // Readable by the unprivileged user of the cross-user tests.
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(root.path().join("work")).unwrap();
        std::fs::set_permissions(
            root.path().join("work"),
            std::fs::Permissions::from_mode(0o1777),
        )
        .unwrap();
        Scratch { root }
    }

    /// The scratch directory devlock uses (not created until devlock runs).
    pub fn dir(&self) -> PathBuf {
        self.root.path().join("locks")
    }

    /// The usage directory devlock keeps records in (made on first use).
    pub fn usage_dir(&self) -> PathBuf {
        self.root.path().join("usage")
    }

    pub fn lock_path(&self, resource: &str) -> PathBuf {
        self.dir().join(format!("{resource}.lock"))
    }

    /// Where tests put handshake and output files.
    pub fn work(&self, name: &str) -> PathBuf {
        self.root.path().join("work").join(name)
    }

    /// `devlock` with `DEVLOCK_DIR` pointing here, and none of the caller's
    /// GPU restrictions (a CI runner's CUDA_VISIBLE_DEVICES must not change
    /// what the tests see), nor its GPUs: NVML is off unless a test points
    /// `DEVLOCK_NVML` at the fake.
    pub fn devlock(&self) -> Command {
        self.with_devlock_env(Command::new(BIN))
    }

    /// `sh -c SCRIPT` in the environment [`Scratch::devlock`] gives, for a
    /// script that sets something up (a trap, an ignored signal) and then
    /// execs devlock itself.
    pub fn sh(&self, script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        self.with_devlock_env(cmd)
    }

    fn with_devlock_env(&self, mut cmd: Command) -> Command {
        cmd.env("DEVLOCK_DIR", self.dir())
            .env("DEVLOCK_USAGE_DIR", self.usage_dir())
            .env("DEVLOCK_NVML", "none")
            .env_remove("NO_COLOR")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("CUDA_DEVICE_ORDER")
            .env_remove("ROCR_VISIBLE_DEVICES")
            .env_remove("HIP_VISIBLE_DEVICES");
        cmd
    }

    /// `devlock ARGS` run to completion.
    pub fn run(&self, args: &[&str]) -> Output {
        self.devlock()
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Starts a holder: `devlock RESOURCE -- sh -c 'SCRIPT'`, and waits until
    /// the script has written "ready" to `ready_file` (SCRIPT must do that).
    pub fn hold(&self, args: &[&str], script: &str, ready_file: &Path) -> Child {
        let mut cmd = self.devlock();
        cmd.args(args).args(["--", "sh", "-c", script]);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let child = cmd.spawn().unwrap();
        wait_for_file(ready_file);
        child
    }

    /// `devlock status --json` parsed.
    pub fn status_json(&self, resources: &[&str]) -> serde_json::Value {
        let mut args = vec!["status", "--json"];
        args.extend(resources);
        let out = self.run(&args);
        assert!(out.status.success(), "status failed: {}", stderr(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The one resource entry of `status --json` for `name`.
    pub fn resource_status(&self, name: &str) -> serde_json::Value {
        self.status_json(&[name])["resources"][0].clone()
    }

    /// Polls status until `accept` holds (status is a snapshot; the thing
    /// we wait for happens in another process).
    pub fn wait_for_status(
        &self,
        name: &str,
        what: &str,
        accept: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        poll_until(what, || self.resource_status(name), accept)
    }
}

/// Fetches a snapshot (a status, which the awaited thing changes in another
/// process) until `accept` holds; fails on a hang, showing the last one.
pub fn poll_until<T: std::fmt::Display>(
    what: &str,
    fetch: impl Fn() -> T,
    accept: impl Fn(&T) -> bool,
) -> T {
    let start = Instant::now();
    loop {
        let view = fetch();
        if accept(&view) {
            return view;
        }
        assert!(
            start.elapsed() < HANG,
            "timed out waiting for {what}; last status: {view}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a pid file written in one rename, and reads the pid.
pub fn pid_in(path: &Path) -> u32 {
    wait_for_file(path);
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The shell a holder runs: says it holds (writes `ready-TAG`), then waits
/// for the test to write `release-TAG`.
pub fn wait_for_release(s: &Scratch, tag: &str) -> (String, PathBuf) {
    let ready = s.work(&format!("ready-{tag}"));
    let release = s.work(&format!("release-{tag}"));
    let script = format!(
        "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
        ready.display(),
        release.display()
    );
    (script, ready)
}

/// A devlock holder (`devlock ARGS -- sh -c ...`) that holds until
/// [`release`] is called with the same tag.
pub fn hold_until_released(s: &Scratch, args: &[&str], tag: &str) -> Child {
    let (script, ready) = wait_for_release(s, tag);
    s.hold(args, &script, &ready)
}

/// `devlock ARGS` (stdin `/dev/null`), seen blocked first in line behind
/// the holder of `resource`, and registered (a plain take registers once
/// it has waited 100 ms; a look at status before then may not name it).
pub fn queued(s: &Scratch, args: &[&str], resource: &str) -> Killed {
    let child = s.devlock().args(args).stdin(Stdio::null()).spawn().unwrap();
    wait_blocked(&s.lock_path(resource), 1);
    let pid = child.id();
    poll_until(
        "the waiter to register",
        || made_by(s, pid).len(),
        |n| *n > 0,
    );
    Killed(child)
}

/// Lets the holder started with `tag` finish.
pub fn release(s: &Scratch, tag: &str) {
    std::fs::write(s.work(&format!("release-{tag}")), "").unwrap();
}

/// Waits until `path` exists.
pub fn wait_for_file(path: &Path) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < HANG,
            "timed out waiting for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads lines from a child's stream until one contains `needle`; returns
/// every line read so far.
pub fn wait_for_line(reader: &mut impl BufRead, needle: &str) -> String {
    let mut seen = String::new();
    let deadline = Instant::now() + HANG;
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).unwrap();
        seen.push_str(&line);
        if line.contains(needle) {
            return seen;
        }
        assert!(
            n > 0 && Instant::now() < deadline,
            "no line with {needle:?}; got {seen:?}"
        );
    }
}

/// Waits for a child with the hang bound, killing it if it hangs.
pub fn wait_child(child: &mut Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            panic!("child {} hung", child.id());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until `pid` has gone (it need not be our child).
pub fn wait_gone(pid: u32) {
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid) {
        assert!(start.elapsed() < HANG, "pid {pid} did not exit");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// The files in the scratch directory and its wait directory a process
/// named `pid` made (its registrations: `.NAME@PID.K.KIND`).
pub fn made_by(s: &Scratch, pid: u32) -> Vec<String> {
    let wait_dir = s.dir().join(".waiting");
    std::fs::read_dir(s.dir())
        .unwrap()
        .chain(std::fs::read_dir(wait_dir).into_iter().flatten())
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&format!("@{pid}.")))
        .collect()
}

/// Waits until the kernel shows `count` processes sleeping for the lock:
/// blocked in flock(2) on the lock file, or in line (a byte-range lock wait
/// on its `.NAME.queue` file).
pub fn wait_blocked(lock: &Path, count: usize) {
    use std::os::unix::fs::MetadataExt;
    let queue = lock.with_file_name(format!(
        ".{}.queue",
        lock.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .strip_suffix(".lock")
            .unwrap()
    ));
    use devlock::testing::procfs::{FileId, LockTable};
    let id = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| FileId::from_metadata(m.dev(), m.ino()))
    };
    let start = Instant::now();
    loop {
        let table = LockTable::read().unwrap();
        let flocks = id(lock).map_or(0, |f| table.blocked(f).count());
        let ranges = id(&queue).map_or(0, |q| table.ranges(q).iter().filter(|r| r.blocked).count());
        if flocks + ranges >= count {
            return;
        }
        assert!(
            start.elapsed() < HANG,
            "never saw {count} blocked on {}",
            lock.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Points a devlock command at contrib/fake-gpu's nvidia-smi, reading the
/// GPUs it reports from `state` (the tests' stand-in for real cards).
pub trait OnFakeGpu {
    fn on_fake_gpu(&mut self, state: &Path) -> &mut Self;
}

impl OnFakeGpu for Command {
    fn on_fake_gpu(&mut self, state: &Path) -> &mut Command {
        self.env(
            "DEVLOCK_NVIDIA_SMI",
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("contrib/fake-gpu/nvidia-smi"),
        )
        .env("FAKE_GPU_DIR", state)
    }
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sends a signal to a process.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: plain kill(2).
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0, "kill {pid}");
}

/// `flock -n PATH true` succeeded: the lock is free right now.
pub fn flock_is_free(path: &Path) -> bool {
    Command::new("/usr/bin/flock")
        .arg("-n")
        .arg(path)
        .arg("true")
        .status()
        .unwrap()
        .success()
}

/// The two unprivileged users of the cross-user tests (neither need exist in
/// the passwd database: setpriv takes numbers).
pub const USER_A: u32 = 65534;
pub const USER_B: u32 = 65533;

/// `program` run as `uid` (group `uid`, no supplementary groups).
pub fn as_user(uid: u32, program: &str) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".to_owned(),
        "--".to_owned(),
        program.to_owned(),
    ]);
    cmd
}

/// A child killed (and reaped) when it goes out of scope, panic or not.
pub struct Killed(pub Child);

impl Killed {
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waiters of a status view that registered (a devlock between taking its
/// place in line and registering shows for that moment as a place nobody
/// registered): what a handshake on "N waiting" should count.
pub fn registered_waiters(view: &serde_json::Value) -> usize {
    view["waiters"].as_array().map_or(0, |w| {
        w.iter().filter(|w| w["source"] == "registration").count()
    })
}
// ----------------------------------------------------------------------------
// The tests' runner (see main.rs): what a test needs, decided at start-up.

// ----------------------------------------------------------------------------
// Processes: started in groups of their own, reaped only here, killed on drop
// (the torture tests' table of everything they start).

/// `script(1)` running `command_line` on a fresh pty, with devlock (or the
/// shell named) as the pty's foreground process group on its own. script
/// runs the line with `$SHELL -c`: a shell that does not exec a lone
/// command (dash, fish; or none, with SHELL unset, as on a CI runner) would
/// share the group with devlock, which then rightly shows a shared
/// terminal's lines instead of the live one.
pub fn on_a_pty(command_line: &str) -> Command {
    let mut cmd = Command::new("script");
    cmd.args(["-qfec", &format!("exec {command_line}"), "/dev/null"])
        .env("SHELL", "/bin/sh");
    cmd
}

/// A process outside any gate, standing in for someone's notebook; killed
/// when dropped.
pub struct Stranger(Child);

impl Stranger {
    pub fn start() -> Stranger {
        Stranger(Command::new("sleep").arg("1000").spawn().unwrap())
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The steps of the jobs a `report --json` document lists, sorted.
pub fn report_steps(doc: &serde_json::Value) -> Vec<String> {
    let mut steps: Vec<String> = doc["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["step"].as_str().unwrap().to_owned())
        .collect();
    steps.sort();
    steps
}

/// A successful run's stdout as JSON (status --json).
pub fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Pids as the fakes' `*_PIDS` variables take them: space-separated.
pub fn pid_list(pids: &[u32]) -> String {
    pids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}
