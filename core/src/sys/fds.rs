//! The descriptors this process has open, found without listing
//! `/proc/self/fd`.

use std::os::fd::RawFd;

/// The most descriptor numbers one look polls before it gives up (and its
/// caller lists `/proc/self/fd`).
const MOST: usize = 1 << 16;

/// This process's open descriptors, lowest first: as many as the kernel
/// counts (the size it reports for `/proc/self/fd`, Linux 6.2 and later),
/// found by poll(2) over the lowest numbers, widened until all are found.
///
/// Why: listing `/proc/self/fd` makes the kernel build a directory entry
/// and an inode for each descriptor, some 50 µs in a new process, and a take
/// that finds its lock busy looks for a descriptor it inherited on it every
/// time (bench/run, section 3); this look costs some 15 µs.
///
/// `None` where the count is not known (an older kernel says 0) or does not
/// come out (another thread opened or closed one meanwhile): the caller
/// lists the directory then.
pub fn open_fds() -> Option<Vec<RawFd>> {
    let count = usize::try_from(std::fs::metadata("/proc/self/fd").ok()?.len()).ok()?;
    if count == 0 {
        return None;
    }
    // poll(2) refuses more entries than RLIMIT_NOFILE, which also bounds
    // the numbers a descriptor can have been given (unless the limit was
    // lowered after it was opened: then the count does not come out).
    let limit = soft_nofile().min(MOST);
    let mut polled: Vec<libc::pollfd> = Vec::new();
    let mut open = Vec::with_capacity(count);
    let mut upto = 64.min(limit);
    loop {
        let from = polled.len();
        polled.extend((from..upto).map(|fd| libc::pollfd {
            fd: fd as RawFd,
            events: 0,
            revents: 0,
        }));
        let fresh = &mut polled[from..];
        // SAFETY: `fresh` is an exclusively borrowed array of
        // `fresh.len()` initialised pollfd entries, which poll(2) only
        // writes the `revents` of; a zero timeout never blocks.
        let n = unsafe { libc::poll(fresh.as_mut_ptr(), fresh.len() as libc::nfds_t, 0) };
        if n < 0 {
            return None;
        }
        // A closed number answers POLLNVAL; an open one anything else.
        open.extend(
            fresh
                .iter()
                .filter(|p| p.revents & libc::POLLNVAL == 0)
                .map(|p| p.fd),
        );
        if open.len() >= count || upto >= limit {
            break;
        }
        upto = (upto * 4).min(limit);
    }
    (open.len() == count).then_some(open)
}

/// The soft RLIMIT_NOFILE.
fn soft_nofile() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one rlimit into `limit`, which outlives it.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The look finds every open descriptor, a high number included, in
    /// order. Other tests' threads open and close descriptors meanwhile, so
    /// a look may not come out; one of a hundred must.
    #[test]
    fn the_look_finds_a_high_descriptor() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let high = crate::sys::fs::inheritable_copy_above(&file, 700).unwrap();
        let found = (0..100)
            .find_map(|_| open_fds())
            .expect("the count came out");
        crate::sys::process::close_raw(high);
        assert!(found.contains(&high), "{found:?}");
        assert!(found.windows(2).all(|w| w[0] < w[1]), "{found:?}");
    }
}
