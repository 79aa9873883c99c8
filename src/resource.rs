//! Resource names: what may be locked, and the file each name maps to.

use std::ffi::OsStr;
use std::fmt;

/// A validated resource name: 1-64 characters of `[A-Za-z0-9._:-]`, not
/// starting with `.` or `-`, so it can never climb out of the scratch
/// directory, hide as a dot file, or be taken for an option.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Resource(String);

/// Longest accepted resource name.
pub const MAX_NAME_LEN: usize = 64;

impl Resource {
    /// Checks a name as the user typed it.
    pub fn parse(name: &OsStr) -> Result<Resource, String> {
        let Some(text) = name.to_str() else {
            return Err(format!(
                "invalid resource name {}: not valid UTF-8",
                name.to_string_lossy().escape_debug()
            ));
        };
        let shown = text.escape_debug();
        if text.is_empty() {
            return Err("invalid resource name \"\": it is empty".into());
        }
        if text.len() > MAX_NAME_LEN {
            return Err(format!(
                "invalid resource name \"{shown}\": longer than {MAX_NAME_LEN} characters"
            ));
        }
        if text.starts_with(['.', '-']) {
            return Err(format!(
                "invalid resource name \"{shown}\": it must not start with '.' or '-'"
            ));
        }
        if let Some(bad) = text.chars().find(|c| !is_name_char(*c)) {
            return Err(format!(
                "invalid resource name \"{shown}\": '{}' is not allowed (use letters, digits, '.', '_', ':' and '-')",
                bad.escape_debug()
            ));
        }
        Ok(Resource(text.to_owned()))
    }

    /// Names from the command line, each checked; the first bad one is a
    /// usage error.
    pub fn parse_all(names: &[std::ffi::OsString]) -> anyhow::Result<Vec<Resource>> {
        names
            .iter()
            .map(|name| {
                Resource::parse(name)
                    .map_err(|e| crate::exit::coded(crate::exit::ExitCode::Usage, e))
            })
            .collect()
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The lock file's name inside the scratch directory.
    pub fn file_name(&self) -> String {
        format!("{}.lock", self.0)
    }

    /// The group of a member `G:M`: `G`.
    pub fn group(&self) -> Option<Resource> {
        let (group, _) = self.0.split_once(':')?;
        Resource::parse(OsStr::new(group)).ok()
    }

    /// The resource a lock file's path belongs to.
    pub fn from_lock_path(path: &std::path::Path) -> Option<Resource> {
        Resource::from_file_name(path.file_name()?.to_str()?)
    }

    /// The resource a lock file name belongs to, if it is one of ours.
    pub fn from_file_name(file_name: &str) -> Option<Resource> {
        let name = file_name.strip_suffix(".lock")?;
        Resource::parse(OsStr::new(name)).ok()
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Resource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Resource::parse(OsStr::new(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn accepts_plain_and_member_names() {
        for name in ["gpu", "gpu:0", "dataset_v2", "a.b-c", "A9", &"x".repeat(64)] {
            assert!(Resource::parse(OsStr::new(name)).is_ok(), "{name}");
        }
    }

    #[test]
    fn refuses_names_that_could_escape_or_confuse() {
        for name in [
            "",
            "../x",
            "a/b",
            ".hidden",
            "-n",
            "a b",
            "tab\t",
            "esc\x1b[31m",
            "é",
            &"x".repeat(65),
        ] {
            let err = Resource::parse(OsStr::new(name)).unwrap_err();
            assert!(err.starts_with("invalid resource name"), "{name}: {err}");
            assert!(!err.contains('\x1b'), "escape leaked into {err:?}");
        }
        let not_utf8 = OsStr::from_bytes(b"gp\xffu");
        assert!(Resource::parse(not_utf8).unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn lock_file_names_round_trip() {
        let gpu: Resource = "gpu:1".parse().unwrap();
        assert_eq!(gpu.file_name(), "gpu:1.lock");
        assert_eq!(Resource::from_file_name("gpu:1.lock"), Some(gpu));
        assert_eq!(Resource::from_file_name(".gpu@12.0.wait"), None);
        assert_eq!(Resource::from_file_name("notes.txt"), None);
        let member: Resource = "gpu:1".parse().unwrap();
        assert_eq!(member.group().unwrap().as_str(), "gpu");
        assert_eq!("gpu".parse::<Resource>().unwrap().group(), None);
    }
}
