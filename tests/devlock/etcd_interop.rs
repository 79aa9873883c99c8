//! devlock and `etcdctl lock` (etcd's `concurrency.Mutex`) against one real
//! etcd server: one gate, whichever tool holds and whichever waits; `-n`,
//! `-w` and status naming an etcdctl holder for what etcd knows of it.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::etcd::{name, run, spawn, status, wait_for, waiters};
use crate::etcd_server::shared_etcd;
use crate::harness::*;

/// What devlock calls a holder whose key it did not write.
const FOREIGN: &str = "etcdctl lock or another client";

/// Starts `etcdctl lock NAME sh -c SCRIPT`: it waits its turn, runs the
/// script holding the lock and gives it back when the script ends.
fn etcdctl_lock(url: &str, lock: &str, script: &str) -> Child {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", url, "lock", lock, "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("etcdctl (Debian package etcd-client)")
}

fn append(line: &str, log: &Path) -> String {
    format!("echo {line} >> {}", log.display())
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

test!(etcd_interop_an_etcdctl_holder_keeps_devlock_out_and_is_named, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `etcdctl lock /devlock/R` holding: `devlock -n R` exits 75 naming it by
/// its key, `-w` gives up, status shows it (key, lease TTL, fence; no `?`),
/// and a waiting `devlock R` runs only once etcdctl's command has ended.
pub(crate) fn etcd_interop_an_etcdctl_holder_keeps_devlock_out_and_is_named() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("interop-held-by-etcdctl");
    let (log, key_file) = (s.work("log"), s.work("key"));
    let (wait, ready) = wait_for_release(&s, "e");
    let etcdctl = etcdctl_lock(
        &url,
        &format!("/devlock/{r}"),
        &format!(
            "echo \"$ETCD_LOCK_KEY\" > {k}; {wait}; {end}",
            k = key_file.display(),
            end = append("etcdctl-end", &log)
        ),
    );
    wait_for_file(&ready);
    let key = read(&key_file).trim().to_owned();
    assert!(key.starts_with(&format!("/devlock/{r}/")), "{key}");

    let out = run(&s, &url, &["-n", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.starts_with(&format!(
            "devlock: {r} is busy: held by {FOREIGN} (key {key}, in line since revision "
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    let out = run(&s, &url, &["-w", "300ms", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("gave up on {r} after")),
        "{}",
        stderr(&out)
    );

    let view = status(&s, &url, &r);
    let holder = &view["holders"][0];
    assert_eq!(holder["client"], FOREIGN, "{view}");
    assert_eq!(holder["key"], key.as_str(), "{view}");
    assert!(holder["lease_ttl_s"].as_i64().unwrap() > 0, "{view}");
    assert!(holder["fence"].as_i64().unwrap() > 0, "{view}");
    let table = stdout(&run(&s, &url, &["status", &r]));
    assert!(table.contains(FOREIGN), "{table}");
    assert!(!table.contains('?'), "{table}");

    let waiter = spawn(&s, &url, &["-q", &r], &append("devlock-start", &log));
    wait_for(&s, &url, &r, "devlock waiting behind etcdctl", |v| {
        waiters(v) == 1
    });
    release(&s, "e");
    let etcdctl = etcdctl.wait_with_output().unwrap();
    assert!(etcdctl.status.success(), "{}", stderr(&etcdctl));
    let waiter = waiter.wait_with_output().unwrap();
    assert!(waiter.status.success(), "{}", stderr(&waiter));
    assert_eq!(read(&log), "etcdctl-end\ndevlock-start\n");
}

test!(etcd_interop_a_devlock_holder_keeps_etcdctl_lock_waiting, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `devlock R` holding: `etcdctl lock /devlock/R` joins the line (status
/// shows it waiting, named) and runs only once devlock's command has ended.
pub(crate) fn etcd_interop_a_devlock_holder_keeps_etcdctl_lock_waiting() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("interop-held-by-devlock");
    let log = s.work("log");
    let (wait, ready) = wait_for_release(&s, "d");
    let holder = spawn(
        &s,
        &url,
        &["-q", &r],
        &format!("{wait}; {}", append("devlock-end", &log)),
    );
    wait_for_file(&ready);
    let etcdctl = etcdctl_lock(
        &url,
        &format!("/devlock/{r}"),
        &append("etcdctl-start", &log),
    );
    wait_for(&s, &url, &r, "etcdctl waiting behind devlock", |v| {
        waiters(v) == 1
    });
    let view = status(&s, &url, &r);
    assert_eq!(view["waiters"][0]["client"], FOREIGN, "{view}");
    assert!(view["holders"][0]["client"].is_null(), "{view}");
    let table = stdout(&run(&s, &url, &["status", &r]));
    assert!(table.contains(FOREIGN) && !table.contains('?'), "{table}");
    assert_eq!(read(&log), "");
    release(&s, "d");
    let holder = holder.wait_with_output().unwrap();
    assert!(holder.status.success(), "{}", stderr(&holder));
    let etcdctl = etcdctl.wait_with_output().unwrap();
    assert!(etcdctl.status.success(), "{}", stderr(&etcdctl));
    assert_eq!(read(&log), "devlock-end\netcdctl-start\n");
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
    let s = Scratch::new();
    let r = name("interop-fences");
    let lock = format!("/devlock/{r}");
    let log = s.work("log");
    let (wait, ready) = wait_for_release(&s, "first");
    let first = etcdctl_lock(
        &url,
        &lock,
        &format!("echo \"e0 $ETCD_LOCK_REV\" >> {}; {wait}", log.display()),
    );
    wait_for_file(&ready);
    let mut line: Vec<Child> = Vec::new();
    for n in 1..=6 {
        let child = if n % 2 == 0 {
            etcdctl_lock(
                &url,
                &lock,
                &format!("echo \"e{n} $ETCD_LOCK_REV\" >> {}", log.display()),
            )
        } else {
            spawn(
                &s,
                &url,
                &["-q", &r],
                &format!(
                    "[ \"$DEVLOCK_FENCE\" = \"$ETCD_LOCK_REV\" ] || echo mismatch >> {l}; \
                     echo \"d{n} $DEVLOCK_FENCE\" >> {l}",
                    l = log.display()
                ),
            )
        };
        line.push(child);
        wait_for(&s, &url, &r, &format!("{n} waiting"), |v| waiters(v) == n);
    }
    release(&s, "first");
    for child in std::iter::once(first).chain(line) {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let text = read(&log);
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
    crate::etcd::etcdctl(&url, &["put", &fence_key, &format!("{:020}", 0)]);
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
    let under_etcdctl = etcdctl_lock(
        &url,
        &format!("/devlock/{r}"),
        &format!("sh {}", script.display()),
    )
    .wait_with_output()
    .unwrap();
    assert!(under_etcdctl.status.success(), "{}", stderr(&under_etcdctl));
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
    let s = Scratch::new();
    let group = name("igm");
    let member = format!("{group}:0");
    let log = s.work("log");
    let (wait, ready) = wait_for_release(&s, "e");
    let etcdctl = etcdctl_lock(
        &url,
        &format!("/devlock/{member}"),
        &format!("{wait}; {}", append("etcdctl-end", &log)),
    );
    wait_for_file(&ready);
    let out = run(&s, &url, &["-n", &group, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("busy: held by {FOREIGN} (key /devlock/{member}/")),
        "{}",
        stderr(&out)
    );
    let (wait_d, _) = wait_for_release(&s, "d");
    let waiter = spawn(
        &s,
        &url,
        &["-q", &group],
        &format!(
            "{}; {wait_d}; {}",
            append("devlock-start", &log),
            append("devlock-end", &log)
        ),
    );
    wait_for(
        &s,
        &url,
        &member,
        "the group's take waiting for the member",
        |v| waiters(v) == 1,
    );
    assert_eq!(status(&s, &url, &group)["state"], "held");
    assert_eq!(read(&log), "");
    let later = etcdctl_lock(
        &url,
        &format!("/devlock/{member}"),
        &append("etcdctl-again", &log),
    );
    wait_for(
        &s,
        &url,
        &member,
        "a second etcdctl behind the group",
        |v| waiters(v) == 2,
    );
    release(&s, "e");
    let etcdctl = etcdctl.wait_with_output().unwrap();
    assert!(etcdctl.status.success(), "{}", stderr(&etcdctl));
    wait_for_file(&s.work("ready-d"));
    let view = status(&s, &url, &member);
    assert_eq!(view["holders"][0]["via"], group.as_str(), "{view}");
    release(&s, "d");
    let waiter = waiter.wait_with_output().unwrap();
    assert!(waiter.status.success(), "{}", stderr(&waiter));
    let later = later.wait_with_output().unwrap();
    assert!(later.status.success(), "{}", stderr(&later));
    assert_eq!(
        read(&log),
        "etcdctl-end\ndevlock-start\ndevlock-end\netcdctl-again\n"
    );
}

test!(etcd_interop_a_devlock_member_holder_keeps_etcdctl_off_the_group, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `devlock G:0` holding (its group shared): `etcdctl lock /devlock/G`
/// waits, and runs once devlock's command has ended.
pub(crate) fn etcd_interop_a_devlock_member_holder_keeps_etcdctl_off_the_group() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let group = name("igd");
    let member = format!("{group}:0");
    let log = s.work("log");
    let (wait, ready) = wait_for_release(&s, "d");
    let holder = spawn(
        &s,
        &url,
        &["-q", &member],
        &format!("{wait}; {}", append("devlock-end", &log)),
    );
    wait_for_file(&ready);
    let etcdctl = etcdctl_lock(
        &url,
        &format!("/devlock/{group}"),
        &append("etcdctl-start", &log),
    );
    wait_for(&s, &url, &group, "etcdctl waiting for the group", |v| {
        waiters(v) == 1
    });
    release(&s, "d");
    let holder = holder.wait_with_output().unwrap();
    assert!(holder.status.success(), "{}", stderr(&holder));
    let etcdctl = etcdctl.wait_with_output().unwrap();
    assert!(etcdctl.status.success(), "{}", stderr(&etcdctl));
    assert_eq!(read(&log), "devlock-end\netcdctl-start\n");
}

test!(etcd_interop_an_etcdctl_group_holder_keeps_devlock_members_out, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `etcdctl lock /devlock/G` holding: `devlock -n G:0` names it, and a
/// waiting `devlock G:0` runs once etcdctl's command has ended.
pub(crate) fn etcd_interop_an_etcdctl_group_holder_keeps_devlock_members_out() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let group = name("ige");
    let member = format!("{group}:0");
    let log = s.work("log");
    let (wait, ready) = wait_for_release(&s, "e");
    let etcdctl = etcdctl_lock(
        &url,
        &format!("/devlock/{group}"),
        &format!("{wait}; {}", append("etcdctl-end", &log)),
    );
    wait_for_file(&ready);
    let out = run(&s, &url, &["-n", &member, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains(FOREIGN), "{}", stderr(&out));
    let waiter = spawn(&s, &url, &["-q", &member], &append("devlock-start", &log));
    wait_for(
        &s,
        &url,
        &group,
        "the member's take waiting for the group",
        |v| waiters(v) == 1,
    );
    release(&s, "e");
    let etcdctl = etcdctl.wait_with_output().unwrap();
    assert!(etcdctl.status.success(), "{}", stderr(&etcdctl));
    let waiter = waiter.wait_with_output().unwrap();
    assert!(waiter.status.success(), "{}", stderr(&waiter));
    assert_eq!(read(&log), "etcdctl-end\ndevlock-start\n");
}

test!(etcd_interop_the_prefix_is_chosen_and_empty_means_the_bare_name, needs: [Tool("etcd"), Tool("etcdctl")]);
/// A team's `etcdctl lock R` (no prefix) meets devlock with an empty
/// prefix, from the flag or the variable; another prefix is another gate;
/// and `--etcd-prefix /team/` meets `etcdctl lock /team/R`.
pub(crate) fn etcd_interop_the_prefix_is_chosen_and_empty_means_the_bare_name() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("interop-bare");
    let log = s.work("log");
    let (wait, ready) = wait_for_release(&s, "e");
    let etcdctl = etcdctl_lock(&url, &r, &wait);
    wait_for_file(&ready);
    let out = run(&s, &url, &["--etcd-prefix=", "-n", &r, "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("{FOREIGN} (key {r}/")),
        "{}",
        stderr(&out)
    );
    let out = crate::etcd::devlock(&s, &url)
        .env("DEVLOCK_ETCD_PREFIX", "")
        .args(["-n", &r, "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    let out = run(&s, &url, &["-n", &r, "--", "true"]);
    assert!(out.status.success(), "under /devlock/: {}", stderr(&out));
    let out = run(
        &s,
        &url,
        &["--etcd-prefix", "/team/", "-n", &r, "--", "true"],
    );
    assert!(out.status.success(), "under /team/: {}", stderr(&out));
    let table = stdout(&run(&s, &url, &["--etcd-prefix=", "status", &r]));
    assert!(table.contains(FOREIGN), "{table}");
    release(&s, "e");
    assert!(etcdctl.wait_with_output().unwrap().status.success());

    let (wait, ready) = wait_for_release(&s, "d");
    let holder = spawn(
        &s,
        &url,
        &["-q", "--etcd-prefix", "/team/", &r],
        &format!("{wait}; {}", append("devlock-end", &log)),
    );
    wait_for_file(&ready);
    let etcdctl = etcdctl_lock(&url, &format!("/team/{r}"), &append("etcdctl-start", &log));
    poll_until(
        "etcdctl waiting under /team/",
        || {
            stdout(&run(
                &s,
                &url,
                &["--etcd-prefix", "/team/", "status", "--json", &r],
            ))
        },
        |json| {
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            waiters(&v["resources"][0]) == 1
        },
    );
    release(&s, "d");
    assert!(holder.wait_with_output().unwrap().status.success());
    assert!(etcdctl.wait_with_output().unwrap().status.success());
    assert_eq!(read(&log), "devlock-end\netcdctl-start\n");
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
    crate::etcd::etcdctl(
        &url,
        &["put", &format!("{base}/fence"), &format!("{:020}", 0)],
    );
    crate::etcd::etcdctl(&url, &["put", &format!("{base}/counter"), "0"]);
    let accepted = s.work("accepted");
    let stops = s.work("stops");
    // One cycle, run holding the lock: read the counter, write it + 1 if
    // no later fence has written, and record the write under its fence.
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
    let clients: Vec<Child> = [("m1", &url), ("m2", &url), ("m3", &proxy.url)]
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
                let template = crate::etcd::devlock(&s, at);
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
        .collect();
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
    let counter: usize = crate::etcd::etcdctl(
        &url,
        &["get", "--print-value-only", &format!("{base}/counter")],
    )
    .trim()
    .parse()
    .unwrap();
    let keys = crate::etcd::etcdctl(&url, &["get", "--prefix", &format!("{base}/accepted/")]);
    // Key and value lines: /accepted/FENCE then the counter it wrote.
    let lines: Vec<&str> = keys.lines().collect();
    let writes: Vec<(i64, usize)> = lines
        .chunks(2)
        .map(|kv| {
            let fence = kv[0].rsplit('/').next().unwrap().parse().unwrap();
            (fence, kv[1].parse().unwrap())
        })
        .collect();
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
