//! The holder's label inside a lock file (and a waiter's in its registration):
//! which step, since when, which place in line. A label only: the kernel says
//! who holds, `/proc` says who the user is and what runs; a record carries no
//! command line and no user name, so nothing secret outlives a hold.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::proc;

/// Largest record a reader accepts; anything longer is not ours.
pub const MAX_RECORD_BYTES: usize = 16 * 1024;

/// Longest step name kept in a record written by this process.
const MAX_STEP_BYTES: usize = 256;

/// What every record starts with: the magic and the format version, so a
/// reader tells a record from anything else a file may hold.
const MAGIC_V2: &[u8] = b"{\"magic\":\"devlock-record\",\"v\":2,\"check\":\"";

/// How version 1 records (with a command line and a user name) started.
/// They are never believed any more, but they are devlock's to overwrite.
const MAGIC_V1: &[u8] = b"{\"check\":\"";

/// Largest pid the kernel hands out (`PID_MAX_LIMIT` on 64-bit).
const MAX_PID: u32 = 1 << 22;

/// Largest ticket and slot numbers a record may carry (see queue.rs).
const MAX_TICKET: u64 = 1 << 32;
const MAX_SLOT: u64 = u16::MAX as u64;
/// Largest memory figure a record may carry: 1 PiB, far past any device.
const MAX_MEM_MIB: u64 = 1 << 30;
/// Largest GPU index a record may carry.
const MAX_GPU_INDEX: u32 = 1 << 16;

/// What devlock writes about a holder or waiter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The holder's (or waiter's) label: `--step`, or the command's name.
    pub step: String,
    /// The holding process (the pid `/proc/locks` names): devlock, which
    /// becomes the command it runs (the same pid and start time).
    pub pid: u32,
    /// Its start time in clock ticks since boot: pid plus start names one process.
    pub pid_start: u64,
    /// A child process that runs the work (written by devlock before it
    /// chain-loaded its command; read for holds that such a devlock made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child: Option<u32>,
    /// The command's start time, in clock ticks since boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_start: Option<u64>,
    /// The hold's watcher, where one runs beside the command (usage
    /// sampling, the idle policy, a memory budget's watch), and its start
    /// time: status says when it is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watcher: Option<u32>,
    /// The watcher's start time, in clock ticks since boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watcher_start: Option<u64>,
    /// Milliseconds since the Unix epoch when the lock was taken (or the wait began).
    pub since_ms: u64,
    /// The boot it was written in (`/proc/sys/kernel/random/boot_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
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
    /// A memory budget held on a GPU (`--mem`), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u64>,
    /// With a budget: what the job was measured using when it went over
    /// its budget by more than a tenth, MiB (a label for status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over_mib: Option<u64>,
    /// Milliseconds since the epoch since when the holder's GPUs computed
    /// nothing for its job, as its sampler saw (a label for status; only
    /// written while idle, so a reader from before it meets it only then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
    /// A library hold kept past its block's end because its process still
    /// uses the device: milliseconds since the epoch when the block ended
    /// (a label for status; only written while kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_ms: Option<u64>,
    /// While kept: what the process still used at the last look, MiB, on
    /// `kept_gpu` (the GPU where it uses the most).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_mib: Option<u64>,
    /// While kept: the GPU `kept_mib` is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_gpu: Option<u32>,
}

impl Record {
    /// A record for this process, as of now.
    pub fn for_this_process(step: &str) -> Record {
        Record {
            step: clip(step, MAX_STEP_BYTES),
            pid: std::process::id(),
            pid_start: own_start_time().unwrap_or(0),
            child: None,
            child_start: None,
            watcher: None,
            watcher_start: None,
            since_ms: now_ms(),
            boot_id: boot_id(),
            ticket: None,
            slot: None,
            via: None,
            mem_mib: None,
            over_mib: None,
            idle_since_ms: None,
            kept_ms: None,
            kept_mib: None,
            kept_gpu: None,
        }
    }

