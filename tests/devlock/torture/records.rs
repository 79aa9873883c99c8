//! Records rewritten thousands of times under concurrent readers: whatever
//! a reader accepts is exactly one of the records written.

use super::*;

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
