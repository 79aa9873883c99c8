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

/// A critical section: `enter`, a few read-modify-writes of a counter (each
/// logged as `rmw`), `leave`. A stop signal is trapped: logged as `sig`, it
/// ends the loop early, and the section still leaves and exits 7. The trap is
/// set before `enter`, so a signal that kills the shell kills it before it
/// entered. The counter is written in place, one write(2) of a fixed width
/// (printf is built in), so that a section its guard kills mid-write leaves
/// the old value or the new, never a torn one.
fn section_script(id: &str, log: &Path, counter: &Path, rmws: u32) -> String {
    let (log, counter) = (log.display(), counter.display());
    format!(
        "trap 'echo \"sig {id}\" >> {log}; stop=1' TERM INT HUP; \
         echo \"enter {id} $$\" >> {log}; i=0; \
         while [ $i -lt {rmws} ] && [ -z \"$stop\" ]; do \
           read n < {counter}; sleep 0.001; printf '%10d\\n' $((n+1)) 1<> {counter}; \
           echo \"rmw {id}\" >> {log}; i=$((i+1)); \
         done; \
         echo \"leave {id}\" >> {log}; [ -z \"$stop\" ] || exit 7"
    )
}

struct ChaosRig {
    dir: PathBuf,
    lock: PathBuf,
    log: PathBuf,
    counter: PathBuf,
    work: PathBuf,
    procs: Procs,
    rmws: u32,
    /// When a section last ended, in any job.
    progress: Mutex<Instant>,
}

#[derive(Debug)]
struct SectionRun {
    id: String,
    status: ExitStatus,
    sent: Vec<i32>,
}

