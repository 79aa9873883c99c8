//! Pools over etcd: `--slots N` and `--any` across three simulated
//! machines (each devlock in a UTS namespace of its own, so with a host
//! name of its own), first come first served and never more than N holders,
//! a slot holder cut off from etcd; and what a `gpu:N` or MIG instance's
//! command is told, with this machine's checks.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::etcd::{
    name, status, stopped_on_lease_loss, verdict_script, wait_for, waiters, write_pid,
};
use crate::etcd_server::{Proxy, shared_etcd};
use crate::harness::*;

/// `devlock` on machine `host`: the same environment as the other etcd
/// tests' devlock, in a UTS namespace whose host name is `host`.
fn on(host: &str, s: &Scratch, url: &str) -> Command {
    let template = crate::etcd::devlock(s, url);
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--uts",
        "sh",
        "-c",
        "hostname \"$0\" && exec \"$@\"",
        host,
        BIN,
    ]);
    for (key, value) in template.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    cmd
}

/// Starts `devlock ARGS -- sh -c SCRIPT` on machine `host`.
fn spawn_on(host: &str, s: &Scratch, url: &str, args: &[&str], script: &str) -> Child {
    on(host, s, url)
        .args(args)
        .args(["--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A command that writes `$VAR` to `started-TAG` once it runs, then holds
/// until the test writes `release-TAG`; and the started file.
fn hold_script(s: &Scratch, tag: &str, var: &str) -> (String, PathBuf) {
    let started = s.work(&format!("started-{tag}"));
    let (wait, _) = wait_for_release(s, tag);
    (
        format!(
            "echo \"${var}\" > {p}.tmp; mv {p}.tmp {p}; {wait}",
            p = started.display()
        ),
        started,
    )
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap().trim().to_owned()
}

fn holders(view: &serde_json::Value) -> Vec<serde_json::Value> {
    view["holders"].as_array().cloned().unwrap_or_default()
}

fn hosts(view: &serde_json::Value, of: &str) -> Vec<String> {
    view[of]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["host"].as_str().unwrap().to_owned())
        .collect()
}

test!(etcd_slots_across_three_machines_never_admit_more_than_n, needs: [Root, Tool("etcd"), Tool("etcdctl"), Tool("unshare")]);
/// Six loops on three machines take a pool of two slots thirty times: never
/// three inside at once, never one slot number twice at once, every
/// machine served.
pub(crate) fn etcd_slots_across_three_machines_never_admit_more_than_n() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("pool-n");
    let (inside, slots, log, seen) = (
        s.work("inside"),
        s.work("slots"),
        s.work("log"),
        s.work("seen"),
    );
    std::fs::create_dir_all(&inside).unwrap();
    std::fs::create_dir_all(&slots).unwrap();
    // Each holder marks itself inside before it counts, and leaves only
    // after: the one that makes three sees three.
    let section = s.work("section.sh");
    std::fs::write(
        &section,
        format!(
            "mkdir {i}/$$\n\
             n=$(ls {i} | wc -l); [ $n -le 2 ] || echo \"over: $n inside\" >> {log}\n\
             mkdir {sl}/$DEVLOCK_SLOT 2>/dev/null || echo \"slot $DEVLOCK_SLOT twice\" >> {log}\n\
             echo \"$(hostname) $DEVLOCK_SLOT\" >> {seen}\n\
             sleep 0.05\n\
             rmdir {sl}/$DEVLOCK_SLOT; rmdir {i}/$$\n",
            i = inside.display(),
            sl = slots.display(),
            log = log.display(),
            seen = seen.display()
        ),
    )
    .unwrap();
    let loops: Vec<Child> = ["m1", "m1", "m2", "m2", "m3", "m3"]
        .iter()
        .map(|host| {
            let template = crate::etcd::devlock(&s, &url);
            let mut cmd = Command::new("unshare");
            let script = format!(
                "hostname {host} && for i in 1 2 3 4 5; do {BIN} -q --slots 2 {r} -- sh {} || exit 1; done",
                section.display()
            );
            cmd.args(["--uts", "sh", "-c", &script]);
            for (key, value) in template.get_envs() {
                match value {
                    Some(value) => cmd.env(key, value),
                    None => cmd.env_remove(key),
                };
            }
            cmd.stdin(Stdio::null()).spawn().unwrap()
        })
        .collect();
    for mut child in loops {
        assert!(wait_child(&mut child).success());
    }
    assert!(!log.exists(), "{}", std::fs::read_to_string(&log).unwrap());
    let seen = std::fs::read_to_string(&seen).unwrap();
    assert_eq!(seen.lines().count(), 30, "{seen}");
    for host in ["m1", "m2", "m3"] {
        assert_eq!(
            seen.lines().filter(|l| l.starts_with(host)).count(),
            10,
            "{seen}"
        );
    }
    assert!(
        seen.lines().all(|l| l.ends_with(" 1") || l.ends_with(" 2")),
        "{seen}"
    );
    crate::etcd::wait_free(&s, &url, &r);
}

test!(etcd_slots_across_three_machines_are_first_come_first_served, needs: [Root, Tool("etcd"), Tool("etcdctl"), Tool("unshare")]);
/// Two machines hold both slots; three waiters from three machines join
/// in turn; each slot that frees goes to the first in line, with the
/// number it had, and status shows the holders' slots and machines.
pub(crate) fn etcd_slots_across_three_machines_are_first_come_first_served() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let r = name("pool-fcfs");
    let args = ["-q", "--slots", "2", r.as_str()];
    let mut started = Vec::new();
    let mut children = Vec::new();
    for (tag, host) in [("h1", "m1"), ("h2", "m2")] {
        let (script, file) = hold_script(&s, tag, "DEVLOCK_SLOT");
        children.push(spawn_on(host, &s, &url, &args, &script));
        wait_for_file(&file);
        started.push(file);
    }
    let slot_of_h1 = read(&started[0]);
    let slot_of_h2 = read(&started[1]);
    assert_eq!(
        [slot_of_h1.as_str(), slot_of_h2.as_str()]
            .map(|s| s.parse::<u64>().unwrap())
            .iter()
            .sum::<u64>(),
        3,
        "slots {slot_of_h1} and {slot_of_h2}"
    );
    for (n, (tag, host)) in [("w1", "m3"), ("w2", "m1"), ("w3", "m2")]
        .iter()
        .enumerate()
    {
        let (script, file) = hold_script(&s, tag, "DEVLOCK_SLOT");
        children.push(spawn_on(host, &s, &url, &args, &script));
        started.push(file);
        wait_for(&s, &url, &r, &format!("{} waiters", n + 1), |v| {
            waiters(v) == n + 1
        });
    }
    let view = status(&s, &url, &r);
    assert_eq!(view["state"], "slots", "{view}");
    assert_eq!(view["slots"], 2, "{view}");
    assert_eq!(hosts(&view, "holders"), ["m1", "m2"], "{view}");
    assert_eq!(hosts(&view, "waiters"), ["m3", "m1", "m2"], "{view}");
    let shown: Vec<String> = holders(&view)
        .iter()
        .map(|h| h["slot"].to_string())
        .collect();
    assert_eq!(shown, [slot_of_h1.clone(), slot_of_h2.clone()], "{view}");
    let table = stdout(&crate::etcd::run(&s, &url, &["status", &r]));
    assert!(
        table.contains("2 of 2 slots") && table.contains(&format!("(slot {slot_of_h1})")),
        "{table}"
    );

    let started_now =
        |started: &[PathBuf]| -> Vec<usize> { (2..5).filter(|&i| started[i].exists()).collect() };
    // h1's slot goes to w1, the first in line, and only to it.
    release(&s, "h1");
    wait_for_file(&started[2]);
    assert_eq!(read(&started[2]), slot_of_h1);
    assert_eq!(started_now(&started), [2]);
    wait_for(&s, &url, &r, "w1 holding", |v| waiters(v) == 2);
    assert_eq!(hosts(&status(&s, &url, &r), "holders"), ["m2", "m3"]);
    // h2's goes to w2; w1's to w3.
    release(&s, "h2");
    wait_for_file(&started[3]);
    assert_eq!(read(&started[3]), slot_of_h2);
    assert_eq!(started_now(&started), [2, 3]);
    release(&s, "w1");
    wait_for_file(&started[4]);
    assert_eq!(read(&started[4]), slot_of_h1);
    assert!(holders(&status(&s, &url, &r)).len() <= 2);
    release(&s, "w2");
    release(&s, "w3");
    for mut child in children {
        let status = wait_child(&mut child);
        assert!(status.success(), "{status}");
    }
    crate::etcd::wait_free(&s, &url, &r);
}

