//! The idle policy of a hold (`--idle-timeout`, the site's default, the
//! library's `idle_timeout=`): once its GPUs have computed nothing for the
//! timeout the holder is warned, and after a grace period (the timeout
//! again, at most [`MAX_GRACE`]) it is stopped through devlock's normal
//! stop sequence and recorded "stopped: idle". `devlock busy DUR` (or a
//! touch of `$DEVLOCK_BUSY_FILE` into the future) says the job is busy
//! without the GPU until then.
//!
//! (See [`super::sample`] for what idle means.)

use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::hold_event::HoldEvent;

/// The longest grace between the warning and the stop.
pub(crate) const MAX_GRACE: Duration = Duration::from_secs(600);

/// The variable naming the file `devlock busy` sets into the future.
pub const BUSY_ENV: &str = "DEVLOCK_BUSY_FILE";

/// The site's default idle timeout in a managed scratch directory: this
/// file, root's, holding a duration (`devlock setup --idle-timeout`).
pub const SITE_FILE: &str = ".idle-timeout";

/// The grace after the warning for `timeout`.
pub(crate) fn grace(timeout: Duration) -> Duration {
    timeout.min(MAX_GRACE)
}

/// The policy's state for one hold.
#[derive(Debug)]
pub(crate) struct Policy {
    pub timeout: Duration,
    pub names: String,
    pub step: String,
    warned_for: Option<SystemTime>,
    pub stopped: bool,
}

impl Policy {
    pub(crate) fn new(timeout: Duration, names: String, step: String) -> Policy {
        Policy {
            timeout,
            names,
            step,
            warned_for: None,
            stopped: false,
        }
    }

    /// Looks at `idle_since` as of `now`: [`HoldEvent::Idle`] once the
    /// timeout passed, [`HoldEvent::IdleStop`] once the grace did too.
    pub(crate) fn check(
        &mut self,
        idle_since: Option<SystemTime>,
        now: SystemTime,
    ) -> Vec<HoldEvent> {
        let Some(since) = idle_since else {
            self.warned_for = None;
            return Vec::new();
        };
        if self.stopped {
            return Vec::new();
        }
        let idle = now.duration_since(since).unwrap_or_default();
        let mut acts = Vec::new();
        if idle >= self.timeout && self.warned_for != Some(since) {
            self.warned_for = Some(since);
            acts.push(HoldEvent::Idle {
                names: self.names.clone(),
                step: self.step.clone(),
                idle_for: idle,
                grace: grace(self.timeout),
            });
        }
        if idle >= self.timeout + grace(self.timeout) && self.warned_for == Some(since) {
            self.stopped = true;
            acts.push(HoldEvent::IdleStop {
                names: self.names.clone(),
                step: self.step.clone(),
                idle_for: idle,
            });
        }
        acts
    }
}

/// The site's default idle timeout: [`SITE_FILE`] in the scratch directory
/// open as `dir`, believed only as root wrote it ([`super::site`]).
pub fn site_default(dir: &crate::flock::dir::ScratchDir) -> Option<Duration> {
    let name = std::ffi::CString::new(SITE_FILE).expect("no NUL in the name");
    parse_site(&super::site::root_file(dir.fd(), &name, MOST_SITE)?)
}

/// The idle timeout a hold of `resources` in `dir` runs under: the site's
/// policy is a ceiling, so a job may ask for a shorter one but not a longer
/// one. A longer request is refused before anything is taken (exit 2, the
/// policy named): capping it would stop the job sooner than its owner
/// asked, with the reason said only after it had waited its turn and
/// started. The policy is read only where it can matter: a timeout was
/// asked, or a resource maps to GPUs (the only thing idle is measured on);
/// a plain take reads nothing.
pub fn within_site(
    asked: Option<Duration>,
    dir: &crate::flock::dir::ScratchDir,
    resources: &[crate::resource::Resource],
) -> anyhow::Result<Option<Duration>> {
    if asked.is_none() && !super::any_gpus(resources) {
        return Ok(None);
    }
    let site = site_default(dir);
    match (asked, site) {
        (Some(asked), Some(site)) if asked > site => Err(crate::error::usage(
            super::site::idle_over_site(asked, site, &dir.path().join(SITE_FILE)),
        )),
        (Some(asked), _) => Ok(Some(asked)),
        (None, site) => Ok(site),
    }
}

/// The longest [`SITE_FILE`] believed.
const MOST_SITE: usize = 64;

/// What a [`SITE_FILE`] says: one duration (`2h`, `90m`, a bare number of
/// seconds), not zero; anything longer than [`MOST_SITE`] bytes, not UTF-8
/// or not a duration says nothing.
pub(crate) fn parse_site(bytes: &[u8]) -> Option<Duration> {
    if bytes.len() > MOST_SITE {
        return None;
    }
    let text = std::str::from_utf8(bytes).ok()?;
    crate::units::parse_duration(text.trim())
        .ok()
        .filter(|d| !d.is_zero())
}

/// The busy file of a hold: a path in the temporary directory named for the
/// holder and a token of 128 random bits drawn once per process, which
/// `devlock busy` creates (the holder never does: nothing is made before
/// the command starts) and sets into the future; believed only while it is
/// a regular file of the holder's user; removed when the hold ends. Only
/// the job learns the name (in its environment, which no other user can
/// read): a name derivable from `/proc` could be created first by another
/// user in a shared `/tmp`, where the sticky bit and `protected_regular`
/// then refuse the job its own `devlock busy` (issue #32.4).
#[derive(Debug, Clone)]
pub struct BusyFile {
    pub path: std::path::PathBuf,
}

