//! A small builder over a temp scratch directory, and handshakes between
//! processes: wait for a file or a line, with a generous bound that only
//! fails on a hang.

use std::io::BufRead;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

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
        let mut cmd = Command::new(BIN);
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

/// A pseudo-terminal of a set width, with a process started as the leader
/// of a new session that has it as its controlling terminal (as a terminal
/// emulator starts a shell). Everything written to it is collected.
pub struct Pty {
    master: std::fs::File,
    slave: std::os::fd::OwnedFd,
    output: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Pty {
    pub fn new(columns: u16) -> Pty {
        use std::os::fd::FromRawFd;
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty fills two descriptors we then own.
        let ok = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(ok, 0, "openpty");
        // SAFETY: descriptors openpty just gave us.
        let (master, slave) = unsafe {
            (
                std::fs::File::from_raw_fd(master),
                std::os::fd::OwnedFd::from_raw_fd(slave),
            )
        };
        let pty = Pty {
            master,
            slave,
            output: Default::default(),
        };
        pty.resize(columns);
        let mut reader = pty.master.try_clone().unwrap();
        let output = pty.output.clone();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            // Ends with EIO once no process has the terminal open.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                output.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        pty
    }

    /// Sets the width (the kernel sends SIGWINCH to the foreground group).
    pub fn resize(&self, columns: u16) {
        use std::os::fd::AsRawFd;
        let size = libc::winsize {
            ws_row: 24,
            ws_col: columns,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize.
        let set = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
        assert_eq!(set, 0);
    }

    /// Starts `cmd` on the terminal, in a session of its own.
    pub fn spawn(&self, cmd: &mut Command) -> Child {
        use std::os::unix::process::CommandExt;
        let io = || Stdio::from(self.slave.try_clone().unwrap());
        cmd.stdin(io()).stdout(io()).stderr(io());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().unwrap()
    }

    /// Types `bytes` (`b"\x03"` is Ctrl-C, `b"\x1a"` Ctrl-Z).
    pub fn type_in(&self, bytes: &[u8]) {
        use std::io::Write;
        (&self.master).write_all(bytes).unwrap();
    }

    /// Everything the terminal was sent so far.
    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Waits until the output holds `needle`; returns all of it.
    pub fn wait_for(&self, needle: &str) -> String {
        self.wait_until(needle, |out| out.contains(needle))
    }

    /// Waits until `ok` holds for the output; returns all of it.
    pub fn wait_until(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let out = self.output();
            if ok(&out) {
                return out;
            }
            assert!(
                start.elapsed() < HANG,
                "the terminal never showed {what:?}; it shows {out:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

// ----------------------------------------------------------------------------
// The tests' runner (see main.rs): what a test needs, decided at start-up.

/// Something a test needs to test anything.
#[derive(Debug, Clone, Copy)]
pub enum Need {
    /// A program on PATH.
    Tool(&'static str),
    /// Running as root (the cross-user tests play two other users).
    Root,
    /// bash-completion's library, which the bash completion sources.
    BashCompletion,
    /// A cgroup v2 hierarchy where a cgroup can be made (root, a writable
    /// `cgroup2` mount), for the systemd unit tests.
    Cgroup,
}

/// Where the cgroup v2 hierarchy is mounted, if it is.
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        let (_, at, kind) = (words.next()?, words.next()?, words.next()?);
        (kind == "cgroup2").then(|| PathBuf::from(at))
    })
}

/// Whether a cgroup can be made (and removed again) here.
fn can_make_cgroup() -> bool {
    let Some(root) = cgroup2_root() else {
        return false;
    };
    let probe = root.join(format!("devlock-test-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).is_ok() && std::fs::remove_dir(&probe).is_ok()
}

/// One test, as `test!` registers it beside its function: its module
/// (`devlock::core`) and name, its body, its needs.
pub struct Test {
    pub module: &'static str,
    pub name: &'static str,
    pub run: fn(),
    pub needs: &'static [Need],
    /// Run only on request (`--ignored`), for this reason.
    pub ignored: Option<&'static str>,
}

inventory::collect!(Test);

impl Test {
    /// `core::exit_status_is_passed_on`: the module within the test binary.
    fn full_name(&self) -> String {
        let module = self.module.split_once("::").map_or(self.module, |(_, m)| m);
        format!("{module}::{}", self.name)
    }
}

/// Whether a test whose tool is missing must fail (CI) rather than be
/// reported as ignored.
pub fn tools_required() -> bool {
    std::env::var_os("DEVLOCK_TEST_REQUIRE_TOOLS").is_some_and(|v| v == "1")
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// What of `needs` this machine lacks, in words.
fn missing(needs: &[Need]) -> Vec<String> {
    needs
        .iter()
        .filter_map(|need| match *need {
            Need::Tool(program) => (!on_path(program)).then(|| program.to_owned()),
            Need::Root => (!nix::unistd::getuid().is_root()).then(|| "root".to_owned()),
            Need::BashCompletion => (!Path::new("/usr/share/bash-completion/bash_completion")
                .exists())
            .then(|| "bash-completion".to_owned()),
            Need::Cgroup => (!can_make_cgroup()).then(|| "a cgroup v2 to make".to_owned()),
        })
        .collect()
}

/// The libtest-mimic trials: a test that cannot test anything here is
/// ignored (its reason shown as the trial's kind, `[needs groff]`), or
/// under `DEVLOCK_TEST_REQUIRE_TOOLS=1` fails, saying what is missing.
pub fn trials() -> Vec<libtest_mimic::Trial> {
    let required = tools_required();
    let mut tests: Vec<&Test> = inventory::iter::<Test>.into_iter().collect();
    tests.sort_by_key(|t| t.full_name());
    tests
        .into_iter()
        .map(|test| {
            let name = test.full_name();
            let lacking = missing(test.needs);
            let run = test.run;
            let why = format!("needs {}", lacking.join(", "));
            if lacking.is_empty() {
                let trial = libtest_mimic::Trial::test(name, move || {
                    run();
                    Ok(())
                });
                // A test run only on request says why in its line.
                match test.ignored {
                    Some(why) => trial.with_kind(why).with_ignored_flag(true),
                    None => trial,
                }
            } else if required {
                // (One run only on request fails only when asked for, and
                // says why it is not run otherwise.)
                let trial = libtest_mimic::Trial::test(name, move || {
                    Err(format!("{why}, and DEVLOCK_TEST_REQUIRE_TOOLS=1").into())
                });
                match test.ignored {
                    Some(reason) => trial.with_kind(reason).with_ignored_flag(true),
                    None => trial,
                }
            } else {
                libtest_mimic::Trial::test(name, || Ok(()))
                    .with_kind(why)
                    .with_ignored_flag(true)
            }
        })
        .collect()
}

// ----------------------------------------------------------------------------
// Processes: started in groups of their own, reaped only here, killed on drop
// (the torture tests' table of everything they start).

use std::collections::{HashMap, HashSet};
use std::os::unix::process::CommandExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex, MutexGuard};

pub struct Proc {
    label: String,
    child: Child,
    status: Option<ExitStatus>,
    /// Signals the test sent it, in order.
    sent: Vec<i32>,
}

#[derive(Default)]
pub struct ProcTable {
    stopped: bool,
    procs: HashMap<u32, Proc>,
}

/// Every process a test starts. Children are reaped only through this table
/// and signalled only under its lock, so a pid we signal is still our
/// unreaped child and can never be a recycled pid of somebody else.
#[derive(Clone, Default)]
pub struct Procs(Arc<Mutex<ProcTable>>);

impl Procs {
    pub fn table(&self) -> MutexGuard<'_, ProcTable> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts `cmd` as the leader of a new process group; `None` once the
    /// cleanup has begun.
    pub fn spawn(&self, label: &str, cmd: &mut Command) -> Option<u32> {
        cmd.process_group(0);
        let mut table = self.table();
        if table.stopped {
            return None;
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {label}: {e}"));
        let pid = child.id();
        table.procs.insert(
            pid,
            Proc {
                label: label.to_owned(),
                child,
                status: None,
                sent: Vec::new(),
            },
        );
        Some(pid)
    }

    pub fn start(&self, label: &str, cmd: &mut Command) -> u32 {
        self.spawn(label, cmd).expect("cleanup already began")
    }

    pub fn is_stopped(&self) -> bool {
        self.table().stopped
    }

    pub fn try_wait(&self, pid: u32) -> Option<ExitStatus> {
        let mut table = self.table();
        let proc = table.procs.get_mut(&pid).expect("a pid we started");
        if proc.status.is_none() {
            proc.status = proc.child.try_wait().expect("waitpid");
        }
        proc.status
    }

    /// Waits for one of our processes; a hang fails the test (and the guard
    /// kills it).
    pub fn wait(&self, pid: u32) -> ExitStatus {
        self.wait_unless_hung(pid, |waited| waited > HANG)
    }

    /// Waits for one of our processes until `hung(time waited)` says it hangs.
    pub fn wait_unless_hung(&self, pid: u32, hung: impl Fn(Duration) -> bool) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.try_wait(pid) {
                return status;
            }
            if hung(start.elapsed()) {
                let sent: Vec<_> = self.sent(pid).into_iter().map(signal_name).collect();
                panic!(
                    "{} (pid {pid}, sent {sent:?}) hung:\n{}",
                    self.label(pid),
                    describe_process(pid)
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sends `sigs` to `pid`, unless it has been reaped already or, with
    /// `only_fresh`, was sent anything before. Returns whether it sent them.
    pub fn signal(&self, pid: u32, sigs: &[i32], only_fresh: bool) -> bool {
        let mut table = self.table();
        let Some(proc) = table.procs.get_mut(&pid) else {
            return false;
        };
        if proc.status.is_some() || (only_fresh && !proc.sent.is_empty()) {
            return false;
        }
        for &sig in sigs {
            // SAFETY: kill(2) of our own unreaped child.
            unsafe { libc::kill(pid as i32, sig) };
            proc.sent.push(sig);
        }
        true
    }

    pub fn sent(&self, pid: u32) -> Vec<i32> {
        self.table().procs[&pid].sent.clone()
    }

    pub fn label(&self, pid: u32) -> String {
        self.table().procs[&pid].label.clone()
    }

    /// Unreaped processes never signalled whose label starts with `prefix`.
    pub fn fresh(&self, prefix: &str) -> Vec<u32> {
        self.table()
            .procs
            .iter()
            .filter(|(_, p)| p.status.is_none() && p.sent.is_empty())
            .filter(|(_, p)| p.label.starts_with(prefix))
            .map(|(&pid, _)| pid)
            .collect()
    }

    /// Stops new starts and SIGKILLs every group we started that still has
    /// members, including orphaned commands of supervisors already reaped.
    pub fn shutdown(&self) {
        let mut table = self.table();
        table.stopped = true;
        let mut reaped = HashSet::new();
        for (&pid, proc) in &table.procs {
            if proc.status.is_none() {
                // SAFETY: our unreaped child leads this group, so the group
                // id cannot belong to anybody else.
                unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            } else {
                reaped.insert(pid);
            }
        }
        for pid in group_members(&reaped) {
            // SAFETY: plain kill(2) of a straggler in one of our groups.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        for proc in table.procs.values_mut() {
            if proc.status.is_none() {
                proc.status = proc.child.wait().ok();
            }
        }
    }
}

/// What a hung process and its children are doing, thread by thread, and
/// the flocks they hold or wait for.
pub fn describe_process(pid: u32) -> String {
    let read = |path: String| std::fs::read_to_string(path).unwrap_or_default();
    let mut out = String::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        out.push_str(&format!(
            "  pid {p}: {}\n",
            read(format!("/proc/{p}/cmdline")).replace('\0', " ")
        ));
        for task in tasks.flatten() {
            let t = task.file_name().to_string_lossy().into_owned();
            let base = format!("/proc/{p}/task/{t}");
            let stat = read(format!("{base}/stat"));
            let state = stat.rsplit_once(')').map_or("?", |(_, r)| r.trim_start());
            out.push_str(&format!(
                "    task {t}: state {} wchan {} syscall {}\n",
                state.split_whitespace().next().unwrap_or("?"),
                read(format!("{base}/wchan")),
                read(format!("{base}/syscall")).trim_end()
            ));
            for child in read(format!("{base}/children")).split_whitespace() {
                todo.extend(child.parse::<u32>());
            }
        }
        for line in read("/proc/locks".into()).lines() {
            if line.split_whitespace().any(|w| w == p.to_string()) {
                out.push_str(&format!("    lock: {line}\n"));
            }
        }
    }
    out
}

/// Kills whatever the test left running when it ends, however it ends.
pub struct Cleanup(pub Procs);

impl Drop for Cleanup {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

/// Processes of our session whose process group is one of `groups`.
pub fn group_members(groups: &HashSet<u32>) -> Vec<u32> {
    if groups.is_empty() {
        return Vec::new();
    }
    // SAFETY: getsid(0) only reads.
    let my_session = unsafe { libc::getsid(0) } as u32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            // state ppid pgrp session ...
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u32>().ok());
            number(2).is_some_and(|pgrp| groups.contains(&pgrp)) && number(3) == Some(my_session)
        })
        .collect()
}

/// A signal's name, for messages.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "TERM",
        libc::SIGINT => "INT",
        libc::SIGHUP => "HUP",
        libc::SIGKILL => "KILL",
        _ => "?",
    }
}

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
