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
mod job;
mod keeper;
mod probe;
pub(crate) mod run;
mod session;
pub(crate) mod status;
mod tls;

use std::time::Duration;

use anyhow::Result;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, GetResponse, KeyValue, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use serde::{Deserialize, Serialize};

use crate::error::EtcdKind;
use crate::messages::etcd as messages;
use crate::resource::Resource;
pub(crate) use cluster::Cluster;
use tls::Tls;
pub(crate) use tls::TlsFiles;

/// `NAME:PASSWORD` split at the first colon.
fn split_user(text: &str) -> Option<(&str, &str)> {
    text.split_once(':').filter(|(name, _)| !name.is_empty())
}

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

/// Where etcd is and who to be there.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub endpoints: Vec<String>,
    user: Option<(String, String)>,
    tls: Option<Tls>,
}

impl Config {
    /// Checks the URLs (http://HOST:PORT, https://HOST:PORT or HOST:PORT,
    /// which is https:// when TLS files are given), the user and the TLS
    /// files.
    pub(crate) fn new(
        endpoints: &[String],
        user: Option<&str>,
        tls: &TlsFiles,
        prefix: &str,
    ) -> Result<Config> {
        if prefix.len() > MAX_PREFIX || prefix.contains('\0') {
            return Err(crate::error::usage(format!(
                "--etcd-prefix must be at most {MAX_PREFIX} bytes, without NUL"
            )));
        }
        let _ = PREFIX.set(prefix.to_owned());
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim())
            .filter(|e| !e.is_empty())
            .map(|e| check_url(e, tls.any()))
            .collect::<Result<_>>()?;
        let Some(first) = endpoints.first() else {
            return Err(crate::error::usage("--etcd needs at least one URL"));
        };
        let https = first.starts_with("https://");
        if endpoints.iter().any(|e| e.starts_with("https://") != https) {
            return Err(crate::error::usage(messages::mixed_schemes()));
        }
        if tls.any() && !https {
            return Err(crate::error::usage(messages::tls_needs_https(first)));
        }
        let user = match user {
            None => None,
            Some(text) => {
                let (name, password) = split_user(text)
                    .ok_or_else(|| crate::error::usage("--etcd-user must be NAME:PASSWORD"))?;
                Some((name.to_owned(), password.to_owned()))
            }
        };
        let tls = if https { Some(Tls::load(tls)?) } else { None };
        Ok(Config {
            endpoints,
            user,
            tls,
        })
    }

    /// The endpoints as one would type them back.
    pub(crate) fn shown(&self) -> String {
        self.endpoints.join(",")
    }

    /// The user name given, if any (never the password).
    pub(crate) fn user_name(&self) -> Option<&str> {
        self.user.as_ref().map(|(name, _)| name.as_str())
    }

    /// The TLS identity, for status.
    pub(crate) fn tls_view(&self) -> Option<tls::TlsView> {
        self.tls.as_ref().map(Tls::view)
    }

    /// A client for one endpoint. Without a user nothing is sent yet (the
    /// first request finds out whether etcd answers); with one, it logs in.
    pub(crate) async fn connect_one(&self, url: &str) -> Result<Client, etcd_client::Error> {
        let connect_timeout = if self.endpoints.len() > 1 {
            cluster::ATTEMPT_TIMEOUT
        } else {
            cluster::REQUEST_TIMEOUT
        };
        let mut options = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            .with_timeout(cluster::REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            // A member cut off from its cluster says so at once (and ends
            // the watches on it) rather than keep requests waiting for a
            // leader it cannot reach: devlock moves to the next endpoint.
            .with_require_leader(true);
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls.options());
        }
        if let Some((name, password)) = &self.user {
            // Tokens expire (etcd's --auth-token-ttl, 5 minutes by
            // default); a long hold must still renew and revoke its lease.
            options = options
                .with_user(name.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        Client::connect([url], Some(options)).await
    }

    /// Turns a client error from endpoint `at` into one line with the exit
    /// code it deserves.
    pub(crate) fn failure(&self, at: &str, doing: &str, err: etcd_client::Error) -> anyhow::Error {
        use etcd_client::Error as E;
        if let Some(tls_error) = tls::classify(causes(&err), at, self.tls.as_ref()) {
            return tls_error;
        }
        match &err {
            E::GRpcStatus(status) => {
                let message = status.message();
                // gRPC's PERMISSION_DENIED (7) and UNAUTHENTICATED (16).
                let denied = matches!(i32::from(status.code()), 7 | 16)
                    || [
                        "authentication failed",
                        "user name is empty",
                        "permission denied",
                        "invalid auth token",
                    ]
                    .iter()
                    .any(|m| message.contains(m));
                if denied {
                    let who = self.user.as_ref().map_or_else(
                        || {
                            "a request without a user (set DEVLOCK_ETCD_USER=NAME:PASSWORD)"
                                .to_owned()
                        },
                        |(name, _)| format!("user {name}"),
                    );
                    crate::error::etcd(
                        crate::error::EtcdKind::Denied,
                        format!("etcd at {at} refused {who} while {doing}: {message}"),
                    )
                } else {
                    // UNAVAILABLE, DEADLINE_EXCEEDED; CANCELLED, UNKNOWN,
                    // UNIMPLEMENTED, INTERNAL (a server that is not etcd).
                    let cause = transport_cause(&err).unwrap_or_else(|| message.to_owned());
                    let text = match i32::from(status.code()) {
                        14 | 4 => format!("cannot reach etcd at {at} while {doing}: {cause}"),
                        1 | 2 | 12 | 13 => format!(
                            "{at} gave no etcd answer while {doing}: {cause} (is it an etcd client URL?)"
                        ),
                        _ => format!("etcd at {at} failed while {doing}: {cause}"),
                    };
                    crate::error::etcd(crate::error::EtcdKind::Unreachable, text)
                }
            }
            E::InvalidUri(e) => crate::error::usage(format!("bad etcd URL {at}: {e}")),
            _ if innermost(&err).contains("no native certs found") => {
                crate::error::etcd(crate::error::EtcdKind::Tls, messages::no_system_roots())
            }
            _ => crate::error::etcd(
                crate::error::EtcdKind::Unreachable,
                format!(
                    "cannot reach etcd at {at} while {doing}: {}",
                    innermost(&err)
                ),
            ),
        }
    }

    /// [`Config::failure`], with a second look at an endpoint whose
    /// connection ended without a word: a probe may say why (a client
    /// certificate refused, TLS on one side only).
    pub(crate) async fn diagnose(
        &self,
        at: &str,
        doing: &str,
        err: etcd_client::Error,
    ) -> anyhow::Error {
        let closed = abrupt_end(&err);
        let said = self.failure(at, doing, err);
        if closed
            && is(&said, EtcdKind::Unreachable)
            && let Some(why) = probe::why_closed(at, self.tls.as_ref()).await
        {
            return why;
        }
        said
    }

    /// The error for a request that got no answer in time.
    pub(crate) fn no_answer(&self, at: &str, doing: &str, waited: Duration) -> anyhow::Error {
        crate::error::etcd(
            crate::error::EtcdKind::Unreachable,
            format!(
                "etcd at {at} did not answer within {} while {doing}",
                crate::show::human_duration(waited)
            ),
        )
    }
}