/// Job `j`: every fourth job is plain util-linux flock, the others devlock
/// (every fourth with `-w`, which waits through the same path with a timer).
fn chaos_job(rig: &ChaosRig, j: usize, sections: usize) -> Vec<SectionRun> {
    let flock = j % 4 == 3;
    let mut runs = Vec::new();
    for k in 0..sections {
        let id = format!("{}{j}.{k}", if flock { 'f' } else { 'd' });
        let script = section_script(&id, &rig.log, &rig.counter, rig.rmws);
        let mut cmd = if flock {
            let mut cmd = Command::new("/usr/bin/flock");
            cmd.arg(&rig.lock);
            cmd
        } else {
            let mut cmd = Command::new(BIN);
            cmd.env("DEVLOCK_DIR", &rig.dir).arg("-q");
            if j % 4 == 1 {
                cmd.args(["-w", "1h"]);
            }
            cmd.args(["r", "--"]);
            cmd
        };
        let err = File::create(rig.work.join(format!("{id}.err"))).unwrap();
        cmd.args(["sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err);
        let Some(pid) = rig.procs.spawn(&id, &mut cmd) else {
            break;
        };
        // A job may wait its turn behind all the others for long: it hangs
        // only if nobody has got anywhere for HANG either.
        let status = rig.procs.wait_unless_hung(pid, |waited| {
            let idle = rig
                .progress
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed();
            waited > HANG && idle > HANG
        });
        *rig.progress.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        runs.push(SectionRun {
            id,
            status,
            sent: rig.procs.sent(pid),
        });
    }
    runs
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Hit {
    /// SIGKILL the devlock that holds the lock: its guard ends its
    /// command, which may die mid-section.
    KillHolder,
    /// SIGKILL a devlock blocked in flock.
    KillWaiter,
    /// TERM/INT/HUP (once or twice) to the holding devlock.
    StopHolder,
    /// TERM/INT/HUP to a blocked devlock.
    StopWaiter,
    /// TERM/INT/HUP to any devlock, whatever it is doing (starting,
    /// acquiring, spawning, reaping).
    StopAnyone,
}

const HITS: [Hit; 5] = [
    Hit::KillHolder,
    Hit::KillWaiter,
    Hit::StopHolder,
    Hit::StopWaiter,
    Hit::StopAnyone,
];

const STOPS: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Hits one fresh devlock every few ms, the least used kind of hit first,
/// until `done`.
fn chaos_monkey(rig: &ChaosRig, done: &AtomicBool, mut rng: Rng) -> HashMap<Hit, usize> {
    let key = file_key(&rig.lock);
    let mut hits: HashMap<Hit, usize> = HITS.iter().map(|&h| (h, 0)).collect();
    while !done.load(Ordering::Acquire) && !rig.procs.is_stopped() {
        // Pacing only: how much chaos, not a handshake.
        std::thread::sleep(Duration::from_millis(20 + rng.below(60) as u64));
        let fresh = rig.procs.fresh("d");
        if fresh.is_empty() {
            continue;
        }
        let kernel = flocks_on(key);
        let pick = |blocked: bool| -> Vec<u32> {
            kernel
                .iter()
                .filter(|&&(pid, b)| b == blocked && fresh.contains(&pid))
                .map(|&(pid, _)| pid)
                .collect()
        };
        let holders = pick(false);
        let blocked_in_flock = pick(true);
        let waiters: Vec<u32> = fresh
            .iter()
            .copied()
            .filter(|pid| blocked_in_flock.contains(pid) || sleeping_in_lock_call(*pid))
            .collect();
        let mut order: Vec<(usize, u64, Hit)> =
            HITS.iter().map(|&h| (hits[&h], rng.next(), h)).collect();
        order.sort_by_key(|&(count, tie, _)| (count, tie));
        for (_, _, hit) in order {
            let pool = match hit {
                Hit::KillHolder | Hit::StopHolder => &holders,
                Hit::KillWaiter | Hit::StopWaiter => &waiters,
                Hit::StopAnyone => &fresh,
            };
            if pool.is_empty() {
                continue;
            }
            let pid = pool[rng.below(pool.len())];
            let sigs = match hit {
                Hit::KillHolder | Hit::KillWaiter => vec![libc::SIGKILL],
                _ => {
                    let mut sigs = vec![STOPS[rng.below(3)]];
                    if rng.below(2) == 0 {
                        sigs.push(STOPS[rng.below(3)]);
                    }
                    sigs
                }
            };
            if rig.procs.signal(pid, &sigs, true) {
                *hits.get_mut(&hit).unwrap() += 1;
                break;
            }
        }
    }
    hits
}

#[derive(Debug, Default)]
struct SectionLog {
    entered: usize,
    left: usize,
    rmw: u32,
    sig: usize,
}

/// Walks the log in the kernel's append order. Exclusion means: no `enter`
/// while another section is open, `rmw` and `leave` only inside one's own
/// section, `sig` only from the section that entered last (a section's
/// process holds the lock until it exits, past its `leave`). A section in
/// `killed` (its devlock was SIGKILLed, so its guard killed its command)
/// may end without `leave`: the next `enter` closes it, and any line it
/// writes after that is outside its section.
fn walk_log(
    lines: &[String],
    killed: &HashSet<String>,
    errors: &mut Vec<String>,
) -> HashMap<String, SectionLog> {
    let mut sections: HashMap<String, SectionLog> = HashMap::new();
    let mut open: Option<(String, usize)> = None;
    let mut last_entered: Option<String> = None;
    for (n, line) in lines.iter().enumerate() {
        let mut words = line.split_whitespace();
        let (Some(what), Some(id)) = (words.next(), words.next()) else {
            errors.push(format!("log line {n} is garbage: {line:?}"));
            continue;
        };
        let section = sections.entry(id.to_owned()).or_default();
        let inside = open.as_ref().is_some_and(|(o, _)| o == id);
        match what {
            "enter" => {
                if let Some((other, at)) = &open
                    && !killed.contains(other)
                {
                    errors.push(format!(
                        "OVERLAP: {id} entered at line {n} while {other} (entered at line {at}) had not left:\n{}",
                        excerpt(lines, *at, n)
                    ));
                }
                section.entered += 1;
                open = Some((id.to_owned(), n));
                last_entered = Some(id.to_owned());
            }
            "rmw" | "leave" => {
                if !inside {
                    errors.push(format!(
                        "{what} of {id} at line {n} outside its section (open: {open:?}):\n{}",
                        excerpt(lines, n, n)
                    ));
                }
                if what == "rmw" {
                    section.rmw += 1;
                } else {
                    section.left += 1;
                    if inside {
                        open = None;
                    }
                }
            }
            "sig" => {
                if last_entered.as_deref() != Some(id) {
                    errors.push(format!(
                        "sig of {id} at line {n} after another section entered:\n{}",
                        excerpt(lines, n, n)
                    ));
                }
                section.sig += 1;
            }
            _ => errors.push(format!("log line {n} is garbage: {line:?}")),
        }
    }
    sections
}

/// What a section's run must show in the log, given what chaos sent it.
fn check_section(run: &SectionRun, log: &SectionLog, rmws: u32, errors: &mut Vec<String>) {
    let id = &run.id;
    let status = run.status;
    let entered = log.entered == 1 && log.left == 1;
    let mut fail = |why: String| {
        errors.push(format!(
            "{id}: {why} (status {status:?}, sent {:?}, log {log:?})",
            run.sent.iter().map(|&s| signal_name(s)).collect::<Vec<_>>()
        ))
    };
    let killed = run.sent.contains(&libc::SIGKILL);
    // A killed devlock's guard may end its command mid-section.
    let unbalanced = if killed {
        log.left > log.entered
    } else {
        log.entered != log.left
    };
    if log.entered > 1 || log.left > 1 || unbalanced {
        fail("entered/left more than once, or entered without leaving".into());
    }
    let stops: Vec<i32> = run
        .sent
        .iter()
        .copied()
        .filter(|&s| s != libc::SIGKILL)
        .collect();
    // The command is devlock's process (chain-loaded): each signal sent
    // reaches it once, nobody forwards (or repeats) one.
    if log.sig > stops.len() {
        fail("the command heard more stop signals than were sent".into());
    }
    if log.sig > 0 && stops.is_empty() {
        fail("the command heard a signal nobody sent".into());
    }
    if run.sent.is_empty() {
        if status.code() != Some(0) || !entered || log.rmw != rmws || log.sig != 0 {
            fail(format!(
                "untouched section did not run all {rmws} read-modify-writes and exit 0"
            ));
        }
    } else if killed {
        let ok = status.signal() == Some(libc::SIGKILL) || status.code() == Some(0);
        if !ok {
            fail("a SIGKILLed devlock neither died of it nor finished first".into());
        }
    } else {
        match status.code() {
            Some(7) if entered && log.sig >= 1 => {}
            Some(0) if entered => {}
            Some(c) if c > 128 && stops.contains(&(c - 128)) => {
                if log.entered != 0 {
                    fail("devlock died of the signal though its command had entered".into());
                }
            }
            // Died of it before it blocked its signals (still starting up):
            // nothing had started and nothing was held.
            None if status.signal().is_some_and(|s| stops.contains(&s)) => {
                if log.entered != 0 {
                    fail("devlock died of the signal though its command had entered".into());
                }
            }
            _ => fail("unexpected outcome for a stopped section".into()),
        }
    }
}

/// Runs `jobs` jobs of `sections` sections each on `rig`'s lock, with the
/// monkey loose among them until they are done: their sections, and what
/// the monkey managed.
fn run_chaos(
    rig: &ChaosRig,
    jobs: usize,
    sections: usize,
    rng: Rng,
) -> (Vec<SectionRun>, HashMap<Hit, usize>) {
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let done = &done;
        let workers: Vec<_> = (0..jobs)
            .map(|j| {
                scope.spawn(move || {
                    // A panicking job (a hang) stops everybody at once.
                    struct StopAllOnPanic<'a>(&'a Procs);
                    impl Drop for StopAllOnPanic<'_> {
                        fn drop(&mut self) {
                            if std::thread::panicking() {
                                self.0.shutdown();
                            }
                        }
                    }
                    let _stop = StopAllOnPanic(&rig.procs);
                    chaos_job(rig, j, sections)
                })
            })
            .collect();
        let monkey = scope.spawn(move || chaos_monkey(rig, done, rng));
        let mut runs = Vec::new();
        let mut panicked = None;
        for worker in workers {
            match worker.join() {
                Ok(r) => runs.extend(r),
                Err(e) => panicked = Some(e),
            }
        }
        done.store(true, Ordering::Release);
        let hits = monkey.join();
        if let Some(e) = panicked {
            std::panic::resume_unwind(e);
        }
        (runs, hits.unwrap())
    })
}

