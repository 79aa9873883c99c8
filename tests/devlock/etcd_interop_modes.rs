//! devlock's `--shared`, `--slots` and `--any` against `etcdctl lock` on one
//! real etcd server: what each tool sees of the other, and what it keeps out.

use crate::etcd::{name, status, waiters};
use crate::etcd_interop::{By, FOREIGN, Gate, read, succeeded};
use crate::etcd_server::shared_etcd;
use crate::harness::*;

test!(etcd_interop_shared_holders_and_etcdctl_exclude_each_other, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `--shared`: an etcdctl holder keeps `devlock -n --shared R` out, naming
/// it. Two shared devlock holders hold together; `etcdctl lock` waits for
/// both, and a shared devlock that comes after it waits for it (a key
/// devlock did not write counts as exclusive: writer preference), so the
/// order is the shared pair, etcdctl, the later reader.
pub(crate) fn etcd_interop_shared_holders_and_etcdctl_exclude_each_other() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let r = name("interop-shared");
    let lock = format!("/devlock/{r}");
    let etcdctl = g.holding(By::Etcdctl(&lock), "e");
    let err = g.refused(&["-n", "--shared", &r, "--", "true"]);
    assert!(
        err.contains(&format!("held by {FOREIGN} (key {lock}/")),
        "{err}"
    );
    g.release("e");
    succeeded([etcdctl]);

    let shared: &[&str] = &["--shared", &r];
    let a = g.holding(By::Devlock(shared), "a");
    let b = g.holding(By::Devlock(shared), "b");
    let etcdctl = g.behind(By::Etcdctl(&lock), "etcdctl");
    g.waiting(&r, 1);
    let later = g.behind(By::Devlock(shared), "later");
    g.waiting(&r, 2);
    g.refused(&["-n", "--shared", &r, "--", "true"]);
    g.release("a");
    g.release("b");
    succeeded([a, b, etcdctl, later]);
    assert_eq!(
        g.lines_with_ties(1..3),
        ["e-end", "a-end", "b-end", "etcdctl", "later"]
    );
}

test!(etcd_interop_slot_holders_and_etcdctl_exclude_each_other, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `--slots 2`: an etcdctl holder keeps `devlock -n --slots 2 R` out,
/// naming it. One slot holder keeps `etcdctl lock` waiting, and a second
/// slot request that comes after etcdctl waits for it though a slot is
/// free (the key devlock did not write counts as exclusive); it then takes
/// slot 1.
pub(crate) fn etcd_interop_slot_holders_and_etcdctl_exclude_each_other() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let r = name("interop-slots");
    let lock = format!("/devlock/{r}");
    let etcdctl = g.holding(By::Etcdctl(&lock), "e");
    let err = g.refused(&["-n", "--slots", "2", &r, "--", "true"]);
    assert!(
        err.contains(&format!("held by {FOREIGN} (key {lock}/")),
        "{err}"
    );
    g.release("e");
    succeeded([etcdctl]);

    let slots: &[&str] = &["--slots", "2", &r];
    let first = g.holding(By::Devlock(slots), "a");
    let etcdctl = g.behind(By::Etcdctl(&lock), "etcdctl");
    g.waiting(&r, 1);
    let second = g.take(By::Devlock(slots), &g.append("b-slot-$DEVLOCK_SLOT"));
    g.waiting(&r, 2);
    g.release("a");
    succeeded([first, etcdctl, second]);
    assert_eq!(g.log(), "e-end\na-end\netcdctl\nb-slot-1\n");
}

test!(etcd_interop_any_picks_around_an_etcdctl_holder_and_keeps_it_off_the_pick, needs: [Tool("etcd"), Tool("etcdctl")]);
/// `--any G:0 G:1` with `etcdctl lock /devlock/G:0` holding picks `G:1`,
/// and leaves `G:0`'s line. While it holds, `-n --any` of both is busy,
/// `etcdctl lock` of the pick and of the group (held shared on the pick's
/// behalf) wait, and both run once devlock's command has ended; etcdctl's
/// holder of `G:0` is untouched throughout.
pub(crate) fn etcd_interop_any_picks_around_an_etcdctl_holder_and_keeps_it_off_the_pick() {
    let (_server, url) = shared_etcd();
    let g = Gate::new(&url);
    let group = name("iga");
    let [m0, m1] = [0, 1].map(|n| format!("{group}:{n}"));
    let etcdctl = g.holding(By::Etcdctl(&format!("/devlock/{m0}")), "e");
    let picked = g.s.work("picked");
    let (wait, ready) = wait_for_release(&g.s, "d");
    let any: &[&str] = &["--any", &m0, &m1];
    let holder = g.take(
        By::Devlock(any),
        &format!(
            "echo \"$DEVLOCK_RESOURCES\" > {}; {wait}; {}",
            picked.display(),
            g.append("d-end")
        ),
    );
    wait_for_file(&ready);
    assert_eq!(read(&picked).trim(), m1);
    assert_eq!(waiters(&status(&g.s, &url, &m0)), 0);
    g.refused(&[&["-n"], any, &["--", "true"]].concat());
    let on_pick = g.behind(By::Etcdctl(&format!("/devlock/{m1}")), "etcdctl-pick");
    let on_group = g.behind(By::Etcdctl(&format!("/devlock/{group}")), "etcdctl-group");
    g.waiting(&m1, 1);
    g.waiting(&group, 1);
    assert_eq!(g.log(), "");
    g.release("d");
    succeeded([holder, on_pick, on_group]);
    g.release("e");
    succeeded([etcdctl]);
    assert_eq!(
        g.lines_with_ties(1..3),
        ["d-end", "etcdctl-group", "etcdctl-pick", "e-end"]
    );
}
