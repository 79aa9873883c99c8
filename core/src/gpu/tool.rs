//! Running a vendor tool (nvidia-smi, amd-smi) under a hard deadline: found
//! on `PATH` or named by a variable, killed with its whole process group when
//! it does not answer in time, its failure put in one line.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;

use crate::show::human_duration;

/// After SIGKILL, how long to wait for the process to die before leaving
/// its reaping to a background thread (a wedged driver can hold it in the kernel).
const KILL_GRACE: Duration = Duration::from_millis(500);

/// The most of a tool's stdout or stderr kept: far more than a full machine's
/// answer. The rest is read and dropped (so the tool never blocks on a full
/// pipe), and a longer answer is reported as a failure, not half believed.
const MAX_OUTPUT_BYTES: usize = 1024 * 1024;

/// The program to run for `tool`: `env_override` (the value of its
/// `DEVLOCK_*` variable) when set and non-empty, taken as is, else an
/// executable `tool` on `path`.
pub(crate) fn lookup_tool(
    tool: &str,
    env_override: Option<OsString>,
    path: Option<OsString>,
) -> Option<PathBuf> {
    if let Some(program) = env_override.filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(program));
    }
    // Empty PATH entries mean the current directory; running a binary from
    // wherever the user happens to stand is not something we want.
    std::env::split_paths(&path?)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(tool))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// `timeout` from now, clamped so that absurd timeouts cannot overflow `Instant`.
pub(crate) fn deadline_in(timeout: Duration) -> Instant {
    Instant::now() + timeout.min(Duration::from_secs(365 * 86_400))
}

/// Runs `program ARGS` (the vendor tool `tool`) to completion or to
/// `deadline`, killing its process group then; its standard output, or
/// the reason to report the devices as unknown.
pub(crate) fn run_tool(
    tool: &str,
    program: &Path,
    args: &[&str],
    deadline: Instant,
    timeout: Duration,
) -> Result<String, String> {
    let output = run(program, args, deadline)
        .map_err(|e| format!("cannot run {}: {e}", crate::show::show_path(program)))?
        .ok_or_else(|| {
            format!(
                "{tool} did not answer within {} (killed)",
                human_duration(timeout)
            )
        })?;
    if !output.status.success() {
        return Err(failure_reason(tool, &output));
    }
    if output.stdout.len() > MAX_OUTPUT_BYTES {
        return Err(format!(
            "{tool} printed more than {MAX_OUTPUT_BYTES} bytes (not read)"
        ));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn failure_reason(tool: &str, output: &Output) -> String {
    let what = match (output.status.code(), output.status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("failed ({})", output.status),
    };
    // Real nvidia-smi prints driver errors on stdout, so fall back to it.
    match first_line(&output.stderr).or_else(|| first_line(&output.stdout)) {
        Some(line) => format!("{tool} {what}: {line}"),
        None => format!("{tool} {what}"),
    }
}

fn first_line(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
}

enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exited,
}

/// Runs `program` to completion, or kills its whole process group at
/// `deadline` and returns `Ok(None)`.
fn run(program: &Path, args: &[&str], deadline: Instant) -> std::io::Result<Option<Output>> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own group, so a timeout also kills anything it forked.
        .process_group(0)
        .spawn()?;
    let pid = Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    spawn_reader(child.stdout.take(), tx.clone(), Event::Stdout);
    spawn_reader(child.stderr.take(), tx.clone(), Event::Stderr);
    thread::spawn(move || {
        // WNOWAIT leaves the child a zombie until we reap it ourselves, so its
        // pid (which is also the group id) cannot be recycled before killpg.
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
        while waitid(Id::Pid(pid), flags) == Err(Errno::EINTR) {}
        let _ = tx.send(Event::Exited);
    });

    let (mut stdout, mut stderr, mut exited) = (None, None, false);
    while stdout.is_none() || stderr.is_none() || !exited {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Event::Stdout(bytes)) => stdout = Some(bytes),
            Ok(Event::Stderr(bytes)) => stderr = Some(bytes),
            Ok(Event::Exited) => exited = true,
            Err(_) => {
                kill_and_reap(child, pid, exited, &rx);
                return Ok(None);
            }
        }
    }
    let status = child.wait()?;
    Ok(Some(Output {
        status,
        stdout: stdout.unwrap_or_default(),
        stderr: stderr.unwrap_or_default(),
    }))
}

fn spawn_reader(
    pipe: Option<impl Read + Send + 'static>,
    tx: Sender<Event>,
    event: fn(Vec<u8>) -> Event,
) {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            // One byte past the bound, so that run_tool can tell it was passed.
            let kept = MAX_OUTPUT_BYTES as u64 + 1;
            let _ = pipe.by_ref().take(kept).read_to_end(&mut bytes);
            let _ = std::io::copy(&mut pipe, &mut std::io::sink());
        }
        let _ = tx.send(event(bytes));
    });
}

fn kill_and_reap(mut child: Child, pid: Pid, mut exited: bool, rx: &Receiver<Event>) {
    let _ = killpg(pid, Signal::SIGKILL);
    let grace = Instant::now() + KILL_GRACE;
    while !exited {
        match rx.recv_timeout(grace.saturating_duration_since(Instant::now())) {
            Ok(Event::Exited) => exited = true,
            Ok(_) => {}
            Err(_) => break,
        }
    }
    if exited {
        let _ = child.wait();
    } else {
        thread::spawn(move || child.wait());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tool that floods its stdout: read to its end without keeping it
    /// all, and reported as a failure rather than parsed.
    #[test]
    fn a_flood_of_output_is_bounded_and_refused() {
        let timeout = Duration::from_secs(60);
        let script = format!("head -c {} /dev/zero", 4 * MAX_OUTPUT_BYTES);
        let answer = run_tool(
            "flood",
            Path::new("/bin/sh"),
            &["-c", &script],
            deadline_in(timeout),
            timeout,
        );
        assert_eq!(
            answer,
            Err(format!(
                "flood printed more than {MAX_OUTPUT_BYTES} bytes (not read)"
            ))
        );
        let script = format!("head -c {MAX_OUTPUT_BYTES} /dev/zero");
        let answer = run_tool(
            "flood",
            Path::new("/bin/sh"),
            &["-c", &script],
            deadline_in(timeout),
            timeout,
        );
        assert_eq!(answer.map(|s| s.len()), Ok(MAX_OUTPUT_BYTES));
    }
}