/// What a transport failure says deepest down ("connection refused"), when
/// gRPC's status only says "transport error".
fn transport_cause(err: &etcd_client::Error) -> Option<String> {
    use std::error::Error;
    let status = match err {
        etcd_client::Error::GRpcStatus(status) => status,
        _ => return None,
    };
    status.source().map(innermost)
}

/// Whether a request failed because the connection ended (closed, reset, a
/// broken pipe, an HTTP/2 protocol error), rather than because it could not
/// be made or got no answer.
fn abrupt_end(err: &etcd_client::Error) -> bool {
    let mut next = Some(causes(err));
    while let Some(e) = next {
        let text = e.to_string().to_lowercase();
        if [
            "closed",
            "reset",
            "broken pipe",
            "eof",
            "protocol error",
            "frame",
        ]
        .iter()
        .any(|m| text.contains(m))
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// The chain of causes of a client error, the gRPC status's included (the
/// client error's own chain ends before it).
fn causes(err: &etcd_client::Error) -> &(dyn std::error::Error + 'static) {
    match err {
        etcd_client::Error::GRpcStatus(status) => status,
        other => other,
    }
}

/// The most specific cause, which is where transport errors say what
/// happened, without Rust's `(os error N)`.
fn innermost(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last: &dyn std::error::Error = err;
    while let Some(source) = last.source() {
        last = source;
    }
    let text = last.to_string();
    match text.rsplit_once(" (os error ") {
        Some((words, code)) if code.ends_with(')') => words.to_owned(),
        _ => text,
    }
}

fn check_url(url: &str, tls: bool) -> Result<String> {
    let bad = |why: &str| {
        crate::error::usage(format!(
            "bad etcd URL {url:?}: {why} (expected http://HOST:PORT or https://HOST:PORT)"
        ))
    };
    let (scheme, rest) = match url.split_once("://") {
        Some(("http", rest)) => ("http", rest),
        Some(("https", rest)) => ("https", rest),
        Some(_) => return Err(bad("only http:// and https:// are supported")),
        None if tls => ("https", url),
        None => ("http", url),
    };
    let rest = rest.trim_end_matches('/');
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    if host.is_empty() || host.contains('/') || host.contains('@') {
        return Err(bad("no host"));
    }
    port.parse::<u16>()
        .map_err(|_| bad("the port is not a number"))?;
    Ok(format!("{scheme}://{rest}"))
}

/// What a key's value says about the request: a label, as in the file
/// backend; whether the request holds comes from the keys' order in etcd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub step: String,
    /// The devlock process, on `host`.
    pub pid: u32,
    /// Its start time in clock ticks since boot, so a reused pid is not it.
    pub pid_start: Option<u64>,
    /// The command, once it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child: Option<u32>,
    /// The watcher that keeps the lease while the job runs, with its start
    /// time: the job may outlive the command (what it started keeps the
    /// lock), and is alive while its watcher is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watcher: Option<(u32, u64)>,
    pub user: String,
    pub host: String,
    /// When the request joined the line (ms since the Unix epoch, on `host`'s clock).
    pub since_ms: u64,
    /// When it got the lock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted_ms: Option<u64>,
    pub command: Vec<String>,
    pub exclusive: bool,
    /// For a group taken on behalf of a member: that member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// `--slots N`: N (then `exclusive` is false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<u64>,
    /// Once granted: the store's revision at the grant (`DEVLOCK_FENCE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<i64>,
}

/// One key under a resource's prefix, in line order.
#[derive(Debug, Clone)]
pub(crate) struct Place {
    pub key: String,
    pub create_revision: i64,
    pub lease: i64,
    /// None when the value is not a devlock entry (somebody else's key):
    /// it still counts, as exclusive.
    pub entry: Option<Entry>,
}

impl Place {
    fn from_kv(kv: &KeyValue) -> Place {
        Place {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
            entry: serde_json::from_slice(kv.value()).ok(),
        }
    }

    pub(crate) fn exclusive(&self) -> bool {
        self.entry.as_ref().is_none_or(|e| e.exclusive)
    }

    /// N of a `--slots N` request, 0 for a plain one.
    pub(crate) fn slots(&self) -> u64 {
        self.entry.as_ref().and_then(|e| e.slots).unwrap_or(0)
    }
}

pub(crate) fn resource_prefix(resource: &Resource) -> String {
    format!("{}{}/", prefix(), resource.as_str())
}

pub(crate) fn key_of(resource: &Resource, lease: i64) -> String {
    format!("{}{lease:016x}", resource_prefix(resource))
}

/// `/devlock/.slots/R/`: the slot numbers taken of `R`.
pub(crate) fn slot_prefix(resource: &Resource) -> String {
    format!("{}{}/", slots_prefix(), resource.as_str())
}

pub(crate) fn slot_key(resource: &Resource, slot: u64) -> String {
    format!("{}{slot}", slot_prefix(resource))
}

/// Every key of one resource, oldest first, and the revision read at.
pub(crate) async fn line_of(
    client: &mut Client,
    resource: &Resource,
) -> Result<(Vec<Place>, i64), etcd_client::Error> {
    let response = client
        .get(resource_prefix(resource), Some(line_options()))
        .await?;
    Ok(line_from(&response))
}

/// At most this many keys are read from each of the lines and the record
/// when looking for a group's members: the keys are anyone's to write, and
/// a look must stay one bounded request.
const MEMBER_KEYS_READ: i64 = 4096;

/// The members of `group` (`gpu:0`, `gpu:1:...`) known now, sorted: those
/// with a line (keys under `/devlock/GROUP:`, whoever put them: `etcdctl
/// lock /devlock/gpu:0` included) and those recorded under
/// `/devlock/.members/GROUP:`. Keys that name no member are skipped.
pub(crate) async fn members_of(
    client: &mut Client,
    group: &Resource,
) -> Result<Vec<Resource>, etcd_client::Error> {
    let bases = [prefix().to_owned(), members_prefix()];
    let options = GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_limit(MEMBER_KEYS_READ);
    let reads: Vec<TxnOp> = bases
        .iter()
        .map(|base| TxnOp::get(format!("{base}{}:", group.as_str()), Some(options.clone())))
        .collect();
    let response = client.txn(Txn::new().and_then(reads)).await?;
    let mut members: Vec<Resource> = response
        .op_responses()
        .iter()
        .zip(&bases)
        .filter_map(|(read, base)| match read {
            TxnOpResponse::Get(get) => Some((get, base)),
            _ => None,
        })
        .flat_map(|(get, base)| {
            get.kvs().iter().filter_map(move |kv| {
                // `BASE G:M/LEASE` in a line, `BASE G:M` in the record.
                let name = kv.key().strip_prefix(base.as_bytes())?;
                let name = name.split(|&b| b == b'/').next()?;
                let name = std::str::from_utf8(name).ok()?;
                Resource::parse(std::ffi::OsStr::new(name)).ok()
            })
        })
        .filter(|member| member.group().as_ref() == Some(group))
        .collect();
    members.sort();
    members.dedup();
    Ok(members)
}

/// Several resources' lines read at one revision, in the order asked.
pub(crate) async fn lines_of(
    client: &mut Client,
    resources: &[&Resource],
) -> Result<(Vec<Vec<Place>>, i64), etcd_client::Error> {
    let txn = Txn::new().and_then(
        resources
            .iter()
            .map(|r| TxnOp::get(resource_prefix(r), Some(line_options())))
            .collect::<Vec<_>>(),
    );
    lines_from_txn(client.txn(txn).await?)
}

/// Puts each key (joining each line, in one revision), records each member
/// joined as known (see the module doc) and reads every line back, in one
/// round trip. Repeating it changes nothing: a key put again with the same
/// lease keeps its create revision, and a member is recorded once.
pub(crate) async fn join_lines(
    client: &mut Client,
    joins: &[(&Resource, &str, Vec<u8>)],
    lease: i64,
) -> Result<(Vec<Vec<Place>>, i64), etcd_client::Error> {
    let mut ops: Vec<TxnOp> = joins
        .iter()
        .map(|(_, key, value)| {
            TxnOp::put(
                *key,
                value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
        })
        .collect();
    ops.extend(
        joins
            .iter()
            .filter(|(r, _, _)| r.group().is_some())
            .map(|(r, _, _)| record_member(r)),
    );
    ops.extend(
        joins
            .iter()
            .map(|(r, _, _)| TxnOp::get(resource_prefix(r), Some(line_options()))),
    );
    lines_from_txn(client.txn(Txn::new().and_then(ops)).await?)
}

/// Records `member` as known, without a lease, unless it already is.
fn record_member(member: &Resource) -> TxnOp {
    let key = format!("{}{}", members_prefix(), member.as_str());
    TxnOp::txn(
        Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key.as_str(), "", None)]),
    )
}

