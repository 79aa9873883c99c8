//! The etcd backend against a 3-member cluster: any one member down, the
//! leader killed or cut off while commands hold and wait, and the fencing
//! token (`DEVLOCK_FENCE`) that every new holder gets larger.

use std::path::Path;
use std::process::Command;

use crate::etcd::{name, run, spawn, status, wait_for, waiters};
use crate::etcd_cluster::{EtcdCluster, shared_cluster};
use crate::etcd_server::shared_etcd;
use crate::harness::*;

/// The other two members, in order.
fn others(of: usize) -> [usize; 2] {
    let rest: Vec<usize> = (0..3).filter(|&i| i != of).collect();
    [rest[0], rest[1]]
}

/// A critical section for `tag`: first checks that the previous holder's
/// command (its shell's pid in `last`) is gone, then logs `start TAG
/// FENCE`, runs `body`, logs `end TAG`.
fn section(dir: &Path, tag: &str, body: &str) -> String {
    let (last, log) = (dir.join("last"), dir.join("log"));
    format!(
        "p=$(cat {last} 2>/dev/null); \
         if [ -n \"$p\" ] && [ -d /proc/$p ] && ! grep -q '^State:.*Z' /proc/$p/status; \
         then echo \"overlap $p\" >> {log}; fi; \
         echo $$ > {last}.tmp; mv {last}.tmp {last}; \
         echo \"start {tag} $DEVLOCK_FENCE\" >> {log}; {body}; echo \"end {tag}\" >> {log}",
        last = last.display(),
        log = log.display()
    )
}

/// The log of [`section`]s: the tags in order, each started after the one
/// before it ended and with a larger fence.
fn check_log(dir: &Path, tags: &[&str]) {
    let log = std::fs::read_to_string(dir.join("log")).unwrap();
    let mut expected = Vec::new();
    for tag in tags {
        expected.push(format!("start {tag}"));
        expected.push(format!("end {tag}"));
    }
    let seen: Vec<String> = log
        .lines()
        .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(seen, expected, "{log}");
    let fences: Vec<i64> = log
        .lines()
        .filter(|l| l.starts_with("start "))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{log}");
}

