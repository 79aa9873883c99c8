//! Chaos: devlock and plain flock jobs on one resource, supervisors and
//! waiters killed and signalled at random. Nobody may ever share the lock.

use super::*;

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
    // Waiters register in the wait directory (or, where it is none to
    // trust, beside the lock files).
    let wait_files = |dir: &Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .chain(
                std::fs::read_dir(dir.join(".waiting"))
                    .into_iter()
                    .flatten(),
            )
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
