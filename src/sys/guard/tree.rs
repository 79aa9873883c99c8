//! Ending a job that shares its process group with other jobs: the
//! command and its descendants, found from `/proc` and stopped as they are
//! found, then killed. Run in a process with a memory map of its own (a
//! fork), so plain libc calls are fine, if async-signal-safe ones only.

use std::os::fd::RawFd;

/// The most processes of one job stopped and killed by tree; the rest of a
/// larger tree is left (a bound on this stack).
const MOST_IN_TREE: usize = 4096;

/// Stops the command (through its pidfd, so a recycled pid is never hit)
/// and, round by round, every process whose parent is a stopped one of the
/// job (stopped parents cannot reap, so none of those pids can be
/// recycled meanwhile), then kills them all.
///
/// # Safety
/// Only in the guard; `pidfd` names `command`.
pub(super) unsafe fn kill_tree(pidfd: RawFd, command: libc::pid_t) {
    // SAFETY: signals through a pidfd we own.
    if !unsafe { super::raw::pidfd_send_signal(pidfd, libc::SIGSTOP) } {
        return;
    }
    let mut job = [0 as libc::pid_t; MOST_IN_TREE];
    job[0] = command;
    let mut count = 1;
    // SAFETY: reads /proc into buffers on this stack.
    while count < MOST_IN_TREE && unsafe { add_children(&mut job, &mut count) } > 0 {}
    // SAFETY: signals through a pidfd we own.
    unsafe { super::raw::pidfd_send_signal(pidfd, libc::SIGKILL) };
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