fn lines_from_txn(
    response: etcd_client::TxnResponse,
) -> Result<(Vec<Vec<Place>>, i64), etcd_client::Error> {
    let revision = response.header().map_or(0, |h| h.revision());
    let lines: Vec<Vec<Place>> = response
        .op_responses()
        .into_iter()
        .filter_map(|r| match r {
            TxnOpResponse::Get(get) => Some(line_from(&get).0),
            _ => None,
        })
        .collect();
    Ok((lines, revision))
}

fn line_options() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

fn line_from(response: &GetResponse) -> (Vec<Place>, i64) {
    let revision = response.header().map_or(0, |h| h.revision());
    (
        response.kvs().iter().map(Place::from_kv).collect(),
        revision,
    )
}

/// The places that stand in the way of `index` in `line`: every earlier one
/// for an exclusive request, the earlier exclusive ones for a shared one,
/// and for a slot request of N the earlier exclusive ones and, once N or
/// more slot requests are earlier, those too.
pub(crate) fn blockers(line: &[Place], index: usize) -> Vec<&Place> {
    let exclusive = line[index].exclusive();
    let slots = line[index].slots();
    let earlier = &line[..index];
    let full = slots > 0 && earlier.iter().filter(|p| p.slots() > 0).count() as u64 >= slots;
    earlier
        .iter()
        .filter(|p| exclusive || p.exclusive() || (full && p.slots() > 0))
        .collect()
}

