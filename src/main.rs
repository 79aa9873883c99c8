//! The `devlock` binary: parse, run, and map the result to an exit code.
//!
//! devlock starts once per job, so it skips std's runtime set-up (which
//! reads /proc/self/maps to find the main thread's stack, and installs a
//! stack-overflow handler): `main` is the C entry point, and the command
//! line comes from the `argc`/`argv` it is given, not from std. SIGPIPE
//! therefore keeps its default action, so `devlock status | head` ends
//! quietly. This file and `src/sys/` are the only places with `unsafe`.
#![no_main]
// The C entry point is the one place outside src/sys/ with `unsafe`.
#![allow(unsafe_code)]

use devlock::exit::ExitCode;

// The one `main` symbol of the program, with the C signature the C
// runtime calls it with.
#[unsafe(no_mangle)]
extern "C" fn main(argc: std::ffi::c_int, argv: *const *const std::ffi::c_char) -> std::ffi::c_int {
    // SAFETY: the C runtime passes argc pointers to NUL-terminated strings
    // that live for the whole program.
    let args = unsafe { devlock::cli::args_from_main(argc, argv) };
    let cli = match parse(args) {
        Ok(cli) => cli,
        Err(err) => return report_usage(err),
    };
    // -q keeps a busy lock or a timeout to the exit status; errors are said.
    let quiet = cli.subcommand.is_none() && cli.run.quiet;
    let conflict = i32::from(cli.run.conflict_exit_code);
    match devlock::run(cli) {
        Ok(code) => code.code(),
        Err(err) => {
            if !(quiet && err.is_busy()) {
                eprintln!("devlock: {err}");
            }
            // A busy lock or a timeout alone takes --conflict-exit-code.
            match err.is_busy() {
                true => conflict,
                false => ExitCode::from(&err).code(),
            }
        }
    }
}

/// The command line parsed, in a frame of its own: inlined into `main`,
/// its locals (clap's among them) made `main`'s frame 12 kB, below every
/// frame of a take, so a waiting devlock kept three more pages of stack
/// (bench/run, section 5).
#[inline(never)]
fn parse(args: Vec<std::ffi::OsString>) -> Result<devlock::cli::Cli, clap::Error> {
    devlock::cli::Cli::parse_from_args(args)
}

/// Help and version go to stdout as clap renders them; real usage errors
/// become one `devlock: ...` line, with clap's suggestion if it has one.
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
    eprintln!(
        "devlock: {}",
        devlock::cli::usage_line(&err.render().to_string())
    );
    ExitCode::Usage.code()
}