/// Checks the shared counter against the read-modify-writes the sections
/// logged; returns how many completed.
fn check_counter(
    rig: &ChaosRig,
    logs: &HashMap<String, SectionLog>,
    killed: &HashSet<String>,
    errors: &mut Vec<String>,
) -> u32 {
    let rmw_total: u32 = logs.values().map(|l| l.rmw).sum();
    let counter = std::fs::read_to_string(&rig.counter).unwrap();
    // A section killed between writing the counter and logging it adds one
    // unlogged increment; no more.
    let cut_short = logs
        .iter()
        .filter(|(id, l)| killed.contains(*id) && l.entered > l.left)
        .count() as u32;
    let counted: Option<u32> = counter.trim().parse().ok();
    if !counted.is_some_and(|c| (rmw_total..=rmw_total + cut_short).contains(&c)) {
        errors.push(format!(
            "counter is {counter:?} but {rmw_total} read-modify-writes completed \
             ({cut_short} sections cut short by a kill)"
        ));
    }
    rmw_total
}

/// Checks that status shows the lock free and unwaited, and sweeps every
/// dead waiter's registration; returns how many there were before.
fn check_swept(s: &Scratch, rig: &ChaosRig, errors: &mut Vec<String>) -> usize {
    let wait_files = |dir: &Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.ends_with(".wait") || name.ends_with(".hold")
            })
            .count()
    };
    let leftover_before = wait_files(&rig.dir);
    let view = s.resource_status("r");
    if view["state"] != "free" || view["waiters"].as_array().is_none_or(|w| !w.is_empty()) {
        errors.push(format!("status does not show r free and unwaited: {view}"));
    }
    let leftover_after = wait_files(&rig.dir);
    if leftover_after != 0 {
        errors.push(format!(
            "{leftover_after} registration files of dead waiters left after status ran"
        ));
    }
    leftover_before
}

