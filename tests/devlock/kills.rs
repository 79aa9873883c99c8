//! A supervisor's SIGKILL of devlock's process group or session ends the
//! whole job, in every placement devlock uses: its own group, a terminal's
//! group shared with a script, a session leader, under `make -j`, under
//! `timeout -k`, after Python's `start_new_session` and `os.killpg`, and
//! under systemd's `KillMode=control-group` and `mixed` (in a real cgroup).
//!
//! The job is a command that ignores SIGTERM (it logs it and goes on) and
//! has a child of its own that ignores it too, as a stuck training job with
//! a data loader. A second taker waits in line outside the killed job; its
//! command writes, as it starts, the state of each of the job's processes.
//! Each test asserts that none of them survived, that the waiter's command
//! started only after the last was gone, and that the lock is free after.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::harness::*;

mod placements;
mod supervisors;

/// The job under test, started by `start` as `devlock r -- sh -c SCRIPT`
/// (or inside whatever `start` wraps it in).
struct Job {
    s: Scratch,
    heard: PathBuf,
}

impl Job {
    fn new() -> Job {
        let s = Scratch::new();
        let heard = s.work("heard");
        Job { s, heard }
    }

    /// The command after `--`: its child is started with SIGTERM ignored,
    /// then the command itself logs SIGTERM and carries on.
    fn command(&self, tag: &str) -> Vec<String> {
        let pids = self.s.work(&format!("pids{tag}"));
        vec![
            "sh".into(),
            "-c".into(),
            format!(
                "trap '' TERM; sleep 1000 & trap 'echo term >> {heard}' TERM; \
                 echo \"$$ $!\" > {pids}.tmp; mv {pids}.tmp {pids}; \
                 while :; do sleep 0.05; done",
                heard = self.heard.display(),
                pids = pids.display(),
            ),
        ]
    }

    /// `devlock r -- COMMAND` as a shell line (for make, timeout, Python).
    fn devlock_line(&self, resource: &str, tag: &str) -> String {
        let mut words = vec![
            BIN.to_owned(),
            "--dir".into(),
            self.s.dir().display().to_string(),
            resource.into(),
            "--".into(),
        ];
        words.extend(self.command(tag));
        words
            .iter()
            .map(|w| format!("'{}'", w.replace('\'', r"'\''")))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The command's and its child's pids, once it runs.
    fn processes(&self, tag: &str) -> Vec<u32> {
        let path = self.s.work(&format!("pids{tag}"));
        wait_for_file(&path);
        std::fs::read_to_string(&path)
            .unwrap()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect()
    }

    /// A taker of `resource` waiting in line outside the job, whose command
    /// reports the state and kernel flags of `victims` the moment it starts.
    fn waiter(&self, resource: &str, victims: &[u32], tag: &str) -> Waiter {
        let report = self.s.work(&format!("report{tag}"));
        let script = format!(
            "for p in {victims}; do \
               if read -r line < /proc/$p/stat; then set -- ${{line##*) }}; echo \"$p $1 $7\"; \
               else echo \"$p gone\"; fi; \
             done > {report}.tmp 2>/dev/null; mv {report}.tmp {report}",
            victims = pid_list(victims),
            report = report.display()
        );
        let child = self
            .s
            .devlock()
            .args(["-q", "-w", "120", resource, "--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Waiter {
            child: Killed(child),
            report,
        }
    }
}

/// `PF_EXITING` in the flags of /proc/PID/stat: the process is in exit(2).
const PF_EXITING: u64 = 0x4;

struct Waiter {
    child: Killed,
    report: PathBuf,
}

impl Waiter {
    /// Once the job was killed at `killed`: every victim was gone when the
    /// waiter's command started, and the waiter ran to the end.
    fn saw_them_gone(mut self, placement: &str, killed: Instant) {
        wait_for_file(&self.report);
        let after = killed.elapsed();
        let report = std::fs::read_to_string(&self.report).unwrap();
        for line in report.lines() {
            let mut words = line.split_whitespace();
            let (pid, state) = (words.next().unwrap(), words.next().unwrap_or(""));
            // Killed and past closing its files (the kernel's PF_EXITING):
            // it runs no more of its own code and holds nothing.
            let exiting = words
                .next()
                .and_then(|f| f.parse::<u64>().ok())
                .is_some_and(|flags| flags & PF_EXITING != 0);
            assert!(
                exiting || matches!(state, "gone" | "Z" | "X" | ""),
                "{placement}: process {pid} of the killed job was still there ({state}) \
                 when the next waiter's command started: {report}"
            );
        }
        assert!(
            wait_child(&mut self.child.0).success(),
            "{placement}: the waiter failed"
        );
        eprintln!(
            "{placement}: the next waiter's command ran {:.1} ms after the SIGKILL",
            after.as_secs_f64() * 1e3
        );
    }
}

/// Waits until the kernel shows the waiter in line for `resource`.
fn in_line(job: &Job, resource: &str) {
    wait_blocked(&job.s.lock_path(resource), 1);
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) of a process or group this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid} {sig}");
}

/// Every process of session `sid`, as `pkill -s SID` finds them.
fn session_members(sid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let (_, rest) = s.rsplit_once(')')?;
                    rest.split_whitespace().nth(3)?.parse::<u32>().ok()
                })
                == Some(sid)
        })
        .collect()
}

/// The common end: the job's processes are gone, the waiter started after
/// them, and the lock is free.
fn ends_the_job(job: &Job, placement: &str, victims: &[u32], waiter: Waiter, killed: Instant) {
    waiter.saw_them_gone(placement, killed);
    for &pid in victims {
        wait_gone(pid);
    }
    assert!(
        flock_is_free(&job.s.lock_path("r")),
        "{placement}: lock still held"
    );
}
