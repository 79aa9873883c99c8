//! The usage file a take opens before it waits (issue 35, the hand-off):
//! a start line written after a long wait still lands where `devlock
//! report` reads, whatever rotations happened meanwhile.

use crate::harness::*;

/// The start lines in the usage files readers read (`UID.jsonl` and its
/// `.old`) whose holder is `pid`.
fn start_lines_of(s: &Scratch, pid: u32) -> usize {
    let uid = nix::unistd::geteuid();
    ["jsonl", "jsonl.old"]
        .iter()
        .filter_map(|ext| std::fs::read_to_string(s.usage_dir().join(format!("{uid}.{ext}"))).ok())
        .flat_map(|text| text.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(&line).ok())
        .filter(|v| v["event"] == "start" && v["pid"] == pid)
        .count()
}

test!(a_start_line_after_a_wait_survives_the_files_rotations, needs: []);
/// A waiter opened its usage file before it waited; meanwhile the file was
/// rotated twice (renamed `.old`, then that `.old` replaced by the next
/// one), so what it opened is gone. Its start line is written in the
/// file as it is now, once: no record is lost to a removed file.
pub(crate) fn a_start_line_after_a_wait_survives_the_files_rotations() {
    let s = Scratch::new();
    let mut holder = Killed(hold_until_released(&s, &["r"], "h"));
    let mut waiter = queued(&s, &["-q", "r", "--", "true"], "r");
    let uid = nix::unistd::geteuid();
    let file = s.usage_dir().join(format!("{uid}.jsonl"));
    let old = s.usage_dir().join(format!("{uid}.jsonl.old"));
    // Two rotations, as two co-holders' would make them.
    for _ in 0..2 {
        std::fs::rename(&file, &old).unwrap();
        std::fs::write(&file, "").unwrap();
    }
    release(&s, "h");
    assert!(wait_child(&mut holder.0).success());
    assert!(wait_child(&mut waiter.0).success());
    assert_eq!(start_lines_of(&s, waiter.id()), 1);
}