impl BusyFile {
    pub fn for_holder(pid: u32, pid_start: u64) -> BusyFile {
        BusyFile {
            path: std::env::temp_dir().join(format!(
                "devlock-busy-{}-{pid}-{pid_start}-{:032x}",
                nix::unistd::geteuid(),
                process_token()
            )),
        }
    }

    /// Until when the job said it is busy, if it did.
    pub(crate) fn busy_until(path: &Path) -> Option<SystemTime> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path).ok()?;
        (meta.is_file() && meta.uid() == nix::unistd::geteuid().as_raw())
            .then(|| meta.modified().ok())
            .flatten()
    }

    /// Removes it, if it is this user's file.
    pub(crate) fn remove(&self) {
        if Self::busy_until(&self.path).is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// This process's token for its busy files: the kernel's random bits, or
/// (where getrandom(2) is refused, as a seccomp filter may) std's randomly
/// keyed hash of the time, which no other user can predict either.
fn process_token() -> u128 {
    static TOKEN: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    *TOKEN.get_or_init(|| {
        crate::sys::random::random_u128().unwrap_or_else(|_| {
            use std::hash::BuildHasher;
            let keyed = std::hash::RandomState::new();
            let now = SystemTime::now();
            u128::from(keyed.hash_one(now)) << 64 | u128::from(keyed.hash_one((now, 1u8)))
        })
    })
}

/// `devlock busy [DUR]`: the hold this process runs under counts as busy
/// for its idle policy for DUR from now.
pub fn say_busy(dur: Duration) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let Some(path) = std::env::var_os(BUSY_ENV) else {
        return Err(crate::error::usage(
            "devlock busy: not inside a devlock hold ($DEVLOCK_BUSY_FILE is not set)",
        ));
    };
    // A hold nothing watches (no idle policy, nobody to remove a file at
    // its end) names no file: there is nobody to tell.
    if path.is_empty() {
        return Ok(());
    }
    let shown = Path::new(&path).display().to_string();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
        .with_context(|| format!("devlock busy: {shown}"))?;
    let meta = file
        .metadata()
        .with_context(|| format!("devlock busy: {shown}"))?;
    if !meta.is_file() || meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(crate::error::unsafe_file(format!(
            "devlock busy: {shown} is not a file of this user's: refusing it"
        )));
    }
    file.set_modified(SystemTime::now() + dur)
        .with_context(|| format!("devlock busy: setting the time of {shown}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warned_at_the_timeout_stopped_after_the_grace() {
        let mut p = Policy::new(Duration::from_secs(60), "gpu:0".into(), "s".into());
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let at = |s| t0 + Duration::from_secs(s);
        assert!(p.check(Some(t0), at(59)).is_empty());
        let acts = p.check(Some(t0), at(60));
        assert_eq!(
            acts,
            [HoldEvent::Idle {
                names: "gpu:0".into(),
                step: "s".into(),
                idle_for: Duration::from_secs(60),
                grace: Duration::from_secs(60)
            }]
        );
        assert!(p.check(Some(t0), at(100)).is_empty(), "warned once");
        // Busy again, then idle anew: the count starts over.
        assert!(p.check(None, at(110)).is_empty());
        assert!(p.check(Some(at(110)), at(150)).is_empty());
        assert!(matches!(
            p.check(Some(at(110)), at(170)).as_slice(),
            [HoldEvent::Idle { .. }]
        ));
        assert!(matches!(
            p.check(Some(at(110)), at(230)).as_slice(),
            [HoldEvent::IdleStop { idle_for, .. }] if *idle_for == Duration::from_secs(120)
        ));
        assert!(p.check(Some(at(110)), at(300)).is_empty(), "stopped once");
    }

    mod site_file {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Whatever the bytes: no panic, and a timeout only from a
            /// short file, never zero.
            #[test]
            fn any_bytes_give_no_timeout_or_a_short_files_nonzero_one(
                bytes in proptest::collection::vec(any::<u8>(), 0..200)
            ) {
                if let Some(d) = parse_site(&bytes) {
                    prop_assert!(bytes.len() <= MOST_SITE);
                    prop_assert!(!d.is_zero());
                }
            }

            /// Adversarial text: far numbers, fractions, signs, units,
            /// controls and padding; never a panic, and what setup writes
            /// reads back the same.
            #[test]
            fn far_numbers_and_junk_never_panic(
                text in "[ \t\n\r]{0,3}[-+]?[0-9]{0,40}(\\.[0-9]{0,20})?(e[0-9]{1,4})?(ns|us|ms|s|m|h|d|w|y|years|NaN|inf|[\\x00-\\x1f])?[ \t\n]{0,3}",
                secs in 1u64..10_000_000_000,
            ) {
                let _ = parse_site(text.as_bytes());
                let written = format!("{}\n", humantime::format_duration(Duration::from_secs(secs)));
                prop_assert_eq!(parse_site(written.as_bytes()), Some(Duration::from_secs(secs)));
            }
        }

        #[test]
        fn a_zero_a_long_or_a_broken_file_says_nothing() {
            assert_eq!(parse_site(b"2h\n"), Some(Duration::from_secs(7200)));
            assert_eq!(parse_site(b"90"), Some(Duration::from_secs(90)));
            for bad in [&b"0s"[..], b"", b"\xff2h", b"-5s", b"nan", b"1e400"] {
                assert_eq!(parse_site(bad), None, "{bad:?}");
            }
            let long = format!("{}2h", " ".repeat(63));
            assert_eq!(parse_site(long.as_bytes()), None);
        }
    }

    #[test]
    fn a_long_timeout_has_a_bounded_grace() {
        assert_eq!(grace(Duration::from_secs(7200)), MAX_GRACE);
        assert_eq!(grace(Duration::from_secs(2)), Duration::from_secs(2));
    }
}
