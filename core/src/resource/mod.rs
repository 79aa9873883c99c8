//! Resource names: what may be locked, and the file each name maps to.

pub(crate) mod mig;

use std::ffi::OsStr;
use std::fmt;

/// A validated resource name: 1-64 characters of `[A-Za-z0-9._:-]`, not
/// starting with `.` or `-`, so it can never climb out of the scratch
/// directory, hide as a dot file, or be taken for an option.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Resource(String);

use crate::names::{MAX_GPU_INDEX, MAX_NAME_LEN};

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
        if let Some(index) = text.strip_prefix("gpu:")
            && index
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-:._".contains(c))
        {
            // gpu:N:... is a MIG instance of GPU N, with one name each.
            if index.contains(':') {
                mig::parse(text)
                    .map_err(|rule| format!("invalid resource name \"{shown}\": {rule}"))?;
            } else {
                check_gpu_index(index)
                    .map_err(|rule| format!("invalid resource name \"{shown}\": {rule}"))?;
            }
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
            .map(|name| Resource::parse(name).map_err(crate::error::usage))
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

    /// N of a GPU member `gpu:N`: one number per device, as parsing
    /// admits only its canonical name.
    pub fn gpu_index(&self) -> Option<u32> {
        self.0.strip_prefix("gpu:")?.parse().ok()
    }

    /// The GPU `gpu:N` of a MIG instance `gpu:N:PROFILE:giG.ciC`
    /// (see the naming in devlock(1)); `None` for anything else.
    pub fn mig_parent(&self) -> Option<Resource> {
        let parsed = mig::parse(&self.0).ok()??;
        Some(Resource(format!("gpu:{}", parsed.gpu)))
    }

    /// What taking this resource also takes, shared, on its behalf: a
    /// member's group (`gpu` for `gpu:N`), and for a MIG instance its group
    /// and its GPU, so that the GPU excludes its instances and instances
    /// share their GPU. Ancestors sort before the resource in the global
    /// lock order.
    pub fn held_shared(&self) -> Vec<Resource> {
        let mut held: Vec<Resource> = self.group().into_iter().collect();
        held.extend(self.mig_parent());
        held
    }

    /// The resource a lock file name belongs to, if it is one of ours.
    pub fn from_file_name(file_name: &str) -> Option<Resource> {
        let name = file_name.strip_suffix(".lock")?;
        Resource::parse(OsStr::new(name)).ok()
    }
}

/// One name per device: a member of `gpu` is its index in canonical decimal,
/// so `gpu:0`, `gpu:00` and `gpu:+0` cannot be three locks on one GPU, and a
/// name that is no index cannot leave `CUDA_VISIBLE_DEVICES` unset.
fn check_gpu_index(index: &str) -> Result<(), String> {
    let rule = format!(
        "a GPU is gpu:N with N its index in decimal, 0 to {MAX_GPU_INDEX}, without sign or leading zeros"
    );
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return Err(rule);
    }
    let canonical = index.trim_start_matches('0');
    let canonical = if canonical.is_empty() { "0" } else { canonical };
    if canonical.len() > 5 || canonical.parse::<u32>().map_or(true, |n| n > MAX_GPU_INDEX) {
        return Err(rule);
    }
    if canonical != index {
        return Err(format!("write it gpu:{canonical} ({rule})"));
    }
    Ok(())
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
    fn a_gpu_has_one_name() {
        for name in ["gpu:0", "gpu:7", "gpu:65535", "gpu", "gpus:00", "tpu:00"] {
            assert!(Resource::parse(OsStr::new(name)).is_ok(), "{name}");
        }
        for (name, want) in [
            ("gpu:00", "write it gpu:0"),
            ("gpu:007", "write it gpu:7"),
            ("gpu:+1", "without sign"),
            ("gpu:-1", "without sign"),
            ("gpu:x", "in decimal"),
            ("gpu:", "in decimal"),
            ("gpu:1:2", "in decimal"),
            ("gpu:65536", "0 to 65535"),
            ("gpu:4294967296", "0 to 65535"),
            ("gpu:0000000000000000000001", "0 to 65535"),
        ] {
            let err = Resource::parse(OsStr::new(name)).unwrap_err();
            assert!(err.contains(want), "{name}: {err}");
        }
        assert_eq!(Resource::from_file_name("gpu:00.lock"), None);
        let r = |s: &str| Resource::parse(OsStr::new(s)).unwrap();
        assert_eq!(r("gpu:65535").gpu_index(), Some(65535));
        assert_eq!(r("gpu").gpu_index(), None);
        assert_eq!(r("tpu:3").gpu_index(), None);
    }

    #[test]
    fn a_mig_instance_is_one_level_below_its_gpu() {
        let r = |s: &str| Resource::parse(OsStr::new(s)).unwrap();
        let instance = r("gpu:3:1g.18gb:gi9.ci0");
        assert_eq!(instance.mig_parent(), Some(r("gpu:3")));
        assert_eq!(instance.gpu_index(), None);
        assert_eq!(instance.held_shared(), [r("gpu"), r("gpu:3")]);
        assert_eq!(r("gpu:3").held_shared(), [r("gpu")]);
        assert_eq!(r("gpu:3").mig_parent(), None);
        assert!(r("gpu").held_shared().is_empty());
        for bad in [
            "gpu:3:1g.18gb:gi09.ci0",
            "gpu:03:1g.18gb:gi9.ci0",
            "gpu:3:mig0",
        ] {
            let err = Resource::parse(OsStr::new(bad)).unwrap_err();
            assert!(err.contains("gpu:N:PROFILE:giG.ciC"), "{bad}: {err}");
        }
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
