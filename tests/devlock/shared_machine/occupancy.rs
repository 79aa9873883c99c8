//! Issue #22: every stranger's lock on a byte that matters is occupancy,
//! named, and bounded by -n, -w and a stopping signal.

use super::*;

/// The last ticket byte a queue file has (see src/flock/queue.rs).
const TOP_TICKET: u64 = SLOT_BASE + (1 << 32);

/// A devlock waiting (shown on its stderr) for `r`, as root: the guard, once
/// its waiting line says it waits.
fn waiting_for(s: &Scratch, args: &[&str]) -> Killed {
    let mut child = s
        .devlock()
        .args(args)
        .args(["r", "--", "true"])
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    wait_for_line(&mut err, "waiting");
    // Keep reading, so the waiter never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
    });
    Killed(child)
}

/// `-n` and `-w` are busy (75), naming `words`; a waiter ends at once on
/// SIGTERM, and one gets in once the stranger lets go.
fn occupancy_is_bounded(s: &Scratch, words: &str, args: &[&str], tag: &str) {
    let mut run = vec!["-n"];
    run.extend(args);
    run.extend(["r", "--", "true"]);
    let out = s.run(&run);
    assert_eq!(out.status.code(), Some(75), "{run:?}: {}", stderr(&out));
    assert!(one_line(&out).contains(words), "{run:?}: {}", stderr(&out));
    let mut run = vec!["-w", "300ms"];
    run.extend(args);
    run.extend(["r", "--", "true"]);
    let out = s.run(&run);
    assert_eq!(out.status.code(), Some(75), "{run:?}: {}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("timed out after 300ms waiting for r") && err.contains(words),
        "{run:?}: {err}"
    );
    let mut stopped = waiting_for(s, args);
    signal(stopped.id(), libc::SIGTERM);
    let ended = wait_child(&mut stopped.0);
    assert!(
        ended.code() == Some(143) || ended.signal() == Some(libc::SIGTERM),
        "{ended:?}"
    );
    let mut gets_in = waiting_for(s, args);
    release(s, tag);
    assert!(wait_child(&mut gets_in.0).success());
}

