//! The names root declared for a managed directory: `.names`, one resource
//! a line, written by `devlock setup` (and `devlock forget`). Believed only
//! as a regular file that root owns and nobody else may write; then a name
//! it does not list is almost always a typo, and a run refuses it unless
//! `--new` says it is meant.

use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use anyhow::{Context, Result};
use nix::fcntl::OFlag;

use crate::flock::dir::ScratchDir;
use crate::resource::Resource;

/// The file's name in the scratch directory (a dot file: no resource's).
pub const FILE: &str = ".names";

/// A list no larger than this is read; a larger one is not root's.
const MOST: u64 = 1 << 20;

/// The declared names, if root declared any here.
pub fn read(dir: &ScratchDir) -> Option<Vec<Resource>> {
    let c_name = crate::flock::dir::c_path(FILE.as_ref()).ok()?;
    let fd = crate::sys::fs::openat(
        dir.fd(),
        &c_name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        0,
    )
    .ok()?;
    let file = std::fs::File::from(fd);
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.uid() != 0 || meta.mode() & 0o022 != 0 || meta.len() > MOST {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(MOST + 1).read_to_end(&mut bytes).ok()?;
    parse(&bytes)
}

/// The names a `.names` file lists, one a line: a line that names no
/// resource is skipped; a file larger than [`MOST`] or not UTF-8 is no
/// list root wrote.
pub(crate) fn parse(bytes: &[u8]) -> Option<Vec<Resource>> {
    if bytes.len() as u64 > MOST {
        return None;
    }
    let text = std::str::from_utf8(bytes).ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.trim().parse::<Resource>().ok())
            .collect(),
    )
}

/// Writes `names` as the declared list (root, from setup and forget): a
/// file of another type or owner at the path, or one with another link
/// (whose other name may be anywhere), is replaced, never followed nor
/// written through.
pub fn write(dir: &ScratchDir, names: &[Resource]) -> Result<()> {
    let path = dir.path().join(FILE);
    let c_name = crate::flock::dir::c_path(FILE.as_ref())?;
    let flags = OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let fd = loop {
        match crate::sys::fs::openat(dir.fd(), &c_name, flags, 0) {
            Ok(fd) => {
                let st = nix::sys::stat::fstat(fd.as_fd())?;
                if st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_uid == 0 && st.st_nlink == 1
                {
                    break fd;
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            // A symlink, FIFO or directory planted at the path: replaced.
            Err(_) => {}
        }
        let _ = nix::unistd::unlinkat(dir.fd(), FILE, nix::unistd::UnlinkatFlags::NoRemoveDir);
        let _ = nix::unistd::unlinkat(dir.fd(), FILE, nix::unistd::UnlinkatFlags::RemoveDir);
        match crate::sys::fs::openat(
            dir.fd(),
            &c_name,
            flags | OFlag::O_CREAT | OFlag::O_EXCL,
            0o644,
        ) {
            Ok(fd) => break fd,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("creating {}", crate::show::show_path(&path)));
            }
        }
    };
    let mut text: String = names.iter().map(|n| format!("{n}\n")).collect();
    if text.is_empty() {
        text.push('\n');
    }
    crate::sys::fs::fchmod(&fd, 0o644)
        .with_context(|| format!("changing {}", crate::show::show_path(&path)))?;
    let file = std::fs::File::from(fd);
    std::os::unix::fs::FileExt::write_all_at(&file, text.as_bytes(), 0)
        .and_then(|()| file.set_len(text.len() as u64))
        .with_context(|| format!("writing {}", crate::show::show_path(&path)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A line of a `.names` file as root writes it, or as another writer
    /// might have left it: a name, padding, controls, far numbers, long
    /// runs, invalid UTF-8.
    fn line() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            "[a-z][a-z0-9_.-]{0,12}(:[0-9]{1,5})?".prop_map(String::into_bytes),
            "[ \t]{0,3}gpu:[0-9]{1,30}[ \t\r]{0,3}".prop_map(String::into_bytes),
            "[\\x00-\\x1f\\x7f\u{202e}]{1,8}".prop_map(String::into_bytes),
            "x{60,80}".prop_map(String::into_bytes),
            proptest::collection::vec(any::<u8>(), 0..40),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the bytes: no panic, at most one name a line, and every
        /// name one that a run accepts and prints as it was written.
        #[test]
        fn any_bytes_give_at_most_a_name_a_line(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
            if let Some(names) = parse(&bytes) {
                let lines = bytes.split(|&b| b == b'\n').count();
                prop_assert!(names.len() <= lines);
                for n in &names {
                    let again: Option<Resource> = n.as_str().parse().ok();
                    prop_assert_eq!(again.as_ref(), Some(n));
                }
            }
        }

        /// Lines mixed from names and garbage: exactly the lines that name
        /// a resource come back, in order; one invalid UTF-8 byte anywhere
        /// makes it no list at all.
        #[test]
        fn the_names_among_garbage_come_back_in_order(lines in proptest::collection::vec(line(), 0..24)) {
            let bytes = lines.join(&b'\n');
            let got = parse(&bytes);
            let Ok(text) = std::str::from_utf8(&bytes) else {
                prop_assert!(got.is_none());
                return Ok(());
            };
            let want: Vec<Resource> = text
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            prop_assert_eq!(got, Some(want));
        }
    }

    #[test]
    fn a_list_larger_than_root_writes_is_none() {
        let mut big = b"gpu\n".to_vec();
        big.resize(MOST as usize, b'x');
        assert_eq!(parse(&big).map(|v| v.len()), Some(1));
        big.push(b'\n');
        assert!(parse(&big).is_none());
    }
}
