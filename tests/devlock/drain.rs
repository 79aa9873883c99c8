//! A drain of queued jobs (issue 35): what the hand-off from one job in
//! line to the next leaves on its path.

use std::process::Stdio;

use crate::harness::*;

/// A command that took its lock through the line inherits the lock's
/// descriptor numbered above its place in line's (the queue file): a dead
/// process's files are let go of newest descriptor first, so the lock goes
/// before the place in line, whose teardown walks every byte-range lock on
/// the queue file, two per request in line.
test!(the_lock_is_let_go_of_before_the_place_in_line, needs: []);
pub(crate) fn the_lock_is_let_go_of_before_the_place_in_line() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["-q", "r"], "a");
    let fds = s.work("fds");
    let script = format!(
        "for f in /proc/$$/fd/*; do echo \"${{f##*/}} $(readlink \"$f\")\"; done > {}",
        fds.display()
    );
    let mut waiter = s
        .devlock()
        .args(["-q", "r", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    // In line behind the holder: its take goes through the queue file.
    wait_blocked(&s.lock_path("r"), 1);
    release(&s, "a");
    assert!(wait_child(&mut holder).success());
    assert!(wait_child(&mut waiter).success());
    let listed = std::fs::read_to_string(&fds).unwrap();
    let fd_of = |suffix: &str| -> u32 {
        let found: Vec<u32> = listed
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, target)| target.ends_with(suffix))
            .map(|(fd, _)| fd.parse().unwrap())
            .collect();
        assert_eq!(found.len(), 1, "one descriptor of {suffix}: {listed}");
        found[0]
    };
    let (lock, line) = (fd_of("/r.lock"), fd_of("/.r.queue"));
    assert!(
        lock > line,
        "the lock (fd {lock}) must be numbered above the place in line (fd {line}): {listed}"
    );
}
