//! `cargo xtask generate`: writes the generated man pages and completions
//! (see the library); `cargo xtask generate --check` only says which are
//! out of date, and fails if any is.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["generate"] => false,
        ["generate", "--check"] => true,
        _ => {
            eprintln!("usage: cargo xtask generate [--check]");
            return ExitCode::from(2);
        }
    };
    let mut stale = 0;
    for (path, text) in xtask::generated_files() {
        let full = xtask::repo().join(&path);
        if std::fs::read_to_string(&full).ok().as_deref() == Some(text.as_str()) {
            continue;
        }
        if check {
            eprintln!("{path} is out of date: run {}", xtask::REGENERATE);
            stale += 1;
            continue;
        }
        if let Err(e) = std::fs::write(&full, &text) {
            eprintln!("writing {}: {e}", full.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {path}");
    }
    if stale > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
