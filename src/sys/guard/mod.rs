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
//! The guard is cheap: it shares devlock's memory map (clone with
//! `CLONE_VM`, as posix_spawn's child does, but without waiting), so there
//! is no page table to copy and no page devlock writes afterwards is copied
//! on write; it runs on a stack of its own that is never unmapped, touches
//! nothing else of devlock's memory, and makes its system calls directly
//! ([`raw`]), with no `errno` (which lives in a devlock thread's storage).
//! The memory map outlives devlock as long as the guard uses it. Where the
//! job must be ended process by process ([`tree`], plain code), the guard
//! first forks a copy of itself with a map of its own. On an architecture
//! [`raw`] does not cover, the guard is a plain fork.

mod raw;
mod tree;

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

/// The guard's stack, where it shares devlock's memory.
const STACK: usize = 64 * 1024;

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
    let pid = if raw::SHARES_MEMORY {
        clone_sharing_memory(theirs.as_raw_fd())?
    } else {
        // SAFETY: the child runs `guard`, which makes only async-signal-safe
        // calls and never returns; the parent goes on as after any fork.
        match unsafe { libc::fork() } {
            -1 => return Err(io::Error::last_os_error()),
            // SAFETY: in the forked child, with the descriptor it was given.
            0 => unsafe { guard(theirs.as_raw_fd()) },
            pid => pid,
        }
    };
    // The guard has its own copy of `theirs` (its descriptor table is its
    // own); ours closes as this returns.
    Ok((pid, ours))
}

/// Starts the guard as a process that shares our memory map, on a stack of
/// its own, with every signal blocked from its first instruction. Its pid.
fn clone_sharing_memory(line: RawFd) -> io::Result<libc::pid_t> {
    // SAFETY: a fresh private mapping; never unmapped, because the guard
    // may run on it after every other user of this memory map is gone.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // Every signal blocked around the clone and restored after, so that
    // only the child keeps the mask (a signal handler of devlock's must
    // never run on the child's stack).
    let before = crate::sys::signal::set_mask(&crate::sys::signal::SigSet::all());
    // SAFETY: the child runs `guard_entry` on the new stack's top (stacks
    // grow down on both architectures raw covers), shares only the memory
    // map (its descriptors and signal dispositions are copies), and makes
    // only raw system calls on its own stack; SIGCHLD tells us of its end.
    let pid = unsafe {
        libc::clone(
            guard_entry,
            stack.cast::<u8>().add(STACK).cast(),
            libc::CLONE_VM | libc::SIGCHLD,
            line as usize as *mut libc::c_void,
        )
    };
    let err = io::Error::last_os_error();
    crate::sys::signal::set_mask(&before);
    if pid < 0 {
        // SAFETY: the mapping made above, which no guard runs on.
        unsafe { libc::munmap(stack, STACK) };
        return Err(err);
    }
    Ok(pid)
}

/// The guard's first function where it shares our memory: its argument is
/// its end of the line.
extern "C" fn guard_entry(line: *mut libc::c_void) -> libc::c_int {
    // SAFETY: in the child clone_sharing_memory started, given its descriptor.
    unsafe { guard(line as usize as RawFd) }
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

/// The guard itself, in the child (sharing devlock's memory or a fork):
/// only [`raw`] system calls, on locals of its own stack.
///
/// # Safety
/// Call only as the guard process, which it ends.
unsafe fn guard(line: RawFd) -> ! {
    // SAFETY: each call below works on this process's own state, locals on
    // its stack and descriptors it owns.
    unsafe {
        // Blocked at its start where it shares memory; here for a fork.
        if !raw::SHARES_MEMORY {
            let mut all = std::mem::zeroed::<libc::sigset_t>();
            libc::sigfillset(&mut all);
            libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
        }
        close_all_but(line);
        raw::chdir(c"/");
        raw::set_name(c"devlock-guard");
        // It mostly sleeps; when it wakes (its dismissal, as the lock is
        // handed over) the next holder comes first.
        raw::set_nice(19);
        let mut command: Option<(libc::pid_t, RawFd, Reach)> = None;
        loop {
            match receive(line) {
                Received::Started(pid, fd, reach) => command = Some((pid, fd, reach)),
                Received::Dismissed => raw::exit(),
                Received::Again => {}
                Received::Gone => break,
            }
        }
        // devlock is gone. A group we lead is the job's (devlock made it
        // for a command just before starting it there, told of it or not).
        let leader = raw::leads_group();
        match command {
            Some((pid, fd, Reach::Tree)) if !leader => end_tree(fd, pid),
            Some((_, fd, _)) => {
                // The command first, should it have moved to a group of
                // its own (an interactive shell does).
                raw::pidfd_send_signal(fd, libc::SIGKILL);
            }
            None => {}
        }
        if leader {
            raw::kill(0, libc::SIGKILL);
        }
        raw::exit()
    }
}

/// Ends the command and its descendants, from a fork with a memory map of
/// its own (the code that does it is plain code).
///
/// # Safety
/// Only in the guard, with the command's pidfd.
unsafe fn end_tree(pidfd: RawFd, command: libc::pid_t) {
    // SAFETY: the child makes only async-signal-safe calls, then ends.
    unsafe {
        if raw::fork() == 0 {
            tree::kill_tree(pidfd, command);
            raw::exit();
        }
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
    let n = unsafe { raw::recvmsg(line, &mut header, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return if n == -(libc::EINTR as isize) {
            Received::Again
        } else {
            Received::Gone
        };
    }
    let kind = message.first().copied().unwrap_or(0);
    let reach = match kind {
        IN_GROUP => Reach::Group,
        _ => Reach::Tree,
    };
    match (n, kind) {
        (0, _) => Received::Gone,
        (1, DISMISSED) => Received::Dismissed,
        (5, IN_GROUP | IN_TREE) => {
            let pid = libc::pid_t::from_ne_bytes([message[1], message[2], message[3], message[4]]);
            // (n is 5: those bytes are there.)
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

/// close_range(2), or before Linux 5.9 one by one up to 65536 (the guard
/// cannot ask its limit without libc).
///
/// # Safety
/// Only in the guard.
unsafe fn close_range(from: libc::c_uint, to: libc::c_uint) {
    // SAFETY: closes descriptors of this process only.
    if unsafe { raw::close_range(from, to) } == 0 {
        return;
    }
    let mut fd = from;
    while fd <= to && fd < 1 << 16 {
        // SAFETY: as above.
        unsafe { raw::close(fd as RawFd) };
        fd += 1;
    }
}