test!(a_strangers_lock_on_an_agreement_byte_is_occupancy_never_a_usage_error, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_strangers_lock_on_an_agreement_byte_is_occupancy_never_a_usage_error() {
    for managed in [false, true] {
        let s = scene(managed);
        let queue = s.dir().join(".r.queue");
        let q = queue.to_str().unwrap();
        let at = (AGREE_BASE + 5).to_string();
        let (_lock, pid) = stranger_holds(&s, USER_A, &["ofd", q, &at, "1", "read"], "a");
        let named = format!(
            "a lock that is not devlock's on bytes 4101 of {q}, the agreement of --slots 5 (pid {pid}, nobody)"
        );
        // Status: held by it, never `free (5 slots)`.
        let view = s.resource_status("r");
        assert_eq!(view["state"], "held", "managed {managed}: {view}");
        assert!(view["slots"].is_null(), "{view}");
        assert_eq!(view["holders"][0]["pid"], pid, "{view}");
        assert_eq!(
            view["foreign_locks"][0]["effect"], "blocks the slot agreement",
            "{view}"
        );
        let as_b = status_as(&s, USER_B, "r");
        assert_eq!(as_b["state"], "held", "{as_b}");
        assert!(as_b["holders"][0]["pid"].is_null(), "{as_b}");
        // Another user cannot see whose it is: busy, never a usage error.
        let out = run_as(&s, USER_B, &["-n", "--slots", "3", "r", "--", "true"]);
        assert_busy_naming(&out, "held by a process this user cannot see");
        occupancy_is_bounded(&s, &named, &[], "a");
        // The same size as the stranger's is occupancy too: slots wait.
        let (_lock, _) = stranger_holds(&s, USER_A, &["ofd", q, &at, "1", "read"], "b");
        occupancy_is_bounded(&s, "the agreement of --slots 5", &["--slots", "2"], "b");
        // A devlock the kernel backs with another size is a usage error.
        let (_holder, _) = hold_as(&s, 0, &["--slots", "5", "r"], "h");
        let out = s.run(&["-n", "--slots", "3", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(
            one_line(&out)
                .contains("r is in use with --slots 5, but this asks for it with --slots 3"),
            "{}",
            stderr(&out)
        );
        release(&s, "h");
    }
}

test!(a_lock_on_the_top_ticket_byte_parked_in_a_socket_is_occupancy, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_lock_on_the_top_ticket_byte_parked_in_a_socket_is_occupancy() {
    for managed in [false, true] {
        let s = scene(managed);
        let queue = s.dir().join(".r.queue");
        let q = queue.to_str().unwrap();
        let at = TOP_TICKET.to_string();
        let (_lock, _) = stranger_holds(&s, USER_A, &["parked", "ofd", q, &at, "1"], "a");
        // Root sees every descriptor: none has it open, and says so.
        occupancy_is_bounded(
            &s,
            "a descriptor no process has open (one sent over a unix socket, say)",
            &[],
            "a",
        );
        let (_lock, _) = stranger_holds(&s, USER_A, &["parked", "ofd", q, &at, "1"], "b");
        let out = run_as(&s, USER_B, &["-n", "r", "--", "true"]);
        assert_busy_naming(&out, "held by a process this user cannot see");
        release(&s, "b");
        // A plain flock parked the same way: root's status says who took
        // it and that it is alive, never "gone".
        let lock = s.lock_path("r");
        let (_lock, taker) = stranger_holds(
            &s,
            USER_A,
            &["parked", "flock", lock.to_str().unwrap(), "0", "0"],
            "c",
        );
        let view = s.resource_status("r");
        assert_eq!(view["state"], "held", "{view}");
        let note = view["holders"][0]["note"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            note.contains(&format!("taken by pid {taker}")) && !note.contains("gone"),
            "{view}"
        );
        release(&s, "c");
    }
}

test!(many_foreign_locks_through_many_descriptors_cost_one_look, needs: [Root, Tool("setpriv")]);
pub(crate) fn many_foreign_locks_through_many_descriptors_cost_one_look() {
    let s = scene(true);
    let queue = s.dir().join(".r.queue");
    let q = queue.to_str().unwrap();
    let (_lock, _) = stranger_holds(&s, USER_A, &["many", q, "200", "1000"], "a");
    // Each of these read every process's descriptors once, not once per
    // lock: a hang bound only.
    for args in [
        vec!["-n", "r", "--", "true"],
        vec!["-n", "--slots", "2", "r", "--", "true"],
        vec!["status", "r"],
    ] {
        let started = std::time::Instant::now();
        let out = s.run(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        assert!(
            started.elapsed() < HANG / 6,
            "{args:?}: {:?}",
            started.elapsed()
        );
    }
    let view = s.resource_status("r");
    assert_eq!(array_len(&view["foreign_locks"]), 200, "{view}");
    release(&s, "a");
}

/// `devlock ARGS` run to completion under `strace -f`, with every path it
/// opened: what a run costs, counted in files rather than in seconds (a
/// count a loaded machine does not change).
fn run_counting_opens(s: &Scratch, args: &[&str]) -> (Output, Vec<String>) {
    let devlock = s.devlock();
    let trace = s.dir().with_extension("opens");
    let mut cmd = Command::new("strace");
    cmd.args([
        "-f",
        "-qq",
        "-s",
        "4096",
        "-e",
        "trace=open,openat,openat2",
        "-o",
    ])
    .arg(&trace)
    .arg(devlock.get_program())
    .args(args)
    .stdin(Stdio::null());
    for (key, value) in devlock.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    let out = cmd.output().unwrap();
    let opened = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .filter_map(|call| call.split('"').nth(1).map(str::to_owned))
        .collect();
    std::fs::remove_file(&trace).unwrap();
    (out, opened)
}

test!(planted_registrations_are_skipped_unopened, needs: [Root, Tool("setpriv"), Tool("strace")]);
pub(crate) fn planted_registrations_are_skipped_unopened() {
    let s = scene(false);
    let dir = s.dir();
    const PLANTED: usize = 100_000;
    // 100k files named as registrations of a live process (root's test).
    let prefix = format!(".r@{}.", std::process::id());
    assert!(user_does(
        USER_A,
        python(),
        &[
            &fixture("stranger.py"),
            "plant",
            dir.to_str().unwrap(),
            &prefix,
            &PLANTED.to_string(),
        ]
    ));
    let (_holder, _) = hold_as(&s, 0, &["--step", "real", "r"], "h");
    let mut waiter = waiting_for(&s, &["--step", "waiter"]);
    for args in [vec!["-n", "r", "--", "true"], vec!["status", "r"]] {
        let (out, opened) = run_counting_opens(&s, &args);
        assert!(!stderr(&out).contains("forged"), "{}", stderr(&out));
        // Not one planted file is opened, and the run opens a handful of
        // files however many are planted: the names are enough to skip
        // them.
        // Counted in files, not seconds: a planted registration nobody
        // flocks is skipped by its name and `d_ino`, unopened, but for the
        // few a look opens to sweep (`SWEEP_PER_LOOK`, 256), however many
        // were planted. (Opens under /proc follow the machine's processes,
        // not the directory.)
        let planted = opened.iter().filter(|p| p.contains(&prefix)).count();
        let in_the_dir = opened.iter().filter(|p| !p.starts_with('/')).count();
        assert!(
            planted <= 256 && in_the_dir <= 256 + 16,
            "{args:?} opened {planted} planted registrations, {in_the_dir} files of the directory"
        );
    }
    let view = s.resource_status("r");
    assert_eq!(view["holders"][0]["step"], "real", "{view}");
    release(&s, "h");
    assert!(wait_child(&mut waiter.0).success());
}

test!(a_plain_flock_on_a_slot_file_is_a_holder_of_that_slot, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_plain_flock_on_a_slot_file_is_a_holder_of_that_slot() {
    for managed in [false, true] {
        let s = scene(managed);
        let slot = s.dir().join(".r.slot1");
        let (mut lock, pid) = stranger_holds(&s, USER_A, &["flock", slot.to_str().unwrap()], "a");
        let view = s.resource_status("r");
        assert_ne!(view["state"], "free", "managed {managed}: {view}");
        let h = &view["holders"][0];
        assert_eq!(
            (h["pid"].as_u64(), h["slot"].as_u64()),
            (Some(u64::from(pid)), Some(1)),
            "{view}"
        );
        assert_eq!(h["user"], "nobody", "{view}");
        let as_b = status_as(&s, USER_B, "r");
        assert_ne!(as_b["state"], "free", "{as_b}");
        let out = s.run(&["-n", "--slots", "1", "r", "--", "true"]);
        assert_busy_naming(&out, &format!("pid {pid}"));
        let out = s.run(&["-w", "300ms", "--slots", "1", "r", "--", "true"]);
        assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("timed out after 300ms")
                && stderr(&out).contains(&format!("pid {pid}")),
            "{}",
            stderr(&out)
        );
        release(&s, "a");
        assert!(wait_child(&mut lock.0).success());
        assert!(
            s.run(&["-n", "--slots", "1", "r", "--", "true"])
                .status
                .success()
        );
    }
}

test!(a_file_lease_on_a_lock_file_is_occupancy_named_and_waited_out, needs: [Root, Tool("setpriv")]);
pub(crate) fn a_file_lease_on_a_lock_file_is_occupancy_named_and_waited_out() {
    let s = scene(false);
    // A lock file a user made in the open directory: theirs to lease.
    assert!(
        run_as(&s, USER_A, &["-n", "l", "--", "true"])
            .status
            .success()
    );
    let lock = s.lock_path("l");
    let l = lock.to_str().unwrap();
    let (mut lease, pid) = stranger_holds(&s, USER_A, &["lease", l], "a");
    let out = s.run(&["-n", "l", "--", "true"]);
    assert_eq!(out.status.code(), Some(75), "{}", stderr(&out));
    assert!(
        one_line(&out).contains(&format!(
            "l is busy: a file lease on {l} (pid {pid}, nobody), not devlock's"
        )),
        "{}",
        stderr(&out)
    );
    let view = s.resource_status("l");
    assert_eq!(view["state"], "held", "never free: {view}");
    assert_eq!(view["holders"][0]["pid"], pid, "{view}");
    // A take waits for the lease to break (its holder gives it up when
    // told to), and keeps it from coming back until its turn: root's and
    // another user's.
    for uid in [0, USER_B] {
        let out = run_as(&s, uid, &["-w", "30s", "l", "--", "true"]);
        assert!(out.status.success(), "uid {uid}: {}", stderr(&out));
    }
    release(&s, "a");
    wait_child(&mut lease.0);
    // In a managed directory the files are root's: nobody else may lease them.
    let m = scene(true);
    let r = m.lock_path("r");
    let script = format!(
        "import fcntl, os\nfd = os.open({:?}, os.O_RDONLY)\nfcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)",
        r.to_str().unwrap()
    );
    assert!(!user_does(USER_A, python(), &["-c", &script]));
}
