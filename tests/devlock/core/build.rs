//! The build: etcd flags without the feature, and what the binary loads and
//! packs.

use super::*;

#[cfg(not(feature = "etcd"))]
test!(etcd_without_the_feature_says_how_to_get_it, needs: []);
#[cfg(not(feature = "etcd"))]
pub(crate) fn etcd_without_the_feature_says_how_to_get_it() {
    let s = Scratch::new();
    let out = s
        .devlock()
        .env("DEVLOCK_ETCD", "http://127.0.0.1:2379")
        .args(["r", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // The install that works from a checkout, as the README's, not the
    // registry's.
    assert!(
        stderr(&out).contains("`cargo install --locked --path . --features etcd`"),
        "{}",
        stderr(&out)
    );
    // --help marks the flags this build cannot use, here and under setup.
    for args in [&["--help"][..], &["setup", "--help"]] {
        let help = stdout(&s.run(args));
        for flag in ["--etcd <", "--etcd-user", "--etcd-ca", "--etcd-key"] {
            let at = help
                .find(flag)
                .unwrap_or_else(|| panic!("{flag} in {help}"));
            let entry = &help[at..];
            let end = entry[2..].find("\n  -").map_or(entry.len(), |e| e + 2);
            assert!(
                entry[..end].contains("not in this build"),
                "{args:?} {flag}: {}",
                &entry[..end]
            );
        }
    }
}

test!(lease_flags_without_etcd_are_usage_errors, needs: []);
pub(crate) fn lease_flags_without_etcd_are_usage_errors() {
    let s = Scratch::new();
    for flag in ["--ttl", "--kill-after"] {
        let out = s
            .devlock()
            .env_remove("DEVLOCK_ETCD")
            .args([flag, "3s", "r", "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(
            stderr(&out).contains("only with --etcd"),
            "{}",
            stderr(&out)
        );
    }
}

test!(the_binary_does_not_load_libgcc_s, needs: [Tool("readelf")]);
pub(crate) fn the_binary_does_not_load_libgcc_s() {
    // build.rs links the unwinder statically: libgcc_s's constructor runs
    // dozens of cpuid instructions, each a trap to the hypervisor on a VM,
    // in every run (bench/RESULTS.md).
    let dynamic = readelf("-d");
    assert!(dynamic.contains("libc.so.6"), "{dynamic}");
    assert!(!dynamic.contains("libgcc_s"), "{dynamic}");
}

test!(the_binary_packs_its_relative_relocations, needs: [Tool("readelf"), Tool("getconf")]);
pub(crate) fn the_binary_packs_its_relative_relocations() {
    // build.rs links with -z pack-relative-relocs where this machine's glibc
    // reads DT_RELR (2.36 and later): as RELA entries, the loader read some
    // 2,200 of them in every run, a tenth of an uncontended run's CPU
    // (bench/RESULTS.md). On an older glibc the binary must go without, or
    // it would not start.
    let out = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .unwrap();
    let version = stdout(&out);
    let mut parts = version.trim().trim_start_matches("glibc ").split('.');
    let mut number = || parts.next().and_then(|p| p.parse::<u32>().ok()).unwrap();
    let reads_relr = (number(), number()) >= (2, 36);
    let dynamic = readelf("-d");
    assert_eq!(
        dynamic.contains("(RELR)"),
        reads_relr,
        "{version}: {dynamic}"
    );
}

/// What `readelf FLAG` says of the binary.
fn readelf(flag: &str) -> String {
    let out = Command::new("readelf").args([flag, BIN]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
}
