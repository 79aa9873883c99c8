//! The `devlock` binary: parse, run, and map the result to an exit code.
//!
//! devlock starts once per job, so it skips std's runtime set-up (which
//! reads /proc/self/maps to find the main thread's stack, and installs a
//! stack-overflow handler): `main` is the C entry point. SIGPIPE therefore
//! keeps its default action, so `devlock status | head` ends quietly.
#![no_main]

use clap::Parser;
use devlock::exit::{ExitCode, exit_code_of};

#[unsafe(no_mangle)]
extern "C" fn main(
    _argc: std::ffi::c_int,
    _argv: *const *const std::ffi::c_char,
) -> std::ffi::c_int {
    let cli = match devlock::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return report_usage(err),
    };
    let code = match devlock::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("devlock: {err:#}");
            exit_code_of(&err)
        }
    };
    code.code()
}

/// Help and version go to stdout as clap renders them; real usage errors
/// become one `devlock: ...` line.
fn report_usage(err: clap::Error) -> i32 {
    use clap::error::ErrorKind;
    if matches!(
        err.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        let _ = err.print();
        return ExitCode::Success.code();
    }
    let text = err.render().to_string();
    let first = text.lines().next().unwrap_or("invalid command line");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    eprintln!("devlock: {first} (see devlock --help)");
    ExitCode::Usage.code()
}
