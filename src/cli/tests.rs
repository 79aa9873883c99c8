//! The command line's unit tests: clap's definitions, and the fast parser
//! read against clap.

use super::fast::common_run;
use super::*;
use crate::units::parse_mib;
use clap::CommandFactory;
use std::path::Path;

#[test]
fn definitions_are_consistent() {
    Cli::command().debug_assert();
    let mut cmd = Cli::command();
    cmd.build();
    let mut names: Vec<&str> = cmd.get_subcommands().map(|s| s.get_name()).collect();
    names.sort();
    assert_eq!(names, SUBCOMMANDS);
}

#[test]
fn resources_and_command_are_split_at_the_double_dash() {
    let cli = Cli::try_parse_from(["devlock", "-n", "gpu", "--", "python", "-n", "x"]).unwrap();
    assert!(cli.run.no_wait);
    assert_eq!(cli.run.resources, ["gpu"]);
    assert_eq!(cli.run.command, ["python", "-n", "x"]);
}

#[test]
fn status_is_a_subcommand() {
    let cli = Cli::try_parse_from(["devlock", "status", "--json", "gpu"]).unwrap();
    match cli.subcommand {
        Some(Command::Status(args)) => {
            assert!(args.json);
            assert_eq!(args.resources, ["gpu"]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn setup_is_a_subcommand() {
    let cli = Cli::try_parse_from(["devlock", "setup", "--gpus", "--group", "gpu", "x"]).unwrap();
    match cli.subcommand {
        Some(Command::Setup(args)) => {
            assert!(args.gpus && !args.print_tmpfiles);
            assert_eq!(args.group.as_deref(), Some("gpu"));
            assert_eq!(args.resources, ["x"]);
        }
        other => panic!("{other:?}"),
    }
    assert!(Cli::try_parse_from(["devlock", "setup", "--slots", "0", "x"]).is_err());
}

#[test]
fn serve_listens_on_loopback_unless_told() {
    let cli = Cli::try_parse_from(["devlock", "serve"]).unwrap();
    match cli.subcommand {
        Some(Command::Serve(args)) => assert_eq!(args.listen.to_string(), DEFAULT_LISTEN),
        other => panic!("{other:?}"),
    }
    assert_eq!(parse_listen("8080").unwrap().to_string(), "127.0.0.1:8080");
    assert_eq!(
        parse_listen("localhost:0").unwrap().to_string(),
        "127.0.0.1:0"
    );
    assert_eq!(parse_listen("[::1]:9").unwrap().to_string(), "[::1]:9");
    assert_eq!(parse_listen("0.0.0.0:1").unwrap().to_string(), "0.0.0.0:1");
    for bad in [
        "",
        ":10425",
        "example.org:80",
        "127.0.0.1",
        "70000",
        "[::1]",
    ] {
        assert!(parse_listen(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn durations_use_humantime_and_bare_numbers_are_seconds() {
    let cli = Cli::try_parse_from(["devlock", "-w", "1h30m", "r", "--", "true"]).unwrap();
    assert_eq!(cli.run.timeout, Some(Duration::from_secs(5400)));
    assert!(Cli::try_parse_from(["devlock", "-w", "soon", "r", "--", "true"]).is_err());
    assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
    assert_eq!(parse_duration(" 1.5 "), Ok(Duration::from_millis(1500)));
    assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    for bad in ["", ".", "1.2.3", "-1", "1e400", "soon"] {
        assert!(parse_duration(bad).is_err(), "{bad:?}");
    }
    let cli = Cli::try_parse_from(["devlock", "--report-every", "2", "r", "--", "x"]).unwrap();
    assert_eq!(cli.run.report_every, Duration::from_secs(2));
}

/// The tests that read or set devlock's variables, one at a time.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn the_common_command_line_reads_as_clap_reads_it() {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let clap_says = |argv: &[&str]| {
        let mut command = <Cli as clap::CommandFactory>::command();
        let matches = command.try_get_matches_from_mut(argv).ok()?;
        <Cli as clap::FromArgMatches>::from_arg_matches(&matches).ok()
    };
    let cases: &[&[&str]] = &[
        &["devlock", "gpu", "--", "true"],
        &[
            "devlock", "-n", "-q", "gpu:0", "gpu:1", "--", "python", "-n", "x",
        ],
        &[
            "devlock", "--step", "train", "--dir", "/tmp/d", "-s", "data", "--", "sh", "-c", "x",
        ],
        &["devlock", "r", "-n", "--", "--", "x"],
        &[
            "devlock",
            "--no-wait",
            "--quiet",
            "--shared",
            "r",
            "--",
            "x",
        ],
        &["devlock", "-n", "-n", "r", "--", "x"],
        &["devlock", "-nq", "r", "--", "x"],
        &["devlock", "--step=x", "r", "--", "x"],
        &["devlock", "--step", "-x", "r", "--", "x"],
        &["devlock", "--dir", "", "r", "--", "x"],
        &["devlock", "status", "--", "x"],
        &["devlock", "-w", "10", "r", "--", "x"],
        &["devlock", "r", "--"],
        &["devlock", "r", "true"],
        &["devlock", "--", "true"],
        &["devlock", "--any", "a", "b", "--", "x"],
        &["devlock", "-", "--", "x"],
    ];
    for &argv in cases {
        let args: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let Some(fast) = common_run(&args) else {
            continue;
        };
        let slow = clap_says(argv).unwrap_or_else(|| panic!("clap refuses {argv:?}"));
        assert_eq!(format!("{fast:?}"), format!("{slow:?}"), "{argv:?}");
    }
    let read = |argv: &[&str]| common_run(&argv.iter().map(OsString::from).collect::<Vec<_>>());
    assert!(read(&["devlock", "gpu", "--", "true"]).is_some());
    for argv in [
        &["devlock", "-n", "-n", "r", "--", "x"][..],
        &["devlock", "-nq", "r", "--", "x"],
        &["devlock", "status", "--", "x"],
        &["devlock", "-w", "10", "r", "--", "x"],
        &["devlock", "r", "--"],
    ] {
        assert!(read(argv).is_none(), "{argv:?} is clap's to parse");
    }
}

#[test]
fn an_empty_environment_variable_counts_as_unset() {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    use crate::sys::env::{remove_var, set_var};
    set_var("DEVLOCK_DIR", "");
    set_var("DEVLOCK_ETCD", "");
    set_var("DEVLOCK_ETCD_USER", "");
    let cli = Cli::parse_from_args(["devlock", "r", "--", "true"]).unwrap();
    assert_eq!(cli.dir, Path::new(crate::flock::dir::DEFAULT_DIR));
    assert!(cli.etcd.is_empty());
    assert_eq!(cli.etcd_user, None);
    assert!(Cli::parse_from_args(["devlock", "--dir", "", "r", "--", "true"]).is_err());
    set_var("DEVLOCK_DIR", "/tmp/x");
    let cli = Cli::parse_from_args(["devlock", "r", "--", "true"]).unwrap();
    assert_eq!(cli.dir, Path::new("/tmp/x"));
    remove_var("DEVLOCK_DIR");
    remove_var("DEVLOCK_ETCD");
    remove_var("DEVLOCK_ETCD_USER");
}

#[test]
fn usage_errors_keep_their_tip_on_one_line() {
    let err = Cli::try_parse_from(["devlock", "--nowait", "r", "--", "true"]).unwrap_err();
    let line = usage_line(&err.render().to_string());
    assert!(
        line.contains("'--nowait'") && line.contains("did you mean '--no-wait'?"),
        "{line}"
    );
    assert_eq!(line.lines().count(), 1);
    assert!(!line.contains("(see"), "one hint: {line}");
    let err = Cli::try_parse_from(["devlock", "status", "-n"]).unwrap_err();
    assert!(
        usage_line(&err.render().to_string()).ends_with("(see devlock status --help)"),
        "{err}"
    );
    let listing =
        "error: the following required arguments were not provided:\n  --any\n\nUsage: x\n";
    assert_eq!(
        usage_line(listing),
        "the following required arguments were not provided --any (see devlock --help)"
    );
}

#[test]
fn flocks_spellings_are_taken_or_answered_with_devlocks() {
    let take = |argv: &[&str]| Cli::try_parse_from(argv).map(|cli| cli.run);
    for argv in [
        &["devlock", "-x", "gpu", "--", "true"][..],
        &["devlock", "--exclusive", "gpu", "--", "true"],
        &["devlock", "-e", "gpu", "--", "true"],
    ] {
        let run = take(argv).unwrap();
        assert!(run.exclusive && !run.shared, "{argv:?}");
    }
    for argv in [
        &["devlock", "--nb", "r", "--", "true"][..],
        &["devlock", "--nonblock", "r", "--", "true"],
        &["devlock", "-xn", "r", "--", "true"],
    ] {
        assert!(take(argv).unwrap().no_wait, "{argv:?}");
    }
    let run = take(&["devlock", "--wait", "10", "-E", "3", "r", "--", "true"]).unwrap();
    assert_eq!(
        (run.timeout, run.conflict_exit_code),
        (Some(Duration::from_secs(10)), 3)
    );
    assert!(take(&["devlock", "-x", "-s", "r", "--", "true"]).is_err());
    for (argv, says) in [
        (&["devlock", "-c", "make", "r"][..], "-- sh -c 'COMMAND'"),
        (&["devlock", "--command", "make", "r"], "-- sh -c 'COMMAND'"),
        (
            &["devlock", "-u", "r", "--", "true"],
            "-u has no equivalent",
        ),
        (
            &["devlock", "--unlock", "r", "--", "true"],
            "--unlock has no",
        ),
        (
            &["devlock", "-o", "r", "--", "true"],
            "-o has no equivalent",
        ),
        (&["devlock", "--close", "r", "--", "true"], "--close has no"),
        (
            &["devlock", "-F", "r", "--", "true"],
            "-F has no equivalent",
        ),
        (
            &["devlock", "--no-fork", "r", "--", "true"],
            "--no-fork has no",
        ),
        (&["devlock", "--verbose", "r", "--", "true"], "unless -q"),
        (
            &["devlock", "-nu", "r", "--", "true"],
            "-u has no equivalent",
        ),
    ] {
        let err = Cli::try_parse_from(argv).unwrap_err();
        let line = usage_line(&err.render().to_string());
        assert!(line.contains(says), "{argv:?}: {line}");
        assert!(line.contains("util-linux flock's"), "{argv:?}: {line}");
        assert!(!line.contains("did you mean"), "{argv:?}: {line}");
        assert_eq!(line.lines().count(), 1);
    }
}

#[test]
fn sizes_are_mebibytes() {
    assert_eq!(parse_mib("256"), Ok(256));
    assert_eq!(parse_mib("256MiB"), Ok(256));
    assert_eq!(parse_mib("1GiB"), Ok(1024));
    assert_eq!(parse_mib("1.5g"), Ok(1536));
    assert!(parse_mib("lots").is_err());
    assert!(parse_mib("5 parsecs").is_err());
}
