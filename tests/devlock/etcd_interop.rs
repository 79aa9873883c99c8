//! devlock and `etcdctl lock` (etcd's `concurrency.Mutex`) against one real
//! etcd server: one gate, whichever tool holds and whichever waits, for a
//! plain lock, groups and their members; `-n`, `-w` and status naming an
//! etcdctl holder for what etcd knows of it; fences; the prefix. The
//! helpers in gate.rs (`Gate`) serve `etcd_interop_modes` too.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::etcd::{etcdctl, name, run, spawn, status, wait_for, waiters};
use crate::etcd_server::shared_etcd;
use crate::harness::*;

mod gate;

pub(crate) use gate::{By, FOREIGN, Gate, etcdctl_lock, read, succeeded};

test!(etcd_interop_an_etcdctl_holder_keeps_devlock_out_and_is_named, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `etcdctl lock /devlock/R` holding: `devlock -n R` exits 75 naming it by
/// its key, `-w` gives up, status shows it (key, lease TTL, fence; no `?`),
/// and a waiting `devlock R` runs only once etcdctl's command has ended.
pub(crate) fn etcd_interop_an_etcdctl_holder_keeps_devlock_out_and_is_named() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let r = name("interop-held-by-etcdctl");
    let key_file = g.s.work("key");
    let (wait, ready) = wait_for_release(&g.s, "e");
    let etcdctl = g.take(
        By::Etcdctl(&format!("/devlock/{r}")),
        &format!(
            "echo \"$ETCD_LOCK_KEY\" > {k}; {wait}; {end}",
            k = key_file.display(),
            end = g.append("etcdctl-end")
        ),
    );
    wait_for_file(&ready);
    let key = read(&key_file).trim().to_owned();
    assert!(key.starts_with(&format!("/devlock/{r}/")), "{key}");

    let err = g.refused(&["-n", &r, "--", "true"]);
    assert!(
        err.starts_with(&format!(
            "devlock: {r} is busy: held by {FOREIGN} (key {key}, in line since revision "
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let err = g.refused(&["-w", "300ms", &r, "--", "true"]);
    assert!(err.contains(&format!("gave up on {r} after")), "{err}");

    let view = status(&g.s, &url, &r);
    let holder = &view["holders"][0];
    assert_eq!(holder["client"], FOREIGN, "{view}");
    assert_eq!(holder["key"], key.as_str(), "{view}");
    assert!(holder["lease_ttl_s"].as_i64().unwrap() > 0, "{view}");
    assert!(holder["fence"].as_i64().unwrap() > 0, "{view}");
    let table = stdout(&run(&g.s, &url, &["status", &r]));
    assert!(table.contains(FOREIGN), "{table}");
    assert!(!table.contains('?'), "{table}");

    let waiter = g.behind(By::Devlock(&[&r]), "devlock-start");
    g.waiting(&r, 1);
    g.release("e");
    succeeded([etcdctl, waiter]);
    assert_eq!(g.log(), "etcdctl-end\ndevlock-start\n");
}

test!(etcd_interop_a_devlock_holder_keeps_etcdctl_lock_waiting, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `devlock R` holding: `etcdctl lock /devlock/R` joins the line (status
/// shows it waiting, named) and runs only once devlock's command has ended.
pub(crate) fn etcd_interop_a_devlock_holder_keeps_etcdctl_lock_waiting() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let r = name("interop-held-by-devlock");
    let lock = format!("/devlock/{r}");
    g.in_turn(By::Devlock(&[&r]), By::Etcdctl(&lock), &r, || {
        let view = status(&g.s, &url, &r);
        assert_eq!(view["waiters"][0]["client"], FOREIGN, "{view}");
        assert!(view["holders"][0]["client"].is_null(), "{view}");
        let table = stdout(&run(&g.s, &url, &["status", &r]));
        assert!(table.contains(FOREIGN) && !table.contains('?'), "{table}");
    });
}

test!(etcd_interop_fences_from_mixed_holders_strictly_increase, needs: [Tool("etcd"), Tool("etcdctl")]);
/// A line of etcdctl and devlock waiters, each joined before the one after
/// it, granted in turn: the tokens their commands get (`ETCD_LOCK_REV`
/// from etcdctl, `DEVLOCK_FENCE` from devlock, which sets `ETCD_LOCK_REV`
/// to the same) strictly increase in the order they held. (A waiter's
/// create revision would not: an etcdctl waiter granted late exports a
/// revision later than the devlock waiter that joined behind it.)
pub(crate) fn etcd_interop_fences_from_mixed_holders_strictly_increase() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let r = name("interop-fences");
    let lock = format!("/devlock/{r}");
    let (wait, ready) = wait_for_release(&g.s, "first");
    let first = g.take(
        By::Etcdctl(&lock),
        &format!("{}; {wait}", g.append("\"e0 $ETCD_LOCK_REV\"")),
    );
    wait_for_file(&ready);
    let mut line = vec![first];
    for n in 1..=6 {
        line.push(if n % 2 == 0 {
            g.take(
                By::Etcdctl(&lock),
                &g.append(&format!("\"e{n} $ETCD_LOCK_REV\"")),
            )
        } else {
            g.take(
                By::Devlock(&[&r]),
                &format!(
                    "[ \"$DEVLOCK_FENCE\" = \"$ETCD_LOCK_REV\" ] || {}; {}",
                    g.append("mismatch"),
                    g.append(&format!("\"d{n} $DEVLOCK_FENCE\""))
                ),
            )
        });
        g.waiting(&r, n);
    }
    g.release("first");
    succeeded(line);
    let text = g.log();
    let held: Vec<(&str, i64)> = text
        .lines()
        .map(|l| {
            let (who, fence) = l.split_once(' ').unwrap_or_else(|| panic!("{text}"));
            (who, fence.parse().unwrap_or_else(|_| panic!("{text}")))
        })
        .collect();
    let order: Vec<&str> = held.iter().map(|(who, _)| *who).collect();
    assert_eq!(order, ["e0", "d1", "e2", "d3", "e4", "d5", "e6"], "{text}");
    assert!(
        held.windows(2).all(|w| w[0].1 < w[1].1),
        "fences not strictly increasing: {text}"
    );
}

test!(etcd_interop_an_etcdctl_lock_script_runs_unchanged_under_devlock, needs: [Tool("etcd"), Tool("etcdctl")]);
/// A script written for `etcdctl lock`: it checks that its lock key is
/// there and makes a write guarded by `ETCD_LOCK_REV` in one transaction.
/// Under etcdctl and then under devlock, both writes are accepted, in order.
pub(crate) fn etcd_interop_an_etcdctl_lock_script_runs_unchanged_under_devlock() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("interop-script");
    let fence_key = format!("/devlock-test/{r}/fence");
    etcdctl(&url, &["put", &fence_key, &format!("{:020}", 0)]);
    let out = s.work("out");
    let script = s.work("guarded.sh");
    std::fs::write(
        &script,
        format!(
            "set -e\n\
             export ETCDCTL_API=3 ETCDCTL_ENDPOINTS={url}\n\
             [ \"$(etcdctl get --print-value-only=false --keys-only \"$ETCD_LOCK_KEY\")\" ] \
               || {{ echo \"no key $ETCD_LOCK_KEY\" >> {o}; exit 1; }}\n\
             f=$(printf %020d \"$ETCD_LOCK_REV\")\n\
             printf 'value(\"%s\") < \"%s\"\\n\\nput %s %s\\n\\n\\n' {fk} $f {fk} $f \
               | etcdctl txn | head -n1 >> {o}\n",
            o = out.display(),
            fk = fence_key,
        ),
    )
    .unwrap();
    succeeded([etcdctl_lock(
        &url,
        &format!("/devlock/{r}"),
        &format!("sh {}", script.display()),
    )]);
    let under_devlock = run(
        &s,
        &url,
        &["-q", &r, "--", "sh", &script.display().to_string()],
    );
    assert!(under_devlock.status.success(), "{}", stderr(&under_devlock));
    assert_eq!(read(&out), "SUCCESS\nSUCCESS\n");
}

test!(etcd_interop_an_etcdctl_member_holder_keeps_the_whole_group_out, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `etcdctl lock /devlock/G:0` holding: `devlock -n G` names it, a waiting
/// `devlock G` runs only once it has ended (as a whole-group take waits for
/// a plain `flock G:0.lock` on one machine), and an etcdctl take of the
/// member that comes later waits behind the group's holder.
pub(crate) fn etcd_interop_an_etcdctl_member_holder_keeps_the_whole_group_out() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let group = name("igm");
    let member = format!("{group}:0");
    let member_lock = format!("/devlock/{member}");
    let etcdctl = g.holding(By::Etcdctl(&member_lock), "e");
    let err = g.refused(&["-n", &group, "--", "true"]);
    assert!(
        err.contains(&format!("busy: held by {FOREIGN} (key /devlock/{member}/")),
        "{err}"
    );
    let (wait_d, _) = wait_for_release(&g.s, "d");
    let waiter = g.take(
        By::Devlock(&[&group]),
        &format!(
            "{}; {wait_d}; {}",
            g.append("devlock-start"),
            g.append("devlock-end")
        ),
    );
    g.waiting(&member, 1);
    assert_eq!(status(&g.s, &url, &group)["state"], "held");
    assert_eq!(g.log(), "");
    let later = g.behind(By::Etcdctl(&member_lock), "etcdctl-again");
    g.waiting(&member, 2);
    g.release("e");
    succeeded([etcdctl]);
    wait_for_file(&g.s.work("ready-d"));
    let view = status(&g.s, &url, &member);
    assert_eq!(view["holders"][0]["via"], group.as_str(), "{view}");
    g.release("d");
    succeeded([waiter, later]);
    assert_eq!(
        g.log(),
        "e-end\ndevlock-start\ndevlock-end\netcdctl-again\n"
    );
}

test!(etcd_interop_a_devlock_group_holder_keeps_etcdctl_off_every_member_known, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `devlock G` holding keeps `etcdctl lock /devlock/G:M` waiting for every
/// member it knows, though none had a line when it took `G`: `G:1`, which
/// a devlock once took (and recorded under `/devlock/.members/`, where it
/// stays), and `G:2`, recorded there by hand. Both run once the group's
/// holder has ended. A member nobody ever recorded (`G:9`) is not known:
/// its etcdctl take runs beside the group's holder, as a `flock` of a
/// member with no lock file does on one machine.
pub(crate) fn etcd_interop_a_devlock_group_holder_keeps_etcdctl_off_every_member_known() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let group = name("igk");
    let [m1, m2, m9] = [1, 2, 9].map(|n| format!("{group}:{n}"));
    let out = run(&g.s, &url, &["-q", &m1, "--", "true"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let recorded = etcdctl(
        &url,
        &["get", "--keys-only", &format!("/devlock/.members/{m1}")],
    );
    assert_eq!(recorded.trim(), format!("/devlock/.members/{m1}"));
    assert_eq!(status(&g.s, &url, &m1)["state"], "free");
    etcdctl(&url, &["put", &format!("/devlock/.members/{m2}"), ""]);

    let holder = g.holding(By::Devlock(&[&group]), "d");
    let (lock1, lock2) = (format!("/devlock/{m1}"), format!("/devlock/{m2}"));
    let e1 = g.behind(By::Etcdctl(&lock1), "etcdctl-1");
    let e2 = g.behind(By::Etcdctl(&lock2), "etcdctl-2");
    g.waiting(&m1, 1);
    g.waiting(&m2, 1);
    for member in [&m1, &m2] {
        let view = status(&g.s, &url, member);
        assert_eq!(view["holders"][0]["via"], group.as_str(), "{view}");
    }
    succeeded([g.behind(By::Etcdctl(&format!("/devlock/{m9}")), "etcdctl-9")]);
    assert_eq!(g.log(), "etcdctl-9\n");
    g.release("d");
    succeeded([holder, e1, e2]);
    assert_eq!(
        g.lines_with_ties(2..4),
        ["etcdctl-9", "d-end", "etcdctl-1", "etcdctl-2"]
    );
}

test!(etcd_interop_group_takers_and_etcdctl_member_takers_do_not_deadlock, needs: [Tool("etcd"), Tool("etcdctl")]);
/// Two `devlock G` and etcdctl takes of its members, interleaved: the
/// first group taker holds `G` and `G:0` and waits for an etcdctl holder of
/// `G:1`; an etcdctl take of `G:0` waits behind it, and the second group
/// taker waits on `G`. Once the etcdctl holder ends, everyone runs, in
/// that order: the group's members are taken one at a time in name order,
/// so no holder waits for one that waits for it.
pub(crate) fn etcd_interop_group_takers_and_etcdctl_member_takers_do_not_deadlock() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let group = name("igo");
    let [m0, m1] = [0, 1].map(|n| format!("{group}:{n}"));
    etcdctl(&url, &["put", &format!("/devlock/.members/{m0}"), ""]);
    let holder = g.holding(By::Etcdctl(&format!("/devlock/{m1}")), "e1");
    let first = g.behind(By::Devlock(&[&group]), "devlock-1");
    g.waiting(&m1, 1);
    let view = status(&g.s, &url, &m0);
    assert_eq!(view["holders"][0]["via"], group.as_str(), "{view}");
    let e0 = g.behind(By::Etcdctl(&format!("/devlock/{m0}")), "etcdctl-0");
    g.waiting(&m0, 1);
    let second = g.behind(By::Devlock(&[&group]), "devlock-2");
    g.waiting(&group, 1);
    assert_eq!(g.log(), "");
    g.release("e1");
    succeeded([holder, first, e0, second]);
    assert_eq!(g.log(), "e1-end\ndevlock-1\netcdctl-0\ndevlock-2\n");
}

test!(etcd_interop_a_devlock_member_holder_keeps_etcdctl_off_the_group, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `devlock G:0` holding (its group shared): `etcdctl lock /devlock/G`
/// waits, and runs once devlock's command has ended.
pub(crate) fn etcd_interop_a_devlock_member_holder_keeps_etcdctl_off_the_group() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let group = name("igd");
    let member = format!("{group}:0");
    let lock = format!("/devlock/{group}");
    g.in_turn(By::Devlock(&[&member]), By::Etcdctl(&lock), &group, || {});
}

test!(etcd_interop_an_etcdctl_group_holder_keeps_devlock_members_out, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `etcdctl lock /devlock/G` holding: `devlock -n G:0` names it, and a
/// waiting `devlock G:0` runs once etcdctl's command has ended.
pub(crate) fn etcd_interop_an_etcdctl_group_holder_keeps_devlock_members_out() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let group = name("ige");
    let member = format!("{group}:0");
    let lock = format!("/devlock/{group}");
    g.in_turn(By::Etcdctl(&lock), By::Devlock(&[&member]), &group, || {
        assert!(g.refused(&["-n", &member, "--", "true"]).contains(FOREIGN));
    });
}

test!(etcd_interop_the_prefix_is_chosen_and_empty_means_the_bare_name, needs: [Tool("etcd"), Tool("etcdctl")]);
/// A team's `etcdctl lock R` (no prefix) meets devlock with an empty
/// prefix, from the flag or the variable; another prefix is another gate;
/// and `--etcd-prefix /team/` meets `etcdctl lock /team/R`.
pub(crate) fn etcd_interop_the_prefix_is_chosen_and_empty_means_the_bare_name() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let r = name("interop-bare");
    let etcdctl = g.holding(By::Etcdctl(&r), "e");
    let err = g.refused(&["--etcd-prefix=", "-n", &r, "--", "true"]);
    assert!(err.contains(&format!("{FOREIGN} (key {r}/")), "{err}");
    let out = crate::etcd::devlock(&g.s, &url)
        .env("DEVLOCK_ETCD_PREFIX", "")
        .args(["-n", &r, "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    for elsewhere in [&["-n", &r][..], &["--etcd-prefix", "/team/", "-n", &r]] {
        let out = run(&g.s, &url, &[elsewhere, &["--", "true"]].concat());
        assert!(out.status.success(), "{elsewhere:?}: {}", stderr(&out));
    }
    let table = stdout(&run(&g.s, &url, &["--etcd-prefix=", "status", &r]));
    assert!(table.contains(FOREIGN), "{table}");
    g.release("e");
    succeeded([etcdctl]);

    let holder = g.holding(By::Devlock(&["--etcd-prefix", "/team/", &r]), "d");
    let etcdctl = g.behind(By::Etcdctl(&format!("/team/{r}")), "etcdctl-start");
    poll_until(
        "etcdctl waiting under /team/",
        || {
            stdout(&run(
                &g.s,
                &url,
                &["--etcd-prefix", "/team/", "status", "--json", &r],
            ))
        },
        |json| {
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            waiters(&v["resources"][0]) == 1
        },
    );
    g.release("d");
    succeeded([holder, etcdctl]);
    assert_eq!(g.log(), "e-end\nd-end\netcdctl-start\n");
}

test!(etcd_interop_no_lost_update_with_mixed_clients_and_a_partition, needs: [Root, Tool("etcd"), Tool("etcdctl"), Tool("unshare"), Tool("timeout")]);
/// In the spirit of Jepsen's lock-etcd-set: six clients on three machines
/// (m1 and m2 straight to etcd, m3 through a proxy that is cut once 30
/// writes are in), a devlock and an `etcdctl lock` on each, 50
/// read-modify-write cycles each on one counter, every write one
/// transaction guarded by the holder's fence (`ETCD_LOCK_REV`, which
/// devlock sets too) and recording that fence. The counter equals the
/// number of writes the guard accepted, and the accepted fences strictly
/// increase in the counter's order.
pub(crate) fn etcd_interop_no_lost_update_with_mixed_clients_and_a_partition() {
    let (_server, url) = shared_etcd();
    let proxy = crate::etcd_server::Proxy::to(&url);
    let s = Scratch::new();
    let r = name("interop-set");
    let base = format!("/devlock-test/{r}");
    etcdctl(
        &url,
        &["put", &format!("{base}/fence"), &format!("{:020}", 0)],
    );
    etcdctl(&url, &["put", &format!("{base}/counter"), "0"]);
    let accepted = s.work("accepted");
    let stops = s.work("stops");
    let rmw = write_rmw_script(&s, &base, &accepted);
    let clients = start_clients(&s, &r, &rmw, &stops, &url, &proxy.url);
    poll_until(
        "30 writes before the partition",
        || read(&accepted).lines().count(),
        |&n| n >= 30,
    );
    proxy.cut();
    // Each cycle is bounded (SIGKILL after 20s: etcdctl lock ignores
    // SIGTERM), and a client cut off stops.
    for mut client in clients {
        client.wait().unwrap();
    }
    let (counter, writes, keys) = accepted_writes(&url, &base);
    assert!(counter > 30, "{counter}");
    assert_eq!(counter, writes.len(), "a lost update: {keys}");
    let mut by_counter = writes.clone();
    by_counter.sort_by_key(|&(_, n)| n);
    assert!(
        by_counter.iter().enumerate().all(|(i, &(_, n))| n == i + 1),
        "{keys}"
    );
    assert!(
        by_counter.windows(2).all(|w| w[0].0 < w[1].0),
        "fences not increasing with the counter: {keys}"
    );
    // Only the clients cut off stopped early.
    let stopped = read(&stops);
    assert!(stopped.lines().all(|l| l.starts_with("m3 ")), "{stopped}");
    let logged = read(&accepted).lines().count();
    assert!(logged <= counter, "{logged} > {counter}");
}

/// One cycle, run holding the lock: read the counter, write it + 1 if no
/// later fence has written, and record the write under its fence in
/// `accepted`. The script's path.
fn write_rmw_script(s: &Scratch, base: &str, accepted: &Path) -> std::path::PathBuf {
    let rmw = s.work("rmw.sh");
    std::fs::write(
        &rmw,
        format!(
            "export ETCDCTL_API=3\n\
             f=$(printf %020d \"$ETCD_LOCK_REV\")\n\
             n=$(timeout 10 etcdctl get --print-value-only {base}/counter) || exit 1\n\
             m=$((n+1))\n\
             printf 'value(\"{base}/fence\") < \"%s\"\\n\\nput {base}/fence %s\\nput {base}/counter %s\\nput {base}/accepted/%s %s\\n\\n\\n' \
               $f $f $m $f $m | timeout 10 etcdctl txn | head -n1 | grep -qx SUCCESS \
               && echo \"$f $m\" >> {a}\n\
             exit 0\n",
            a = accepted.display()
        ),
    )
    .unwrap();
    rmw
}

/// The six clients: on each of three machines (m3 through `proxy_url`), a
/// devlock and an `etcdctl lock` running 50 cycles of `rmw`; a client cut
/// off logs to `stops` and stops.
fn start_clients(
    s: &Scratch,
    r: &str,
    rmw: &Path,
    stops: &Path,
    url: &str,
    proxy_url: &str,
) -> Vec<Child> {
    [("m1", url), ("m2", url), ("m3", proxy_url)]
        .into_iter()
        .flat_map(|(host, at)| {
            let devlock = format!(
                "timeout -s KILL 20 {BIN} -q --ttl 4s --kill-after 1s {r} -- sh {}",
                rmw.display()
            );
            let etcdctl = format!(
                "timeout -s KILL 20 etcdctl lock --ttl=3 /devlock/{r} -- sh {}",
                rmw.display()
            );
            [("devlock", devlock), ("etcdctl", etcdctl)].map(|(tool, take)| {
                let template = crate::etcd::devlock(s, at);
                let mut cmd = Command::new("unshare");
                // A client cut off stops; the others go on.
                let script = format!(
                    "hostname {host} && for i in $(seq 50); do {take} || \
                     {{ echo \"{host} {tool} cycle $i: exit $?\" >> {stops}; break; }}; done",
                    stops = stops.display()
                );
                cmd.args(["--uts", "sh", "-c", &script]);
                for (key, value) in template.get_envs() {
                    match value {
                        Some(value) => cmd.env(key, value),
                        None => cmd.env_remove(key),
                    };
                }
                cmd.env("ETCDCTL_API", "3").env("ETCDCTL_ENDPOINTS", at);
                cmd.stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap()
            })
        })
        .collect()
}

/// The counter, and each accepted write as (fence, counter it wrote), and
/// the keys they were read from.
fn accepted_writes(url: &str, base: &str) -> (usize, Vec<(i64, usize)>, String) {
    let counter: usize = etcdctl(
        url,
        &["get", "--print-value-only", &format!("{base}/counter")],
    )
    .trim()
    .parse()
    .unwrap();
    let keys = etcdctl(url, &["get", "--prefix", &format!("{base}/accepted/")]);
    // Key and value lines: /accepted/FENCE then the counter it wrote.
    let lines: Vec<&str> = keys.lines().collect();
    let writes: Vec<(i64, usize)> = lines
        .chunks(2)
        .map(|kv| {
            let fence = kv[0].rsplit('/').next().unwrap().parse().unwrap();
            (fence, kv[1].parse().unwrap())
        })
        .collect();
    (counter, writes, keys)
}
