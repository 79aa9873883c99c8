//! devlock's integration tests: real processes, signals, files and flock.
//!
//! One test binary with a harness of its own (libtest-mimic, `harness =
//! false` in Cargo.toml): libtest decides what runs at compile time, but
//! whether a test can test anything here (a tool installed, root) is known
//! only at run time. So every test registers itself beside its function,
//! with what it needs (`test!(name, needs: [Tool("bash")])`, collected with
//! the `inventory` crate), and `needs:` is the only way a test skips; at start-up
//! a test whose needs are missing is reported as ignored, with the reason
//! in its line (`test [needs groff] generated::... ignored`), unless
//! `DEVLOCK_TEST_REQUIRE_TOOLS=1` (CI sets it), which makes it fail
//! instead. Everything else is libtest's command line: filters, `--exact`,
//! `--ignored`, `--test-threads`, `--list`.

// The tests play the terminal, the attacker and the signal sender with raw
// calls (openpty, kill, setsid); the crate's own `unsafe` is in core/src/sys/.
#![allow(unsafe_code)]
// A test binary: its modules' items are for each other.
#![allow(unreachable_pub)]
// A test that is defined but not registered (see `test!`) never runs: fail
// the build instead.
#![deny(dead_code)]

/// `test!(name, needs: [...])`, beside the test function `name` of the
/// module it is in, registers it with what it needs to test anything;
/// optionally `ignored: "why"` (run only when asked for with `--ignored`).
/// A test function that is not registered is dead code, which fails the
/// build (`deny(dead_code)` above).
macro_rules! test {
    ($name:ident, $(ignored: $why:literal,)? needs: [$($need:expr),* $(,)?]) => {
        const _: () = {
            #[allow(unused_imports)]
            use $crate::harness::Need::{BashCompletion, Cgroup, Root, Tool};
            inventory::submit! {
                $crate::harness::Test {
                    module: module_path!(),
                    name: stringify!($name),
                    run: $name,
                    needs: &[$($need),*],
                    ignored: test!(@ignored $($why)?),
                }
            }
        };
    };
    (@ignored $why:literal) => { Some($why) };
    (@ignored) => { None };
}

mod harness;

mod amd;
mod budgets;
mod chain;
mod containers;
mod core;
mod devices;
mod display;
mod drain;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
mod etcd_chain;
#[cfg(feature = "etcd")]
mod etcd_cluster;
#[cfg(feature = "etcd")]
mod etcd_ha;
#[cfg(feature = "etcd")]
mod etcd_interop;
#[cfg(feature = "etcd")]
mod etcd_interop_modes;
#[cfg(feature = "etcd")]
mod etcd_pools;
#[cfg(feature = "etcd")]
mod etcd_server;
#[cfg(feature = "etcd")]
mod etcd_tls;
mod generated;
mod granularity;
mod hostile_paths;
mod hostile_records;
mod hostile_serve;
mod hostile_takes;
mod kills;
mod layers;
mod long_waits;
mod manners;
mod nvml;
mod one_thread_wait;
mod page_truth;
mod quiet_wait;
mod readme;
mod screens;
mod screens_daily;
mod serve;
mod serve_scene;
mod shared_machine;
mod signals;
mod site_record;
mod status;
mod timeout_stop;
mod torture;
mod usage;
mod usage_wait;
mod wait_dir;

fn main() {
    // The signal tests' command is this binary too (not a test of its own,
    // so the listing shows nothing ignored that is not a skipped test).
    if std::env::var_os("DEVLOCK_TEST_COUNTER").is_some() {
        signals::signal_counter();
        return;
    }
    // So are the library's holds of the usage record's tests.
    if let Some(dir) = std::env::var_os(site_record::LIBRARY_HOLD) {
        site_record::library_hold(dir.into());
        return;
    }
    // Started with `&` from a non-interactive shell, or under nohup, this
    // binary would have SIGINT and SIGQUIT (or SIGHUP) ignored, and every
    // command it starts would inherit that: a shell cannot trap a signal
    // ignored on entry, and `sleep` would outlive the signal a test sends.
    // The tests are about devlock's handling of those signals, so they
    // start from the default action, as an interactive terminal gives it.
    for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP, libc::SIGTERM] {
        // SAFETY: SIG_DFL is always a valid disposition, set before any
        // thread of the harness starts.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
    let args = libtest_mimic::Arguments::from_args();
    // Usage records of every devlock the tests start (those not given a
    // scratch directory's own too) stay in a directory of this run's, never
    // in the machine's.
    let usage = tempfile::Builder::new()
        .prefix("devlock-test-usage")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(
        usage.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    // SAFETY: no other thread runs yet.
    unsafe { std::env::set_var("DEVLOCK_USAGE_DIR", usage.path()) };
    let conclusion = libtest_mimic::run(&args, harness::trials());
    #[cfg(feature = "etcd")]
    etcd_cluster::stop_shared();
    drop(usage);
    conclusion.exit();
}
