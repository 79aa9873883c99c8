//! A resource's line in etcd: its keys, what their values say, reading and
//! joining lines in one round trip, and who holds (see the module doc).

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, GetResponse, KeyValue, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse,
};
use serde::{Deserialize, Serialize};

use super::{members_prefix, prefix, slots_prefix};
use crate::resource::Resource;

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
    pub(super) fn from_kv(kv: &KeyValue) -> Place {
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
    fn keys_sort_by_resource_then_lease() {
        let r = Resource::parse("gpu:0".as_ref()).unwrap();
        assert_eq!(key_of(&r, 0x2a), "/devlock/gpu:0/000000000000002a");
    }
}
