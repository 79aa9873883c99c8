//! The README's examples, run: every `devlock` line of its `sh` blocks
//! (the try-without-a-gpu block is run whole, in generated.rs).

use std::process::{Command, Stdio};

use xtask::repo;

/// The `devlock ...` lines of the README's `sh` blocks, without their
/// comments, leaving out what needs root (`sudo`), runs until stopped
/// (`serve`) or is run whole elsewhere (the try-without-a-gpu block).
fn readme_devlock_lines() -> Vec<String> {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let mut lines = Vec::new();
    for block in readme.split("```sh\n").skip(1) {
        let block = block.split("\n```").next().unwrap();
        if block.contains("FAKE_GPU_DIR") {
            continue;
        }
        for line in block.lines() {
            let line = line.split("  #").next().unwrap().trim();
            if line.starts_with("devlock ") && !line.contains("sudo") && !line.contains(" serve") {
                lines.push(line.to_owned());
            }
        }
    }
    lines
}

/// `LINE` with its command (after ` -- `) replaced by `true`, so that what
/// is checked is devlock's own part: its flags, names and subcommands.
fn with_true_command(line: &str) -> String {
    match line.split_once(" -- ") {
        Some((devlock, _command)) => format!("{devlock} -- true"),
        None => line.to_owned(),
    }
}

test!(readme_devlock_lines_run, needs: [Tool("sh")]);
pub(crate) fn readme_devlock_lines_run() {
    // Each line, as a user would paste it, on a machine with four fake GPUs
    // of 80 GiB and nothing else on them: it exits 0 (a free lock, a
    // budget that fits, a status and a report of an empty directory).
    let lines = readme_devlock_lines();
    for wanted in [
        "devlock gpu -- ",
        "--any",
        "--mem",
        "devlock status",
        "devlock -n",
    ] {
        assert!(
            lines.iter().any(|l| l.contains(wanted)),
            "the README has no {wanted:?} line any more: {lines:?}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let gpus = tempfile::tempdir().unwrap();
    std::fs::write(
        gpus.path().join("gpus"),
        "0 81920\n1 81920\n2 81920\n3 81920\n",
    )
    .unwrap();
    let bin_dir = std::path::Path::new(crate::harness::BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let fake_smi = repo().join("contrib/fake-gpu/nvidia-smi");
    for line in &lines {
        let run = with_true_command(line);
        let out = Command::new("sh")
            .args(["-c", &run])
            .current_dir(dir.path())
            .env("PATH", &path)
            .env("DEVLOCK_DIR", dir.path())
            .env("DEVLOCK_NVML", "none")
            .env("DEVLOCK_NVIDIA_SMI", &fake_smi)
            .env("FAKE_GPU_DIR", gpus.path())
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "README line {line:?}, run as {run:?}: {:?}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