    /// When the lock was taken (or the wait began).
    pub fn since(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.since_ms)
    }

    /// Whether the record was written in this boot (a record without a boot
    /// id cannot say, and is taken to be).
    pub fn this_boot(&self) -> bool {
        match (&self.boot_id, boot_id()) {
            (Some(then), Some(now)) => *then == now,
            _ => true,
        }
    }

    /// Whether `pid` is the very process this record's `pid` names.
    pub fn names(&self, pid: u32) -> bool {
        self.pid == pid
            && self.this_boot()
            && proc::process::start_time(pid) == Some(self.pid_start)
    }

    /// Whether `pid` is the very process this record's `child` names.
    pub fn names_child(&self, pid: u32) -> bool {
        self.child == Some(pid)
            && self.this_boot()
            && self
                .child_start
                .is_some_and(|start| proc::process::start_time(pid) == Some(start))
    }

    /// Whether the hold's watcher named here is gone (a watched hold whose
    /// watcher was killed runs on unwatched).
    pub fn watcher_gone(&self) -> bool {
        match (self.watcher, self.watcher_start) {
            (Some(pid), Some(start)) => {
                self.this_boot()
                    && (proc::process::start_time(pid) != Some(start)
                        || proc::process::is_zombie(pid))
            }
            _ => false,
        }
    }

    /// The record as bytes: one JSON object whose first members are the
    /// magic, the version and a checksum of the rest, so that a reader tells
    /// a torn read (bytes of two records mixed mid-update) from a whole one.
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = serde_json::to_vec(self).expect("a record always serialises");
        let mut bytes = MAGIC_V2.to_vec();
        bytes.extend_from_slice(format!("{:016x}\",", fnv1a(&body)).as_bytes());
        bytes.extend_from_slice(&body[1..]);
        bytes.push(b'\n');
        bytes
    }

    /// Writes the record over the file's contents in one call, then cuts off
    /// whatever an older, longer record left behind. Callers check first
    /// that the file is theirs to write ([`is_ours_to_write`]).
    pub fn write_to(&self, file: &File) -> std::io::Result<()> {
        self.write_over(file, u64::MAX).map(|_| ())
    }

    /// [`Record::write_to`] over a file known to be `old_len` bytes long:
    /// the cut is skipped when nothing longer is left behind (a metadata
    /// change the filesystem would journal for nothing). Returns the
    /// length written.
    pub(crate) fn write_over(&self, file: &File, old_len: u64) -> std::io::Result<u64> {
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
        let len = bytes.len() as u64;
        if old_len > len {
            file.set_len(len)?;
        }
        Ok(len)
    }
}

/// Whether bytes read from the start of a file may be overwritten with a
/// record: nothing, or something devlock wrote (a record of any version,
/// whole or torn). Anything else is somebody's data (a `Cargo.lock` in
/// `--dir .`).
pub(crate) fn is_ours_to_write(start: &[u8]) -> bool {
    start.is_empty()
        || start.starts_with(MAGIC_V2)
        || MAGIC_V2.starts_with(start)
        || start.starts_with(MAGIC_V1)
}

/// This process's start time, read once.
fn own_start_time() -> Option<u64> {
    static START: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *START.get_or_init(|| proc::process::start_time(std::process::id()))
}

/// The boot id, read once.
fn boot_id() -> Option<String> {
    static BOOT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    BOOT.get_or_init(proc::process::boot_id).clone()
}

/// What a reader made of a record.
// Short-lived, one at a time: boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadRecord {
    /// The file is empty.
    Empty,
    /// A whole, sane record.
    Valid(Record),
    /// Still garbage after a few tries: torn beyond repair, absurd, or not ours.
    Unreadable,
}

