//! `status` with budgets: the BUDGET column fits the terminal, and a pipe
//! keeps one record a line.

use super::*;

test!(status_with_budgets_fits_the_terminal_and_keeps_one_record_a_line, needs: []);
/// `status` with a budget fits a terminal: the figures have a column
/// (BUDGET) and a line of their own, the longest cells give way with `…`,
/// and no line is wider than the terminal; in a pipe every row stays whole
/// on one line, the memory figures on one greppable line of their own.
pub(crate) fn status_with_budgets_fits_the_terminal_and_keeps_one_record_a_line() {
    let g = Gpus::new(&[140 * GIB]);
    let long = "a-training-run-with-a-rather-long-step-name-for-the-table";
    // The holder computes, as a training run does: however long a loaded
    // machine keeps it holding, its row gains no `(idle ...)` label (whose
    // width would depend on how long that was).
    std::fs::write(g.state.join("util.0"), "50\n").unwrap();
    let a = mem_on(long, "20GiB", "0.2s", "gpu:0");
    let mut holder = g.job(&a, "a", 0, GIB, false);
    g.wait_ready("a");
    g.wait_settled("gpu:0", 1);
    let b = mem_on("big", "130GiB", "0.2s", "gpu:0");
    let mut big = g.job(&b, "b", 0, 0, false);
    g.wait_waiting("gpu:0", "big");
    let piped = stdout(&g.run(&["status"]));
    assert!(row_with(&piped, &[long, "20 GiB"]), "{piped}");
    assert!(!piped.contains("(idle"), "{piped}");
    assert!(row_with(&piped, &[" big ", "asks 130 GiB"]), "{piped}");
    let memory: Vec<&str> = piped.lines().filter(|l| l.contains("budgeted")).collect();
    assert_eq!(memory.len(), 1, "{piped}");
    assert!(
        memory[0].starts_with("gpu:0 memory: 20 GiB of 140 GiB budgeted,")
            && memory[0].ends_with(" room"),
        "{piped}"
    );
    // The step column is as wide as the step, not as the figures.
    let header = piped.lines().next().unwrap();
    let step_width = header.find("PID").unwrap() - header.find("STEP").unwrap();
    assert!(step_width < long.len() + 20, "{piped}");
    let pty = Pty::new(80);
    let mut status = pty.spawn(
        g.devlock()
            .env("NO_COLOR", "1")
            .args(["status"])
            .stdin(Stdio::null()),
    );
    assert!(wait_child(&mut status).success());
    let shown = pty.wait_for("(GPUs as");
    for line in shown.lines() {
        assert!(
            line.trim_end_matches('\r').chars().count() <= 80,
            "{line:?} in:\n{shown}"
        );
    }
    assert!(shown.contains('…'), "{shown}");
    assert!(row_with(&shown, &[" big ", "asks 130 GiB"]), "{shown}");
    finish(&g, "a", &mut holder);
    finish(&g, "b", &mut big);
}
