//! `devlock forget RESOURCE...`: remove an idle name's files (lock, queue,
//! slots), so that a typo no longer counts among the idle locks.
//!
//! Removing a lock file is what lets two holders in (a taker with the old
//! file open, and one that makes a new file), so a name is forgotten only
//! while the kernel shows nothing on any of its files (no lock held or
//! waited for, nobody in line), and its lock file is unlinked while devlock
//! holds that lock itself: a devlock that opened the file meanwhile finds,
//! once it has the lock, that the path names another file, and takes that.

use std::path::Path;

use anyhow::Result;

use crate::cli::ForgetArgs;
use crate::exit::ExitCode;
use crate::flock::declared;
use crate::flock::dir::ScratchDir;
use crate::flock::file::LockFile;
use crate::proc::lock_entry::FileId;
use crate::proc::locks::LockTable;
use crate::resource::Resource;

pub(crate) fn run(args: &ForgetArgs, dir_path: &Path) -> Result<ExitCode> {
    let names = Resource::parse_all(&args.resources)?;
    let Some(dir) = ScratchDir::open(dir_path)? else {
        return Err(crate::error::usage(crate::messages::forget_nothing(
            &crate::show::show_path(dir_path),
        )));
    };
    let declared = declared::read(&dir);
    if declared.is_some() && !nix::unistd::geteuid().is_root() {
        return Err(crate::error::denied(crate::messages::forget_needs_root(
            &crate::show::show_path(dir_path),
        )));
    }
    for name in &names {
        forget(&dir, name)?;
        println!("devlock forget: {name} forgotten");
    }
    if let Some(mut declared) = declared {
        declared.retain(|n| !names.contains(n));
        declared::write(&dir, &declared)?;
    }
    Ok(ExitCode::Success)
}

/// The files of `name` there are: its lock file, its queue, its slots.
fn files_of(dir: &ScratchDir, name: &Resource) -> Result<Vec<String>> {
    let lock = name.file_name();
    let queue = crate::flock::queue::queue_name(&lock);
    let slot = format!(".{name}.slot");
    Ok(dir
        .entries()?
        .into_iter()
        .filter(|n| {
            *n == lock
                || *n == queue
                || n.strip_prefix(slot.as_str())
                    .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect())
}

fn forget(dir: &ScratchDir, name: &Resource) -> Result<()> {
    let files = files_of(dir, name)?;
    if !files.contains(&name.file_name()) {
        return Err(crate::error::usage(crate::messages::forget_unknown(
            name,
            &crate::show::show_path(dir.path()),
        )));
    }
    let id_of = |f: &str| {
        nix::sys::stat::fstatat(dir.fd(), f, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            .ok()
            .map(|st| FileId::from_metadata(st.st_dev, st.st_ino))
    };
    let lock_id = id_of(&name.file_name());
    let others_ids: Vec<FileId> = files
        .iter()
        .filter(|f| **f != name.file_name())
        .filter_map(|f| id_of(f))
        .collect();
    let ids: Vec<FileId> = lock_id
        .iter()
        .copied()
        .chain(others_ids.iter().copied())
        .collect();
    let in_use = || -> Result<bool> {
        let table = LockTable::read()?;
        Ok(ids.iter().any(|&id| table.any_on(id)))
    };
    if in_use()? {
        return Err(busy(dir, name));
    }
    let mut lock = LockFile::open(dir, &name.file_name())?;
    if !lock.try_lock_at_path(dir, true)? {
        return Err(busy(dir, name));
    }
    // Ours alone now; anything else on its files means someone came.
    let table = LockTable::read()?;
    let others = others_ids.iter().any(|&id| table.any_on(id))
        || lock_id.is_some_and(|id| table.blocked(id).next().is_some());
    if others {
        return Err(busy(dir, name));
    }
    for file in files.iter().rev() {
        let _ = nix::unistd::unlinkat(
            dir.fd(),
            file.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
    drop(lock);
    Ok(())
}

fn busy(dir: &ScratchDir, name: &Resource) -> anyhow::Error {
    let view =
        LockFile::open(dir, &name.file_name()).map(|lock| crate::view::describe(&lock, dir, name));
    crate::error::busy(
        name.as_str(),
        false,
        crate::messages::forget_in_use(name, view.ok().as_ref()),
    )
}
