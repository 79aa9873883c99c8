//! The line's unit tests: places, agreement bytes, strangers' locks.

use super::*;
use std::os::unix::fs::FileExt;

fn dir() -> (tempfile::TempDir, ScratchDir) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = ScratchDir::open_or_create(&tmp.path().join("d")).unwrap();
    (tmp, dir)
}

fn take(dir: &ScratchDir, slots: u64) -> Result<Ticket> {
    Ticket::take(dir, "r.lock", slots, &|| false, &|_| true, "r")
}

/// Another open file description on the queue, as a stranger has.
fn stranger(dir: &ScratchDir) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join(".r.queue"))
        .unwrap()
}

#[test]
fn tickets_are_served_in_order_and_the_dead_do_not_block() {
    let (_tmp, dir) = dir();
    let first = take(&dir, 0).unwrap();
    let second = take(&dir, 0).unwrap();
    let third = take(&dir, 0).unwrap();
    assert_eq!((first.number, second.number, third.number), (1, 2, 3));
    assert!(!first.has_anyone_ahead().unwrap());
    assert!(second.has_anyone_ahead().unwrap());
    drop(second); // a waiter that died in line
    assert!(third.has_anyone_ahead().unwrap(), "first still holds");
    drop(first);
    assert!(!third.has_anyone_ahead().unwrap());
    third.wait_turn(&|| true).unwrap();
    let fourth = take(&dir, 0).unwrap();
    assert_eq!(fourth.number, 4, "one past the highest held");
    drop((third, fourth));
    assert_eq!(take(&dir, 0).unwrap().number, 1, "an empty line restarts");
}

#[test]
fn an_emptied_line_is_seen_as_empty_again() {
    let (_tmp, dir) = dir();
    assert!(line_is_empty(&dir, "r.lock").unwrap());
    let first = take(&dir, 0).unwrap();
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
    let tickets: Vec<Ticket> = (0..5).map(|_| take(&dir, 0).unwrap()).collect();
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
    let reader = take(&dir, 0).unwrap();
    let next = take(&dir, 0).unwrap();
    assert!(next.has_anyone_ahead().unwrap());
    reader.step_aside().unwrap();
    assert!(!next.has_anyone_ahead().unwrap());
}

#[test]
fn everyone_in_line_must_agree_on_the_slot_count() {
    let (_tmp, dir) = dir();
    let a = take(&dir, 2).unwrap();
    assert_eq!(a.agreed_slots, 2);
    // The lock held by those in the agreement is no plain holder.
    let b = Ticket::take(&dir, "r.lock", 2, &|| true, &|_| true, "r").unwrap();
    a.step_aside().unwrap();
    let err = take(&dir, 3).unwrap_err();
    assert!(
        format!("{err:#}").contains("in use with --slots 2"),
        "{err:#}"
    );
    assert_eq!(agreement(&dir, "r.lock").unwrap(), Agreement::Slots(2));
    let plain = take(&dir, 0).unwrap_err();
    assert!(format!("{plain:#}").contains("with --slots 2, but this asks for it as a plain lock"));
    drop((a, b));
    assert_eq!(agreement(&dir, "r.lock").unwrap(), Agreement::None);
    assert_eq!(
        take(&dir, 3).unwrap().agreed_slots,
        3,
        "free to choose again"
    );
    let held_plainly = Ticket::take(&dir, "r.lock", 2, &|| true, &|_| true, "r").unwrap_err();
    assert!(format!("{held_plainly:#}").contains("in use as a plain lock"));
}

#[test]
fn whatever_is_written_into_the_file_changes_nothing() {
    let (_tmp, dir) = dir();
    drop(take(&dir, 0).unwrap());
    let junk = stranger(&dir);
    // The old format's last ticket at its maximum, and garbage after it.
    junk.write_all_at(&(i64::MAX as u64).to_le_bytes(), 0)
        .unwrap();
    junk.write_all_at(&[0xff; 64], 8).unwrap();
    assert_eq!(take(&dir, 0).unwrap().number, 1);
    assert!(line_is_empty(&dir, "r.lock").unwrap());
}

#[test]
fn a_strangers_locks_are_stepped_over_or_named() {
    let (_tmp, dir) = dir();
    drop(take(&dir, 0).unwrap());
    let other = stranger(&dir);
    // Over the first tickets: the next request goes behind it.
    set_lock(&other, libc::F_WRLCK, SLOT_BASE + 1, 10, false).unwrap();
    let t = take(&dir, 0).unwrap();
    assert_eq!(t.number, 11);
    assert!(t.has_anyone_ahead().unwrap(), "the stranger is ahead");
    drop(t);
    // To the end of the file: no place in line can be had.
    set_lock(&other, libc::F_WRLCK, SLOT_BASE + 5, 0, false).unwrap();
    let err = format!("{:#}", take(&dir, 0).unwrap_err());
    assert!(
        err.contains("its line is blocked by a lock that is not devlock's on bytes 1048577-EOF"),
        "{err}"
    );
    // Over the whole agreement range, a wide write lock.
    let (_tmp2, dir2) = self::dir();
    drop(take(&dir2, 0).unwrap());
    let other2 = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir2.path().join(".r.queue"))
        .unwrap();
    set_lock(&other2, libc::F_WRLCK, 0, SLOT_BASE, false).unwrap();
    let err = format!("{:#}", take(&dir2, 2).unwrap_err());
    assert!(
        err.contains("blocked by a lock that is not devlock's"),
        "{err}"
    );
}

#[test]
fn many_tickets_are_found_in_few_queries() {
    let (_tmp, dir) = dir();
    drop(take(&dir, 0).unwrap());
    let other = stranger(&dir);
    set_lock(&other, libc::F_WRLCK, SLOT_BASE + 1_000_000, 1, false).unwrap();
    assert_eq!(take(&dir, 0).unwrap().number, 1_000_001);
}
