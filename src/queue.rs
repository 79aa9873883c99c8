//! The line in front of each lock: first come, first served, built on
//! open-file-description byte-range locks so every wait is a kernel sleep.
//!
//! flock(2) wakes all waiters at once and lets any of them win, and a
//! newcomer can take a lock at the instant it is released. So each lock file
//! `R.lock` has a queue file `.R.queue`. A request takes the next ticket
//! (a counter in the header, under a brief header lock), then write-locks the
//! byte at `SLOT_BASE + ticket` for as long as it waits (and, if exclusive,
//! holds). Its turn comes when no earlier ticket's byte is locked any more:
//! one blocking read-lock over all of them, which the kernel grants once the
//! last earlier request has finished or died. A dead waiter's bytes vanish
//! with it, so it never blocks the line.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use anyhow::Result;

use crate::lockfile::LockFile;
use crate::scratch::ScratchDir;

/// Header: the last ticket handed out (u64), then the slot count all users
/// of the resource agreed on (u64, 0 when not a semaphore).
const HEADER_LEN: i64 = 16;
const SLOTS_AT: u64 = 8;
/// Where ticket bytes start; anything past the header would do.
const SLOT_BASE: i64 = 1 << 20;

/// A place in line. Dropping it leaves the line.
#[derive(Debug)]
pub struct Ticket {
    file: File,
    pub number: u64,
    /// Slot count recorded for the resource when the ticket was taken.
    pub agreed_slots: u64,
}

/// The queue file's name for a lock file's name.
pub fn queue_name(lock_name: &str) -> String {
    let base = lock_name.strip_suffix(".lock").unwrap_or(lock_name);
    format!(".{base}.queue")
}

impl Ticket {
    /// Joins the line for `lock_name`. `slots` is the semaphore size this
    /// request expects (0 for a plain lock); it is recorded when nobody is in
    /// line and `in_use` says nobody holds the lock, and reported back in
    /// `agreed_slots` either way.
    pub fn take(
        dir: &ScratchDir,
        lock_name: &str,
        slots: u64,
        in_use: &dyn Fn() -> bool,
    ) -> Result<Ticket> {
        // A separate open per ticket: OFD locks belong to the open file
        // description, and two tickets of one process must not merge.
        let file = LockFile::open(dir, &queue_name(lock_name))?.into_file();
        // Ctrl-Z while holding the header lock would stop everyone's line.
        let _no_stop = StopSignalsHeld::new();
        set_lock(&file, libc::F_WRLCK, 0, HEADER_LEN, true)?;
        let mut header = [0u8; HEADER_LEN as usize];
        let len = file.read_at(&mut header, 0)?;
        let last = if len >= 8 {
            u64::from_le_bytes(header[..8].try_into().unwrap())
        } else {
            0
        };
        let mut agreed = if len >= 16 {
            u64::from_le_bytes(header[8..16].try_into().unwrap())
        } else {
            0
        };
        let number = last + 1;
        let mut header = [0u8; HEADER_LEN as usize];
        header[..8].copy_from_slice(&number.to_le_bytes());
        header[8..].copy_from_slice(&agreed.to_le_bytes());
        file.write_all_at(&header, 0)?;
        set_lock(&file, libc::F_WRLCK, SLOT_BASE + number as i64, 1, false)?;
        if agreed != slots && !Ticket::anyone_ahead(&file, number)? && !in_use() {
            // Nobody else is in line or holding: this request sets the terms.
            file.write_all_at(&slots.to_le_bytes(), SLOTS_AT)?;
            agreed = slots;
        }
        set_lock(&file, libc::F_UNLCK, 0, HEADER_LEN, false)?;
        Ok(Ticket {
            file,
            number,
            agreed_slots: agreed,
        })
    }

    /// Whether an earlier ticket is still in line (or holding).
    pub fn has_anyone_ahead(&self) -> io::Result<bool> {
        Ticket::anyone_ahead(&self.file, self.number)
    }

