//! MIG instances as devices: the canonical resource name of a MIG instance, one level below its GPU, and what follows from it (its parent, the locks it holds shared, what CUDA is told).
//!
//! # The rule
//!
//! A MIG instance of GPU `N` is the resource
//!
//! ```text
//! gpu:N:PROFILE:giG.ciC        e.g.  gpu:0:1g.18gb:gi9.ci0   gpu:0:1c.3g.71gb:gi1.ci1   gpu:3:1g.18gb_me:gi13.ci0
//! ```
//!
//! - `N` is the GPU's index, written as in `gpu:N` (canonical decimal, 0 to
//!   65535, no sign, no leading zeros).
//! - `PROFILE` is the MIG profile NVML names the instance by: the words after
//!   the last `" MIG "` in `nvmlDeviceGetName` of the MIG device (what
//!   `nvidia-smi -L` prints: `1g.18gb`, `1c.3g.71gb` for a compute instance
//!   that takes one slice of a 3-slice GPU instance, `1g.18gb+me` with the media
//!   engines). It is kept as NVML writes it, lower case, except that `+`, which
//!   no resource name may hold, is written `_` (`1g.18gb_me`). A profile with
//!   any other character (an `_` of its own included, so the mapping stays one
//!   to one) has no name: the instance is listed but cannot be locked.
//! - `G` and `C` are its GPU instance and compute instance ids, the numbers
//!   `nvidia-smi` prints as "GI ID" and "CI ID", in canonical decimal.
//!
//! Every part is one of `[a-z0-9._-]`, so the name is a file name (`gpu:0:1g.18gb:gi9.ci0.lock`)
//! and a valid resource name of at most 64 characters; one that would be
//! longer gets no name. There is one name per instance: parsing accepts
//! only the form above, exactly as written by [`instance_name`].
//!
//! **The parent** is the name up to the second `:` (`gpu:N`), and its group
//! is `gpu`. The GPU excludes its instances and an instance holds its GPU
//! shared, as `gpu` and `gpu:N` relate now: taking an instance takes `gpu`
//! and `gpu:N` shared on its behalf ([`crate::resource::Resource::held_shared`]), then the instance
//! exclusive. In the one global lock order (sorted names) `gpu` < `gpu:N` <
//! `gpu:N:...`, so ancestors always come first.
//!
//! # Why this rule
//!
//! The issue's example, `gpu:0/1g.18gb:0`, cannot be used as it is: `/` cannot
//! be in a file name, and the lock file is named after the resource. The
//! choice is then what identifies an instance below `gpu:N`:
//!
//! - **An ordinal** (`gpu:0:1g.18gb:0`, the first 1g.18gb instance; or
//!   `gpu:0:mig0`, the MIG device index) reads best, but it moves when the
//!   layout changes: destroy an idle instance that sorts first and every later
//!   name now means another instance, so a job holding `...:1` and a newcomer
//!   taking the `...:0` that now resolves to the same instance share it. An
//!   exclusion hole under an administrator's reconfiguration; the MIG device
//!   index has the same flaw and tells nothing about size.
//! - **The MIG UUID** (`MIG-...`) never moves, but is 40 characters nobody can
//!   read or type.
//! - **The GPU/compute instance ids** stay with an instance for its whole life
//!   (nvml.h: "GPU instance IDs are unique per device and remain valid until
//!   the GPU instance is destroyed"; compute instance ids likewise within their
//!   GPU instance), and NVML refuses to destroy an instance while a process
//!   uses it. So a live name always means the same live instance, and the lock
//!   on it protects exactly that instance. An id can be reused after its
//!   instance is destroyed; the profile in the name means a reused id names an
//!   instance of the same size, or a different name.
//!
//! So: the ids for identity, the profile for reading (and for `--any
//! gpu:0:1g.18gb:gi9.ci0 gpu:0:1g.18gb:gi10.ci0`, which lists instances of
//! one size), `gi`/`ci` spelled out so that the ids read as nvidia-smi's
//! columns. A layout change makes old names vanish (their lock files stay,
//! unused) rather than silently point elsewhere.

use std::fmt;

use crate::names::{MAX_GPU_INDEX, MAX_NAME_LEN};

/// A MIG instance's resource name, taken apart.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct InstanceName {
    /// The GPU's index (its `gpu:N`).
    pub(crate) gpu: u32,
    /// The profile as it stands in the name (`+` written `_`).
    pub(crate) profile: String,
    /// GPU instance id.
    pub(crate) gpu_instance: u32,
    /// Compute instance id.
    pub(crate) compute_instance: u32,
}

impl fmt::Display for InstanceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gpu:{}:{}:gi{}.ci{}",
            self.gpu, self.profile, self.gpu_instance, self.compute_instance
        )
    }
}

/// The MIG profile in an NVML device name: `"NVIDIA H200 MIG 1g.18gb"` is
/// `1g.18gb`. `None` when the name has no `" MIG "` followed by a word.
pub(crate) fn profile_of_device_name(name: &str) -> Option<&str> {
    let (_, profile) = name.rsplit_once(" MIG ")?;
    let profile = profile.trim();
    (!profile.is_empty() && !profile.contains(char::is_whitespace)).then_some(profile)
}

