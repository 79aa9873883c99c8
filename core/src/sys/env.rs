//! The environment, changed only by unit tests (devlock itself never
//! changes its own: a command's variables are given to it at its start).

/// Sets a variable for a unit test.
pub fn set_var(key: &str, value: &str) {
    // SAFETY: only the unit tests of the one module that reads these
    // variables (cli) set them, and that module's tests do not run their
    // environment-touching parts concurrently with each other: one test
    // sets, reads and removes them.
    unsafe { std::env::set_var(key, value) };
}

/// Removes a variable for a unit test.
pub fn remove_var(key: &str) {
    // SAFETY: as for set_var.
    unsafe { std::env::remove_var(key) };
}
