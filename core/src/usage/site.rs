//! What root's `devlock setup` recorded in a lock directory for every hold
//! there: the site's idle timeout ([`super::idle::SITE_FILE`]) and where
//! usage records go ([`USAGE_FILE`]). Each is one small file that only root
//! can have written: believed only when the directory and the file are
//! root's, the file regular with one link, writable by nobody else and no
//! longer than its bound. Anything else (a file a user made there first, a
//! link, a FIFO, a hard link to another file) says nothing. Read with one
//! `openat`, `fstat` and `read`, never through a link, never waited on.

use std::ffi::CStr;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use nix::fcntl::OFlag;

/// Where `devlock setup` recorded the usage directory: a file of root's in
/// the lock directory holding its absolute path, or `none`.
pub const USAGE_FILE: &str = ".usage-dir";

/// The longest [`USAGE_FILE`] believed (`PATH_MAX`).
const MOST_USAGE: usize = 4096;

/// Where the usage records of holds in a lock directory go, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UsageDir {
    /// Nowhere: no records are kept (`setup --usage-dir none`).
    Nowhere,
    /// In this directory (absolute).
    At(PathBuf),
}

impl UsageDir {
    /// What a name given by `--usage-dir` or `DEVLOCK_USAGE_DIR` says:
    /// `none` (or `off`) for nowhere, else that directory.
    pub fn named(v: &std::ffi::OsStr) -> UsageDir {
        if v == "none" || v == "off" {
            UsageDir::Nowhere
        } else {
            UsageDir::At(PathBuf::from(v))
        }
    }

    /// The directory, if there is one.
    pub(crate) fn path(self) -> Option<PathBuf> {
        match self {
            UsageDir::Nowhere => None,
            UsageDir::At(path) => Some(path),
        }
    }
}

/// The usage directory recorded in the lock directory open as `dir`, if
/// root recorded one.
pub fn usage_dir(dir: BorrowedFd<'_>) -> Option<UsageDir> {
    let name = std::ffi::CString::new(USAGE_FILE).expect("no NUL in the name");
    parse_usage_dir(&root_file(dir, &name, MOST_USAGE)?)
}

/// What a [`USAGE_FILE`] says: `none` (or `off`), or an absolute path of
/// printable UTF-8 (no control or format character: setup records nothing
/// else, and a boot snippet could not carry it), one newline after it at
/// most; anything else says nothing.
pub(crate) fn parse_usage_dir(bytes: &[u8]) -> Option<UsageDir> {
    if bytes.len() > MOST_USAGE {
        return None;
    }
    let text = std::str::from_utf8(bytes).ok()?;
    let text = text.strip_suffix('\n').unwrap_or(text);
    if text == "none" || text == "off" {
        return Some(UsageDir::Nowhere);
    }
    (recordable(text) && text.starts_with('/')).then(|| UsageDir::At(PathBuf::from(text)))
}

/// Whether `path` can be recorded as it is (and carried by a boot snippet's
/// line): not empty, no control (NUL included) or format character.
pub fn recordable(path: &str) -> bool {
    !path.is_empty() && !path.chars().any(crate::show::is_unsafe_char)
}

