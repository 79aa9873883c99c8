//! A drain of queued jobs (issue 35): what the hand-off from one job in
//! line to the next leaves on its path.

use std::process::Stdio;

use crate::harness::*;

test!(the_lock_is_let_go_of_before_the_place_in_line, needs: []);
/// A command that took its lock through the line inherits the lock's
/// descriptor numbered above its place in line's (the queue file): a dead
/// process's files are let go of newest descriptor first, so the lock goes
/// before the place in line, whose teardown walks every byte-range lock on
/// the queue file, two per request in line.
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

test!(a_shared_hold_through_the_line_keeps_its_labels_tag, needs: []);
/// The lock files' copies above the places in line leave a shared holder's
/// label where it is: a close of its descriptor at the exec would drop the
/// tag (a POSIX lock, ended by any close in the process) by which users who
/// cannot read the holder's descriptors see that it still holds.
pub(crate) fn a_shared_hold_through_the_line_keeps_its_labels_tag() {
    use std::os::unix::fs::MetadataExt;
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["-q", "r"], "a");
    let (script, ready) = wait_for_release(&s, "b");
    let mut shared = s
        .devlock()
        .args(["-q", "--shared", "r", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    wait_blocked(&s.lock_path("r"), 1);
    release(&s, "a");
    assert!(wait_child(&mut holder).success());
    wait_for_file(&ready);
    let label = std::fs::read_dir(s.dir())
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".hold"))
        .expect("a shared holder's label");
    let ino = label.metadata().unwrap().ino();
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    let tagged = locks.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 8
            && f[1] == "POSIX"
            && f[4] == shared.id().to_string()
            && f[5].ends_with(&format!(":{ino}"))
            && f[6] == (1u64 << 40).to_string()
    });
    release(&s, "b");
    assert!(wait_child(&mut shared).success());
    assert!(
        tagged,
        "no tag of pid {} on the label: {locks}",
        shared.id()
    );
}
