//! Torture: a dozen jobs and a chaos thread on one lock, records rewritten
//! under their readers, a lock file deleted under its waiters, and stop
//! signals sent to supervisors with a queue behind them.
//!
//! Every handshake waits for a file, a log line, a `/proc/locks` entry or a
//! thread asleep in a lock call, bounded by HANG; sleeps only pace the work.
//! Every process runs as the leader of a process group of its own, and a
//! guard kills what is left of those groups on the way out, panic or not.
//!
//! `DEVLOCK_SOAK=1` makes every test run longer (minutes in all);
//! `DEVLOCK_TORTURE_SEED=N` replays a chaos run's choices.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use devlock::testing::procfs::{FileId, parse_locks};
use devlock::testing::record::{self, ReadRecord, Record};

use crate::harness::*;

mod chaos;
mod inode;
mod records;
mod stops;

// ----------------------------------------------------------------------------
// Small helpers: the kernel's lock table, bounded polling, logs, randomness.

/// A file as `/proc/locks` names it.
type FileKey = FileId;

fn file_key(path: &Path) -> FileKey {
    let meta = std::fs::metadata(path).unwrap();
    FileId::from_metadata(meta.dev(), meta.ino())
}

/// `(pid, blocked)` for every flock entry on `key` in `/proc/locks`, read
/// with the crate's own parser.
fn flocks_on(key: FileKey) -> Vec<(u32, bool)> {
    let text = std::fs::read_to_string("/proc/locks").unwrap();
    parse_locks(&text)
        .into_iter()
        .filter(|l| l.file == key)
        .map(|l| (l.pid, l.blocked))
        .collect()
}

/// Polls `ok` until it holds; only a hang fails.
fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < HANG, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits until the kernel shows `pid` blocked in flock on `key`.
fn wait_blocked_on(key: FileKey, pid: u32, who: &str) {
    wait_until(
        &format!("{who} (pid {pid}) to block on inode {}", key.ino),
        || flocks_on(key).contains(&(pid, true)),
    );
}

/// Whether a thread of `pid` sleeps in a lock call: flock(2), or a blocking
/// fcntl(2) record lock (a line of byte-range locks, say). Whichever way
/// devlock makes its waiters wait, this sees them.
fn sleeping_in_lock_call(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        let text = std::fs::read_to_string(task.path().join("syscall")).unwrap_or_default();
        let mut words = text.split_whitespace();
        let call = words.next().and_then(|w| w.parse::<libc::c_long>().ok());
        let arg = |w: Option<&str>| {
            w.and_then(|w| i64::from_str_radix(w.trim_start_matches("0x"), 16).ok())
        };
        let (_fd, cmd) = (arg(words.next()), arg(words.next()));
        match call {
            Some(libc::SYS_flock) => true,
            Some(libc::SYS_fcntl) => {
                cmd == Some(i64::from(libc::F_SETLKW)) || cmd == Some(i64::from(libc::F_OFD_SETLKW))
            }
            _ => false,
        }
    })
}

fn log_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Appends one line in one O_APPEND write, as the shell's `>>` does.
fn append(path: &Path, line: &str) {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    file.write_all(format!("{line}\n").as_bytes()).unwrap();
}

fn excerpt(lines: &[String], from: usize, to: usize) -> String {
    let start = from.saturating_sub(3);
    let end = (to + 4).min(lines.len());
    (start..end)
        .map(|i| format!("  {i:5}: {}", lines[i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn err_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn soak() -> bool {
    std::env::var("DEVLOCK_SOAK").is_ok_and(|v| v == "1")
}

/// xorshift64*: enough to vary the chaos, and replayable from its seed.
struct Rng(u64);

impl Rng {
    fn seeded() -> (Rng, u64) {
        let seed = std::env::var("DEVLOCK_TORTURE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        (Rng(seed | 1), seed)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

// ----------------------------------------------------------------------------
// 1. Chaos: devlock and plain flock jobs on one resource, supervisors and
//    waiters killed and signalled at random. Nobody may ever share the lock.

// ----------------------------------------------------------------------------
// 2. Records rewritten thousands of times under concurrent readers: whatever
//    a reader accepts is exactly one of the records written.

// ----------------------------------------------------------------------------
// 3. The inode split: a holder holds, waiter A has the file open and waits,
//    somebody deletes the lock file, C arrives and creates a new one. A and C
//    must never run at once.

// ----------------------------------------------------------------------------
// 4. Stop signals sent twice to a holding supervisor with three waiters
//    queued behind it: the command hears each once, cleans up, and only
//    then does the next waiter start; every waiter runs.