/// The places that hold the lock now: nothing stands in their way.
pub(crate) fn holders(line: &[Place]) -> Vec<&Place> {
    (0..line.len())
        .filter(|&i| blockers(line, i).is_empty())
        .map(|i| &line[i])
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn place(n: i64, exclusive: bool) -> Place {
        Place {
            key: format!("k{n}"),
            create_revision: n,
            lease: n,
            entry: Some(Entry {
                step: String::new(),
                pid: 1,
                pid_start: None,
                child: None,
                watcher: None,
                user: String::new(),
                host: String::new(),
                since_ms: 0,
                granted_ms: None,
                command: vec![],
                exclusive,
                via: None,
                slots: None,
                fence: None,
            }),
        }
    }

    fn slot(n: i64, of: u64) -> Place {
        let mut p = place(n, false);
        p.entry.as_mut().unwrap().slots = Some(of);
        p
    }

    #[test]
    fn the_first_n_slot_requests_hold_and_a_writer_waits_for_them() {
        let line = [slot(1, 2), slot(2, 2), slot(3, 2), slot(4, 2)];
        let held: Vec<i64> = holders(&line).iter().map(|p| p.create_revision).collect();
        assert_eq!(held, [1, 2]);
        assert_eq!(blockers(&line, 3).len(), 3);
        let line = [slot(1, 2), place(2, true), slot(3, 2)];
        let held: Vec<i64> = holders(&line).iter().map(|p| p.create_revision).collect();
        assert_eq!(held, [1]);
        // Once the first goes, the next slot request in line moves up.
        let line = [slot(2, 2), slot(3, 2), slot(4, 2)];
        assert_eq!(holders(&line).len(), 2);
    }

    #[test]
    fn readers_share_until_a_writer_waits() {
        let line = [
            place(1, false),
            place(2, false),
            place(3, true),
            place(4, false),
        ];
        let held: Vec<i64> = holders(&line).iter().map(|p| p.create_revision).collect();
        assert_eq!(held, [1, 2]);
        assert_eq!(blockers(&line, 3).len(), 1);
        assert_eq!(blockers(&line, 2).len(), 2);
    }

    #[test]
    fn a_foreign_key_counts_as_exclusive() {
        let mut foreign = place(1, false);
        foreign.entry = None;
        let line = [foreign, place(2, false)];
        assert_eq!(holders(&line).len(), 1);
    }

    #[test]
    fn urls_are_checked() {
        assert_eq!(
            check_url("127.0.0.1:2379", false).unwrap(),
            "http://127.0.0.1:2379"
        );
        assert_eq!(
            check_url("127.0.0.1:2379", true).unwrap(),
            "https://127.0.0.1:2379"
        );
        assert_eq!(check_url("http://h:1/", true).unwrap(), "http://h:1");
        assert_eq!(check_url("https://h:1", false).unwrap(), "https://h:1");
        for bad in [
            "ftp://h:1",
            "http://h",
            "http://:1",
            "h:port",
            "http://u@h:1",
            "unix://h:1",
        ] {
            assert!(check_url(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_cluster_speaks_one_scheme() {
        let urls = |u: &[&str]| u.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let none = TlsFiles::default();
        let default = DEFAULT_PREFIX;
        assert!(Config::new(&urls(&["http://a:1", "https://b:1"]), None, &none, default).is_err());
        let ca = TlsFiles {
            ca: Some("/nonexistent".into()),
            ..TlsFiles::default()
        };
        let err = Config::new(&urls(&["http://a:1"]), None, &ca, default).unwrap_err();
        assert!(matches!(
            crate::error::root(&err),
            Some(crate::Error::Usage(_))
        ));
        let err = Config::new(&urls(&["https://a:1"]), None, &ca, default).unwrap_err();
        assert!(is(&err, EtcdKind::Tls));
        assert!(format!("{err:#}").contains("/nonexistent"), "{err:#}");
    }

    #[test]
    fn keys_sort_by_resource_then_lease() {
        let r = Resource::parse("gpu:0".as_ref()).unwrap();
        assert_eq!(key_of(&r, 0x2a), "/devlock/gpu:0/000000000000002a");
    }
}
