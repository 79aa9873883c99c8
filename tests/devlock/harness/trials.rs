//! The tests' runner (see main.rs): what a test needs, decided at start-up.

use super::*;

/// Something a test needs to test anything.
#[derive(Debug, Clone, Copy)]
pub enum Need {
    /// A program on PATH.
    Tool(&'static str),
    /// Running as root (the cross-user tests play two other users).
    Root,
    /// bash-completion's library, which the bash completion sources.
    BashCompletion,
    /// A cgroup v2 hierarchy where a cgroup can be made (root, a writable
    /// `cgroup2` mount), for the systemd unit tests.
    Cgroup,
}

/// Where the cgroup v2 hierarchy is mounted, if it is.
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        let (_, at, kind) = (words.next()?, words.next()?, words.next()?);
        (kind == "cgroup2").then(|| PathBuf::from(at))
    })
}

/// Whether a cgroup can be made (and removed again) here.
fn can_make_cgroup() -> bool {
    let Some(root) = cgroup2_root() else {
        return false;
    };
    let probe = root.join(format!("devlock-test-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).is_ok() && std::fs::remove_dir(&probe).is_ok()
}

/// One test, as `test!` registers it beside its function: its module
/// (`devlock::core`) and name, its body, its needs.
pub struct Test {
    pub module: &'static str,
    pub name: &'static str,
    pub run: fn(),
    pub needs: &'static [Need],
    /// Run only on request (`--ignored`), for this reason.
    pub ignored: Option<&'static str>,
}

inventory::collect!(Test);

impl Test {
    /// `core::exit_status_is_passed_on`: the module within the test binary.
    fn full_name(&self) -> String {
        let module = self.module.split_once("::").map_or(self.module, |(_, m)| m);
        format!("{module}::{}", self.name)
    }
}

/// Whether a test whose tool is missing must fail (CI) rather than be
/// reported as ignored.
pub fn tools_required() -> bool {
    std::env::var_os("DEVLOCK_TEST_REQUIRE_TOOLS").is_some_and(|v| v == "1")
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// What of `needs` this machine lacks, in words.
fn missing(needs: &[Need]) -> Vec<String> {
    needs
        .iter()
        .filter_map(|need| match *need {
            Need::Tool(program) => (!on_path(program)).then(|| program.to_owned()),
            Need::Root => (!nix::unistd::getuid().is_root()).then(|| "root".to_owned()),
            Need::BashCompletion => (!Path::new("/usr/share/bash-completion/bash_completion")
                .exists())
            .then(|| "bash-completion".to_owned()),
            Need::Cgroup => (!can_make_cgroup()).then(|| "a cgroup v2 to make".to_owned()),
        })
        .collect()
}

/// The libtest-mimic trials: a test that cannot test anything here is
/// ignored (its reason shown as the trial's kind, `[needs groff]`), or
/// under `DEVLOCK_TEST_REQUIRE_TOOLS=1` fails, saying what is missing.
pub fn trials() -> Vec<libtest_mimic::Trial> {
    let required = tools_required();
    let mut tests: Vec<&Test> = inventory::iter::<Test>.into_iter().collect();
    tests.sort_by_key(|t| t.full_name());
    tests
        .into_iter()
        .map(|test| {
            let name = test.full_name();
            let lacking = missing(test.needs);
            let run = test.run;
            let why = format!("needs {}", lacking.join(", "));
            if lacking.is_empty() {
                let trial = libtest_mimic::Trial::test(name, move || {
                    run();
                    Ok(())
                });
                // A test run only on request says why in its line.
                match test.ignored {
                    Some(why) => trial.with_kind(why).with_ignored_flag(true),
                    None => trial,
                }
            } else if required {
                // (One run only on request fails only when asked for, and
                // says why it is not run otherwise.)
                let trial = libtest_mimic::Trial::test(name, move || {
                    Err(format!("{why}, and DEVLOCK_TEST_REQUIRE_TOOLS=1").into())
                });
                match test.ignored {
                    Some(reason) => trial.with_kind(reason).with_ignored_flag(true),
                    None => trial,
                }
            } else {
                libtest_mimic::Trial::test(name, || Ok(()))
                    .with_kind(why)
                    .with_ignored_flag(true)
            }
        })
        .collect()
}
