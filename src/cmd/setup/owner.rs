//! Who owns what setup makes: an open file or directory given to root (and
//! the group) with its mode, and the owners' names setup says.

use std::os::fd::OwnedFd;

use anyhow::{Context, Result};

use super::Plan;
use crate::proc;
use crate::show::sanitize;

pub(super) fn owner_name(uid: u32) -> String {
    sanitize(&proc::process::user_name(uid))
}

/// Gives an open file or directory to root (and the group), with `mode`,
/// and without ACL entries a former owner may have added (a named entry
/// could lock a user out). Says what changed, if anything.
pub(super) fn make_ours(
    fd: &OwnedFd,
    st: &libc::stat,
    gid: u32,
    mode: u32,
) -> Result<Option<String>> {
    let acls = [c"system.posix_acl_access", c"system.posix_acl_default"];
    let mut had_acl = false;
    for name in acls {
        if crate::sys::fs::remove_xattr(fd, name) {
            had_acl = true;
        }
    }
    let right_owner = st.st_uid == 0 && st.st_gid == gid;
    let right_mode = st.st_mode & 0o7777 == mode;
    if right_owner && right_mode && !had_acl {
        return Ok(None);
    }
    // chown first (it may clear mode bits), then the mode.
    crate::sys::fs::fchown(fd, 0, gid)
        .and_then(|()| crate::sys::fs::fchmod(fd, mode))
        .context("changing owner and mode")?;
    let mut what = Vec::new();
    if !right_owner {
        what.push(format!(
            "taken over from {}:{}",
            owner_name(st.st_uid),
            group_name(st.st_gid)
        ));
    }
    if !right_mode {
        what.push(format!("mode {:o} (was {:o})", mode, st.st_mode & 0o7777));
    }
    if had_acl {
        what.push("ACL removed".to_owned());
    }
    Ok(Some(what.join(", ")))
}

fn group_name(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => sanitize(&g.name),
        _ => gid.to_string(),
    }
}

pub(super) fn owner_words(plan: &Plan) -> String {
    match &plan.group {
        Some(g) => format!("root:{}", sanitize(g)),
        None => "root:root".to_owned(),
    }
}
