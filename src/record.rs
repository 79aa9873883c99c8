//! The holder's label inside a lock file (and a waiter's in its waiter file):
//! who, since when, doing what. A label only; the kernel says who really holds.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::procfs;

/// Largest record a reader accepts; anything longer is garbage.
pub const MAX_RECORD_BYTES: usize = 16 * 1024;

/// Longest command line kept in a record, so a huge argv cannot make the
/// record too long to write in one call.
const MAX_COMMAND_BYTES: usize = 4 * 1024;

/// Longest step name kept in a record.
const MAX_STEP_BYTES: usize = 256;

/// What devlock writes about a holder or waiter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Format version, so later versions can tell old records apart.
    pub v: u32,
    pub step: String,
    /// The devlock process (the pid `/proc/locks` names).
    pub pid: u32,
    /// Its start time in clock ticks since boot: pid plus start names one process.
    pub pid_start: Option<u64>,
    /// The command devlock runs, once started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_start: Option<u64>,
    pub uid: u32,
    /// The user name as the environment gave it (a label; readers show the
    /// name of `uid`, looked up when shown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Milliseconds since the Unix epoch when the lock was taken (or the wait began).
    pub since_ms: u64,
    pub boot_id: Option<String>,
    pub command: Vec<String>,
    /// Place in the resource's line (for a waiter, or a holder that came
    /// through it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<u64>,
    /// The semaphore slot held (`--slots`), counted from 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u64>,
    /// For a group's lock held on behalf of a member: that member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
}

impl Record {
    /// A record for this process, as of now.
    pub fn for_this_process(step: &str, command: &[String]) -> Record {
        let pid = std::process::id();
        let uid = nix::unistd::getuid().as_raw();
        Record {
            v: 1,
            step: clip(step, MAX_STEP_BYTES),
            pid,
            pid_start: own_start_time(),
            child: None,
            child_start: None,
            uid,
            user: std::env::var("USER").ok(),
            since_ms: now_ms(),
            boot_id: boot_id(),
            command: clip_command(command),
            ticket: None,
            slot: None,
            via: None,
        }
    }

    pub fn since(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.since_ms)
    }

    /// Whether the process the record names is still the one that wrote it
    /// (the devlock, or the command it started).
    pub fn names_live_process(&self) -> bool {
        self.live_pids().next().is_some()
    }

    /// The recorded processes that are still alive and still the same process.
    pub fn live_pids(&self) -> impl Iterator<Item = u32> + '_ {
        let same_boot = match (&self.boot_id, boot_id()) {
            (Some(then), Some(now)) => *then == now,
            _ => true,
        };
        [
            (Some(self.pid), self.pid_start),
            (self.child, self.child_start),
        ]
        .into_iter()
        .filter_map(move |(pid, start)| {
            let pid = pid?;
            (same_boot && procfs::is_same_process(pid, start)).then_some(pid)
        })
    }

    /// The record as one JSON object that carries a checksum of itself as
    /// its first member, so a reader can tell a torn read (bytes of two
    /// records mixed mid-update) from a whole record.
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = serde_json::to_vec(self).expect("a record always serialises");
        let mut bytes = format!("{{\"check\":\"{:016x}\",", fnv1a(&body)).into_bytes();
        bytes.extend_from_slice(&body[1..]);
        bytes.push(b'\n');
        bytes
    }

    /// Writes the record over the file's contents in one call, then cuts off
    /// whatever an older, longer record left behind.
    pub fn write_to(&self, file: &File) -> std::io::Result<()> {
        let bytes = self.to_bytes();
        let written = file.write_at(&bytes, 0)?;
        if written != bytes.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!(
                    "short write of holder record ({written} of {} bytes)",
                    bytes.len()
                ),
            ));
        }
        file.set_len(bytes.len() as u64)
    }
}

/// This process's start time, read once.
fn own_start_time() -> Option<u64> {
    static START: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *START.get_or_init(|| procfs::start_time(std::process::id()))
}

/// The boot id, read once.
fn boot_id() -> Option<String> {
    static BOOT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BOOT.get_or_init(procfs::boot_id).clone()
}

/// What a reader made of a record.
// Short-lived, one at a time: boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadRecord {
    Empty,
    Valid(Record),
    /// Still garbage after a few tries: torn beyond repair, or not ours.
    Unreadable,
}