/// The profile as it stands in a resource name: lower case already, `+`
/// as `_`. An error says why a profile has no name.
pub(crate) fn profile_part(profile: &str) -> Result<String, String> {
    let shown = profile.escape_debug();
    if profile.is_empty() {
        return Err("the MIG profile is empty".to_owned());
    }
    if let Some(bad) = profile
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '.' | '-' | '+'))
    {
        return Err(format!(
            "MIG profile \"{shown}\" has '{}', which no resource name can carry",
            bad.escape_debug()
        ));
    }
    if !profile.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!(
            "MIG profile \"{shown}\" does not start with a letter or digit"
        ));
    }
    Ok(profile.replace('+', "_"))
}

/// The canonical resource name of the MIG instance `gpu_instance`.`compute_instance`
/// of profile `profile` (as NVML names it) on GPU `gpu`.
pub(crate) fn instance_name(
    gpu: u32,
    profile: &str,
    gpu_instance: u32,
    compute_instance: u32,
) -> Result<String, String> {
    if gpu > MAX_GPU_INDEX {
        return Err(format!("GPU index {gpu} is above {MAX_GPU_INDEX}"));
    }
    let name = InstanceName {
        gpu,
        profile: profile_part(profile)?,
        gpu_instance,
        compute_instance,
    }
    .to_string();
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "{name} would be longer than {MAX_NAME_LEN} characters"
        ));
    }
    Ok(name)
}

/// `Ok(None)` for a name that is not a MIG instance (nothing after `gpu:N`);
/// the parts of one that is; an error naming the rule for a `gpu:N:...`
/// that is not written canonically.
pub(crate) fn parse(name: &str) -> Result<Option<InstanceName>, String> {
    let Some(rest) = name.strip_prefix("gpu:") else {
        return Ok(None);
    };
    let Some((gpu, rest)) = rest.split_once(':') else {
        return Ok(None);
    };
    let rule = "a MIG instance is gpu:N:PROFILE:giG.ciC (N, G and C in decimal without \
                sign or leading zeros, PROFILE as nvidia-smi -L names it, lower case, '+' written '_')";
    let bad = || Err(format!("{name} is no MIG instance name: {rule}"));
    let Some((profile, ids)) = rest.split_once(':') else {
        return bad();
    };
    let Some((gi, ci)) = ids.strip_prefix("gi").and_then(|ids| ids.split_once(".ci")) else {
        return bad();
    };
    let (Some(gpu), Some(gpu_instance), Some(compute_instance)) =
        (canonical_u32(gpu), canonical_u32(gi), canonical_u32(ci))
    else {
        return bad();
    };
    if gpu > MAX_GPU_INDEX
        || profile.contains('+')
        || profile_part(&profile.replace('_', "+")).as_deref() != Ok(profile)
    {
        return bad();
    }
    let parsed = InstanceName {
        gpu,
        profile: profile.to_owned(),
        gpu_instance,
        compute_instance,
    };
    if name.len() > MAX_NAME_LEN || parsed.to_string() != name {
        return bad();
    }
    Ok(Some(parsed))
}

/// A number written as [`fmt::Display`] writes it: digits, no sign, no
/// leading zero (except `0` itself).
fn canonical_u32(text: &str) -> Option<u32> {
    let number: u32 = text.parse().ok()?;
    (text.bytes().all(|b| b.is_ascii_digit()) && number.to_string() == text).then_some(number)
}