impl ReadRecord {
    /// The record, if it was one.
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
    let mut buf = vec![0u8; MAX_RECORD_BYTES + 1];
    for attempt in 0..TRIES {
        if attempt > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let Ok(len) = file.read_at(&mut buf, 0) else {
            continue;
        };
        if len == 0 {
            return ReadRecord::Empty;
        }
        if len > MAX_RECORD_BYTES {
            return ReadRecord::Unreadable;
        }
        if let Some(record) = parse(&buf[..len]) {
            return ReadRecord::Valid(record);
        }
        if !is_ours_to_write(&buf[..len]) {
            // Not a record being rewritten: somebody's data. No retry helps.
            return ReadRecord::Unreadable;
        }
    }
    ReadRecord::Unreadable
}

/// A record is accepted only whole and sane: the magic and version, a
/// checksum that matches, known fields only, and every number in bounds.
pub fn parse(bytes: &[u8]) -> Option<Record> {
    if bytes.len() > MAX_RECORD_BYTES {
        return None;
    }
    let text = bytes.strip_suffix(b"\n")?.strip_prefix(MAGIC_V2)?;
    let (hex, rest) = (text.get(..16)?, text.get(16..)?.strip_prefix(b"\",")?);
    let check = u64::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
    let mut body = Vec::with_capacity(rest.len() + 1);
    body.push(b'{');
    body.extend_from_slice(rest);
    if fnv1a(&body) != check {
        return None;
    }
    let record: Record = serde_json::from_slice(&body).ok()?;
    record.in_bounds().then_some(record)
}

impl Record {
    /// Whether every number is one a real devlock could have written: a
    /// record anyone can write must not make a reader compute with absurd
    /// values.
    fn in_bounds(&self) -> bool {
        let pid_ok = |p: u32| (1..=MAX_PID).contains(&p);
        // A day of clock skew is plenty; anything later is made up.
        let latest = now_ms().saturating_add(86_400_000);
        pid_ok(self.pid)
            && self.child.is_none_or(pid_ok)
            && self.child.is_some() == self.child_start.is_some()
            && self.watcher.is_none_or(pid_ok)
            && self.watcher.is_some() == self.watcher_start.is_some()
            && self.since_ms <= latest
            && self.ticket.is_none_or(|t| (1..=MAX_TICKET).contains(&t))
            && self.slot.is_none_or(|s| (1..=MAX_SLOT).contains(&s))
            && self.mem_mib.is_none_or(|m| (1..=MAX_MEM_MIB).contains(&m))
            && self.over_mib.is_none_or(|m| m <= MAX_MEM_MIB)
            && self.idle_since_ms.is_none_or(|t| t <= latest)
            && self.kept_ms.is_none_or(|t| t <= latest)
            && self.kept_mib.is_none_or(|m| m <= MAX_MEM_MIB)
            && self.kept_gpu.is_none_or(|g| g <= MAX_GPU_INDEX)
            && self
                .boot_id
                .as_ref()
                .is_none_or(|b| b.len() <= 64 && b.bytes().all(|c| c.is_ascii_graphic()))
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_torn_or_foreign_text() {
        let record = Record::for_this_process("train");
        let bytes = record.to_bytes();
        assert!(bytes.starts_with(MAGIC_V2));
        assert_eq!(parse(&bytes), Some(record.clone()));
        for cut in [1, bytes.len() / 2, bytes.len() - 1] {
            assert_eq!(parse(&bytes[..cut]), None, "torn at {cut}");
            assert!(is_ours_to_write(&bytes[..cut]), "a torn record is ours");
        }
        assert_eq!(parse(b"garbage\n"), None);
        assert!(!is_ours_to_write(
            b"# This file is automatically @generated"
        ));
        let text = String::from_utf8(bytes.clone()).unwrap();
        let mixed = text.replacen("\"step\":\"train\"", "\"step\":\"trbin\"", 1);
        assert_eq!(
            parse(mixed.as_bytes()),
            None,
            "a changed byte fails the check"
        );
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(value["step"], "train", "the record stays plain JSON");
        assert!(value.get("command").is_none() && value.get("user").is_none());
        assert!(record.names(std::process::id()));
    }

    #[test]
    fn version_1_records_are_never_believed_but_are_ours() {
        let v1 = br#"{"check":"0123456789abcdef","v":1,"step":"x","pid":1,"pid_start":1,"uid":0,"since_ms":0,"boot_id":null,"command":["secret"]}
"#;
        assert_eq!(parse(v1), None);
        assert!(is_ours_to_write(v1));
    }

    /// A record with a valid check whose body says anything we like.
    fn forged(body: &str) -> Vec<u8> {
        let mut bytes = MAGIC_V2.to_vec();
        bytes.extend_from_slice(format!("{:016x}\",", fnv1a(body.as_bytes())).as_bytes());
        bytes.extend_from_slice(&body.as_bytes()[1..]);
        bytes.push(b'\n');
        bytes
    }

    #[test]
    fn absurd_numbers_and_unknown_fields_are_refused() {
        let ok = r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1}"#;
        assert!(parse(&forged(ok)).is_some());
        for body in [
            r#"{"step":"s","pid":0,"pid_start":1,"since_ms":1}"#,
            r#"{"step":"s","pid":4294967295,"pid_start":1,"since_ms":1}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":18446744073709551615}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"ticket":9223372036854775807}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"slot":0}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"child":7}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"command":["x"]}"#,
            r#"{"step":"s","pid":-1,"pid_start":1,"since_ms":1}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"kept_gpu":4294967295}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"kept_ms":18446744073709551615}"#,
            r#"{"step":"s","pid":5,"pid_start":1,"since_ms":1,"kept_mib":18446744073709551615}"#,
        ] {
            assert_eq!(parse(&forged(body)), None, "{body}");
        }
    }