/// The bytes of the file `name` in the directory open as `dir`, at most
/// `most` of them, when root wrote it (see the module's comment); `None`
/// otherwise, or when it is longer.
pub(crate) fn root_file(dir: BorrowedFd<'_>, name: &CStr, most: usize) -> Option<Vec<u8>> {
    if nix::sys::stat::fstat(dir).ok()?.st_uid != 0 {
        return None;
    }
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let fd = crate::sys::fs::openat(dir, name, flags, 0).ok()?;
    let st = nix::sys::stat::fstat(&fd).ok()?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG
        || st.st_uid != 0
        || st.st_nlink != 1
        || st.st_mode & 0o022 != 0
        || st.st_size > most as i64
    {
        return None;
    }
    // One read for a file of the size fstat said; more only if it grew
    // meanwhile, up to one byte past the bound (then it says nothing).
    let mut bytes = vec![0; most + 1];
    let mut got = 0;
    while got < bytes.len() {
        match nix::unistd::read(fd.as_fd(), &mut bytes[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return None,
        }
        if got as i64 >= st.st_size {
            break;
        }
    }
    bytes.truncate(got);
    (got <= most).then_some(bytes)
}

/// The text setup records for `usage`.
pub fn usage_text(usage: &UsageDir) -> String {
    match usage {
        UsageDir::Nowhere => "none".to_owned(),
        UsageDir::At(path) => String::from_utf8_lossy(path.as_os_str().as_bytes()).into_owned(),
    }
}

/// A job's `--idle-timeout` over the site's: `--idle-timeout 1000h is
/// longer than this machine's idle policy, 8s (/run/lock/devlock/.idle-timeout,
/// set by the administrator): ask for 8s or less, or leave it out`.
pub(crate) fn idle_over_site(
    asked: std::time::Duration,
    site: std::time::Duration,
    policy_file: &std::path::Path,
) -> String {
    let site = humantime::format_duration(site);
    format!(
        "--idle-timeout {} is longer than this machine's idle policy, {site} ({}, set by the \
         administrator with devlock setup --idle-timeout): ask for {site} or less, or leave it out",
        humantime::format_duration(asked),
        crate::show::show_path(policy_file)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the bytes: no panic, and a directory only from a short
        /// file, absolute and printable.
        #[test]
        fn any_bytes_give_nothing_or_an_absolute_printable_path(
            bytes in proptest::collection::vec(any::<u8>(), 0..300)
        ) {
            if let Some(UsageDir::At(path)) = parse_usage_dir(&bytes) {
                prop_assert!(bytes.len() <= MOST_USAGE);
                let text = path.to_str().unwrap();
                prop_assert!(text.starts_with('/'));
                prop_assert!(!text.chars().any(crate::show::is_unsafe_char));
            }
        }

        /// Paths with controls, format characters, relative ones and long
        /// runs: never a panic; what setup writes reads back the same.
        #[test]
        fn what_setup_writes_reads_back(
            path in "/[a-z0-9 ._%-]{1,40}(/[a-z0-9 ._-]{1,20}){0,4}",
            junk in "[\\x00-\\x1f\\x7f\u{202e}\u{200b}]{1,4}",
            long in 4000usize..5000,
        ) {
            let recorded = UsageDir::At(PathBuf::from(&path));
            let written = format!("{}\n", usage_text(&recorded));
            prop_assert_eq!(parse_usage_dir(written.as_bytes()), Some(recorded.clone()));
            prop_assert_eq!(parse_usage_dir(usage_text(&recorded).as_bytes()), Some(recorded));
            prop_assert_eq!(parse_usage_dir(format!("{path}{junk}/x").as_bytes()), None);
            prop_assert_eq!(parse_usage_dir(&path.as_bytes()[1..]), None);
            let far = format!("/{}", "a".repeat(long));
            prop_assert_eq!(
                parse_usage_dir(far.as_bytes()).is_some(),
                far.len() <= MOST_USAGE
            );
        }
    }

    #[test]
    fn none_relative_empty_and_broken_records() {
        assert_eq!(parse_usage_dir(b"none\n"), Some(UsageDir::Nowhere));
        assert_eq!(parse_usage_dir(b"off"), Some(UsageDir::Nowhere));
        assert_eq!(
            parse_usage_dir(b"/var/lib/devlock/usage\n"),
            Some(UsageDir::At("/var/lib/devlock/usage".into()))
        );
        for bad in [
            &b""[..],
            b"\n",
            b"usage",
            b"/a\n\n",
            b"/a\nd /etc 0777 root root -",
            b"\xff/a",
            b"/a\0b",
        ] {
            assert_eq!(parse_usage_dir(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_roots_regular_file_with_one_link_is_read() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fd = crate::sys::fs::open(
            &std::ffi::CString::new(dir.path().as_os_str().as_bytes()).unwrap(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        )
        .unwrap();
        let file = dir.path().join(USAGE_FILE);
        std::fs::write(&file, "/srv/usage\n").unwrap();
        let root = nix::unistd::geteuid().is_root();
        let read = || usage_dir(fd.as_fd());
        if !root {
            // Not root's: nothing, whatever it says.
            assert_eq!(read(), None);
            return;
        }
        assert_eq!(read(), Some(UsageDir::At("/srv/usage".into())));
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(read(), None, "writable by others");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::hard_link(&file, dir.path().join("other")).unwrap();
        assert_eq!(read(), None, "two links");
        std::fs::remove_file(dir.path().join("other")).unwrap();
        std::os::unix::fs::lchown(&file, Some(65534), None).unwrap();
        assert_eq!(read(), None, "another user's");
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &file).unwrap();
        assert_eq!(read(), None, "a link");
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, format!("/{}", "a".repeat(MOST_USAGE))).unwrap();
        assert_eq!(read(), None, "too long");
    }
}