/// `CUDA_VISIBLE_DEVICES` for a command holding MIG instances: the instance's
/// UUID. CUDA enumerates only one MIG device per process (CUDA 11/R450 and 12/R525
/// say so), so a second one is refused with the reason instead of exported
/// and silently unused.
pub(crate) fn visible_devices(instances: &[(&str, &str)]) -> Result<String, String> {
    match instances {
        [] => Err("no MIG instance to export".to_owned()),
        [(_, uuid)] => Ok((*uuid).to_owned()),
        [(first, _), (second, _), ..] => Err(format!(
            "{first} and {second} are MIG instances, and CUDA uses only one MIG instance per \
             process; take one per command (for example one devlock per worker)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_come_from_nvml_device_names() {
        for (name, want) in [
            ("NVIDIA H200 MIG 1g.18gb", Some("1g.18gb")),
            ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", Some("1g.5gb")),
            ("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", Some("1c.3g.40gb")),
            ("NVIDIA H200 MIG 1g.18gb+me", Some("1g.18gb+me")),
            ("NVIDIA H200 MIG 1g.18gb ", Some("1g.18gb")),
            ("NVIDIA H200", None),
            ("NVIDIA H200 MIG ", None),
            ("NVIDIA H200 MIG 1g 18gb", None),
            ("MIG 1g.10gb", None),
        ] {
            assert_eq!(profile_of_device_name(name), want, "{name:?}");
        }
    }

    #[test]
    fn names_are_canonical_and_file_name_safe() {
        assert_eq!(
            instance_name(0, "1g.18gb", 9, 0).unwrap(),
            "gpu:0:1g.18gb:gi9.ci0"
        );
        assert_eq!(
            instance_name(3, "1g.18gb+me", 13, 0).unwrap(),
            "gpu:3:1g.18gb_me:gi13.ci0"
        );
        assert_eq!(
            instance_name(0, "1c.3g.71gb", 1, 1).unwrap(),
            "gpu:0:1c.3g.71gb:gi1.ci1"
        );
        assert_eq!(
            instance_name(65535, "7g.141gb", 0, 0).unwrap(),
            "gpu:65535:7g.141gb:gi0.ci0"
        );
        // '-' profiles (Blackwell's "-me") stay apart from '+' ones.
        assert_ne!(
            instance_name(0, "1g.23gb-me", 3, 0).unwrap(),
            instance_name(0, "1g.23gb+me", 3, 0).unwrap()
        );
        for bad in [
            "", "1G.18GB", "1g_18gb", "1g/18gb", "1g:18gb", ".1g", "-1g", "1g 18gb", "ü",
        ] {
            assert!(instance_name(0, bad, 1, 0).is_err(), "{bad:?}");
        }
        assert!(instance_name(65536, "1g.18gb", 1, 0).is_err());
        assert!(instance_name(0, &"x".repeat(40), u32::MAX, u32::MAX).is_err());
        for gpu in [0, 7, 65535] {
            for (profile, gi, ci) in [
                ("1g.18gb", 9, 0),
                ("1g.18gb+me", 4_000_000_000, 7),
                ("1c.3g.71gb", 1, 2),
            ] {
                let name = instance_name(gpu, profile, gi, ci).unwrap();
                assert!(name.len() <= MAX_NAME_LEN, "{name}");
                assert!(
                    name.chars()
                        .all(|c| c.is_ascii_alphanumeric() || ".:_-".contains(c)),
                    "{name}"
                );
                let parsed = parse(&name).unwrap().unwrap();
                assert_eq!(
                    (parsed.gpu, parsed.gpu_instance, parsed.compute_instance),
                    (gpu, gi, ci)
                );
                assert_eq!(parsed.to_string(), name, "round trip");
            }
        }
    }

    #[test]
    fn one_name_per_instance() {
        assert_eq!(parse("gpu").unwrap(), None);
        assert_eq!(parse("gpu:0").unwrap(), None);
        assert_eq!(parse("dataset:0:1g.18gb:gi9.ci0").unwrap(), None);
        for bad in [
            "gpu:00:1g.18gb:gi9.ci0",
            "gpu:+0:1g.18gb:gi9.ci0",
            "gpu:0:1g.18gb:gi09.ci0",
            "gpu:0:1g.18gb:gi9.ci00",
            "gpu:0:1g.18gb:gi9",
            "gpu:0:1g.18gb:9.0",
            "gpu:0:1g.18gb:0",
            "gpu:0:1G.18GB:gi9.ci0",
            "gpu:0:1g.18gb+me:gi9.ci0",
            "gpu:0::gi9.ci0",
            "gpu:0:1g.18gb:gi9.ci0:x",
            "gpu:0:1g.18gb:gi.ci0",
            "gpu:65536:1g.18gb:gi9.ci0",
            "gpu:0:mig0",
            "gpu:0:1g.18gb:gi4294967296.ci0",
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains("gpu:N:PROFILE:giG.ciC"), "{bad}: {err}");
        }
        let parsed = parse("gpu:2:1g.18gb_me:gi13.ci0").unwrap().unwrap();
        assert_eq!(parsed.profile, "1g.18gb_me");
    }

    #[test]
    fn ancestors_sort_first() {
        // The global lock order (sorted names) puts the ancestors first.
        let mut names = ["gpu:1:1g.18gb:gi9.ci0", "gpu:10", "gpu:1", "gpu"];
        names.sort();
        let at = |n: &str| names.iter().position(|x| *x == n).unwrap();
        assert!(at("gpu") < at("gpu:1") && at("gpu:1") < at("gpu:1:1g.18gb:gi9.ci0"));
    }

    #[test]
    fn cuda_gets_one_instance_uuid() {
        assert_eq!(
            visible_devices(&[("gpu:0:1g.18gb:gi9.ci0", "MIG-c1d2")]).unwrap(),
            "MIG-c1d2"
        );
        let err = visible_devices(&[
            ("gpu:0:1g.18gb:gi9.ci0", "MIG-a"),
            ("gpu:0:1g.18gb:gi10.ci0", "MIG-b"),
        ])
        .unwrap_err();
        assert!(
            err.contains("gpu:0:1g.18gb:gi9.ci0 and gpu:0:1g.18gb:gi10.ci0")
                && err.contains("only one MIG instance per process"),
            "{err}"
        );
        assert!(visible_devices(&[]).is_err());
    }
}
