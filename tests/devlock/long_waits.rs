//! What a long line costs the machine (issue 35): a waiting line far back
//! in a long line names the holder and its place without reading every
//! registration ahead of it.

use std::io::BufReader;
use std::process::Stdio;

use crate::harness::*;

test!(a_waiting_line_far_back_names_the_holder_and_its_place, needs: []);
pub(crate) fn a_waiting_line_far_back_names_the_holder_and_its_place() {
    let s = Scratch::new();
    let mut holder = hold_until_released(&s, &["--step", "the-holder", "r"], "h");
    let mut ahead: Vec<_> = (0..17)
        .map(|i| {
            let child = s.devlock().args(["-q", "r", "--", "true"]).spawn().unwrap();
            wait_blocked(&s.lock_path("r"), i + 1);
            child
        })
        .collect();
    let mut waiter = s
        .devlock()
        .args(["r", "--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(waiter.stderr.take().unwrap());
    let line = wait_for_line(&mut err, "· waiting");
    assert!(line.contains(" · 18th in line"), "{line:?}");
    assert!(line.contains(" for the-holder (pid "), "{line:?}");
    assert!(!line.contains("behind"), "{line:?}");
    release(&s, "h");
    wait_child(&mut holder);
    for child in &mut ahead {
        assert!(wait_child(child).success());
    }
    assert!(wait_child(&mut waiter).success());
}