    fn anyone_ahead(file: &File, number: u64) -> io::Result<bool> {
        if number <= 1 {
            return Ok(false);
        }
        let mut probe = flock_struct(libc::F_RDLCK, SLOT_BASE + 1, number as i64 - 1);
        // SAFETY: valid descriptor and struct.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(probe.l_type != libc::F_UNLCK as libc::c_short)
    }

    /// Sleeps until every earlier ticket has left the line. Returns early
    /// with `Interrupted` when a signal arrives and `keep_waiting` says stop.
    pub fn wait_turn(&self, keep_waiting: &dyn Fn() -> bool) -> io::Result<()> {
        if self.number <= 1 {
            return Ok(());
        }
        loop {
            match set_lock(
                &self.file,
                libc::F_RDLCK,
                SLOT_BASE + 1,
                self.number as i64 - 1,
                true,
            ) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted && keep_waiting() => continue,
                Err(e) => return Err(e),
            }
        }
        set_lock(
            &self.file,
            libc::F_UNLCK,
            SLOT_BASE + 1,
            self.number as i64 - 1,
            false,
        )
    }

    /// Lets the next request go while this one keeps what it took (a shared
    /// holder admits the readers behind it; a writer behind still waits for
    /// the lock itself).
    pub fn step_aside(&self) -> io::Result<()> {
        set_lock(
            &self.file,
            libc::F_UNLCK,
            SLOT_BASE + self.number as i64,
            1,
            false,
        )
    }
}

/// Whether nobody is in line for `lock_name` (and it is no semaphore), asked
/// without joining the line: the cheap check that lets an uncontended take
/// skip the ticket. A request that arrives just after this check takes a
/// ticket, finds nobody ahead, and waits for the lock itself; one that was
/// in line before it still holds its byte, which this check sees.
pub fn line_is_empty(dir: &ScratchDir, lock_name: &str) -> io::Result<bool> {
    let file = match crate::waiters::open_read_only(dir, &queue_name(lock_name)) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(e),
    };
    let mut header = [0u8; HEADER_LEN as usize];
    file.read_at(&mut header, 0)?;
    let last = u64::from_le_bytes(header[..8].try_into().unwrap());
    let slots = u64::from_le_bytes(header[8..16].try_into().unwrap());
    Ok(slots == 0 && !Ticket::anyone_ahead(&file, last + 1)?)
}

/// How many tickets before `number` are still in line (or holding), for the
/// waiting line's "2nd in line". The kernel reports one conflicting lock per
/// query, so the range is split around each one found: two queries per
/// request ahead, and no file of anyone else's to open.
pub fn count_ahead(dir: &ScratchDir, lock_name: &str, number: u64) -> io::Result<usize> {
    let file = crate::waiters::open_read_only(dir, &queue_name(lock_name))?;
    let mut count = 0;
    let mut ranges = vec![(SLOT_BASE + 1, SLOT_BASE + number as i64 - 1)];
    while let Some((lo, hi)) = ranges.pop() {
        if lo > hi {
            continue;
        }
        let mut probe = flock_struct(libc::F_RDLCK, lo, hi - lo + 1);
        // SAFETY: valid descriptor and struct.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if probe.l_type == libc::F_UNLCK as libc::c_short {
            continue;
        }
        count += 1;
        ranges.push((lo, probe.l_start - 1));
        ranges.push((probe.l_start + 1, hi));
    }
    Ok(count)
}

/// The slot count recorded in a resource's queue, read without taking any
/// lock (status must never get in anyone's way).
pub fn agreed_slots(dir: &ScratchDir, lock_name: &str) -> Option<u64> {
    let file = crate::waiters::open_read_only(dir, &queue_name(lock_name)).ok()?;
    let mut slots = [0u8; 8];
    file.read_exact_at(&mut slots, SLOTS_AT).ok()?;
    Some(u64::from_le_bytes(slots))
}

/// Keeps job-control stops away for as long as it lives.
struct StopSignalsHeld(libc::sigset_t);

impl StopSignalsHeld {
    fn new() -> StopSignalsHeld {
        // SAFETY: plain signal-mask calls on sets we initialise.
        unsafe {
            let mut set = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut set);
            for sig in [libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU] {
                libc::sigaddset(&mut set, sig);
            }
            let mut old = std::mem::zeroed::<libc::sigset_t>();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            StopSignalsHeld(old)
        }
    }
}

