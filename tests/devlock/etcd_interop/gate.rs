//! One gate, whichever tool holds and whichever waits: etcdctl's and
//! devlock's takes side by side, logged to one file (for etcd_interop_modes too).

use super::*;

/// What devlock calls a holder whose key it did not write.
pub(crate) const FOREIGN: &str = "etcdctl lock or another client";

/// Starts `etcdctl lock NAME sh -c SCRIPT`: it waits its turn, runs the
/// script holding the lock and gives it back when the script ends.
pub(crate) fn etcdctl_lock(url: &str, lock: &str, script: &str) -> Child {
    Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", url, "lock", lock, "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("etcdctl (Debian package etcd-client)")
}

/// One take, by either tool.
#[derive(Clone, Copy)]
pub(crate) enum By<'a> {
    /// `etcdctl lock LOCK` (the whole key prefix, `/devlock/R`).
    Etcdctl(&'a str),
    /// `devlock -q ARGS`.
    Devlock(&'a [&'a str]),
}

/// The scratch, the server and the log every take of one test writes to.
pub(crate) struct Gate {
    pub(crate) s: Scratch,
    url: String,
    log: std::path::PathBuf,
}

impl Gate {
    pub(crate) fn new(url: &str) -> Gate {
        let s = Scratch::new();
        let log = s.work("log");
        Gate {
            s,
            url: url.to_owned(),
            log,
        }
    }

    /// Starts `by` running `script` once it holds.
    pub(crate) fn take(&self, by: By, script: &str) -> Child {
        match by {
            By::Etcdctl(lock) => etcdctl_lock(&self.url, lock, script),
            By::Devlock(args) => spawn(&self.s, &self.url, &[&["-q"], args].concat(), script),
        }
    }

    /// `by` holding, once this returns, until `release(tag)`; it logs
    /// `TAG-end` as its command ends.
    pub(crate) fn holding(&self, by: By, tag: &str) -> Child {
        let (wait, ready) = wait_for_release(&self.s, tag);
        let child = self.take(
            by,
            &format!("{wait}; {}", self.append(&format!("{tag}-end"))),
        );
        wait_for_file(&ready);
        child
    }

    /// `by` in line: it logs `TAG` once it holds, and gives the lock back.
    pub(crate) fn behind(&self, by: By, tag: &str) -> Child {
        self.take(by, &self.append(tag))
    }

    /// `first` holding and `then` waiting for it in `line`'s line (where
    /// `meanwhile` looks): `then` runs only once `first`'s command has ended.
    pub(crate) fn in_turn(&self, first: By, then: By, line: &str, meanwhile: impl FnOnce()) {
        let first = self.holding(first, "first");
        let then = self.behind(then, "then");
        self.waiting(line, 1);
        meanwhile();
        assert_eq!(self.log(), "");
        self.release("first");
        succeeded([first, then]);
        assert_eq!(self.log(), "first-end\nthen\n");
    }

    pub(crate) fn release(&self, tag: &str) {
        release(&self.s, tag);
    }

    pub(crate) fn append(&self, line: &str) -> String {
        format!("echo {line} >> {}", self.log.display())
    }

    pub(crate) fn log(&self) -> String {
        read(&self.log)
    }

    /// The log's lines, those at `ties` (which may come in any order)
    /// sorted.
    pub(crate) fn lines_with_ties(&self, ties: std::ops::Range<usize>) -> Vec<String> {
        let mut lines: Vec<String> = self.log().lines().map(str::to_owned).collect();
        if let Some(tied) = lines.get_mut(ties) {
            tied.sort_unstable();
        }
        lines
    }

    /// `devlock ARGS`, which must end as busy (75); what it said.
    pub(crate) fn refused(&self, args: &[&str]) -> String {
        let out = run(&self.s, &self.url, args);
        assert_eq!(out.status.code(), Some(75), "{args:?}: {}", stderr(&out));
        stderr(&out)
    }

    /// Waits until `resource`'s line has `n` waiters.
    pub(crate) fn waiting(&self, resource: &str, n: usize) {
        wait_for(
            &self.s,
            &self.url,
            resource,
            &format!("{n} waiting for {resource}"),
            |v| waiters(v) == n,
        );
    }
}

/// Waits for each take to end, and to have succeeded.
pub(crate) fn succeeded(children: impl IntoIterator<Item = Child>) {
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
}

pub(crate) fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}