    #[test]
    fn a_recycled_pid_is_not_the_recorded_process() {
        let mut record = Record::for_this_process("x");
        record.pid_start += 1;
        assert!(!record.names(std::process::id()));
    }

    #[test]
    fn shorter_record_cuts_off_the_longer_one_before_it() {
        let file = tempfile::tempfile().unwrap();
        let long = Record::for_this_process(&"s".repeat(500));
        long.write_to(&file).unwrap();
        let short = Record::for_this_process("s");
        short.write_to(&file).unwrap();
        assert_eq!(read_from(&file), ReadRecord::Valid(short));
    }

    #[test]
    fn huge_steps_are_clipped() {
        let record = Record::for_this_process(&"é".repeat(3000));
        assert!(record.step.len() <= MAX_STEP_BYTES);
        assert!(record.to_bytes().len() < MAX_RECORD_BYTES);
    }

    /// What every reader of an accepted record does with it: its moments
    /// as times and as RFC 3339 (status, serve), none of which may panic.
    fn use_as_readers_do(record: &Record) {
        let since = record.since();
        let _ = humantime::format_rfc3339_seconds(since).to_string();
        if let Some(t) = record.idle_since_ms {
            let idle = UNIX_EPOCH + Duration::from_millis(t);
            let _ = humantime::format_rfc3339_seconds(idle).to_string();
        }
    }

