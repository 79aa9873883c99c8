//! The etcd backend (`--etcd`, cargo feature `etcd`): locks on resources
//! shared between machines, as keys under `/devlock/` tied to a lease.
//!
//! # Keys
//!
//! | key | what it is | put by |
//! |---|---|---|
//! | `/devlock/R/LEASE` | one request for `R`: its place in `R`'s line | the requester, with its lease |
//! | `/devlock/.slots/R/K` | slot K (1..=N) of `--slots N` taken; the value is the holder's line key | that slot's holder, with its lease |
//! | `/devlock/.members/G:M` | member `G:M` is known: a whole-group take of `G` joins its line | a devlock joining `G:M`'s line, once, without a lease; or by hand |
//!
//! `LEASE` is the lease's id in 16 hex digits; every key a devlock puts in a
//! line or a slot is on its one lease, so when devlock dies (or is cut off)
//! its lease runs out and etcd deletes every key it had at once. A resource
//! name never starts with `.`, so `/devlock/.slots/` and `/devlock/.members/`
//! are no resource's line.
//!
//! # The line
//!
//! One request is one key, `/devlock/R/LEASE`, put with this devlock's
//! lease; its create revision is its place in line (keys put in one
//! transaction share a revision, and so keep one order against everyone
//! else in every line they join). A request holds once nothing earlier in
//! its line stands in its way:
//!
//! - an exclusive request: any earlier key;
//! - a shared one (`--shared`, a group taken on a member's behalf): an
//!   earlier exclusive key (writer preference, as in the file backend);
//! - a slot request (`--slots N`, its value says `"slots":N`): an earlier
//!   exclusive key, or N earlier slot keys (then the first N of the line
//!   hold, and the next one in line takes the first slot that frees).
//!
//! A key whose value is not a devlock entry counts as exclusive. Everyone
//! must use a resource with the same N (0 for a plain lock): a request that
//! finds a key of another size in the line when it joins leaves it again
//! and is a usage error, as with lock files.
//!
//! Waiting is one watch over the line from the revision it was read at, and
//! the line kept up to date from its delete events: no polling, and nothing
//! between the read and the watch is missed.
//!
//! # A whole group and its members
//!
//! A whole group `G` taken exclusively holds, after `G`, every member it
//! knows, one line at a time in name order, as the file backend takes each
//! member's lock file: a devlock can hold `G:M` only with `G` shared, so
//! what can still hold a member is another client (`etcdctl lock
//! /devlock/G:M`), which the group's take waits for, and which waits for
//! the group's holder once its key is in the member's line. A member is
//! known when its line has keys (whoever put them) or `/devlock/.members/`
//! names it: a line is gone once empty, so, as a lock file outlives its
//! holder, a devlock joining a member's line records the member there for
//! good (in the join's transaction, only if not there yet), and a
//! member devlock has never seen can be named by hand (`etcdctl put
//! /devlock/.members/gpu:7 ''`). Deadlock-free: devlock's group takers
//! queue on `G` first, its member takers hold `G` shared, and one line at a
//! time in name order never holds a later member while waiting for an
//! earlier one, whatever an `etcdctl lock` that takes in name order does.
//!
//! # `--slots N`: the slot number
//!
//! A slot request that holds takes the lowest free `/devlock/.slots/R/K`
//! with a transaction that puts it only if it does not exist (create
//! revision 0), and tells the command K in `DEVLOCK_SLOT`. The line alone
//! decides who holds; the slot keys only number the holders, so at most N
//! exist. One left by a holder whose line key was removed by hand lives until
//! that holder's lease is revoked a moment later, and the next holder waits
//! for it.
//!
//! # `--any`
//!
//! The candidates' groups are taken first, shared, in the global order,
//! then each pick as the file backend makes it: from a window of candidates
//! (those after the last pick that leave enough for the rest), a key in
//! every window candidate's line, all put in one transaction, then one watch
//! stream over those lines; the first candidate that holds is the pick (the
//! first in name order if several do), and the keys in the others' lines are
//! deleted in one transaction, letting whoever is behind move up. Groups no
//! pick needs are given back before the command starts.
//!
//! # Fencing
//!
//! The holder's fencing token (`DEVLOCK_FENCE`) is the store's revision at
//! its grant, as `etcdctl lock`'s `ETCD_LOCK_REV` is: the revision of the
//! join when nothing stood in the way, else of the delete that freed the
//! way (or of the read that found it free). etcd's revisions only grow, and
//! a holder is granted only after the key of each holder before it was
//! deleted, at a revision later than that holder's grant; so every new
//! holder of a resource has a larger token than all before it, whichever
//! tool (devlock or `etcdctl lock`) made the grants. (A create revision
//! would not do: a waiter that joined early and was granted late would
//! carry a smaller token than an `etcdctl lock` holder before it.) The
//! command also gets `ETCD_LOCK_KEY` and `ETCD_LOCK_REV` as `etcdctl lock`
//! sets them. Every request goes to one endpoint at a
//! time and moves to the next when that one fails (`cluster`); `https://`
//! endpoints are checked as `tls` says.
//!
//! # What only this machine knows
//!
//! A name is one lock for every machine: `gpu:1` taken on host A excludes
//! `gpu:1` on host B. What the command is told about the device
//! (`CUDA_VISIBLE_DEVICES`, `CUDA_DEVICE_ORDER`, a MIG instance's `MIG-`
//! UUID from this machine's NVML) and the caller's own
//! `CUDA_VISIBLE_DEVICES` are this machine's, as with lock files. A memory
//! budget (`--mem`) and `--require-idle` measure the device on the machine
//! that has it, which no key in etcd can do for another machine: refused.

