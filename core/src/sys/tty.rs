//! Terminal calls: the foreground process group, the width, and writing
//! to the terminal without being stopped for it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use nix::unistd::Pid;

use crate::sys::signal::{self, SigSet};

/// Standard error, for the calls below (it stays open for the life of the
/// process: [`crate::sys::fs::open_std_descriptors`] sees to it).
pub fn stderr() -> BorrowedFd<'static> {
    // SAFETY: descriptor 2 is open for the life of the process (opened on
    // /dev/null at start when a parent left it closed) and never closed.
    unsafe { BorrowedFd::borrow_raw(2) }
}

/// The foreground process group of the terminal on `fd`.
pub fn foreground_of(fd: impl AsFd) -> Option<libc::pid_t> {
    nix::unistd::tcgetpgrp(fd)
        .ok()
        .map(Pid::as_raw)
        .filter(|&g| g > 0)
}

/// The width of the terminal on `fd`, when it says (a pty nobody sized
/// says 0).
pub fn columns(fd: impl AsFd) -> Option<usize> {
    let mut size = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one winsize into the one we pass, on a
    // descriptor the borrow keeps open.
    let ok = unsafe { libc::ioctl(fd.as_fd().as_raw_fd(), libc::TIOCGWINSZ, &mut size) } == 0;
    (ok && size.ws_col > 0).then_some(usize::from(size.ws_col))
}

/// Runs `f` with SIGTTOU blocked on this thread: a write to the terminal
/// (with `stty tostop`) or a tcsetpgrp from outside the foreground group
/// then goes through instead of stopping devlock.
pub fn with_ttou_held<T>(f: impl FnOnce() -> T) -> T {
    let old = signal::block(&SigSet::of(&[libc::SIGTTOU]));
    let result = f();
    signal::set_mask(&old);
    result
}
