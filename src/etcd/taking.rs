//! Joining the lines of one run's requests and waiting one's turn in each,
//! in the one global order: a whole group's members, `--any`'s picks.

use std::collections::HashSet;
use std::time::Instant;

use anyhow::Result;

use super::slot::claim_slot;
use super::turn::{Waiting, wait_turn};
use super::wanted::Settings;
use super::{Cluster, Entry, Place, join_lines, key_of};
use crate::flock::record::{Record, now_ms};
use crate::messages::etcd as messages;
use crate::proc;
use crate::request::Request;

/// A lock taken: its key, label, fencing token (the revision it was
/// granted at) and the revision it joined at.
pub(super) struct Taken {
    pub request: crate::resource::Resource,
    pub key: String,
    pub entry: Entry,
    pub fence: i64,
    pub joined_at: i64,
    /// `--slots`: the slot number it took.
    pub slot: Option<u64>,
}

/// Who we are, for every key's value.
pub(super) struct Label {
    pid: u32,
    pid_start: u64,
    user: String,
    host: String,
}

impl Label {
    pub(super) fn of_this_process(step: &str) -> Label {
        // Who we are, once for every request (pid, start time, user as the
        // file backend's records have them).
        let record = Record::for_this_process(step);
        // etcd keys are not the kernel's to check: the name as the
        // environment gives it, else the uid's.
        let user = std::env::var("USER")
            .ok()
            .unwrap_or_else(|| proc::process::user_name(nix::unistd::getuid().as_raw()));
        Label {
            pid: record.pid,
            pid_start: record.pid_start,
            user,
            host: super::hostname(),
        }
    }

    fn entry(&self, settings: &Settings, request: &Request) -> Entry {
        Entry {
            step: settings.step.clone(),
            pid: self.pid,
            pid_start: Some(self.pid_start),
            child: None,
            watcher: None,
            user: self.user.clone(),
            host: self.host.clone(),
            since_ms: now_ms(),
            granted_ms: None,
            command: settings.command.clone(),
            exclusive: request.exclusive && request.slots == 0,
            // A member taken for its whole group says which group.
            via: match (&request.via, request.for_group) {
                (Some(member), _) => Some(member.as_str().to_owned()),
                (None, true) => request.name.group().map(|g| g.as_str().to_owned()),
                (None, false) => None,
            },
            slots: (request.slots > 0).then_some(request.slots),
            fence: None,
        }
    }
}

/// What every take of one run shares.
pub(super) struct Taking<'a> {
    pub settings: &'a Settings,
    pub cluster: &'a Cluster,
    pub lease: i64,
    pub label: Label,
    pub deadline: Option<Instant>,
    pub say: &'a dyn Fn(String),
}