impl ReadRecord {
    pub fn valid(self) -> Option<Record> {
        match self {
            ReadRecord::Valid(record) => Some(record),
            _ => None,
        }
    }
}

/// Reads the record in a file, tolerating a writer caught mid-update: a bounded
/// read, a few retries, then "unreadable".
pub fn read_from(file: &File) -> ReadRecord {
    const TRIES: usize = 3;
    // Records are a few hundred bytes; read a page first, more only if needed.
    let mut buf = vec![0u8; 4096];
    for attempt in 0..TRIES {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let Ok(mut len) = file.read_at(&mut buf, 0) else {
            continue;
        };
        if len == buf.len() && buf.len() <= MAX_RECORD_BYTES {
            buf.resize(MAX_RECORD_BYTES + 1, 0);
            let Ok(full) = file.read_at(&mut buf, 0) else {
                continue;
            };
            len = full;
        }
        if len == 0 {
            return ReadRecord::Empty;
        }
        if len > MAX_RECORD_BYTES {
            return ReadRecord::Unreadable;
        }
        if let Some(record) = parse(&buf[..len]) {
            return ReadRecord::Valid(record);
        }
    }
    ReadRecord::Unreadable
}

/// A record is accepted only whole: one JSON object ending in a newline whose
/// checksum matches the rest of it.
pub fn parse(bytes: &[u8]) -> Option<Record> {
    const PREFIX: &[u8] = b"{\"check\":\"";
    let text = bytes.strip_suffix(b"\n")?.strip_prefix(PREFIX)?;
    let (hex, rest) = (text.get(..16)?, text.get(16..)?.strip_prefix(b"\",")?);
    let check = u64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
    let mut body = Vec::with_capacity(rest.len() + 1);
    body.push(b'{');
    body.extend_from_slice(rest);
    if fnv1a(&body) != check {
        return None;
    }
    let record: Record = serde_json::from_slice(&body).ok()?;
    (record.v == 1).then_some(record)
}

/// FNV-1a, 64 bits: enough to catch a torn read, and nothing to depend on.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn clip(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

fn clip_command(command: &[String]) -> Vec<String> {
    let mut kept = Vec::new();
    let mut budget = MAX_COMMAND_BYTES;
    for arg in command {
        if arg.len() > budget {
            kept.push("...".to_owned());
            break;
        }
        budget -= arg.len();
        kept.push(arg.clone());
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_torn_or_foreign_text() {
        let record = Record::for_this_process("train", &["python".into(), "t.py".into()]);
        let bytes = record.to_bytes();
        assert_eq!(parse(&bytes), Some(record.clone()));
        for cut in [1, bytes.len() / 2, bytes.len() - 1] {
            assert_eq!(parse(&bytes[..cut]), None, "torn at {cut}");
        }
        assert_eq!(parse(b"garbage\n"), None);
        let text = String::from_utf8(bytes.clone()).unwrap();
        let mixed = text.replacen("\"step\":\"train\"", "\"step\":\"trbin\"", 1);
        assert_eq!(
            parse(mixed.as_bytes()),
            None,
            "a changed byte fails the check"
        );
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value["step"], "train", "the record stays plain JSON");
        assert_eq!(parse(b"{\"v\":2}\n"), None);
        assert!(record.names_live_process());
    }

    #[test]
    fn a_recycled_pid_is_not_the_recorded_process() {
        let mut record = Record::for_this_process("x", &[]);
        record.pid_start = record.pid_start.map(|t| t + 1);
        assert!(!record.names_live_process());
    }

    #[test]
    fn shorter_record_cuts_off_the_longer_one_before_it() {
        let file = tempfile::tempfile().unwrap();
        let long = Record::for_this_process(&"s".repeat(500), &[]);
        long.write_to(&file).unwrap();
        let short = Record::for_this_process("s", &[]);
        short.write_to(&file).unwrap();
        assert_eq!(read_from(&file), ReadRecord::Valid(short));
    }

    #[test]
    fn huge_command_lines_are_clipped() {
        let args = vec!["x".repeat(3000), "y".repeat(3000)];
        let record = Record::for_this_process("s", &args);
        assert_eq!(record.command.len(), 2);
        assert_eq!(record.command[1], "...");
        assert!(record.to_bytes().len() < MAX_RECORD_BYTES);
    }
}
