//! The workspace's layers, as cargo and rustc enforce them: the kernel-facing
//! core (`devlock-core`, core/) imports nothing that words, draws or parses a
//! command line, and a front-end module named inside the core is a build
//! error, not a script's finding.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The front-end modules the core must never reach, as a line the core's
/// lib.rs could hold: each must fail to resolve there.
const FRONT_END: &[&str] = &[
    "use crate::messages;",
    "use crate::cli;",
    "use crate::tty;",
    "use crate::wait_display;",
    "use crate::cmd;",
    "use crate::serve;",
    "use crate::api;",
    "use devlock::cli::Cli;",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `cargo metadata` of the workspace's own packages, offline.
fn metadata() -> serde_json::Value {
    let out = Command::new("cargo")
        .args([
            "metadata",
            "--format-version",
            "1",
            "--offline",
            "--no-deps",
        ])
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The names of the dependencies of package `name`.
fn dependencies(meta: &serde_json::Value, name: &str) -> Vec<String> {
    let package = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no package {name} in the workspace"));
    package["dependencies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The core alone, in a one-member workspace of its own (the root's lints,
/// its Cargo.lock), with `extra` appended to its lib.rs.
fn core_alone(extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&repo().join("core"), &dir.path().join("core"));
    std::fs::copy(repo().join("Cargo.lock"), dir.path().join("Cargo.lock")).unwrap();
    let root = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let lints = root.find("[workspace.lints").map_or("", |at| &root[at..]);
    // Only the lints tables: they end at the first table that is not one.
    let lints: String = lints
        .split("\n[")
        .enumerate()
        .take_while(|(i, t)| *i == 0 || t.starts_with("workspace.lints"))
        .map(|(i, t)| {
            if i == 0 {
                t.to_owned()
            } else {
                format!("\n[{t}")
            }
        })
        .collect();
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!("[workspace]\nmembers = [\"core\"]\nresolver = \"3\"\n\n{lints}\n"),
    )
    .unwrap();
    let lib = dir.path().join("core/src/lib.rs");
    let mut text = std::fs::read_to_string(&lib).unwrap();
    for line in extra {
        text.push_str(line);
        text.push('\n');
    }
    std::fs::write(&lib, text).unwrap();
    dir
}

fn cargo_check(dir: &Path) -> std::process::Output {
    Command::new("cargo")
        .args(["check", "--offline", "--quiet", "--lib"])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", repo().join("target/layers"))
        .output()
        .unwrap()
}

test!(the_core_cannot_import_a_front_end, needs: [Tool("cargo")]);
pub(crate) fn the_core_cannot_import_a_front_end() {
    let meta = metadata();
    let front = dependencies(&meta, "devlock");
    assert!(front.iter().any(|d| d == "devlock-core"), "{front:?}");
    let core = dependencies(&meta, "devlock-core");
    for forbidden in ["devlock", "clap"] {
        assert!(
            !core.iter().any(|d| d == forbidden),
            "{forbidden}: {core:?}"
        );
    }
    // The core alone builds: the layout the suite builds, on its own.
    let plain = core_alone(&[]);
    let out = cargo_check(plain.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each front-end module named in the core is an unresolved import.
    let reaching = core_alone(FRONT_END);
    let out = cargo_check(reaching.path());
    assert!(!out.status.success(), "the core reached a front end");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for line in FRONT_END {
        let name = line
            .trim_start_matches("use ")
            .trim_end_matches(';')
            .rsplit("::")
            .next()
            .unwrap();
        assert!(
            stderr.contains(&format!("`{name}`")) || stderr.contains(line),
            "{line} was not refused:\n{stderr}"
        );
    }
    assert!(
        stderr.contains("E0432") || stderr.contains("E0433"),
        "{stderr}"
    );
}
