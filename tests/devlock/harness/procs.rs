//! Processes: started in groups of their own, reaped only here, killed on drop
//! (the torture tests' table of everything they start).

use super::*;

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
