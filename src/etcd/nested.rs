//! A devlock under a devlock: a lock an ancestor on this machine holds
//! passes through (its fence is the command's), as with lock files.

use anyhow::Result;

use super::wanted::{Got, Wanted};
use super::{Cluster, holders, line_of};
use crate::proc;
use crate::request::Request;

/// Whether an ancestor of this process already holds `request` (a nested
/// devlock), checked against etcd's line and this machine's processes: the
/// revision of its key if so.
async fn inherited(
    cluster: &Cluster,
    request: &Request,
    ancestors: &[(u32, u64)],
) -> Result<Option<i64>> {
    if ancestors.is_empty() {
        return Ok(None);
    }
    let (line, _) = cluster
        .ask("reading the line", |mut client| async move {
            line_of(&mut client, &request.name).await
        })
        .await?;
    let host = super::hostname();
    for place in holders(&line) {
        let Some(entry) = &place.entry else { continue };
        let is_ancestor = entry.host == host
            && ancestors.iter().any(|&(pid, start)| {
                pid == entry.pid && entry.pid_start.is_none_or(|s| s == start)
            });
        if !is_ancestor {
            continue;
        }
        if request.exclusive && !entry.exclusive {
            return Err(crate::error::in_use(format!(
                "{} is held only shared by a devlock this command runs under (pid {}); an exclusive take would wait for itself",
                request.name.as_str(),
                entry.pid
            )));
        }
        return Ok(Some(entry.fence.unwrap_or(place.create_revision)));
    }
    Ok(None)
}

/// This process and its ancestors with their start times, when one of them may be
/// a devlock: a devlock set `DEVLOCK_RESOURCES` for its command, or an
/// ancestor runs a program called devlock, or the kernel will not say what
/// it runs. Usually there is none, which spares asking etcd.
fn possible_devlock_ancestors() -> Vec<(u32, u64)> {
    let me = std::process::id();
    let ancestors: Vec<(u32, u64)> = proc::process::ancestors(me)
        .map(|(pid, stat)| (pid, stat.start))
        .collect();
    let maybe_nested = std::env::var_os("DEVLOCK_RESOURCES").is_some()
        || ancestors.iter().any(|(pid, _)| {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .map_or(true, |exe| exe.to_string_lossy().contains("devlock"))
        });
    if !maybe_nested {
        return Vec::new();
    }
    // This process among them: a devlock whose command is devlock became it.
    let this = proc::process::start_time(me).map(|start| (me, start));
    this.into_iter().chain(ancestors).collect()
}

/// What one run still has to take once the locks an enclosing devlock holds
/// pass through: the fixed requests left, the candidates left and how many
/// of them to pick; and what the command is given so far.
pub(super) async fn passed_through(
    cluster: &Cluster,
    wanted: &Wanted,
) -> Result<(Vec<Request>, Vec<Request>, usize, Got)> {
    let ancestors = possible_devlock_ancestors();
    let mut pending = Vec::new();
    let mut got = Got {
        resources: wanted.members.clone(),
        ..Got::default()
    };
    for request in &wanted.fixed {
        match inherited(cluster, request, &ancestors).await? {
            Some(fence) => got.fences.push((request.name.clone(), fence)),
            None => pending.push(request.clone()),
        }
    }
    // A candidate an enclosing devlock holds is a pick that passes through.
    let mut count = wanted.count;
    let mut candidates = Vec::new();
    for request in &wanted.candidates {
        let passed = if count > 0 {
            inherited(cluster, request, &ancestors).await?
        } else {
            None
        };
        match passed {
            Some(fence) => {
                count -= 1;
                got.fences.push((request.name.clone(), fence));
                got.resources.push(request.name.clone());
            }
            None => candidates.push(request.clone()),
        }
    }
    Ok((pending, candidates, count, got))
}