test!(chaos_never_admits_two_holders, needs: []);
pub(crate) fn chaos_never_admits_two_holders() {
    let (jobs, sections, rmws) = if soak() { (24, 150, 3) } else { (12, 20, 3) };
    let s = Scratch::new();
    let procs = Procs::default();
    let _cleanup = Cleanup(procs.clone());
    let (rng, seed) = Rng::seeded();
    eprintln!("chaos_never_admits_two_holders: DEVLOCK_TORTURE_SEED={seed}");
    // The lock file exists before plain flock (which cannot make the
    // directory) joins.
    assert!(s.run(&["r", "--", "true"]).status.success());
    let rig = ChaosRig {
        dir: s.dir(),
        lock: s.lock_path("r"),
        log: s.work("log"),
        counter: s.work("counter"),
        work: s.work(""),
        procs: procs.clone(),
        rmws,
        progress: Mutex::new(Instant::now()),
    };
    std::fs::write(&rig.counter, "0\n").unwrap();
    let started = Instant::now();
    let (runs, hits) = run_chaos(&rig, jobs, sections, rng);

    // Commands of SIGKILLed supervisors are ended by their guards; once
    // every job is done, the lock goes free.
    wait_until("the lock to be free", || flock_is_free(&rig.lock));

    let lines = log_lines(&rig.log);
    let mut errors = Vec::new();
    let killed: HashSet<String> = runs
        .iter()
        .filter(|r| r.sent.contains(&libc::SIGKILL))
        .map(|r| r.id.clone())
        .collect();
    let logs = walk_log(&lines, &killed, &mut errors);
    let empty = SectionLog::default();
    for run in &runs {
        let log = logs.get(&run.id).unwrap_or(&empty);
        let before = errors.len();
        check_section(run, log, rmws, &mut errors);
        if errors.len() > before {
            let err = err_text(&rig.work.join(format!("{}.err", run.id)));
            errors
                .last_mut()
                .unwrap()
                .push_str(&format!("; stderr: {err:?}"));
        }
    }
    let expected_runs = jobs * sections;
    if runs.len() != expected_runs {
        errors.push(format!("{} of {expected_runs} sections ran", runs.len()));
    }
    let rmw_total = check_counter(&rig, &logs, &killed, &mut errors);
    for hit in HITS {
        if hits[&hit] == 0 {
            errors.push(format!("the chaos never managed a {hit:?}"));
        }
    }
    let leftover_before = check_swept(&s, &rig, &mut errors);
    let untouched = runs.iter().filter(|r| r.sent.is_empty()).count();
    eprintln!(
        "chaos: {} sections ({untouched} untouched), {rmw_total} read-modify-writes, hits {hits:?}, \
         {leftover_before} dead waiters' files swept, {:.1}s",
        runs.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        errors.is_empty(),
        "DEVLOCK_TORTURE_SEED={seed}: {} problems:\n{}",
        errors.len(),
        errors.join("\n")
    );
}

// ----------------------------------------------------------------------------
// 2. Records rewritten thousands of times under concurrent readers: whatever
//    a reader accepts is exactly one of the records written.

fn torture_records() -> Vec<Record> {
    // Built on a real record (whatever fields it grows) and varied only in
    // step, pid and via; the fields are public, so no clipping applies.
    // (Records carry no command line any more: long steps and vias make
    // the long ones.)
    let record = |step: String, pid: u32, via: Option<String>| {
        let mut r = Record::for_this_process("");
        r.step = step;
        r.pid = pid;
        r.via = via;
        r
    };
    vec![
        record("a".into(), 1, None),
        // Two records of the same length and shape that span three pages: a
        // read torn between them is still well-formed JSON, which only the
        // checksum can refuse.
        record("x".repeat(3000), 2_222_222, Some("y".repeat(6000))),
        record("z".repeat(3000), 3_333_333, Some("w".repeat(6000))),
        record("m".repeat(700), 44, Some("arg".repeat(60))),
    ]
}

#[derive(Debug, Default)]
struct ReadStats {
    calls: u64,
    accepted: u64,
    unreadable: u64,
    empty: u64,
    /// Torn reads the checksum refused that would otherwise pass as a record.
    torn_but_well_formed: u64,
    bad: Vec<String>,
}

/// A reader without the checksum: the record JSON minus its header members
/// (magic, version, check).
fn parse_without_check(bytes: &[u8]) -> Option<Record> {
    let mut value: serde_json::Value = serde_json::from_slice(bytes.strip_suffix(b"\n")?).ok()?;
    for header in ["magic", "v", "check"] {
        value.as_object_mut()?.remove(header);
    }
    serde_json::from_value(value).ok()
}