impl Taking<'_> {
    /// Joins each line in turn, holding the earlier locks while waiting for
    /// the later ones (the requests come in the one global order).
    /// A whole group held exclusively then takes each member known (a line
    /// or a record, see "A whole group and its members" in the module
    /// above), one at a time in name order, as the file backend takes each
    /// member's lock file: a devlock holds a member only with its group
    /// shared, so what can still hold one is another client (`etcdctl lock
    /// /devlock/gpu:0`), which the group's take then waits for, or with
    /// `-n` names, and which waits behind the group's key once it is in.
    async fn in_order(&self, requests: &[Request], entries: &mut Vec<Taken>) -> Result<()> {
        for request in requests {
            let (_, taken) = self.first(std::slice::from_ref(request)).await?;
            entries.push(taken);
            let whole_group = request.exclusive
                && request.slots == 0
                && request.via.is_none()
                && request.name.group().is_none();
            if !whole_group {
                continue;
            }
            let group = &request.name;
            let members = self
                .cluster
                .ask("reading the group's members", |mut client| async move {
                    super::members_of(&mut client, group).await
                })
                .await?;
            for member in members {
                if requests.iter().any(|r| r.name == member) {
                    continue;
                }
                let member = Request {
                    name: member,
                    exclusive: true,
                    via: None,
                    slots: 0,
                    for_group: true,
                };
                let (_, taken) = self.first(std::slice::from_ref(&member)).await?;
                entries.push(taken);
            }
        }
        Ok(())
    }

    /// Takes `pending` in order, then `count` of `candidates` (`--any`),
    /// whose picks join `resources`; the groups taken for candidates that
    /// were not picked go back.
    pub(super) async fn all(
        &self,
        pending: &[Request],
        candidates: &[Request],
        count: usize,
        resources: &mut Vec<crate::resource::Resource>,
        entries: &mut Vec<Taken>,
    ) -> Result<()> {
        self.in_order(pending, entries).await?;
        if count == 0 {
            return Ok(());
        }
        let fixed = entries.len();
        self.any(candidates, count, entries).await?;
        // The groups taken for candidates that were not picked go back.
        let picks: Vec<crate::resource::Resource> =
            entries[fixed..].iter().map(|t| t.request.clone()).collect();
        let needed: HashSet<crate::resource::Resource> = picks
            .iter()
            .chain(resources.iter())
            .flat_map(|p| p.held_shared())
            .collect();
        let unneeded: Vec<String> = entries[..fixed]
            .iter()
            .filter(|t| !needed.contains(&t.request))
            .map(|t| t.key.clone())
            .collect();
        if !unneeded.is_empty() {
            self.cluster
                .ask("giving back groups no pick needs", |mut client| {
                    let txn = etcd_client::Txn::new().and_then(
                        unneeded
                            .iter()
                            .map(|k| etcd_client::TxnOp::delete(k.as_str(), None))
                            .collect::<Vec<_>>(),
                    );
                    async move { client.txn(txn).await }
                })
                .await?;
            entries.retain(|t| !unneeded.contains(&t.key));
        }
        // A group kept is held on behalf of a pick (its label says which
        // once the command runs).
        let groups = entries.len() - picks.len();
        for group in entries.iter_mut().take(groups) {
            if let Some(pick) = picks
                .iter()
                .find(|p| p.held_shared().contains(&group.request))
            {
                group.entry.via = Some(pick.as_str().to_owned());
            }
        }
        resources.extend(picks);
        Ok(())
    }

    /// `--any`: `count` of `candidates` (sorted), the first that are or
    /// become free, picked as the file backend picks them: each from the
    /// candidates after the last pick that leave enough for the rest, so
    /// holding one while waiting for another never goes against the global
    /// lock order.
    async fn any(
        &self,
        candidates: &[Request],
        count: usize,
        entries: &mut Vec<Taken>,
    ) -> Result<()> {
        let mut start = 0;
        for pick in 0..count {
            let window = &candidates[start..candidates.len() - (count - 1 - pick)];
            let (index, taken) = self.first(window).await?;
            entries.push(taken);
            start += index + 1;
        }
        Ok(())
    }

    /// Joins the lines of `requests` at once (one transaction, one
    /// revision) and waits until one of them holds; leaves the others'
    /// lines. The index of the one taken, and the lock.
    async fn first(&self, requests: &[Request]) -> Result<(usize, Taken)> {
        let Taking {
            settings,
            cluster,
            lease,
            label,
            deadline,
            say,
        } = self;
        let (lease, deadline) = (*lease, *deadline);
        let mut entries: Vec<Entry> = requests.iter().map(|r| label.entry(settings, r)).collect();
        let keys: Vec<String> = requests.iter().map(|r| key_of(&r.name, lease)).collect();
        let values: Vec<Vec<u8>> = entries
            .iter()
            .map(|e| serde_json::to_vec(e).expect("entries serialise"))
            .collect();
        let (lines, joined_at) = cluster
            .ask("joining the line", |mut client| {
                let joins: Vec<(&crate::resource::Resource, &str, Vec<u8>)> = requests
                    .iter()
                    .zip(&keys)
                    .zip(&values)
                    .map(|((r, k), v)| (&r.name, k.as_str(), v.clone()))
                    .collect();
                async move { join_lines(&mut client, &joins, lease).await }
            })
            .await?;
        let mut waits: Vec<Waiting> = requests
            .iter()
            .zip(keys)
            .zip(lines)
            .map(|((request, key), line)| Waiting { request, key, line })
            .collect();
        same_size(&waits)?;
        let started = Instant::now();
        let name = if requests.len() == 1 {
            requests[0].name.as_str().to_owned()
        } else {
            let names: Vec<&str> = requests.iter().map(|r| r.name.as_str()).collect();
            format!("any of {}", names.join(" "))
        };
        let (index, waited, granted_at) = wait_turn(
            settings, cluster, &name, &mut waits, joined_at, deadline, say,
        )
        .await?;
        leave_others(cluster, &waits, index).await?;
        let request = &requests[index];
        let key = waits.swap_remove(index).key;
        let slot = if request.slots > 0 {
            Some(claim_slot(settings, cluster, lease, request, &key, deadline).await?)
        } else {
            None
        };
        let mut entry = entries.swap_remove(index);
        entry.granted_ms = Some(now_ms());
        entry.fence = Some(granted_at);
        if waited && !settings.quiet {
            say(messages::got(
                request.name.as_str(),
                started.elapsed(),
                &settings.step,
            ));
        }
        Ok((
            index,
            Taken {
                request: request.name.clone(),
                key,
                entry,
                fence: granted_at,
                joined_at,
                slot,
            },
        ))
    }
}

/// A usage error if a line of `waits` has a key of another size: everyone
/// uses a resource with one size (0: a plain lock); a member taken for its
/// whole group waits for any size, and is no size itself.
fn same_size(waits: &[Waiting<'_>]) -> Result<()> {
    for wait in waits {
        let ours = wait.request.slots;
        let group = wait.request.name.group();
        let for_group =
            |e: &Entry| e.via.is_some() && e.via.as_deref() == group.as_ref().map(|g| g.as_str());
        if let Some(theirs) = wait
            .line
            .iter()
            .filter(|_| !wait.request.for_group)
            .filter(|p| p.key != wait.key && p.entry.as_ref().is_some_and(|e| !for_group(e)))
            .map(Place::slots)
            .find(|&theirs| theirs != ours)
        {
            return Err(crate::flock::queue::slots_mismatch(
                wait.request.name.as_str(),
                theirs,
                ours,
            ));
        }
    }
    Ok(())
}

/// Leaves the lines of `waits` but the one at `index`, letting whoever is
/// behind move up.
async fn leave_others(cluster: &Cluster, waits: &[Waiting<'_>], index: usize) -> Result<()> {
    let others: Vec<String> = waits
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != index)
        .map(|(_, w)| w.key.clone())
        .collect();
    if !others.is_empty() {
        cluster
            .ask("leaving the other lines", |mut client| {
                let txn = etcd_client::Txn::new().and_then(
                    others
                        .iter()
                        .map(|k| etcd_client::TxnOp::delete(k.as_str(), None))
                        .collect::<Vec<_>>(),
                );
                async move { client.txn(txn).await }
            })
            .await?;
    }
    Ok(())
}
