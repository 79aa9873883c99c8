//! A run's notes ([`Note`]: the setup warning, other one-line warnings) in
//! words, on stderr: the core notes what it met and says nothing.

use std::io::Write;

use crate::flock::trust::{Note, Notes};

/// Says what `notes` gathered since the last time, unless `quiet`: the
/// trust issues as one line with the fix, then any other warning.
pub(crate) fn say_notes(notes: &Notes, quiet: bool) {
    let drained = notes.drain();
    if quiet {
        return;
    }
    let mut out = String::new();
    for note in drained {
        match note {
            Note::NotSetUp {
                named,
                owners,
                above,
                fixes,
            } => {
                let owners: Vec<&str> = owners.iter().map(String::as_str).collect();
                out.push_str(&crate::messages::setup_warning(
                    &named, &owners, above, &fixes,
                ));
            }
            Note::Line(line) => out.push_str(&format!("devlock: warning: {line}\n")),
        }
    }
    if !out.is_empty() {
        let _ = std::io::stderr().write_all(out.as_bytes());
    }
}