test!(etcd_any_across_three_machines_takes_the_first_free_in_arrival_order, needs: [Root, Tool("etcd"), Tool("etcdctl"), Tool("unshare")]);
/// Two candidates held on two machines, three `--any` waiters from three
/// machines: each that frees goes to the first in line, who leaves the
/// other line at once; `--count 2` takes two, each with its fence.
pub(crate) fn etcd_any_across_three_machines_takes_the_first_free_in_arrival_order() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let (a, b) = (name("any-a"), name("any-b"));
    let mut children = Vec::new();
    for (tag, host, r) in [("ha", "m1", &a), ("hb", "m2", &b)] {
        let (script, file) = hold_script(&s, tag, "DEVLOCK_RESOURCES");
        children.push(spawn_on(host, &s, &url, &["-q", r], &script));
        wait_for_file(&file);
    }
    let mut started = Vec::new();
    for (n, (tag, host)) in [("w1", "m3"), ("w2", "m1"), ("w3", "m2")]
        .iter()
        .enumerate()
    {
        let (script, file) = hold_script(&s, tag, "DEVLOCK_RESOURCES");
        children.push(spawn_on(host, &s, &url, &["-q", "--any", &a, &b], &script));
        started.push(file);
        for r in [&a, &b] {
            wait_for(&s, &url, r, &format!("{} waiters", n + 1), |v| {
                waiters(v) == n + 1
            });
        }
    }
    assert_eq!(hosts(&status(&s, &url, &b), "waiters"), ["m3", "m1", "m2"]);
    let started_now = || -> Vec<usize> { (0..3).filter(|&i| started[i].exists()).collect() };

    release(&s, "hb");
    wait_for_file(&started[0]);
    assert_eq!(read(&started[0]), b);
    assert_eq!(started_now(), [0]);
    // w1 has left a's line.
    wait_for(&s, &url, &a, "w1 out of a's line", |v| waiters(v) == 2);
    assert_eq!(hosts(&status(&s, &url, &a), "waiters"), ["m1", "m2"]);
    release(&s, "ha");
    wait_for_file(&started[1]);
    assert_eq!(read(&started[1]), a);
    assert_eq!(started_now(), [0, 1]);
    for r in [&a, &b] {
        assert_eq!(holders(&status(&s, &url, r)).len(), 1);
    }
    release(&s, "w1");
    wait_for_file(&started[2]);
    assert_eq!(read(&started[2]), b);
    release(&s, "w2");
    release(&s, "w3");
    for mut child in children {
        let status = wait_child(&mut child);
        assert!(status.success(), "{status}");
    }

    let c = name("any-c");
    let out = crate::etcd::run(
        &s,
        &url,
        &[
            "--any",
            "--count",
            "2",
            &c,
            &b,
            &a,
            "--",
            "sh",
            "-c",
            "echo $DEVLOCK_RESOURCES=$DEVLOCK_FENCE",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stdout(&out);
    let (names, fences) = said.trim().split_once('=').unwrap();
    assert_eq!(names, format!("{a} {b}"));
    assert_eq!(fences.split(' ').count(), 2, "{said}");
    for r in [&a, &b, &c] {
        crate::etcd::wait_free(&s, &url, r);
    }
}

test!(etcd_slot_holder_cut_off_stops_its_work_before_the_next_slot_holder_starts, needs: [Root, Tool("etcd"), Tool("etcdctl"), Tool("unshare")]);
/// A pool of two: m1 holds a slot through a proxy the test cuts, m2 holds
/// the other, m3 waits. m1's command, and what it left running, must be
/// dead before m3's starts, in m1's slot; m2 holds throughout.
pub(crate) fn etcd_slot_holder_cut_off_stops_its_work_before_the_next_slot_holder_starts() {
    let (_server, url) = shared_etcd();
    let proxy = Proxy::to(&url);
    let s = Scratch::new();
    let r = name("pool-cut");
    let (shell, orphan, slot) = (s.work("shell"), s.work("orphan"), s.work("slot-m1"));
    let script = format!(
        "(trap '' TERM; exec sleep 1000) & {}; echo $DEVLOCK_SLOT > {}; {}; wait",
        write_pid("$!", &orphan),
        slot.display(),
        write_pid("$$", &shell)
    );
    let cut_off = spawn_on(
        "m1",
        &s,
        &proxy.url,
        &["--ttl", "3s", "--kill-after", "500ms", "--slots", "2", &r],
        &script,
    );
    wait_for_file(&shell);
    let (other, other_started) = hold_script(&s, "m2", "DEVLOCK_SLOT");
    let mut other = spawn_on("m2", &s, &url, &["-q", "--slots", "2", &r], &other);
    wait_for_file(&other_started);
    let verdict = s.work("verdict");
    let next = format!(
        "{}; echo $DEVLOCK_SLOT > {}",
        verdict_script(&[&shell, &orphan], &verdict),
        s.work("slot-m3").display()
    );
    let mut waiter = spawn_on("m3", &s, &url, &["-q", "--slots", "2", &r], &next);
    wait_for(&s, &url, &r, "a waiter", |v| waiters(v) == 1);
    proxy.cut();
    stopped_on_lease_loss(cut_off);
    assert!(wait_child(&mut waiter).success());
    assert_eq!(read(&verdict), "clean");
    assert_eq!(read(&s.work("slot-m3")), read(&slot));
    // The other slot's holder never noticed (and m3's watcher lets go
    // just after m3's command ended).
    wait_for(&s, &url, &r, "m2 alone", |v| hosts(v, "holders") == ["m2"]);
    release(&s, "m2");
    assert!(wait_child(&mut other).success());
}

test!(etcd_gpu_members_get_the_device_variables_and_this_machines_checks, needs: [Tool("etcd"), Tool("etcdctl"), Tool("cc")]);
/// `gpu:N` over etcd: CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER as with
/// lock files; the caller's CUDA_VISIBLE_DEVICES limits the GPUs and
/// `--any`'s candidates; two MIG instances in one command are refused as
/// locally; an instance's UUID comes from this machine's NVML, and without
/// one the command is not started and nothing stays in etcd.
pub(crate) fn etcd_gpu_members_get_the_device_variables_and_this_machines_checks() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let show = "echo $DEVLOCK_RESOURCES $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER";
    let run_with = |cuda: Option<&str>, nvml: Option<&Path>, args: &[&str]| {
        let mut cmd = crate::etcd::devlock(&s, &url);
        if let Some(cuda) = cuda {
            cmd.env("CUDA_VISIBLE_DEVICES", cuda);
        }
        if let Some(library) = nvml {
            cmd.env("DEVLOCK_NVML", library)
                .env_remove("DEVLOCK_NVIDIA_SMI");
        }
        cmd.args(args).stdin(Stdio::null()).output().unwrap()
    };
    let out = run_with(None, None, &["gpu:1", "--", "sh", "-c", show]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "gpu:1 1 PCI_BUS_ID");
    let out = run_with(None, None, &["gpu:3", "gpu:1", "--", "sh", "-c", show]);
    assert_eq!(
        stdout(&out).trim(),
        "gpu:1 gpu:3 1,3 PCI_BUS_ID",
        "{}",
        stderr(&out)
    );

    let out = run_with(
        Some("1"),
        None,
        &["--any", "gpu:0", "gpu:1", "--", "sh", "-c", show],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "gpu:1 1 PCI_BUS_ID");
    let out = run_with(Some("1"), None, &["gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("outside CUDA_VISIBLE_DEVICES"),
        "{}",
        stderr(&out)
    );

    // A candidate that holds another shared would be one key twice.
    let out = run_with(None, None, &["--any", "gpu", "gpu:0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("one level"), "{}", stderr(&out));

    const GI9: &str = "gpu:0:1g.18gb:gi9.ci0";
    const GI10: &str = "gpu:0:1g.18gb:gi10.ci0";
    let out = run_with(None, None, &[GI9, GI10, "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("MIG"), "{}", stderr(&out));
    let out = run_with(None, None, &[GI9, "gpu:1", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));

    let library = crate::nvml::fake_nvml(&s, &crate::nvml::scenario("mig"));
    let out = run_with(
        None,
        Some(&library),
        &[
            GI10,
            "--",
            "sh",
            "-c",
            "echo $DEVLOCK_RESOURCES $CUDA_VISIBLE_DEVICES",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        stdout(&out).trim(),
        format!("{GI10} MIG-0f1e2d3c-4b5a-5968-8776-a5b4c3d2e1f0")
    );
    // No NVML to ask: said, nothing ran, nothing left in etcd.
    let ran = s.work("ran");
    let out = run_with(None, None, &[GI10, "--", "touch", ran.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot tell CUDA which MIG instance"),
        "{}",
        stderr(&out)
    );
    assert!(!ran.exists());
    for r in [GI10, "gpu:0"] {
        assert_eq!(status(&s, &url, r)["holders"].as_array().unwrap().len(), 0);
    }
}

test!(etcd_any_holder_cut_off_stops_its_work_before_the_next_one_starts, needs: [Root, Tool("etcd"), Tool("etcdctl"), Tool("unshare")]);
/// `--any a b` on m1 through a proxy the test cuts takes `a` (b is held on
/// m2); a plain waiter for `a` on m3 starts only once m1's command, and
/// what it left running, are dead, and m1 never held a place in b's line.
pub(crate) fn etcd_any_holder_cut_off_stops_its_work_before_the_next_one_starts() {
    let (_server, url) = shared_etcd();
    let proxy = Proxy::to(&url);
    let s = Scratch::new();
    let (a, b) = (name("any-cut-a"), name("any-cut-b"));
    let (held_b, held_b_started) = hold_script(&s, "m2", "DEVLOCK_RESOURCES");
    let mut holder_b = spawn_on("m2", &s, &url, &["-q", &b], &held_b);
    wait_for_file(&held_b_started);
    let (shell, orphan, got) = (s.work("shell"), s.work("orphan"), s.work("got-m1"));
    let script = format!(
        "(trap '' TERM; exec sleep 1000) & {}; echo $DEVLOCK_RESOURCES > {}; {}; wait",
        write_pid("$!", &orphan),
        got.display(),
        write_pid("$$", &shell)
    );
    let cut_off = spawn_on(
        "m1",
        &s,
        &proxy.url,
        &["--ttl", "3s", "--kill-after", "500ms", "--any", &a, &b],
        &script,
    );
    wait_for_file(&shell);
    assert_eq!(read(&got), a);
    assert_eq!(waiters(&status(&s, &url, &b)), 0);
    let verdict = s.work("verdict");
    let mut waiter = spawn_on(
        "m3",
        &s,
        &url,
        &["-q", &a],
        &verdict_script(&[&shell, &orphan], &verdict),
    );
    wait_for(&s, &url, &a, "a waiter", |v| waiters(v) == 1);
    proxy.cut();
    stopped_on_lease_loss(cut_off);
    assert!(wait_child(&mut waiter).success());
    assert_eq!(read(&verdict), "clean");
    release(&s, "m2");
    assert!(wait_child(&mut holder_b).success());
}

test!(etcd_slot_numbers_planted_by_hand_bound_every_wait, needs: [Tool("etcd"), Tool("etcdctl")]);
/// Keys put by hand (no lease) on every slot number of a pool: a request
/// whose turn in the line comes still meets `-n` and `-w` in the numbering,
/// is told which keys are in the way, and leaves the line.
pub(crate) fn etcd_slot_numbers_planted_by_hand_bound_every_wait() {
    let (_server, url) = shared_etcd();
    let s = Scratch::new();
    let pool = name("planted-slots");
    for k in 1..=2 {
        crate::etcd::etcdctl(&url, &["put", &format!("/devlock/.slots/{pool}/{k}"), "x"]);
    }
    let run = |args: &[&str]| {
        crate::etcd::devlock(&s, &url)
            .args(args)
            .args(["--slots", "2", &pool, "--", "true"])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run(&["-n"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("every slot number") && stderr(&out).contains(&pool),
        "{}",
        stderr(&out)
    );
    let out = run(&["-w", "1"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(stderr(&out).contains("gave up on"), "{}", stderr(&out));
    // Nothing of theirs stays in the line.
    let line = crate::etcd::etcdctl(
        &url,
        &[
            "get",
            "--prefix",
            "--keys-only",
            &format!("/devlock/{pool}/"),
        ],
    );
    assert!(line.trim().is_empty(), "{line}");
    crate::etcd::etcdctl(
        &url,
        &["del", "--prefix", &format!("/devlock/.slots/{pool}/")],
    );
    let out = run(&["-n"]);
    assert!(out.status.success(), "{}", stderr(&out));
}
