//! The job's guard process: it outlives a devlock that is killed and then
//! ends the job, so that a supervisor's SIGKILL of devlock (or of devlock's
//! group or session) ends the whole job, as it would without devlock.
//!
//! The guard is a plain fork of devlock, made before devlock opens any lock
//! file (so it never holds a lock, however late it is scheduled), that
//! blocks every signal it can, closes every descriptor but its end of a
//! socket pair whose other end only devlock holds, and sleeps in
//! recvmsg(2). Where the command is to have a process group of its own,
//! devlock makes the guard the leader of a new group just before it starts
//! the command inside that group, so no process of the job can exist
//! outside a group the guard belongs to. devlock then sends it the
//! command's pid with a pidfd, and a dismissal once it has reaped it.
//! End of file without a dismissal means devlock is gone: the guard then
//! kills the command (through its pidfd, never a recycled pid) and the
//! group it leads, itself included; or, where the command shares devlock's
//! group with other jobs (a terminal's job shared with make), the command
//! and its descendants, each stopped first so that none escapes by forking.
//! A guard that leads no group and was never told of a command (devlock
//! gave up before starting one) just ends.
//!
//! Between fork and `_exit` the child makes only async-signal-safe calls on
//! its own stack: devlock may have other threads, whose locks (the
//! allocator's among them) the child must never touch.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// How the guard ends the job when devlock is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// The guard leads the process group the command starts in, and kills
    /// it whole (a group the guard belongs to cannot be a recycled id of
    /// somebody else's).
    Group,
    /// The command shares devlock's group with other jobs: the command and
    /// its descendants, found from `/proc` while each is stopped.
    Tree,
}

/// What devlock says to its guard: the command started, in the guard's
/// group or in a shared one (its pid, with its pidfd attached), or the
/// command was reaped (stand down).
const IN_GROUP: u8 = b'G';
const IN_TREE: u8 = b'T';
const DISMISSED: u8 = b'.';

/// The most processes of one job the guard stops and kills by tree; the
/// rest of a larger tree is left (a bound on its own stack).
const MOST_IN_TREE: usize = 4096;

/// Forks the guard, in devlock's process group. Returns its pid and
/// devlock's end of their socket pair.
pub(crate) fn start() -> io::Result<(libc::pid_t, OwnedFd)> {
    let mut ends = [0 as RawFd; 2];
    // SAFETY: socketpair fills the two-element array it is given.
    let made = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            ends.as_mut_ptr(),
        )
    };
    if made != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made by socketpair and are ours.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    // SAFETY: the child runs `guard`, which makes only async-signal-safe
    // calls and never returns; the parent goes on as after any fork.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        // SAFETY: in the forked child, with the descriptor it was given.
        0 => unsafe { guard(theirs.as_raw_fd()) },
        pid => Ok((pid, ours)),
    }
}

/// Makes the guard `pid` (our child, which never execs) the leader of a
/// new process group, for the command to start in. Whether it could.
pub(crate) fn lead_group(pid: libc::pid_t) -> bool {
    // SAFETY: setpgid of our own child into a group of its own.
    unsafe { libc::setpgid(pid, pid) == 0 }
}