    /// A number as a record field may hold one: in range, at the edges,
    /// or anything JSON can spell.
    fn any_number() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (1u64..=5).prop_map(|n| n.to_string()),
            1 => any::<u64>().prop_map(|n| n.to_string()),
            1 => any::<i64>().prop_map(|n| n.to_string()),
            1 => prop::sample::select(vec![
                "4194304".to_owned(),
                "4194305".to_owned(),
                "4294967296".to_owned(),
                "18446744073709551616".to_owned(),
                "1e308".to_owned(),
                "0".to_owned(),
                "-0".to_owned(),
                "1.5".to_owned(),
                "null".to_owned(),
                "\"7\"".to_owned(),
                "253402300800000".to_owned(),
            ]),
        ]
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Bytes of any kind: no panic, and nothing over the size
            /// limit or out of bounds is ever accepted.
            #[test]
            fn any_bytes_are_read_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
                if let Some(record) = parse(&bytes) {
                    prop_assert!(bytes.len() <= MAX_RECORD_BYTES);
                    prop_assert!(record.in_bounds());
                    use_as_readers_do(&record);
                }
            }

            /// The same after the magic, so the checksum and JSON are
            /// reached: the check refuses what it does not match.
            #[test]
            fn bytes_after_the_magic_fail_the_check(
                check in "[0-9a-f]{16}",
                body in prop::collection::vec(any::<u8>(), 0..2048),
            ) {
                let mut bytes = MAGIC_V2.to_vec();
                bytes.extend_from_slice(check.as_bytes());
                bytes.extend_from_slice(b"\",");
                bytes.extend_from_slice(&body);
                bytes.push(b'\n');
                if let Some(record) = parse(&bytes) {
                    prop_assert!(record.in_bounds());
                    use_as_readers_do(&record);
                }
            }

            /// A forged record (its check right) with any numbers, any
            /// step (control and format characters, escapes of invalid
            /// UTF-16, long) and any boot id: accepted only in bounds,
            /// and then harmless to every reader.
            #[test]
            fn forged_numbers_are_accepted_only_in_bounds(
                pid in any_number(),
                pid_start in any_number(),
                since_ms in any_number(),
                ticket in any_number(),
                slot in any_number(),
                mem in any_number(),
                idle in any_number(),
                child in prop::option::of((any_number(), any_number())),
                step in prop_oneof![
                    "\\PC{0,40}".prop_map(|t| serde_json::to_string(&t).unwrap()),
                    "[\u{0}-\u{1f}\u{7f}-\u{9f}\u{202e}\u{200f}]{0,20}"
                        .prop_map(|t| serde_json::to_string(&t).unwrap()),
                    // Escapes of invalid UTF-16: a pair, and lone halves.
                    Just(r#""\ud800\udc00""#.to_owned()),
                    Just(r#""a\udfffb""#.to_owned()),
                    Just(r#""\ud800""#.to_owned()),
                    "x{0,20000}".prop_map(|t| serde_json::to_string(&t).unwrap()),
                ],
                boot in prop_oneof![3 => "[!-~]{0,64}", 1 => "\\PC{0,80}"],
            ) {
                let boot = serde_json::to_string(&boot).unwrap();
                let child = child.map_or(String::new(), |(c, s)| {
                    format!(r#","child":{c},"child_start":{s}"#)
                });
                let body = format!(
                    r#"{{"step":{step},"pid":{pid},"pid_start":{pid_start},"since_ms":{since_ms},"boot_id":{boot},"ticket":{ticket},"slot":{slot},"mem_mib":{mem},"idle_since_ms":{idle}{child}}}"#
                );
                let bytes = forged(&body);
                match parse(&bytes) {
                    Some(record) => {
                        prop_assert!(bytes.len() <= MAX_RECORD_BYTES);
                        prop_assert!(record.in_bounds());
                        prop_assert!((1..=MAX_PID).contains(&record.pid));
                        prop_assert!(record.ticket.is_none_or(|t| t <= MAX_TICKET));
                        use_as_readers_do(&record);
                    }
                    None => {
                        // Refused: over the size limit, not JSON of a
                        // record, or a number out of bounds.
                        let value: Option<Record> = serde_json::from_str(&body).ok();
                        prop_assert!(
                            bytes.len() > MAX_RECORD_BYTES || value.is_none_or(|r| !r.in_bounds()),
                            "a sane record was refused: {}", body
                        );
                    }
                }
            }

            /// What this process writes reads back as it was, whatever the
            /// step, and every cut of it (a torn read) is refused but left
            /// devlock's to write over.
            #[test]
            fn written_records_round_trip_and_torn_ones_are_refused(
                step in "\\PC{0,300}",
                cut in any::<prop::sample::Index>(),
            ) {
                let record = Record::for_this_process(&step);
                let bytes = record.to_bytes();
                prop_assert!(bytes.len() < MAX_RECORD_BYTES);
                prop_assert_eq!(parse(&bytes), Some(record));
                let at = cut.index(bytes.len());
                prop_assert_eq!(parse(&bytes[..at]), None);
                prop_assert!(is_ours_to_write(&bytes[..at]));
            }
        }
    }
}
