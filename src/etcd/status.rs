//! `devlock status --etcd URL`: who holds and who waits, across machines.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::Result;
use etcd_client::{GetOptions, SortOrder, SortTarget};
use serde::Serialize;

use super::tls::TlsView;
use super::{Cluster, Config, Place, blockers, hostname, line_of, prefix, slots_prefix};
use crate::cli::StatusArgs;
use crate::exit::ExitCode;
use crate::flock::record::now_ms;
use crate::messages::etcd as messages;
use crate::proc;
use crate::resource::Resource;
use crate::show::sanitize;
use crate::status::print::print_report;
use crate::status::table::{Render, Row, align, duration_cell, paint_lock_cell};

#[derive(Debug, Serialize)]
struct Report {
    etcd: Vec<String>,
    /// The endpoint that answered.
    endpoint: String,
    /// Who devlock is to etcd: the TLS files and client certificate (null
    /// over plain http://), and the user given (never the password).
    tls: Option<TlsView>,
    user: Option<String>,
    prefix: &'static str,
    resources: Vec<ResourceView>,
}

#[derive(Debug, Serialize)]
struct ResourceView {
    name: String,
    /// free, held, shared or slots
    state: &'static str,
    /// `--slots N`: N, when its holders or waiters use slots.
    #[serde(skip_serializing_if = "Option::is_none")]
    slots: Option<u64>,
    holders: Vec<PlaceView>,
    waiters: Vec<PlaceView>,
}

#[derive(Debug, Serialize)]
struct PlaceView {
    step: Option<String>,
    pid: Option<u32>,
    child: Option<u32>,
    user: Option<String>,
    host: Option<String>,
    since: Option<String>,
    /// Held for (holders) or waiting for (waiters), by the writer's clock.
    #[serde(skip_serializing_if = "Option::is_none")]
    held_for_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    waiting_for_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    position: Option<usize>,
    command: Option<Vec<String>>,
    exclusive: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    via: Option<String>,
    /// `--slots`: the slot this holder took (`DEVLOCK_SLOT`).
    #[serde(skip_serializing_if = "Option::is_none")]
    slot: Option<u64>,
    /// For a key devlock did not write: who puts such keys.
    #[serde(skip_serializing_if = "Option::is_none")]
    client: Option<&'static str>,
    key: String,
    /// The key's create revision: its place in line.
    revision: i64,
    /// For a holder: its fencing token (`DEVLOCK_FENCE`), the revision it
    /// was granted at; for a key devlock did not write (or one not yet
    /// labelled), its create revision, which that grant is no earlier than.
    #[serde(skip_serializing_if = "Option::is_none")]
    fence: Option<i64>,
    lease: String,
    /// Seconds etcd gives the lease before it expires, unless renewed.
    lease_ttl_s: Option<i64>,
    /// On this machine: whether the devlock that wrote the key still runs
    /// (false means the key lives only until its lease runs out). Null for
    /// other machines.
    alive: Option<bool>,
}

pub(crate) fn run(args: &StatusArgs, config: Config) -> Result<ExitCode> {
    let wanted = Resource::parse_all(&args.resources)?;
    super::block_sigpipe();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(gather(&config, &wanted))?;
    print_report(&report, args.json, table)
}