/// Waits until `n` wait behind the holder of `r`, as status through `urls`
/// says; a status that fails (etcd electing a leader) is asked again.
fn wait_in_line(s: &Scratch, urls: &str, r: &str, n: usize) {
    let count = || {
        let out = run(s, urls, &["status", "--json", r]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .map_or(-1, |json| waiters(&json["resources"][0]) as i64)
    };
    poll_until(&format!("{n} in line for {r}"), count, |&c| c == n as i64);
}

test!(etcd_cluster_with_one_member_down_serves_every_take_wait_and_release, needs: [Tool("etcd"), Tool("etcdctl")]);
/// With any one member down, named anywhere in the list (first included),
/// every take, wait and release succeeds by moving to the next endpoint.
pub(crate) fn etcd_cluster_with_one_member_down_serves_every_take_wait_and_release() {
    let mut cluster = EtcdCluster::start();
    let s = Scratch::new();
    let r = name("one-down");
    let leader = cluster.leader();
    let follower = others(leader)[0];
    for (round, victim) in [follower, leader].into_iter().enumerate() {
        if round == 1 {
            // The follower is back, and the current leader goes.
            cluster.restart(follower);
            let _ = cluster.leader();
        }
        let victim = if round == 1 { cluster.leader() } else { victim };
        cluster.kill(victim);
        let [a, b] = others(victim);
        let orders = [[victim, a, b], [a, victim, b], [b, a, victim]];
        for order in &orders {
            let urls = cluster.urls(order);
            for _ in 0..3 {
                let out = run(&s, &urls, &[&r, "--", "true"]);
                assert!(out.status.success(), "{order:?}: {}", stderr(&out));
            }
        }
        // A hold whose lease would outlive the test: only a revoke that
        // goes through lets the waiter in before its -w runs out.
        let dead_first = cluster.urls(&orders[0]);
        let (script, ready) = wait_for_release(&s, &format!("h{round}"));
        let holder = spawn(&s, &dead_first, &["--ttl", "600s", &r], &script);
        wait_for_file(&ready);
        let mut waiter = spawn(&s, &dead_first, &["-q", "-w", "40s", &r], "true");
        wait_for(&s, &dead_first, &r, "a waiter", |v| waiters(v) == 1);
        release(&s, &format!("h{round}"));
        let out = holder.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(wait_child(&mut waiter).success());
        crate::etcd::wait_free(&s, &dead_first, &r);
    }
}

/// A holder on the leader, two waiters and a late taker; then `disrupt`
/// (the leader killed, or cut off) while the holder holds and the others
/// wait. Everyone runs, in the order they joined, each after the one
/// before it has stopped, with larger fences; the holder keeps its lease
/// through the election (it ends with its command's status).
fn holds_and_waits_through(disrupt: impl FnOnce(&mut EtcdCluster, usize)) {
    let mut cluster = EtcdCluster::start();
    let s = Scratch::new();
    let r = name("election");
    let leader = cluster.leader();
    let [f1, f2] = others(leader);
    let dir = s.work("sections");
    std::fs::create_dir(&dir).unwrap();
    let (wait_script, ready) = wait_for_release(&s, "h");
    let holder = spawn(
        &s,
        &cluster.urls(&[leader, f1, f2]),
        &["-q", &r],
        &section(&dir, "h", &wait_script),
    );
    wait_for_file(&ready);
    let observer = cluster.urls(&[f1, f2, leader]);
    let mut line = Vec::new();
    for (n, order) in [[f1, leader, f2], [leader, f2, f1]].iter().enumerate() {
        let tag = format!("w{}", n + 1);
        line.push(spawn(
            &s,
            &cluster.urls(order),
            &["-q", &r],
            &section(&dir, &tag, "sleep 0.2"),
        ));
        wait_in_line(&s, &observer, &r, n + 1);
    }
    disrupt(&mut cluster, leader);
    // A take while etcd elects, through the old leader first.
    line.push(spawn(
        &s,
        &cluster.urls(&[leader, f2, f1]),
        &["-q", &r],
        &section(&dir, "w3", "true"),
    ));
    let after = cluster.urls(&[f2, f1, leader]);
    wait_in_line(&s, &after, &r, 3);
    release(&s, "h");
    let out = holder.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for mut waiter in line {
        assert!(wait_child(&mut waiter).success());
    }
    check_log(&dir, &["h", "w1", "w2", "w3"]);
    crate::etcd::wait_free(&s, &after, &r);
}

test!(etcd_cluster_leader_killed_during_holds_and_waits_keeps_exclusion_and_order, needs: [Tool("etcd"), Tool("etcdctl")]);
pub(crate) fn etcd_cluster_leader_killed_during_holds_and_waits_keeps_exclusion_and_order() {
    holds_and_waits_through(|cluster, leader| {
        cluster.kill(leader);
        cluster.new_leader(leader);
    });
}

test!(etcd_cluster_leader_partitioned_during_holds_and_waits_keeps_exclusion_and_order, needs: [Tool("etcd"), Tool("etcdctl")]);
/// The leader cut off from clients and peers alike (a black hole: nothing
/// is refused, nothing gets through).
pub(crate) fn etcd_cluster_leader_partitioned_during_holds_and_waits_keeps_exclusion_and_order() {
    holds_and_waits_through(|cluster, leader| {
        cluster.partition(leader);
        cluster.new_leader(leader);
    });
}

test!(etcd_cluster_contenders_in_every_endpoint_order_exclude_each_other, needs: [Tool("etcd"), Tool("etcdctl")]);
/// The shared cluster, every endpoint named in three orders by contenders
/// in separate processes: one holder at a time, fences ever larger.
pub(crate) fn etcd_cluster_contenders_in_every_endpoint_order_exclude_each_other() {
    let cluster = shared_cluster();
    let s = Scratch::new();
    let r = name("cluster-excl");
    let dir = s.work("sections");
    std::fs::create_dir(&dir).unwrap();
    let counter = s.work("counter");
    std::fs::write(&counter, "0").unwrap();
    let fences = s.work("fences");
    let body = format!(
        "n=$(cat {c}); echo $DEVLOCK_FENCE >> {f}; sleep 0.01; echo $((n+1)) > {c}",
        c = counter.display(),
        f = fences.display()
    );
    let loops: Vec<_> = [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
        .iter()
        .map(|order| {
            let script =
                format!("for i in 1 2 3 4; do {BIN} -q {r} -- sh -c '{body}' || exit 1; done");
            Command::new("sh")
                .args(["-c", &script])
                .env("DEVLOCK_ETCD", cluster.urls(order))
                .spawn()
                .unwrap()
        })
        .collect();
    for mut child in loops {
        assert!(wait_child(&mut child).success());
    }
    assert_eq!(std::fs::read_to_string(&counter).unwrap().trim(), "12");
    let seen: Vec<i64> = std::fs::read_to_string(&fences)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(seen.len(), 12);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
}

test!(etcd_fencing_tokens_grow_with_every_holder_and_stop_a_stale_writer, needs: [Tool("etcd"), Tool("etcdctl"), Tool("python3")]);
/// `DEVLOCK_FENCE`: one number per resource, in `DEVLOCK_RESOURCES`'
/// order, larger for each new holder, the same as status shows, the outer
/// holder's inside a nested take; and the README's store that refuses a
/// stale writer does.
pub(crate) fn etcd_fencing_tokens_grow_with_every_holder_and_stop_a_stale_writer() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let (a, b) = (name("fence-a"), name("fence-b"));
    let fence_of = |args: &[&str]| {
        let mut argv = args.to_vec();
        argv.extend([
            "--",
            "sh",
            "-c",
            "echo \"$DEVLOCK_RESOURCES=$DEVLOCK_FENCE\"",
        ]);
        let out = run(&s, &url, &argv);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out).trim().to_owned()
    };
    let one: i64 = fence_of(&[&a]).split('=').nth(1).unwrap().parse().unwrap();
    let both = fence_of(&[&b, &a]);
    // Named b a, listed (as taken) a b, each with its own key's fence.
    let (names, fences) = both.split_once('=').unwrap();
    assert_eq!(names, format!("{a} {b}"));
    let fences: Vec<i64> = fences.split(' ').map(|f| f.parse().unwrap()).collect();
    assert_eq!(fences.len(), 2, "{both}");
    assert!(
        fences[0] > one && fences[1] > one && fences[0] != fences[1],
        "{both} after {one}"
    );

    // Status shows the holder's; a nested take passes the outer one on.
    let (script, ready) = wait_for_release(&s, "h");
    let inner = s.work("inner");
    let script = format!(
        "echo $DEVLOCK_FENCE > {o}; {BIN} -n {a} -- sh -c 'echo $DEVLOCK_FENCE > {i}'; {script}",
        o = s.work("outer").display(),
        i = inner.display()
    );
    let holder = spawn(&s, &url, &[&a], &script);
    wait_for_file(&ready);
    let outer = std::fs::read_to_string(s.work("outer")).unwrap();
    assert_eq!(std::fs::read_to_string(&inner).unwrap(), outer);
    let view = status(&s, &url, &a);
    assert_eq!(
        view["holders"][0]["fence"].to_string(),
        outer.trim(),
        "{view}"
    );
    let table = stdout(&run(&s, &url, &["status", &a]));
    assert!(
        table.contains("FENCE") && table.contains(outer.trim()),
        "{table}"
    );
    release(&s, "h");
    assert!(holder.wait_with_output().unwrap().status.success());

    // The store of the README: a write carries its fence, and the store
    // takes it only if no larger one wrote before.
    let db = s.work("store.db");
    let store = format!(
        "import os, sqlite3, sys\n\
         db = sqlite3.connect({db:?}, isolation_level=None)\n\
         db.execute('CREATE TABLE IF NOT EXISTS ckpt (id INTEGER PRIMARY KEY, fence INTEGER, data TEXT)')\n\
         db.execute('INSERT OR IGNORE INTO ckpt VALUES (1, 0, NULL)')\n\
         fence = int(os.environ['DEVLOCK_FENCE'])\n\
         cur = db.execute('UPDATE ckpt SET data = ?, fence = ? WHERE id = 1 AND fence <= ?', (sys.argv[1], fence, fence))\n\
         if cur.rowcount == 0: sys.exit('a newer holder has written: stopping')\n",
        db = db.display().to_string()
    );
    let store_py = s.work("store.py");
    std::fs::write(&store_py, store).unwrap();
    let write = |fence: Option<&str>, data: &str| {
        let mut cmd = match fence {
            Some(f) => {
                let mut cmd = Command::new("python3");
                cmd.env("DEVLOCK_FENCE", f);
                cmd
            }
            None => {
                let mut cmd = crate::etcd::devlock(&s, &url);
                cmd.args([a.as_str(), "--", "python3"]);
                cmd
            }
        };
        cmd.arg(&store_py).arg(data).output().unwrap()
    };
    assert!(write(None, "first").status.success());
    let stale = write(Some(outer.trim()), "stale");
    assert_eq!(stale.status.code(), Some(1), "{}", stderr(&stale));
    assert!(
        stderr(&stale).contains("newer holder"),
        "{}",
        stderr(&stale)
    );
}