/// Tells the guard the command runs: its pid, and a pidfd naming it.
pub(crate) fn arm(
    line: &OwnedFd,
    command: libc::pid_t,
    pidfd: RawFd,
    reach: Reach,
) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let kind = match reach {
        Reach::Group => IN_GROUP,
        Reach::Tree => IN_TREE,
    };
    let mut message = [kind, 0, 0, 0, 0];
    message[1..].copy_from_slice(&command.to_ne_bytes());
    let fds = [pidfd];
    sendmsg::<()>(
        line.as_raw_fd(),
        &[io::IoSlice::new(&message)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Stands the guard down: the command has been reaped.
pub(crate) fn dismiss(line: &OwnedFd) {
    let _ = nix::sys::socket::send(
        line.as_raw_fd(),
        &[DISMISSED],
        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
    );
}

/// The guard itself, in the forked child.
///
/// # Safety
/// Call only in the child of a fork, which it ends.
unsafe fn guard(line: RawFd) -> ! {
    // SAFETY: each call below is async-signal-safe and works on this
    // process's own state, locals on its stack and descriptors it owns.
    unsafe {
        let mut all = std::mem::zeroed::<libc::sigset_t>();
        libc::sigfillset(&mut all);
        libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        close_all_but(line);
        libc::chdir(c"/".as_ptr());
        libc::prctl(libc::PR_SET_NAME, c"devlock-guard".as_ptr());
        // It mostly sleeps; when it wakes (its dismissal, as the lock is
        // handed over) the next holder comes first.
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
        let mut command: Option<(libc::pid_t, RawFd, Reach)> = None;
        loop {
            match receive(line) {
                Received::Started(pid, fd, reach) => command = Some((pid, fd, reach)),
                Received::Dismissed => libc::_exit(0),
                Received::Again => {}
                Received::Gone => break,
            }
        }
        // devlock is gone. A group we lead is the job's (devlock made it
        // for a command just before starting it there, told of it or not).
        let leader = libc::getpgrp() == libc::getpid();
        match command {
            Some((pid, fd, Reach::Tree)) if !leader => kill_tree(fd, pid),
            Some((_, fd, _)) => {
                // The command first, should it have moved to a group of
                // its own (an interactive shell does).
                send(fd, libc::SIGKILL);
            }
            None => {}
        }
        if leader {
            libc::kill(0, libc::SIGKILL);
        }
        libc::_exit(0)
    }
}

enum Received {
    Started(libc::pid_t, RawFd, Reach),
    Dismissed,
    /// Interrupted, or a message that is not ours: read again.
    Again,
    /// End of file, or the line is broken.
    Gone,
}

/// One message from devlock.
///
/// # Safety
/// Only in the guard, on its end of the line.
unsafe fn receive(line: RawFd) -> Received {
    let mut message = [0u8; 8];
    // Room for one descriptor (CMSG_SPACE of an int), 8-aligned.
    let mut control = [0u64; 4];
    let mut iov = libc::iovec {
        iov_base: message.as_mut_ptr().cast(),
        iov_len: message.len(),
    };
    // SAFETY: a zeroed msghdr is valid; the fields set point into this frame.
    let mut header = unsafe { std::mem::zeroed::<libc::msghdr>() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: recvmsg fills the buffers the header points to.
    let n = unsafe { libc::recvmsg(line, &mut header, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        // SAFETY: errno of this (only) thread.
        let err = unsafe { *libc::__errno_location() };
        return if err == libc::EINTR {
            Received::Again
        } else {
            Received::Gone
        };
    }
    let reach = match message[0] {
        IN_GROUP => Reach::Group,
        _ => Reach::Tree,
    };
    match (n, message[0]) {
        (0, _) => Received::Gone,
        (1, DISMISSED) => Received::Dismissed,
        (5, IN_GROUP | IN_TREE) => {
            let pid = libc::pid_t::from_ne_bytes([message[1], message[2], message[3], message[4]]);
            // SAFETY: walking the control messages recvmsg filled in.
            let fd = unsafe { passed_fd(&header) };
            match fd {
                Some(fd) => Received::Started(pid, fd, reach),
                None => Received::Again,
            }
        }
        _ => Received::Again,
    }
}

/// The descriptor passed with a message, if any.
///
/// # Safety
/// `header` must be one recvmsg just filled in.
unsafe fn passed_fd(header: &libc::msghdr) -> Option<RawFd> {
    // SAFETY: the CMSG_* walk stays within msg_control, as recvmsg set it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(header);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return None;
        }
        Some(std::ptr::read_unaligned(
            libc::CMSG_DATA(cmsg).cast::<RawFd>(),
        ))
    }
}

/// Closes every descriptor but `keep`.
///
/// # Safety
/// Only in the guard, which owns every descriptor it has.
unsafe fn close_all_but(keep: RawFd) {
    let keep = keep as libc::c_uint;
    // SAFETY: closes descriptors of this process only.
    unsafe {
        if keep > 0 {
            close_range(0, keep - 1);
        }
        close_range(keep + 1, libc::c_uint::MAX);
    }
}

/// close_range(2), or before Linux 5.9 one by one up to the descriptor
/// limit.
///
/// # Safety
/// Only in the guard.
unsafe fn close_range(from: libc::c_uint, to: libc::c_uint) {
    // SAFETY: closes descriptors of this process only.
    if unsafe { libc::syscall(libc::SYS_close_range, from, to, 0) } == 0 {
        return;
    }
    let mut limit = std::mem::MaybeUninit::<libc::rlimit>::zeroed();
    // SAFETY: getrlimit fills the struct it is given.
    let top = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, limit.as_mut_ptr()) } {
        // SAFETY: initialised by the call that just succeeded.
        0 => (unsafe { limit.assume_init() }.rlim_cur).min(1 << 16) as libc::c_uint,
        _ => 1 << 16,
    };
    for n in from..=to.min(top) {
        // SAFETY: as above.
        unsafe { libc::close(n as RawFd) };
    }
}

/// pidfd_send_signal(2): whether `sig` was sent to the process the pidfd
/// names (not if it has ended, whatever now has its pid).
///
/// # Safety
/// `fd` must be a pidfd.
unsafe fn send(fd: RawFd, sig: libc::c_int) -> bool {
    // SAFETY: a pidfd, no siginfo, no flags.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd,
            sig,
            std::ptr::null::<()>(),
            0,
        ) == 0
    }
}

