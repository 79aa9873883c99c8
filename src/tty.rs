//! The terminal and process groups: whether the waiting line may be drawn
//! in place, and where the command runs so that a stop signal reaches it
//! once and the terminal stays usable.
//!
//! Two facts decide both. Whether devlock's process group is the terminal's
//! foreground group (tcgetpgrp): only then does Ctrl-C reach it, and only
//! then may it draw over the line its cursor is on. And whether the group
//! holds nothing but devlock, as when a shell starts `devlock ...` as a job
//! of its own: under `make -j`, `xargs -P` or a script, the group is shared
//! with the tool that started devlock and with its other children.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

/// Whether devlock's process group is the foreground group of the terminal
/// on `fd` (false when `fd` is not our controlling terminal).
pub fn in_foreground(fd: RawFd) -> bool {
    // SAFETY: plain calls on a descriptor and on the calling process.
    unsafe {
        let foreground = libc::tcgetpgrp(fd);
        foreground > 0 && foreground == libc::getpgrp()
    }
}

/// The width of the terminal on `fd`, when it says (a pty nobody sized
/// says 0).
pub fn columns(fd: RawFd) -> Option<usize> {
    // SAFETY: winsize is plain data the kernel fills.
    let mut size = unsafe { std::mem::zeroed::<libc::winsize>() };
    // SAFETY: TIOCGWINSZ writes one winsize.
    let ok = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut size) } == 0;
    (ok && size.ws_col > 0).then_some(usize::from(size.ws_col))
}

/// Whether devlock's process group has no other process in it: a job of
/// its own, as an interactive shell starts it, rather than one shared with
/// make, xargs, a script or the other half of a pipeline. Asked once, of
/// `/proc` (a process can only join the group by being forked into it by
/// a member, or moved in by the shell that built the job).
pub fn alone_in_group() -> bool {
    static ALONE: OnceLock<bool> = OnceLock::new();
    *ALONE.get_or_init(|| {
        // SAFETY: getpgrp and getpid cannot fail.
        let (group, me) = unsafe { (libc::getpgrp(), libc::getpid()) };
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return false;
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            if pid != me && group_of(pid) == Some(group) {
                return false;
            }
        }
        true
    })
}

/// The process group of `pid` (field 5 of its stat line).
fn group_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &stat[stat.rfind(')')? + 1..];
    after_comm.split_whitespace().nth(2)?.parse().ok()
}

/// devlock's controlling terminal, opened as `/dev/tty`.
#[derive(Debug)]
pub struct Terminal {
    fd: OwnedFd,
}

impl Terminal {
    /// The controlling terminal, if devlock has one.
    pub fn open() -> Option<Terminal> {
        const PATH: &CStr = c"/dev/tty";
        // SAFETY: a NUL-terminated path; the descriptor is ours alone.
        let fd = unsafe {
            libc::open(
                PATH.as_ptr(),
                libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK,
            )
        };
        // SAFETY: a descriptor open just now and owned by nobody else.
        (fd >= 0).then(|| Terminal {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The terminal's foreground process group.
    pub fn foreground(&self) -> Option<libc::pid_t> {
        // SAFETY: tcgetpgrp on a descriptor we own.
        let group = unsafe { libc::tcgetpgrp(self.fd.as_raw_fd()) };
        (group > 0).then_some(group)
    }

    /// Whether devlock's own group is the foreground group.
    pub fn is_ours(&self) -> bool {
        // SAFETY: getpgrp cannot fail.
        self.foreground() == Some(unsafe { libc::getpgrp() })
    }

    /// Makes `group` the foreground group. A background process asking
    /// this would be stopped by SIGTTOU, so that is blocked meanwhile.
    pub fn give_to(&self, group: libc::pid_t) -> bool {
        // SAFETY: plain signal-mask and terminal calls on data we own.
        unsafe {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTTOU);
            let mut old = std::mem::zeroed::<libc::sigset_t>();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            let ok = libc::tcsetpgrp(self.fd.as_raw_fd(), group) == 0;
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            ok
        }
    }
}

/// Writes `text` to stderr in one call even when devlock's group is not
/// the terminal's foreground group (the command's group has the terminal
/// while it runs): with `stty tostop` such a write would stop devlock by
/// SIGTTOU, and with it the job as the shell sees it, so SIGTTOU is held
/// off this thread meanwhile (the kernel then lets the write through).
pub fn say_while_command_runs(text: &str) {
    use std::io::Write;
    // SAFETY: plain signal-mask calls on sets we initialise.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTTOU);
        let mut old = std::mem::zeroed::<libc::sigset_t>();
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        let _ = std::io::stderr().write_all(text.as_bytes());
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}
