//! Whether the names a run asks for are ones this machine knows: declared
//! by root (a managed directory's `.names`), used here before (a lock file),
//! In a managed directory an undeclared name is refused unless `--new` says
//! it is meant; elsewhere a new name close to a known one is said once, as
//! its lock file is made. (A new name with nothing close is taken silently:
//! a machine's first job must not read as a mistake. A `gpu:N` the driver
//! does not list is named by status: a run never waits on the GPU probe.)

use crate::flock::declared;
use crate::flock::dir::ScratchDir;
use crate::resource::Resource;
use anyhow::Result;

/// Checks `asked` against what `dir` knows; `new` is `--new`.
pub(crate) fn check(dir: &ScratchDir, asked: &[Resource], new: bool, quiet: bool) -> Result<()> {
    // The common case costs one look at each lock file.
    let exists = |r: &Resource| {
        nix::sys::stat::fstatat(
            dir.fd(),
            r.file_name().as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .is_ok()
    };
    if asked.iter().all(exists) {
        return Ok(());
    }
    let entries = dir.entries()?;
    let used: Vec<Resource> = entries
        .iter()
        .filter_map(|n| Resource::from_file_name(n))
        .collect();
    let declared = declared::read(dir);
    for name in asked {
        if used.contains(name) || declared.as_ref().is_some_and(|d| d.contains(name)) {
            continue;
        }
        let known: Vec<&Resource> = declared.iter().flatten().chain(&used).collect();
        // One GPU's name is never a typo of another's: the driver says
        // which exist.
        let close = match name.gpu_index() {
            Some(_) => None,
            None => closest(name, &known),
        };
        if let Some(declared) = &declared {
            if new {
                continue;
            }
            return Err(crate::error::usage(crate::messages::undeclared(
                name,
                &crate::show::show_path(dir.path()),
                declared,
                close,
            )));
        }
        if new || quiet {
            continue;
        }
        if let Some(close) = close {
            eprintln!(
                "devlock: {}",
                crate::messages::new_name(name, &crate::show::show_path(dir.path()), close)
            );
        }
    }
    Ok(())
}

/// The known name `name` most likely meant: the same letters and digits in
/// another case or punctuation (`GPU0` for `gpu:0`), else one edit away
/// (two for longer names).
pub(crate) fn closest<'a>(name: &Resource, known: &[&'a Resource]) -> Option<&'a Resource> {
    let bare = |r: &Resource| -> String {
        r.as_str()
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .map(|c| c.to_ascii_lowercase())
            .collect()
    };
    let wanted = bare(name);
    if let Some(same) = known.iter().find(|k| bare(k) == wanted && **k != name) {
        return Some(same);
    }
    let most = if wanted.len() > 6 { 2 } else { 1 };
    known
        .iter()
        .filter(|k| **k != name)
        .map(|k| (edits(&wanted, &bare(k)), *k))
        .filter(|(d, _)| *d <= most && wanted.len() >= 3)
        .min_by_key(|(d, k)| (*d, k.as_str().len()))
        .map(|(_, k)| k)
}

/// Levenshtein distance.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let replaced = previous + usize::from(ca != *cb);
            previous = row[j + 1];
            row[j + 1] = replaced.min(row[j] + 1).min(previous + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str) -> Resource {
        name.parse().unwrap()
    }

    #[test]
    fn a_close_name_is_found() {
        let (gpu0, gpu1, dataset) = (r("gpu:0"), r("gpu:1"), r("dataset"));
        let known = [&gpu0, &gpu1, &dataset];
        assert_eq!(closest(&r("GPU0"), &known), Some(&gpu0));
        assert_eq!(closest(&r("gpu-1"), &known), Some(&gpu1));
        assert_eq!(closest(&r("datset"), &known), Some(&dataset));
        assert_eq!(closest(&r("licence"), &known), None);
        assert_eq!(edits("kitten", "sitting"), 3);
    }
}
