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
pub(crate) const FILE: &str = ".names";

/// A list no larger than this is read; a larger one is not root's.
const MOST: u64 = 1 << 20;

/// The declared names, if root declared any here.
pub(crate) fn read(dir: &ScratchDir) -> Option<Vec<Resource>> {
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
pub(crate) fn write(dir: &ScratchDir, names: &[Resource]) -> Result<()> {
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
                    .with_context(|| format!("creating {}", crate::text::show_path(&path)));
            }
        }
    };
    let mut text: String = names.iter().map(|n| format!("{n}\n")).collect();
    if text.is_empty() {
        text.push('\n');
    }
    crate::sys::fs::fchmod(&fd, 0o644)
        .with_context(|| format!("changing {}", crate::text::show_path(&path)))?;
    let file = std::fs::File::from(fd);
    std::os::unix::fs::FileExt::write_all_at(&file, text.as_bytes(), 0)
        .and_then(|()| file.set_len(text.len() as u64))
        .with_context(|| format!("writing {}", crate::text::show_path(&path)))
}