fn read_records(path: &Path, written: &[Record], done: &AtomicBool, raw: bool) -> ReadStats {
    let file = File::open(path).unwrap();
    let mut stats = ReadStats::default();
    let mut buf = vec![0u8; record::MAX_RECORD_BYTES + 1];
    let accept = |stats: &mut ReadStats, got: Record, how: &str| {
        if written.contains(&got) {
            stats.accepted += 1;
        } else if stats.bad.len() < 3 {
            stats
                .bad
                .push(format!("{how} accepted a record never written: {got:?}"));
        }
    };
    while !done.load(Ordering::Acquire) {
        stats.calls += 1;
        if raw {
            let n = file.read_at(&mut buf, 0).unwrap();
            match record::parse(&buf[..n]) {
                Some(got) => accept(&mut stats, got, "parse"),
                None => {
                    stats.unreadable += 1;
                    if n == 0 {
                        stats.empty += 1;
                    }
                    if parse_without_check(&buf[..n]).is_some_and(|r| !written.contains(&r)) {
                        stats.torn_but_well_formed += 1;
                    }
                }
            }
        } else {
            match record::read_from(&file) {
                ReadRecord::Valid(got) => accept(&mut stats, got, "read_from"),
                ReadRecord::Unreadable => stats.unreadable += 1,
                ReadRecord::Empty => stats.empty += 1,
            }
        }
    }
    stats
}

test!(torn_records_are_never_accepted, needs: []);
pub(crate) fn torn_records_are_never_accepted() {
    let writes = if soak() { 300_000 } else { 10_000 };
    // tmpfs where there is one, as /run/lock is: hundreds of thousands of
    // truncations are no load for a disk to take.
    let dir = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let path = dir.path().join("record");
    let records = torture_records();
    for r in &records {
        assert!(r.to_bytes().len() < record::MAX_RECORD_BYTES);
    }
    // The twins torn at a page boundary make a well-formed record that was
    // never written: only the checksum can refuse it.
    let (x, z) = (records[1].to_bytes(), records[2].to_bytes());
    assert_eq!(x.len(), z.len());
    assert!(x.len() > 4096);
    let spliced = [&z[..4096], &x[4096..]].concat();
    assert!(parse_without_check(&spliced).is_some_and(|r| !records.contains(&r)));
    assert_eq!(record::parse(&spliced), None, "a spliced record is refused");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    records[0].write_to(&file).unwrap();
    let (mut rng, seed) = Rng::seeded();
    let done = AtomicBool::new(false);
    let started = Instant::now();
    let (stats, last) = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..3)
            .map(|i| {
                let (path, records, done) = (&path, &records, &done);
                scope.spawn(move || read_records(path, records, done, i == 2))
            })
            .collect();
        let mut last = 0;
        for n in 0..writes {
            // Twin over twin (half the time the other twin), then a short
            // or a medium one over a long one.
            last = match n % 3 {
                0 | 1 => 1 + rng.below(2),
                _ => [0, 3][rng.below(2)],
            };
            records[last].write_to(&file).unwrap();
        }
        done.store(true, Ordering::Release);
        let stats: Vec<ReadStats> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        (stats, last)
    });
    eprintln!(
        "torn records (seed {seed}): {writes} writes in {:.1}s; readers: {stats:?}",
        started.elapsed().as_secs_f64()
    );
    for (i, s) in stats.iter().enumerate() {
        assert!(s.bad.is_empty(), "reader {i}: {:?}", s.bad);
        assert_eq!(s.empty, 0, "reader {i} saw an empty file: {s:?}");
        assert!(
            s.calls >= 100 && s.accepted * 4 >= s.calls,
            "reader {i} accepted too few whole records: {s:?}"
        );
    }
    assert_eq!(
        record::read_from(&file),
        ReadRecord::Valid(records[last].clone()),
        "once the writer stops, the last record reads back whole"
    );
}

// ----------------------------------------------------------------------------
// 3. The inode split: a holder holds, waiter A has the file open and waits,
//    somebody deletes the lock file, C arrives and creates a new one. A and C
//    must never run at once.

#[derive(Debug, Clone, Copy)]
enum Party {
    Cli,
    CliTimeout,
    Lib,
    LibTimeout,
}

enum Waiting {
    Proc(u32),
    Thread(mpsc::Receiver<Result<(), String>>),
}