/// Stops the command (through its pidfd, so a recycled pid is never hit)
/// and, round by round, every process whose parent is a stopped one of the
/// job (stopped parents cannot reap, so none of those pids can be
/// recycled meanwhile), then kills them all.
///
/// # Safety
/// Only in the guard; `pidfd` names `command`.
unsafe fn kill_tree(pidfd: RawFd, command: libc::pid_t) {
    // SAFETY: signals through a pidfd we own.
    if !unsafe { send(pidfd, libc::SIGSTOP) } {
        return;
    }
    let mut job = [0 as libc::pid_t; MOST_IN_TREE];
    job[0] = command;
    let mut count = 1;
    // SAFETY: reads /proc into buffers on this stack.
    while count < MOST_IN_TREE && unsafe { add_children(&mut job, &mut count) } > 0 {}
    // SAFETY: signals through a pidfd we own.
    unsafe { send(pidfd, libc::SIGKILL) };
    for &pid in &job[1..count] {
        // SAFETY: each pid is a stopped (or zombie) child of a stopped
        // member of the job, so still that process.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// One pass over `/proc`: every process whose parent is in `job[..count]`
/// and which is not in it yet is stopped and added. Returns how many.
///
/// # Safety
/// Only in the guard.
unsafe fn add_children(job: &mut [libc::pid_t; MOST_IN_TREE], count: &mut usize) -> usize {
    // SAFETY: opening a directory by a NUL-terminated path.
    let dir = unsafe {
        libc::open(
            c"/proc".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return 0;
    }
    let mut added = 0;
    let mut entries = [0u8; 8192];
    loop {
        // SAFETY: getdents64 fills at most the buffer's length.
        let n = unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                dir,
                entries.as_mut_ptr(),
                entries.len(),
            )
        };
        let Ok(n) = usize::try_from(n) else { break };
        if n == 0 {
            break;
        }
        let mut at = 0usize;
        // struct linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name.
        while at + 19 < n {
            let reclen = usize::from(u16::from_ne_bytes([entries[at + 16], entries[at + 17]]));
            if reclen == 0 {
                break;
            }
            let name = &entries[at + 19..(at + reclen).min(n)];
            at += reclen;
            let Some(pid) = parse_pid(name) else {
                continue;
            };
            if *count == MOST_IN_TREE || job[..*count].contains(&pid) {
                continue;
            }
            // SAFETY: reads /proc/PID/stat into a buffer on this stack.
            if let Some(parent) = unsafe { parent_of(pid) }
                && job[..*count].contains(&parent)
            {
                // SAFETY: a child of a stopped member: that process.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                job[*count] = pid;
                *count += 1;
                added += 1;
            }
        }
    }
    // SAFETY: the descriptor opened above.
    unsafe { libc::close(dir) };
    added
}

/// A directory entry's name (up to its NUL) as a pid, if it is one.
fn parse_pid(name: &[u8]) -> Option<libc::pid_t> {
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let digits = &name[..end];
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(
        digits
            .iter()
            .fold(0, |n, &d| n * 10 + libc::pid_t::from(d - b'0')),
    )
}

/// The parent pid in `/proc/PID/stat` (the field after the state, which
/// follows the last `)`: a command name may hold any byte).
///
/// # Safety
/// Only in the guard.
unsafe fn parent_of(pid: libc::pid_t) -> Option<libc::pid_t> {
    let mut path = [0u8; 32];
    path[..6].copy_from_slice(b"/proc/");
    let mut digits = [0u8; 10];
    let mut len = 0;
    let mut n = pid;
    while n > 0 && len < digits.len() {
        digits[len] = b'0' + (n % 10) as u8;
        n /= 10;
        len += 1;
    }
    for (i, d) in digits[..len].iter().rev().enumerate() {
        path[6 + i] = *d;
    }
    path[6 + len..6 + len + 5].copy_from_slice(b"/stat");
    // SAFETY: a NUL-terminated path on this stack (the array is zeroed).
    let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    let mut stat = [0u8; 1024];
    // SAFETY: reads at most the buffer's length into it.
    let n = unsafe { libc::read(fd, stat.as_mut_ptr().cast(), stat.len()) };
    // SAFETY: the descriptor opened above.
    unsafe { libc::close(fd) };
    let text = stat.get(..usize::try_from(n).ok()?)?;
    let close = text.iter().rposition(|&b| b == b')')?;
    let mut fields = text[close + 1..]
        .split(|&b| b == b' ')
        .filter(|f| !f.is_empty());
    let _state = fields.next()?;
    parse_pid(fields.next()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_names_that_are_pids() {
        assert_eq!(parse_pid(b"4242\0\0\0"), Some(4242));
        assert_eq!(parse_pid(b"self\0"), None);
        assert_eq!(parse_pid(b"\0"), None);
        assert_eq!(parse_pid(b"12a\0"), None);
    }

    #[test]
    fn the_parent_of_this_process_is_read_from_proc() {
        // SAFETY: reads /proc only.
        let parent = unsafe { parent_of(std::process::id() as libc::pid_t) };
        assert_eq!(parent, Some(nix::unistd::getppid().as_raw()));
    }
}