async fn gather(config: &Config, wanted: &[Resource]) -> Result<Report> {
    let cluster = Cluster::new(config.clone());
    let mut lines: BTreeMap<String, Vec<Place>> = BTreeMap::new();
    if wanted.is_empty() {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response = cluster
            .ask("listing locks", |mut client| {
                let options = options.clone();
                async move { client.get(prefix(), Some(options)).await }
            })
            .await?;
        for kv in response.kvs() {
            let place = Place::from_kv(kv);
            // Slot numbers (`/devlock/.slots/`), read below: no resource.
            if place.key.starts_with(&slots_prefix()) {
                continue;
            }
            // Under a prefix shared with other keys (an empty one: all of
            // etcd), only the lines of names devlock can take (not the
            // members known, `/devlock/.members/G:M`).
            let Some(name) = place
                .key
                .strip_prefix(prefix())
                .and_then(|k| k.rsplit_once('/'))
                .filter(|(name, _)| Resource::parse(std::ffi::OsStr::new(name)).is_ok())
            else {
                continue;
            };
            lines.entry(name.0.to_owned()).or_default().push(place);
        }
    } else {
        for resource in wanted {
            let (line, _) = cluster
                .ask("reading a line", |mut client| async move {
                    line_of(&mut client, resource).await
                })
                .await?;
            lines.insert(resource.as_str().to_owned(), line);
        }
    }
    let ttls = lease_ttls(&cluster, &lines).await?;
    let slots = slot_numbers(&cluster, &lines).await?;
    let here = hostname();
    let now = now_ms();
    let resources = lines
        .into_iter()
        .map(|(name, line)| {
            let mut holders = Vec::new();
            let mut waiters = Vec::new();
            for (i, place) in line.iter().enumerate() {
                let ttl = ttls.get(&place.lease).copied();
                if blockers(&line, i).is_empty() {
                    let mut held = view(place, &here, now, ttl, None);
                    held.slot = slots.get(&(name.clone(), place.lease)).copied();
                    holders.push(held);
                } else {
                    let position = waiters.len() + 1;
                    waiters.push(view(place, &here, now, ttl, Some(position)));
                }
            }
            let size = line.iter().map(Place::slots).find(|&n| n > 0);
            let state = match holders.first() {
                None => "free",
                Some(h) if h.exclusive => "held",
                Some(_) if size.is_some() => "slots",
                Some(_) => "shared",
            };
            ResourceView {
                name,
                state,
                slots: size,
                holders,
                waiters,
            }
        })
        .collect();
    Ok(Report {
        etcd: config.endpoints.clone(),
        endpoint: cluster.url(cluster.current()).to_owned(),
        tls: config.tls_view(),
        user: config.user_name().map(str::to_owned),
        prefix: prefix(),
        resources,
    })
}

/// Remaining TTL of every lease seen, asked once per lease.
async fn lease_ttls(
    cluster: &Cluster,
    lines: &BTreeMap<String, Vec<Place>>,
) -> Result<HashMap<i64, i64>> {
    let mut ttls = HashMap::new();
    for place in lines.values().flatten() {
        if place.lease == 0 || ttls.contains_key(&place.lease) {
            continue;
        }
        let lease = place.lease;
        let response = cluster
            .ask("asking for a lease", |mut client| async move {
                client.lease_time_to_live(lease, None).await
            })
            .await?;
        ttls.insert(place.lease, response.ttl());
    }
    Ok(ttls)
}

/// The slot each `--slots` holder took, by resource and lease.
async fn slot_numbers(
    cluster: &Cluster,
    lines: &BTreeMap<String, Vec<Place>>,
) -> Result<HashMap<(String, i64), u64>> {
    let mut numbers = HashMap::new();
    for (name, line) in lines {
        if !line.iter().any(|p| p.slots() > 0) {
            continue;
        }
        let prefix = format!("{}{name}/", slots_prefix());
        let response = cluster.get_prefix("reading the slots", &prefix).await?;
        for kv in response.kvs() {
            let number = String::from_utf8_lossy(kv.key())
                .strip_prefix(&prefix)
                .and_then(|n| n.parse::<u64>().ok());
            if let Some(number) = number {
                numbers.insert((name.clone(), kv.lease()), number);
            }
        }
    }
    Ok(numbers)
}