/// Starts A: the devlock CLI or the library in a thread of this process.
/// Its section logs `enter A`, takes a moment, logs `leave A`.
fn start_party(party: Party, s: &Scratch, procs: &Procs, log: &Path) -> (Waiting, u32) {
    let section_ms = 50;
    match party {
        Party::Cli | Party::CliTimeout => {
            let mut cmd = s.devlock();
            cmd.arg("-q");
            if matches!(party, Party::CliTimeout) {
                cmd.args(["-w", "1h"]);
            }
            cmd.args(["r", "--", "sh", "-c"])
                .arg(format!(
                    "echo 'enter A' >> {log}; sleep 0.0{section_ms}; echo 'leave A' >> {log}",
                    log = log.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(s.work("A.err")).unwrap());
            let pid = procs.start("A", &mut cmd);
            (Waiting::Proc(pid), pid)
        }
        Party::Lib | Party::LibTimeout => {
            let options = devlock::Options {
                dir: s.dir(),
                wait: if matches!(party, Party::LibTimeout) {
                    devlock::Wait::Timeout(HANG)
                } else {
                    devlock::Wait::Block
                },
                step: "torture".into(),
            };
            let log = log.to_owned();
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let got = devlock::Acquiring::start(&"r".into(), &options, &[])
                    .and_then(devlock::Acquiring::hold)
                    .map(|guard| {
                        append(&log, "enter A");
                        std::thread::sleep(Duration::from_millis(section_ms));
                        append(&log, "leave A");
                        drop(guard);
                    });
                let _ = tx.send(got.map_err(|e| format!("{e:#}")));
            });
            (Waiting::Thread(rx), std::process::id())
        }
    }
}

fn finish(waiting: Waiting, procs: &Procs, what: &str, err: &Path) {
    match waiting {
        Waiting::Proc(pid) => {
            let status = procs.wait(pid);
            assert!(
                status.success(),
                "{what}: A ended {status:?}: {}",
                err_text(err)
            );
        }
        Waiting::Thread(rx) => match rx.recv_timeout(HANG) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("{what}: Acquiring::hold failed: {e}"),
            Err(e) => panic!("{what}: library waiter hung: {e}"),
        },
    }
}

/// Starts the holder H (devlock, or plain flock with `flock_holder`) on the
/// lock of `r`: it says `ready` once it holds, and holds until `release`.
fn start_holder(
    s: &Scratch,
    procs: &Procs,
    flock_holder: bool,
    ready: &Path,
    release: &Path,
) -> u32 {
    let lock = s.lock_path("r");
    let hold = format!(
        "echo > {}; while [ ! -e {} ]; do sleep 0.01; done",
        ready.display(),
        release.display()
    );
    let mut holder = if flock_holder {
        let mut cmd = Command::new("/usr/bin/flock");
        cmd.arg(&lock);
        cmd
    } else {
        let mut cmd = s.devlock();
        cmd.args(["-q", "r", "--"]);
        cmd
    };
    holder
        .args(["sh", "-c", &hold])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(s.work("H.err")).unwrap());
    procs.start("H", &mut holder)
}