impl Drop for StopSignalsHeld {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in new().
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

fn flock_struct(kind: libc::c_int, start: i64, len: i64) -> libc::flock {
    // SAFETY: plain data; every field the kernel reads is set below.
    let mut fl = unsafe { std::mem::zeroed::<libc::flock>() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = len;
    fl
}

fn set_lock(file: &File, kind: libc::c_int, start: i64, len: i64, wait: bool) -> io::Result<()> {
    let fl = flock_struct(kind, start, len);
    let cmd = if wait {
        libc::F_OFD_SETLKW
    } else {
        libc::F_OFD_SETLK
    };
    // SAFETY: valid descriptor and struct; pid must be 0 for OFD locks, which
    // zeroed() gave us.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &fl) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (tempfile::TempDir, ScratchDir) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = ScratchDir::open_or_create(&tmp.path().join("d")).unwrap();
        (tmp, dir)
    }

    #[test]
    fn tickets_are_served_in_order_and_the_dead_do_not_block() {
        let (_tmp, dir) = dir();
        let first = Ticket::take(&dir, "r.lock", 0, &|| false).unwrap();
        let second = Ticket::take(&dir, "r.lock", 0, &|| false).unwrap();
        let third = Ticket::take(&dir, "r.lock", 0, &|| false).unwrap();
        assert_eq!((first.number, second.number, third.number), (1, 2, 3));
        assert!(!first.has_anyone_ahead().unwrap());
        assert!(second.has_anyone_ahead().unwrap());
        drop(second); // a waiter that died in line
        assert!(third.has_anyone_ahead().unwrap(), "first still holds");
        drop(first);
        assert!(!third.has_anyone_ahead().unwrap());
        third.wait_turn(&|| true).unwrap();
    }

    #[test]
    fn an_emptied_line_is_seen_as_empty_again() {
        let (_tmp, dir) = dir();
        assert!(line_is_empty(&dir, "r.lock").unwrap());
        let first = Ticket::take(&dir, "r.lock", 0, &|| false).unwrap();
        assert!(!line_is_empty(&dir, "r.lock").unwrap());
        drop(first);
        assert!(
            line_is_empty(&dir, "r.lock").unwrap(),
            "the fast path works again"
        );
    }

    #[test]
    fn counts_who_is_ahead() {
        let (_tmp, dir) = dir();
        let tickets: Vec<Ticket> = (0..5)
            .map(|_| Ticket::take(&dir, "r.lock", 0, &|| false).unwrap())
            .collect();
        assert_eq!(count_ahead(&dir, "r.lock", 5).unwrap(), 4);
        let mut tickets = tickets;
        tickets.remove(1);
        tickets.remove(2);
        assert_eq!(count_ahead(&dir, "r.lock", 5).unwrap(), 2);
        assert_eq!(count_ahead(&dir, "r.lock", 1).unwrap(), 0);
    }

    #[test]
    fn stepping_aside_lets_the_next_through() {
        let (_tmp, dir) = dir();
        let reader = Ticket::take(&dir, "r.lock", 0, &|| false).unwrap();
        let next = Ticket::take(&dir, "r.lock", 0, &|| false).unwrap();
        assert!(next.has_anyone_ahead().unwrap());
        reader.step_aside().unwrap();
        assert!(!next.has_anyone_ahead().unwrap());
    }

    #[test]
    fn the_first_in_an_empty_line_sets_the_slot_count() {
        let (_tmp, dir) = dir();
        let a = Ticket::take(&dir, "r.lock", 2, &|| false).unwrap();
        assert_eq!(a.agreed_slots, 2);
        let b = Ticket::take(&dir, "r.lock", 3, &|| false).unwrap();
        assert_eq!(b.agreed_slots, 2, "someone is in line with 2");
        drop((a, b));
        let c = Ticket::take(&dir, "r.lock", 3, &|| false).unwrap();
        assert_eq!(c.agreed_slots, 3);
    }
}
