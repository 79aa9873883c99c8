//! The inode split: a holder holds, waiter A has the file open and waits,
//! somebody deletes the lock file, C arrives and creates a new one. A and C
//! must never run at once.

use super::*;

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
