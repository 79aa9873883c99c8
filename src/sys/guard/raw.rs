//! The system calls the guard makes while it shares devlock's memory: made
//! directly (no libc wrapper, so no `errno`, which lives in the thread-local
//! storage of a devlock thread), each returning the kernel's value (a
//! negative errno on failure). Where devlock runs on an architecture this
//! does not cover, the guard is a plain fork and these go through libc.

use std::os::fd::RawFd;

#[cfg(target_arch = "x86_64")]
/// One system call with up to six arguments.
///
/// # Safety
/// As the call `nr` with these arguments.
unsafe fn syscall6(nr: libc::c_long, a: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the x86-64 Linux system call convention; rcx and r11 are
    // clobbered by `syscall`, memory may be read or written by the call.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") nr as isize => ret,
            in("rdi") a[0], in("rsi") a[1], in("rdx") a[2],
            in("r10") a[3], in("r8") a[4], in("r9") a[5],
            lateout("rcx") _, lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

#[cfg(target_arch = "aarch64")]
/// One system call with up to six arguments.
///
/// # Safety
/// As the call `nr` with these arguments.
unsafe fn syscall6(nr: libc::c_long, a: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the AArch64 Linux system call convention.
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") nr,
            inlateout("x0") a[0] => ret,
            in("x1") a[1], in("x2") a[2], in("x3") a[3], in("x4") a[4], in("x5") a[5],
            options(nostack),
        );
    }
    ret
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
/// One system call through libc (the guard is a fork of its own here).
///
/// # Safety
/// As the call `nr` with these arguments.
unsafe fn syscall6(nr: libc::c_long, a: [usize; 6]) -> isize {
    // SAFETY: as the call itself.
    let ret = unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]) };
    if ret < 0 {
        // SAFETY: errno of this process's only thread.
        -(unsafe { *libc::__errno_location() } as isize)
    } else {
        ret as isize
    }
}

/// Whether the guard may share devlock's memory (this file makes its calls
/// without libc on this architecture).
pub(super) const SHARES_MEMORY: bool = cfg!(any(target_arch = "x86_64", target_arch = "aarch64"));

/// # Safety
/// Closes descriptors of this process only.
pub(super) unsafe fn close_range(from: libc::c_uint, to: libc::c_uint) -> isize {
    // SAFETY: as documented.
    unsafe {
        syscall6(
            libc::SYS_close_range,
            [from as usize, to as usize, 0, 0, 0, 0],
        )
    }
}

/// # Safety
/// `fd` is this process's.
pub(super) unsafe fn close(fd: RawFd) {
    // SAFETY: as documented.
    unsafe { syscall6(libc::SYS_close, [fd as usize, 0, 0, 0, 0, 0]) };
}

/// # Safety
/// `path` is NUL-terminated.
pub(super) unsafe fn chdir(path: &std::ffi::CStr) {
    // SAFETY: as documented.
    unsafe { syscall6(libc::SYS_chdir, [path.as_ptr() as usize, 0, 0, 0, 0, 0]) };
}

/// # Safety
/// `name` is NUL-terminated.
pub(super) unsafe fn set_name(name: &std::ffi::CStr) {
    // SAFETY: PR_SET_NAME reads at most 16 bytes of a NUL-terminated name.
    unsafe {
        syscall6(
            libc::SYS_prctl,
            [
                libc::PR_SET_NAME as usize,
                name.as_ptr() as usize,
                0,
                0,
                0,
                0,
            ],
        )
    };
}

/// # Safety
/// Changes this process's nice value only.
pub(super) unsafe fn set_nice(nice: i32) {
    // SAFETY: as documented.
    unsafe {
        syscall6(
            libc::SYS_setpriority,
            [libc::PRIO_PROCESS as usize, 0, nice as usize, 0, 0, 0],
        )
    };
}

/// # Safety
/// `header` and what it points to are valid for the call.
pub(super) unsafe fn recvmsg(fd: RawFd, header: *mut libc::msghdr, flags: i32) -> isize {
    // SAFETY: as documented.
    unsafe {
        syscall6(
            libc::SYS_recvmsg,
            [fd as usize, header as usize, flags as usize, 0, 0, 0],
        )
    }
}

/// Whether this process leads its process group.
///
/// # Safety
/// Reads this process's ids only.
pub(super) unsafe fn leads_group() -> bool {
    // SAFETY: getpgid(0) and getpid() read only.
    unsafe { syscall6(libc::SYS_getpgid, [0; 6]) == syscall6(libc::SYS_getpid, [0; 6]) }
}

/// # Safety
/// `fd` is a pidfd.
pub(super) unsafe fn pidfd_send_signal(fd: RawFd, sig: i32) -> bool {
    // SAFETY: a pidfd, no siginfo, no flags.
    unsafe {
        syscall6(
            libc::SYS_pidfd_send_signal,
            [fd as usize, sig as usize, 0, 0, 0, 0],
        ) == 0
    }
}

/// # Safety
/// Sends `sig` to `pid` (a negative one names a group, 0 our own).
pub(super) unsafe fn kill(pid: libc::pid_t, sig: i32) {
    // SAFETY: as documented.
    unsafe {
        syscall6(
            libc::SYS_kill,
            [pid as isize as usize, sig as usize, 0, 0, 0, 0],
        )
    };
}

/// A plain fork (a copy of the memory map, not a share of it): 0 in the
/// child.
///
/// # Safety
/// The child may make only async-signal-safe calls.
pub(super) unsafe fn fork() -> isize {
    // SAFETY: clone(SIGCHLD) with no other flag is fork(2).
    unsafe { syscall6(libc::SYS_clone, [libc::SIGCHLD as usize, 0, 0, 0, 0, 0]) }
}

/// Ends this process.
///
/// # Safety
/// Nothing runs after it.
pub(super) unsafe fn exit() -> ! {
    // SAFETY: as documented.
    unsafe { syscall6(libc::SYS_exit_group, [0; 6]) };
    // exit_group does not return.
    loop {
        std::hint::spin_loop();
    }
}
