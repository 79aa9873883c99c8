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

use std::sync::OnceLock;

use crate::sys::tty::{self as sys_tty, stderr};

/// Whether devlock's process group is the foreground group of the terminal
/// on standard error (false when it is not our controlling terminal).
pub(crate) fn in_foreground() -> bool {
    sys_tty::foreground_of(stderr()) == Some(crate::sys::process::own_group())
}

/// The width of the terminal on standard error, when it says.
pub(crate) fn columns() -> Option<usize> {
    sys_tty::columns(stderr())
}

/// Whether devlock's process group has no other process in it: a job of
/// its own, as an interactive shell starts it, rather than one shared with
/// make, xargs, a script or the other half of a pipeline. Asked once, of
/// `/proc` (a process can only join the group by being forked into it by
/// a member, or moved in by the shell that built the job).
pub(crate) fn alone_in_group() -> bool {
    static ALONE: OnceLock<bool> = OnceLock::new();
    *ALONE.get_or_init(|| {
        let (group, me) = (crate::sys::process::own_group() as u32, std::process::id());
        let Ok(pids) = crate::proc::process::pids_in(std::path::Path::new("/proc")) else {
            return false;
        };
        for pid in pids {
            if pid == me {
                continue;
            }
            if crate::proc::process::stat(pid).is_some_and(|s| s.pgrp == group) {
                return false;
            }
        }
        true
    })
}

/// Writes `text` to stderr in one call even when devlock's group is not
/// the terminal's foreground group (the command's group has the terminal
/// while it runs): with `stty tostop` such a write would stop devlock by
/// SIGTTOU, and with it the job as the shell sees it, so SIGTTOU is held
/// off this thread meanwhile (the kernel then lets the write through).
pub(crate) fn say_while_command_runs(text: &str) {
    use std::io::Write;
    sys_tty::with_ttou_held(|| {
        let _ = std::io::stderr().write_all(text.as_bytes());
    });
}
