//! The job an etcd lease covers, as its watcher knows it: the command (by a
//! pidfd) and every process that holds the job's descriptor, the write end
//! of a pipe that the command inherits as it would a lock file's
//! descriptor (and passes on to what it starts). The job has ended when the
//! command has and nothing holds that descriptor any more: what the kernel
//! waits for before it lets go of a flock.

use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use crate::sys::process::PidFd;

/// The watcher's end of the job's descriptor.
pub(super) struct WatchersEnd(OwnedFd);

/// Makes the job's descriptor before the watcher is forked: the watcher's
/// end, and the command's. Both close on exec: the command's is made
/// inheritable just before the command's (see `supervise::exec`).
pub(super) fn descriptor() -> io::Result<(WatchersEnd, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((WatchersEnd(read), write))
}

impl WatchersEnd {
    /// In the watcher: its copy of the command's end, `commands_end`,
    /// closes (else the job would never end; the caller's owner of it never
    /// runs on in this process), and the job is known by `command` (process
    /// `pid`) and the pipe.
    pub(super) fn into_job(self, command: PidFd, pid: u32, commands_end: RawFd) -> Job {
        crate::sys::process::close_raw(commands_end);
        // Without it (it cannot fail on a pipe of ours), only the command
        // is known to signal; the job's end is still the pipe's.
        let inode = nix::sys::stat::fstat(&self.0).map_or(0, |stat| stat.st_ino);
        Job {
            command,
            since: crate::proc::process::start_time(pid).unwrap_or(0),
            read: self.0,
            link: format!("pipe:[{inode}]"),
            members: Mutex::new(Vec::new()),
            ended: AtomicBool::new(false),
            ended_notify: Notify::new(),
        }
    }
}

/// The job, in its watcher.
pub(super) struct Job {
    command: PidFd,
    /// The command's start time: a process started before it is not the
    /// job's (it cannot have inherited the descriptor).
    since: u64,
    read: OwnedFd,
    /// What /proc/PID/fd/N reads for a descriptor of the pipe.
    link: String,
    /// The other processes found holding the descriptor so far.
    members: Mutex<Vec<(u32, PidFd)>>,
    ended: AtomicBool,
    ended_notify: Notify,
}

impl Job {
    /// Blocks until the job has ended, then says so to [`Job::ended`]; on
    /// a thread of its own.
    pub(super) fn wait_for_the_end(&self) {
        while !self.command.wait_ended(Duration::from_secs(3600)) {}
        let mut buf = [0u8; 512];
        // Nobody is meant to write, but the command may: read and forget.
        loop {
            match nix::unistd::read(&self.read, &mut buf) {
                Ok(0) => break,
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(_) => break,
            }
        }
        self.ended.store(true, Ordering::SeqCst);
        self.ended_notify.notify_waiters();
    }

    pub(super) fn has_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// Resolves once the job has ended.
    pub(super) async fn ended(&self) {
        loop {
            let notified = self.ended_notify.notified();
            if self.has_ended() {
                return;
            }
            notified.await;
        }
    }

    /// Sends `signal` to the whole job: the command, through its pidfd,
    /// and each process that holds the job's descriptor: first those found
    /// before (their pidfds kept: the SIGKILL at the deadline goes out at
    /// once), then any new one, through a pidfd opened before it is checked
    /// to still hold the descriptor (so a pid reused meanwhile is never
    /// signalled).
    pub(super) fn signal(&self, signal: libc::c_int) {
        self.command.signal(signal);
        let mut members = self.members.lock().unwrap();
        for (_, member) in members.iter() {
            member.signal(signal);
        }
        let mut known: Vec<u32> = members.iter().map(|(pid, _)| *pid).collect();
        known.push(std::process::id());
        let pids: Vec<u32> = crate::proc::process::pids()
            .filter(|pid| !known.contains(pid))
            .filter(|&pid| {
                crate::proc::process::stat(pid).is_some_and(|stat| stat.start >= self.since)
            })
            .collect();
        for pid in pids {
            if !self.held_by(pid) {
                continue;
            }
            let Some(pidfd) = PidFd::open(pid) else {
                continue;
            };
            if self.held_by(pid) {
                pidfd.signal(signal);
                members.push((pid, pidfd));
            }
        }
    }

    /// Whether process `pid` has a descriptor of the job's pipe.
    fn held_by(&self, pid: u32) -> bool {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return false;
        };
        fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|link| link.as_os_str() == self.link.as_str())
        })
    }
}