/// Starts B, a plain flock waiter on the old inode `old` of `lock`, once it
/// is blocked there.
fn start_flock_waiter(procs: &Procs, lock: &Path, log: &Path, old: FileKey) -> u32 {
    let mut cmd = Command::new("/usr/bin/flock");
    cmd.arg(lock)
        .arg("sh")
        .arg("-c")
        .arg(format!(
            "echo 'enter B' >> {log}; sleep 0.05; echo 'leave B' >> {log}",
            log = log.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let pid = procs.start("B", &mut cmd);
    wait_blocked_on(old, pid, "B");
    pid
}

/// Starts C, which makes a new lock file where the old one was deleted: it
/// logs its section, which ends once `release_c` is there.
fn start_c(s: &Scratch, procs: &Procs, log: &Path, release_c: &Path) -> u32 {
    let mut c_cmd = s.devlock();
    c_cmd
        .args(["-q", "r", "--", "sh", "-c"])
        .arg(format!(
            "echo 'enter C' >> {log}; while [ ! -e {rc} ]; do sleep 0.01; done; \
             sleep 0.03; echo 'leave C' >> {log}",
            log = log.display(),
            rc = release_c.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(s.work("C.err")).unwrap());
    procs.start("C", &mut c_cmd)
}

/// A and C each ran once, and never at the same time.
fn assert_a_and_c_apart(log: &Path, what: &str) {
    let lines = log_lines(log);
    let at = |line: &str| {
        let found: Vec<usize> = (0..lines.len()).filter(|&i| lines[i] == line).collect();
        assert_eq!(found.len(), 1, "{what}: {line:?} once in {lines:?}");
        found[0]
    };
    let (enter_a, leave_a, enter_c, leave_c) =
        (at("enter A"), at("leave A"), at("enter C"), at("leave C"));
    assert!(
        leave_a < enter_c || leave_c < enter_a,
        "{what}: A and C ran at the same time: {lines:?}"
    );
}

fn inode_split_round(round: usize, procs: &Procs) {
    let party = [Party::Cli, Party::CliTimeout, Party::Lib, Party::LibTimeout][round % 4];
    // The holder is plain flock in some rounds: it needs no re-check.
    let flock_holder = round % 3 == 1;
    // A plain flock waiter B on the old inode too, in some rounds: it does
    // not re-check the path, so it may share with C and is not judged, but
    // it can take the old inode before A does.
    let flock_waiter = round % 5 == 2;
    // The deleting tool puts a fresh empty file back at once, in some rounds.
    let recreate = round % 2 == 1;
    // The last rounds of every 20 release the holder while C is still
    // starting.
    let racy = round % 20 >= 14;
    let what = format!(
        "round {round} ({party:?}, flock holder {flock_holder}, flock waiter {flock_waiter}, \
         recreate {recreate}, racy {racy})"
    );

    let s = Scratch::new();
    assert!(s.run(&["r", "--", "true"]).status.success());
    let lock = s.lock_path("r");
    let old = file_key(&lock);
    let log = s.work("log");
    let (ready, release) = (s.work("ready"), s.work("release"));
    let h = start_holder(&s, procs, flock_holder, &ready, &release);
    wait_for_file(&ready);

    let (a, a_pid) = start_party(party, &s, procs, &log);
    // A has the old file open and sleeps: in flock(2) on it, or in line.
    wait_until(&format!("{what}: A to wait"), || {
        sleeping_in_lock_call(a_pid)
    });
    let b = flock_waiter.then(|| start_flock_waiter(procs, &lock, &log, old));

    std::fs::remove_file(&lock).unwrap();
    if recreate {
        File::create(&lock).unwrap();
    }
    let release_c = s.work("release-c");
    if racy {
        std::fs::write(&release_c, "").unwrap();
    }
    let c = start_c(&s, procs, &log, &release_c);

    let entered = |who: &str| log_lines(&log).iter().any(|l| *l == format!("enter {who}"));
    if racy {
        std::fs::write(&release, "").unwrap();
    } else {
        // C arrives while the holder holds: it runs at once on its new file
        // (a bare flock gate) or waits (in line behind A, say).
        wait_until(&format!("{what}: C to run or wait"), || {
            entered("C") || sleeping_in_lock_call(c)
        });
        let c_first = entered("C");
        std::fs::write(&release, "").unwrap();
        let status = procs.wait(h);
        assert!(status.success(), "{what}: holder ended {status:?}");
        if c_first {
            // A wakes on the dead inode; C holds the new one, so A must find
            // it and wait on it (or, wrongly, run).
            let new = file_key(&lock);
            assert_ne!(new, old, "{what}: C holds a new file");
            wait_until(&format!("{what}: A to wait for the new file"), || {
                flocks_on(new).contains(&(a_pid, true)) || entered("A")
            });
            assert!(
                !entered("A"),
                "{what}: A ran while C held the new file: {:?}",
                log_lines(&log)
            );
        }
        std::fs::write(&release_c, "").unwrap();
    }
    let status = procs.wait(h);
    assert!(status.success(), "{what}: holder ended {status:?}");
    let status = procs.wait(c);
    assert!(
        status.success(),
        "{what}: C ended {status:?}: {}",
        err_text(&s.work("C.err"))
    );
    finish(a, procs, &what, &s.work("A.err"));
    if let Some(b) = b {
        assert!(procs.wait(b).success(), "{what}: B failed");
    }

    assert_a_and_c_apart(&log, &what);
    // Polled: while A is the library in this process, a child that another
    // test is spawning shares A's descriptor until it execs.
    wait_until(&format!("{what}: the lock to be free at the end"), || {
        flock_is_free(&lock)
    });
}

test!(inode_split_never_admits_two_holders, needs: []);
pub(crate) fn inode_split_never_admits_two_holders() {
    let procs = Procs::default();
    let _cleanup = Cleanup(procs.clone());
    for round in 0..if soak() { 140 } else { 20 } {
        inode_split_round(round, &procs);
    }
}

// ----------------------------------------------------------------------------
// 4. Stop signals sent twice to a holding supervisor with three waiters
//    queued behind it: the command hears each once, cleans up, and only
//    then does the next waiter start; every waiter runs.

/// Starts three waiters that keep looking at the lock (a status line every
/// 10ms) while they wait, each once it waits.
fn start_waiters(s: &Scratch, procs: &Procs, log: &Path, what: &str) -> Vec<u32> {
    (0..3)
        .map(|k| {
            let mut cmd = s.devlock();
            cmd.args(["--report-every", "10ms", "r", "--", "sh", "-c"])
                .arg(format!(
                    "echo 'enter W{k}' >> {log}; sleep 0.02; echo 'leave W{k}' >> {log}",
                    log = log.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(s.work(&format!("W{k}.err"))).unwrap());
            let pid = procs.start(&format!("W{k}"), &mut cmd);
            wait_until(&format!("{what}: W{k} to wait"), || {
                sleeping_in_lock_call(pid)
            });
            pid
        })
        .collect()
}

/// The command is devlock's process (chain-loaded): each signal reaches
/// it once, as sent; nobody forwards or repeats one. Two sent back to
/// back may merge in the kernel where they are the same signal.
fn assert_each_signal_heard_once(
    lines: &[String],
    first: i32,
    second: i32,
    after_handshake: bool,
    what: &str,
) {
    let heard: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("sig "))
        .collect();
    if after_handshake {
        assert_eq!(
            heard,
            [signal_name(first), signal_name(second)],
            "{what}: each heard once, in order: {lines:?}"
        );
    } else {
        let mut sent = vec![signal_name(first), signal_name(second)];
        sent.dedup();
        let mut distinct = heard.clone();
        distinct.sort_unstable();
        distinct.dedup();
        sent.sort_unstable();
        assert!(
            heard.len() <= 2 && distinct == sent,
            "{what}: each signal sent heard, none more often than sent: {lines:?}"
        );
    }
}

/// Every waiter ran once, one at a time, and none before the holder's
/// cleanup finished.
fn assert_waiters_ran_in_turn_after_cleanup(lines: &[String], what: &str) {
    // Missing counts as never: a waiter that started is then too early.
    let cleaned = lines
        .iter()
        .position(|l| l == "cleaned")
        .unwrap_or(lines.len());
    let mut open: Option<&str> = None;
    let mut ran = HashSet::new();
    for (i, line) in lines.iter().enumerate() {
        if let Some(w) = line.strip_prefix("enter ") {
            assert!(
                i > cleaned,
                "{what}: {w} started before the holder's cleanup finished: {lines:?}"
            );
            assert!(open.is_none(), "{what}: waiters overlapped: {lines:?}");
            assert!(ran.insert(w), "{what}: {w} ran twice: {lines:?}");
            open = Some(w);
        } else if let Some(w) = line.strip_prefix("leave ") {
            assert_eq!(open, Some(w), "{what}: {lines:?}");
            open = None;
        }
    }
    assert_eq!(ran.len(), 3, "{what}: every waiter ran: {lines:?}");
    assert!(cleaned < lines.len(), "{what}: no cleanup: {lines:?}");
}

fn signal_round(round: usize, procs: &Procs) {
    let first = [libc::SIGTERM, libc::SIGINT][round % 2];
    let second = [libc::SIGTERM, libc::SIGINT][(round / 2) % 2];
    // Most rounds send the second signal once the command has taken the
    // first (so a second delivery could not merge with the first); the rest
    // send both back to back.
    let after_handshake = !round.is_multiple_of(3);
    let what = format!(
        "round {round} ({} then {}, {})",
        signal_name(first),
        signal_name(second),
        if after_handshake {
            "after the first was heard"
        } else {
            "back to back"
        }
    );

    let s = Scratch::new();
    let log = s.work("log");
    let ready = s.work("ready");
    let holder_script = format!(
        "trap 'echo sig TERM >> {log}; got=1' TERM; trap 'echo sig INT >> {log}; got=1' INT; \
         echo > {ready}; while [ -z \"$got\" ]; do sleep 0.01; done; \
         sleep 0.2; echo cleaned >> {log}",
        log = log.display(),
        ready = ready.display()
    );
    let mut cmd = s.devlock();
    cmd.args(["-q", "r", "--", "sh", "-c", &holder_script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(s.work("H.err")).unwrap());
    let h = procs.start("holder", &mut cmd);
    wait_for_file(&ready);

    let waiters = start_waiters(&s, procs, &log, &what);

    assert!(procs.signal(h, &[first], false));
    if after_handshake {
        wait_until(&format!("{what}: the command to hear the signal"), || {
            log_lines(&log).iter().any(|l| l.starts_with("sig "))
        });
    }
    assert!(procs.signal(h, &[second], false));
    let status = procs.wait(h);
    assert_eq!(
        status.code(),
        Some(0),
        "{what}: devlock ends with the command's status: {}",
        err_text(&s.work("H.err"))
    );
    for (k, &w) in waiters.iter().enumerate() {
        let status = procs.wait(w);
        assert!(
            status.success(),
            "{what}: W{k} ended {status:?}: {}",
            err_text(&s.work(&format!("W{k}.err")))
        );
    }

    let lines = log_lines(&log);
    assert_each_signal_heard_once(&lines, first, second, after_handshake, &what);
    assert_waiters_ran_in_turn_after_cleanup(&lines, &what);
}

test!(signals_to_supervisors_under_load, needs: []);
pub(crate) fn signals_to_supervisors_under_load() {
    let procs = Procs::default();
    let _cleanup = Cleanup(procs.clone());
    // Background load: two busy loops at a lower priority.
    for n in 0..2 {
        procs.start(
            &format!("burner{n}"),
            Command::new("nice")
                .args(["-n", "10", "sh", "-c", "while :; do :; done"])
                .stdin(Stdio::null()),
        );
    }
    for round in 0..if soak() { 120 } else { 20 } {
        signal_round(round, &procs);
    }
}
