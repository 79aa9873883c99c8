//! The registrations' tests: names, the wait directory, planted files.

use super::*;

#[test]
fn waiter_file_names_name_their_resource() {
    let gpu: Resource = "gpu:3".parse().unwrap();
    let name = file_name(&gpu, 4242, 0, Kind::Wait);
    assert_eq!(name, ".gpu:3@4242.0.wait");
    assert_eq!(resource_of(&name), Some((gpu.clone(), Kind::Wait)));
    assert_eq!(parse_name(&name), Some((gpu.clone(), Kind::Wait, 4242)));
    assert_eq!(
        resource_of(".gpu:3@1.2.hold"),
        Some((gpu.clone(), Kind::Hold))
    );
    assert_eq!(resource_of(".gpu:3@1.2.lost"), Some((gpu, Kind::Lost)));
    assert_eq!(resource_of("gpu.lock"), None);
    assert_eq!(resource_of(".gpu:3@x.2.wait"), None);
}

/// Issue #35: a waiter registers in the wait directory, which a
/// group's take lists no longer (its members' prefix, or anything);
/// a shared holder's label stays in the lock directory; readers find
/// both; and the waiter's file goes with it.
#[test]
fn a_waiter_registers_out_of_the_lock_directorys_listing() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::write(tmp.path().join("gpu:0.lock"), "").unwrap();
    let dir = ScratchDir::open(tmp.path()).unwrap().unwrap();
    let record = Record::for_this_process("t");
    let member: Resource = "gpu:0".parse().unwrap();
    let wait = Registration::create(&dir, &member, &record, Kind::Wait).unwrap();
    let hold = Registration::create(&dir, &member, &record, Kind::Hold).unwrap();
    let waits = dir.wait_dir().expect("made by the directory's owner");
    let waiting = waits.entries().unwrap();
    assert_eq!(waiting.len(), 1);
    assert!(waiting[0].ends_with(".wait"), "{waiting:?}");
    let mut listed = dir.entries_starting_with("").unwrap();
    listed.sort();
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(listed[0].ends_with(".hold"), "{listed:?}");
    assert_eq!(listed[1], WAIT_DIR);
    assert_eq!(listed[2], "gpu:0.lock");
    assert_eq!(dir.entries_starting_with("gpu:").unwrap(), ["gpu:0.lock"]);
    // Both read back, from one listing of the lock directory.
    let table = LockTable::read().unwrap();
    let names = dir.entries().unwrap();
    let mut kinds: Vec<&str> = live_waiters(&dir, &names, &table, |r| r == &member)
        .iter()
        .map(|w| w.kind.suffix())
        .collect();
    kinds.sort();
    assert_eq!(kinds, [".hold", ".wait"]);
    drop((wait, hold));
    assert_eq!(waits.entries().unwrap(), Vec::<String>::new());
    let mut left = dir.entries().unwrap();
    left.sort();
    assert_eq!(left, [WAIT_DIR, "gpu:0.lock"]);
}

/// Where the wait directory is none to trust, a waiter registers in
/// the lock directory as before, and readers look there too.
#[test]
fn a_wait_directory_not_to_trust_is_passed_by() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::set_permissions(elsewhere.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let r: Resource = "r".parse().unwrap();
    let record = Record::for_this_process("t");
    let wait_dir = tmp.path().join(WAIT_DIR);
    let planted: [(&str, &dyn Fn()); 3] = [
        ("a link", &|| {
            std::os::unix::fs::symlink(elsewhere.path(), &wait_dir).unwrap()
        }),
        ("a file", &|| std::fs::write(&wait_dir, "").unwrap()),
        ("a directory of the wrong mode", &|| {
            std::fs::create_dir(&wait_dir).unwrap();
            std::fs::set_permissions(&wait_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        }),
    ];
    for (what, plant) in planted {
        plant();
        let dir = ScratchDir::open(tmp.path()).unwrap().unwrap();
        assert!(dir.wait_dir().is_none(), "{what}");
        let wait = Registration::create(&dir, &r, &record, Kind::Wait).unwrap();
        let names = dir.entries().unwrap();
        assert!(
            names.iter().any(|n| n.ends_with(".wait")),
            "{what}: {names:?}"
        );
        let table = LockTable::read().unwrap();
        assert_eq!(
            live_waiters(&dir, &names, &table, |x| x == &r).len(),
            1,
            "{what}"
        );
        drop(wait);
        let _ = std::fs::remove_dir(&wait_dir).or_else(|_| std::fs::remove_file(&wait_dir));
    }
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    // A user's own directory (not sticky, as `--dir .`): none is made
    // there, and the waiter registers beside the lock files.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = ScratchDir::open(tmp.path()).unwrap().unwrap();
    let wait = Registration::create(&dir, &r, &record, Kind::Wait).unwrap();
    assert!(!wait_dir.exists());
    assert!(dir.entries().unwrap().iter().any(|n| n.ends_with(".wait")));
    drop(wait);
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = Kind> {
        prop::sample::select(vec![Kind::Wait, Kind::Hold, Kind::Lost])
    }

    /// Names another user can plant in the directory, built from the
    /// pieces of a registration's name or from nothing.
    fn planted() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[A-Za-z0-9._:@-]{0,80}",
            "\\PC{0,40}",
            "[\u{0}-\u{1f}\u{7f}\u{202e}]{1,4}",
            any::<u64>().prop_map(|n| n.to_string()),
            Just("99999999999999999999999".to_owned()),
            Just("-1".to_owned()),
            Just("+7".to_owned()),
            Just(String::new()),
        ];
        let suffix =
            prop::sample::select(vec![".wait", ".hold", ".lost", ".lock", "", ".wait.wait"]);
        prop_oneof![
            "\\PC{0,300}",
            (piece.clone(), piece.clone(), piece, suffix)
                .prop_map(|(name, pid, n, suffix)| format!(".{name}@{pid}.{n}{suffix}")),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever is planted: no panic, and a name is taken for a
        /// registration only when it is one (a valid resource, a pid
        /// and a number in decimal that fit, a known suffix): what it
        /// names is a resource within the name rules and a pid.
        #[test]
        fn planted_names_are_registrations_only_when_well_formed(name in planted()) {
            if let Some((resource, kind, pid)) = parse_name(&name) {
                prop_assert!(resource.as_str().len() <= crate::names::MAX_NAME_LEN);
                prop_assert!(resource.as_str().parse::<Resource>().is_ok());
                prop_assert!(name.starts_with('.') && name.ends_with(kind.suffix()));
                let named = format!(".{}@", resource.as_str());
                prop_assert!(name.contains(&named));
                let made = file_name(&resource, pid, 0, kind);
                prop_assert_eq!(parse_name(&made), Some((resource, kind, pid)));
            }
        }

        /// Every name a registration is made with reads back as what
        /// it was made for.
        #[test]
        fn made_names_read_back(
            resource in prop_oneof![
                "[A-Za-z0-9_][A-Za-z0-9._:-]{0,63}",
                (0u32..=crate::names::MAX_GPU_INDEX).prop_map(|i| format!("gpu:{i}")),
            ],
            pid in any::<u32>(),
            n in any::<u32>(),
            kind in kind(),
        ) {
            let Ok(resource) = resource.parse::<Resource>() else {
                return Ok(());
            };
            let name = file_name(&resource, pid, n, kind);
            prop_assert_eq!(parse_name(&name), Some((resource, kind, pid)));
        }
    }
}