/// A key as status shows it: a holder, or the waiter at `position`.
fn view(
    place: &Place,
    here: &str,
    now: u64,
    lease_ttl: Option<i64>,
    position: Option<usize>,
) -> PlaceView {
    let entry = place.entry.as_ref();
    let alive = entry.filter(|e| e.host == here).map(|e| {
        proc::process::is_same_process(e.pid, e.pid_start)
            || e.watcher
                .is_some_and(|(pid, start)| proc::process::is_same_process(pid, Some(start)))
    });
    PlaceView {
        step: entry.map(|e| e.step.clone()),
        pid: entry.map(|e| e.pid),
        child: entry.and_then(|e| e.child),
        user: entry.map(|e| e.user.clone()),
        host: entry.map(|e| e.host.clone()),
        since: entry.map(|e| {
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + Duration::from_millis(e.granted_ms.unwrap_or(e.since_ms)),
            )
            .to_string()
        }),
        held_for_ms: entry
            .filter(|_| position.is_none())
            .map(|e| now.saturating_sub(e.granted_ms.unwrap_or(e.since_ms))),
        waiting_for_ms: entry
            .filter(|_| position.is_some())
            .map(|e| now.saturating_sub(e.since_ms)),
        position,
        command: entry.map(|e| e.command.clone()),
        exclusive: place.exclusive(),
        via: entry.and_then(|e| e.via.clone()),
        slot: None,
        client: entry.is_none().then_some(messages::FOREIGN_CLIENT),
        key: place.key.clone(),
        revision: place.create_revision,
        fence: position
            .is_none()
            .then(|| entry.and_then(|e| e.fence).unwrap_or(place.create_revision)),
        lease: format!("{:016x}", place.lease),
        lease_ttl_s: lease_ttl,
        alive,
    }
}

fn table(report: &Report, render: Render) -> String {
    let header = [
        "RESOURCE", "STATE", "STEP", "PID", "HOST", "USER", "FOR", "LEASE", "FENCE",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    // A key devlock did not write has no step, pid, host or user to show:
    // it is named for who puts such keys, its lease and fence still shown.
    let cell = |v: &Option<String>| v.as_deref().map_or("-".to_owned(), sanitize);
    let step_cell = |p: &PlaceView| {
        p.step
            .as_deref()
            .map_or(messages::FOREIGN_CLIENT.to_owned(), sanitize)
    };
    let pid_cell = |p: &PlaceView| p.pid.map_or("-".to_owned(), |pid| pid.to_string());
    let lease_cell = |p: &PlaceView| {
        let ttl = p.lease_ttl_s.map_or("-".to_owned(), |t| format!("{t}s"));
        match p.alive {
            Some(false) => format!("{ttl} (devlock gone)"),
            _ => ttl,
        }
    };
    for res in &report.resources {
        let state = match (res.state, res.holders.len(), res.slots) {
            ("shared", n, _) => format!("shared by {n}"),
            ("slots", n, Some(of)) => format!("{n} of {of} slots"),
            (state, _, _) => state.to_owned(),
        };
        if res.holders.is_empty() && res.waiters.is_empty() {
            rows.push(vec![res.name.clone(), state.clone()]);
        }
        for (i, h) in res.holders.iter().enumerate() {
            let mut step = step_cell(h);
            if let Some(via) = &h.via {
                step.push_str(&format!(" (via {})", sanitize(via)));
            }
            if let Some(slot) = h.slot {
                step.push_str(&format!(" (slot {slot})"));
            }
            rows.push(vec![
                if i == 0 {
                    res.name.clone()
                } else {
                    String::new()
                },
                if i == 0 { state.clone() } else { String::new() },
                step,
                pid_cell(h),
                cell(&h.host),
                cell(&h.user),
                duration_cell(h.held_for_ms),
                lease_cell(h),
                h.fence.map_or_else(String::new, |f| f.to_string()),
            ]);
        }
        for w in &res.waiters {
            rows.push(vec![
                if res.holders.is_empty() {
                    res.name.clone()
                } else {
                    String::new()
                },
                format!("waits #{}", w.position.unwrap_or(0)),
                step_cell(w),
                pid_cell(w),
                cell(&w.host),
                cell(&w.user),
                duration_cell(w.waiting_for_ms),
                lease_cell(w),
            ]);
        }
    }
    let rows: Vec<Row> = rows.into_iter().map(Row::Cells).collect();
    let mut out = align(&rows, render, &[2, 3], paint_lock_cell);
    if report.resources.is_empty() {
        out.push_str(&format!(
            "(no locks in etcd at {} under {})\n",
            report.etcd.join(","),
            match report.prefix {
                "" => "the bare names (an empty --etcd-prefix)",
                prefix => prefix,
            }
        ));
    }
    let identity = match (&report.tls, &report.user) {
        (Some(tls), user) => Some(tls.line(user.as_deref())),
        (None, Some(user)) => Some(messages::plain_identity(user)),
        (None, None) => None,
    };
    if let Some(line) = identity {
        out.push_str(&line);
        out.push('\n');
    }
    out
}