mod cluster;
mod config;
mod failure;
mod job;
mod keeper;
mod line;
mod nested;
mod probe;
pub(crate) mod run;
mod session;
mod slot;
pub(crate) mod status;
mod taking;
mod tls;
mod turn;
mod wanted;

use crate::error::EtcdKind;
pub(crate) use cluster::Cluster;
pub(crate) use config::Config;
use failure::innermost;
pub(crate) use line::{
    Entry, Place, blockers, holders, join_lines, key_of, line_of, lines_of, members_of,
    resource_prefix, slot_key, slot_prefix,
};
pub(crate) use tls::TlsFiles;

/// What every devlock key starts with unless `--etcd-prefix` says otherwise.
pub(crate) const DEFAULT_PREFIX: &str = "/devlock/";

/// The longest `--etcd-prefix`: a key is no place for a document.
const MAX_PREFIX: usize = 512;

/// `--etcd-prefix`, set once by [`Config::new`]: one run talks to one etcd
/// under one prefix.
static PREFIX: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// What every devlock key starts with: resource `R`'s line is
/// `PREFIX R /`, as `etcdctl lock PREFIX R` makes it.
pub(crate) fn prefix() -> &'static str {
    PREFIX.get().map_or(DEFAULT_PREFIX, String::as_str)
}

/// Where `--slots` holders number themselves (no resource starts with `.`).
pub(crate) fn slots_prefix() -> String {
    format!("{}.slots/", prefix())
}

/// Where the members known are recorded (see the module doc).
pub(crate) fn members_prefix() -> String {
    format!("{}.members/", prefix())
}

/// Whether an error is etcd's failure of `kind` (some are worth another
/// endpoint or another try, some are the cluster's answer).
pub(crate) fn is(err: &anyhow::Error, kind: EtcdKind) -> bool {
    matches!(crate::error::root(err), Some(crate::Error::Etcd { kind: k, .. }) if *k == kind)
}

/// Blocks SIGPIPE in this thread and the threads it starts: a peer that
/// closes a socket under a write must give EPIPE, not kill devlock (which
/// has no std runtime to ignore it). Blocked, not ignored, so the command
/// does not inherit an ignored SIGPIPE.
pub(crate) fn block_sigpipe() {
    crate::sys::signal::block(&crate::sys::signal::SigSet::of(&[libc::SIGPIPE]));
}

/// This machine's name, as other machines will see it in status.
pub(crate) fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".to_owned())
}
