//! The generated documentation (man pages, shell completions: made by the
//! xtask crate from src/cli.rs and doc/), checked against the committed
//! copies under man/ and completions/, rendered by groff and man, and loaded
//! by bash, zsh and fish.
//!
//! Regenerate after changing src/cli.rs or doc/: `cargo xtask generate`
//! (or, as before, `DEVLOCK_REGENERATE=1 cargo test --test devlock generated`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use xtask::{REGENERATE, built_command, exit_codes, generated_files, repo, sections};

fn generated(path: &str) -> String {
    generated_files()
        .into_iter()
        .find(|(p, _)| p == path)
        .unwrap_or_else(|| panic!("{path} is not generated"))
        .1
}

/// The freshly generated file, written into a temp directory.
fn fresh_copy(path: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(Path::new(path).file_name().unwrap());
    std::fs::write(&file, generated(path)).unwrap();
    (dir, file)
}

/// Runs a program (one the test `needs:`).
fn run(program: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args);
    for (key, value) in env {
        cmd.env(key, value);
    }
    cmd.output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

test!(generated_files_are_up_to_date, needs: []);
pub(crate) fn generated_files_are_up_to_date() {
    let regenerate = std::env::var_os("DEVLOCK_REGENERATE").is_some_and(|v| !v.is_empty());
    let mut stale = Vec::new();
    for (path, text) in generated_files() {
        let full = repo().join(&path);
        let committed = std::fs::read_to_string(&full).ok();
        if committed.as_deref() == Some(text.as_str()) {
            continue;
        }
        if regenerate {
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(&full, &text).unwrap();
            eprintln!("wrote {path}");
        } else {
            stale.push(format!(
                "{path} is out of date: run {REGENERATE} and commit"
            ));
        }
    }
    assert!(stale.is_empty(), "{}", stale.join("\n"));
}

test!(generated_output_is_deterministic, needs: []);
pub(crate) fn generated_output_is_deterministic() {
    assert_eq!(generated_files(), generated_files());
    let page = generated("man/devlock.1");
    let title = page.lines().find(|l| l.starts_with(".TH ")).unwrap();
    let looks_like_a_date = title.as_bytes().windows(10).any(|w| {
        w.iter().enumerate().all(|(i, b)| {
            if i == 4 || i == 7 {
                *b == b'-'
            } else {
                b.is_ascii_digit()
            }
        })
    });
    assert!(!looks_like_a_date, "no date in the title line: {title}");
}

test!(man_page_has_every_section_and_exit_code, needs: []);
pub(crate) fn man_page_has_every_section_and_exit_code() {
    let page = generated("man/devlock.1");
    let sections = sections(&page);
    let titles: Vec<&str> = sections.iter().map(|(t, _)| t.as_str()).collect();
    let wanted = [
        "NAME",
        "SYNOPSIS",
        "DESCRIPTION",
        "OPTIONS",
        "SUBCOMMANDS",
        "WAITING",
        "SIGNALS",
        "ON A SHARED MACHINE",
        "ACROSS MACHINES",
        "EXIT STATUS",
        "ENVIRONMENT",
        "FILES",
        "EXAMPLES",
        "VERSION",
        "SEE ALSO",
    ];
    let mut at = 0;
    for title in wanted {
        let found = titles[at..]
            .iter()
            .position(|t| *t == title)
            .unwrap_or_else(|| panic!("no {title} section after {:?}: {titles:?}", titles.get(at)));
        at += found + 1;
    }
    let exit_status = &sections.iter().find(|(t, _)| t == "EXIT STATUS").unwrap().1;
    for (code, shown) in exit_codes() {
        assert!(
            exit_status.contains(&shown),
            "EXIT STATUS does not show {code:?} as {shown:?}"
        );
    }
    // Every flag comes from clap, none from a hand-kept list.
    let options = &sections.iter().find(|(t, _)| t == "OPTIONS").unwrap().1;
    for arg in built_command().get_arguments().filter(|a| !a.is_hide_set()) {
        if let Some(long) = arg.get_long() {
            let shown = format!("\\-\\-{}", long.replace('-', "\\-"));
            assert!(options.contains(&shown), "OPTIONS lacks --{long}");
        }
    }
    let environment = &sections.iter().find(|(t, _)| t == "ENVIRONMENT").unwrap().1;
    for var in [
        "DEVLOCK_DIR",
        "NO_COLOR",
        "DEVLOCK_NVIDIA_SMI",
        "DEVLOCK_ETCD",
        "DEVLOCK_ETCD_USER",
        "DEVLOCK_RESOURCES",
        "DEVLOCK_STEP",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
    ] {
        assert!(environment.contains(var), "ENVIRONMENT lacks {var}");
    }
    assert!(!page.contains(".SH EXTRA"), "after_long_help stays out");
}

test!(man_pages_render_without_warnings, needs: [Tool("groff"), Tool("man")]);
pub(crate) fn man_pages_render_without_warnings() {
    let pages: Vec<String> = generated_files()
        .into_iter()
        .map(|(path, _)| path)
        .filter(|path| path.starts_with("man/"))
        .collect();
    for path in &pages {
        let (_dir, file) = fresh_copy(path);
        let file = file.to_str().unwrap();
        let out = run("groff", &["-ww", "-man", "-Tutf8", file], &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "groff -ww on {path}: {stderr}"
        );
        let env = [("MANWIDTH", "80")];
        let out = run("man", &["-l", file], &env);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "man -l on {path}: {stderr}"
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("SYNOPSIS"), "man -l on {path}: {text}");
    }
}

/// Runs bash with the fresh completion script sourced first.
fn bash_with_completions(script: &str, env: &[(&str, &str)]) -> Output {
    let (_dir, file) = fresh_copy("completions/devlock.bash");
    let full = format!("source '{}' || exit 99\n{script}", file.display());
    run("bash", &["--norc", "--noprofile", "-c", &full], env)
}

test!(bash_loads_the_completion_script, needs: [Tool("bash")]);
pub(crate) fn bash_loads_the_completion_script() {
    let out = bash_with_completions("complete -p devlock", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("-F _devlock_with_resources") && stdout.trim_end().ends_with(" devlock"),
        "{stdout}"
    );
}

test!(bash_completes_resource_names_from_the_scratch_directory, needs: [Tool("bash"), BashCompletion]);
pub(crate) fn bash_completes_resource_names_from_the_scratch_directory() {
    let locks = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    for name in ["gpu.lock", "gpu:0.lock", "gpu:1.lock", ".gpu@1.0.wait"] {
        std::fs::write(locks.path().join(name), "").unwrap();
    }
    std::fs::write(other.path().join("tpu.lock"), "").unwrap();
    let script = completion_cases(other.path());
    let stdout = run_completions(locks.path(), &script);
    let reply = |line: &str| reply_to(&stdout, line);
    let other_dir = other.path().display().to_string();
    assert_eq!(reply("words-only"), ["gpu", "gpu:0", "gpu:1"]);
    assert_eq!(
        reply("devlock "),
        [
            "busy", "forget", "gpu", "gpu:0", "gpu:1", "help", "report", "serve", "setup", "status"
        ]
    );
    assert_eq!(reply("devlock g"), ["gpu", "gpu:0", "gpu:1"]);
    assert_eq!(reply("devlock -n -w 10m g"), ["gpu", "gpu:0", "gpu:1"]);
    assert_eq!(reply("devlock gpu "), ["gpu", "gpu:0", "gpu:1"]);
    assert_eq!(reply("devlock status "), ["gpu", "gpu:0", "gpu:1"]);
    assert_eq!(reply("devlock status --json g"), ["gpu", "gpu:0", "gpu:1"]);
    // serve takes no resource.
    assert!(!reply("devlock serve ").contains(&"gpu"), "{stdout}");
    assert_eq!(
        reply(&format!("devlock --dir {other_dir} ")),
        [
            "busy", "forget", "help", "report", "serve", "setup", "status", "tpu"
        ]
    );
    assert_eq!(
        reply(&format!("devlock --dir={other_dir} status ")),
        ["tpu"]
    );
    // Bash splits gpu:0 at the colon and replaces only what follows it.
    assert_eq!(reply("devlock gpu:"), ["0", "1"]);
    // A duration completes nothing, not even file names.
    assert!(reply("devlock -w ").is_empty(), "{stdout}");
    assert!(reply("devlock --report-every ").is_empty(), "{stdout}");
    // Options are clap's to complete.
    assert_eq!(reply("devlock --no"), ["--no-setup-warning", "--no-wait"]);
    // After --: commands, then the command's own arguments.
    assert!(!reply("devlock gpu -- ").contains(&"gpu"));
    assert_eq!(
        reply("devlock gpu -- devlock-test-t"),
        ["devlock-test-tool"]
    );
    assert_eq!(reply("devlock -n gpu:0 -- devlock-test-tool a"), ["alpha"]);
}

/// The completion cases. Each: the line up to the cursor, then what
/// COMPREPLY must and must not hold (one line, words separated by spaces).
fn completion_cases(other: &std::path::Path) -> String {
    format!(
        r#"
complete_line() {{
    COMP_LINE=$1 COMP_POINT=${{#1}}
    COMP_WORDS=($1)
    [[ $1 == *' ' ]] && COMP_WORDS+=('')
    COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))
    COMPREPLY=()
    _devlock_with_resources devlock "${{COMP_WORDS[COMP_CWORD]}}" "${{COMP_WORDS[COMP_CWORD-1]}}"
    echo "$1|${{COMPREPLY[*]}}"
}}
# As the brief of a completion test goes: COMP_WORDS and COMP_CWORD only.
unset COMP_LINE COMP_POINT
COMP_WORDS=(devlock g) COMP_CWORD=1 COMPREPLY=()
_devlock_with_resources devlock g devlock
echo "words-only|${{COMPREPLY[*]}}"
complete_line 'devlock '
complete_line 'devlock g'
complete_line 'devlock -n -w 10m g'
complete_line 'devlock gpu '
complete_line 'devlock status '
complete_line 'devlock status --json g'
complete_line 'devlock serve '
complete_line 'devlock --dir {other} '
complete_line 'devlock --dir={other} status '
complete_line 'devlock gpu:'
complete_line 'devlock -w '
complete_line 'devlock --report-every '
complete_line 'devlock --no'
complete_line 'devlock gpu -- '
complete_line 'devlock gpu -- devlock-test-t'
complete_line 'devlock -n gpu:0 -- devlock-test-tool a'
"#,
        other = other.display()
    )
}

/// Runs `script` in bash with devlock's completion loaded, `locks` as the
/// lock directory and a command with a completion of its own on PATH; its
/// stdout.
fn run_completions(locks: &std::path::Path, script: &str) -> String {
    let dir = locks.to_str().unwrap();
    let tools = tempfile::tempdir().unwrap();
    let tool = tools.path().join("devlock-test-tool");
    std::fs::write(&tool, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        tools.path().display(),
        std::env::var("PATH").unwrap()
    );
    // The command's own completion, for bash-completion to find.
    let script = format!(
        "{}complete -W 'alpha beta' devlock-test-tool\n{script}",
        bash_completion_prelude()
    );
    let out = bash_with_completions(&script, &[("DEVLOCK_DIR", dir), ("PATH", &path)]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// What COMPREPLY held for `line`, sorted.
fn reply_to<'a>(stdout: &'a str, line: &str) -> Vec<&'a str> {
    let replies: Vec<(&str, Vec<&str>)> = stdout
        .lines()
        .filter_map(|l| l.split_once('|'))
        .map(|(line, reply)| (line, reply.split_whitespace().collect()))
        .collect();
    let mut words = replies
        .iter()
        .find(|(l, _)| *l == line)
        .unwrap_or_else(|| panic!("no reply for {line:?} in {stdout}"))
        .1
        .clone();
    words.sort();
    words
}

const BASH_COMPLETION: &str = "/usr/share/bash-completion/bash_completion";

/// Sources bash-completion, whose command-offset completion devlock's uses
/// after `--` (the test needs it).
fn bash_completion_prelude() -> String {
    format!("source {BASH_COMPLETION}\n")
}

test!(zsh_and_fish_accept_their_completions, needs: [Tool("zsh"), Tool("fish")]);
pub(crate) fn zsh_and_fish_accept_their_completions() {
    let (_zdir, zsh_file) = fresh_copy("completions/_devlock");
    let out = run("zsh", &["-n", zsh_file.to_str().unwrap()], &[]);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "zsh -n: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_fdir, fish_file) = fresh_copy("completions/devlock.fish");
    let fish_file = fish_file.to_str().unwrap();
    let out = run("fish", &["-n", fish_file], &[]);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "fish -n: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let locks = tempfile::tempdir().unwrap();
    std::fs::write(locks.path().join("gpu:0.lock"), "").unwrap();
    let script = format!(
        "source '{fish_file}'\n\
         complete -C'devlock '\necho ==\n\
         complete -C'devlock status g'\necho ==\n\
         complete -C'devlock -w '\necho ==\n\
         complete -C'devlock gpu:0 -- '\necho ==\n\
         complete -C'devlock gpu:0 -- devlock-test-t'\necho ==\n\
         complete -c devlock-test-tool -f -a 'alpha beta'\n\
         complete -C'devlock -n gpu:0 -- devlock-test-tool '\n"
    );
    let dir = locks.path().to_str().unwrap();
    let tools = tempfile::tempdir().unwrap();
    let tool = tools.path().join("devlock-test-tool");
    std::fs::write(&tool, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        tools.path().display(),
        std::env::var("PATH").unwrap()
    );
    let out = run(
        "fish",
        &["--no-config", "-c", &script],
        &[("DEVLOCK_DIR", dir), ("HOME", dir), ("PATH", &path)],
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let parts: Vec<Vec<&str>> = stdout
        .split("==\n")
        .map(|p| p.lines().map(|l| l.split('\t').next().unwrap()).collect())
        .collect();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        parts[0].contains(&"gpu:0") && parts[0].contains(&"status"),
        "{stdout}"
    );
    assert_eq!(parts[1], ["gpu:0"], "{stdout}");
    // A duration completes nothing, not even file names.
    assert!(parts[2].is_empty(), "{stdout}");
    // After --: commands, then the command's own arguments.
    assert!(!parts[3].contains(&"gpu:0"), "{stdout}");
    assert!(parts[3].contains(&"devlock-test-tool"), "{stdout}");
    assert_eq!(parts[4], ["devlock-test-tool"], "{stdout}");
    assert_eq!(parts[5], ["alpha", "beta"], "{stdout}");
}

test!(zsh_completes_the_command_after_the_double_dash, needs: [Tool("zsh")]);
pub(crate) fn zsh_completes_the_command_after_the_double_dash() {
    // zsh's completion system runs inside its line editor; the test runs
    // the real zsh on devlock's function with the completion builtins it
    // calls replaced by ones that print what they were given.
    let (_zdir, zsh_file) = fresh_copy("completions/_devlock");
    let locks = tempfile::tempdir().unwrap();
    std::fs::write(locks.path().join("gpu:0.lock"), "").unwrap();
    let script = format!(
        r#"
compdef() {{ : }}
_normal() {{ print -r -- "normal CURRENT=$CURRENT words=${{(j:,:)words}}" }}
compadd() {{ print -r -- "compadd ${{(j:,:)@}}" }}
_arguments() {{ print -r -- "clap" }}
source {file}
try() {{ words=("$@"); CURRENT=$#; _devlock_with_resources; print -- "=="; }}
try devlock gpu -- ech
try devlock -n gpu:0 -- make -j
try devlock g
try devlock -w ''
"#,
        file = zsh_file.display()
    );
    let dir = locks.path().to_str().unwrap();
    let out = run("zsh", &["-f", "-c", &script], &[("DEVLOCK_DIR", dir)]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parts: Vec<&str> = stdout.split("==\n").map(str::trim).collect();
    assert_eq!(parts[0], "normal CURRENT=1 words=ech", "{stdout}");
    assert_eq!(parts[1], "normal CURRENT=2 words=make,-j", "{stdout}");
    assert!(
        parts[2].contains("compadd -X,resource,--,gpu:0"),
        "{stdout}"
    );
    assert_eq!(parts[3], "clap", "{stdout}");
}

test!(man_exit_table_names_no_other_code, needs: []);
pub(crate) fn man_exit_table_names_no_other_code() {
    // The exit table lives in devlock(1)'s EXIT STATUS (the README points
    // there): `man_page_has_every_section` wants every code devlock ends
    // with in it; this wants no entry for a code devlock does not use.
    let page = std::fs::read_to_string(repo().join("man/devlock.1")).unwrap();
    let sections = xtask::sections(&page);
    let exit_status = &sections
        .iter()
        .find(|(title, _)| title == "EXIT STATUS")
        .expect("devlock(1) has an EXIT STATUS section")
        .1;
    let lines: Vec<&str> = exit_status.lines().collect();
    let entries: Vec<&str> = lines
        .windows(2)
        .filter(|pair| pair[0] == ".TP")
        .map(|pair| pair[1])
        .collect();
    assert!(entries.len() >= 10, "{entries:?}");
    let shown: Vec<String> = exit_codes()
        .into_iter()
        .map(|(_, shown)| shown.trim().to_owned())
        .collect();
    for entry in &entries {
        assert!(
            shown.iter().any(|s| s == entry),
            "EXIT STATUS has {entry:?}, which no ExitCode is: {shown:?}"
        );
    }
}

test!(install_commands_build_what_was_tested, needs: []);
pub(crate) fn install_commands_build_what_was_tested() {
    // Every `cargo install` the docs give builds from Cargo.lock, as the
    // tests do (`--locked`), and the wheel's build is pinned likewise: its
    // backend at one version, its Rust side from python/Cargo.lock.
    for doc in [
        "README.md",
        "python/README.md",
        "doc/man/etcd.roff",
        "doc/man/files.roff",
    ] {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        for line in text
            .lines()
            .map(|l| l.replace("\\-", "-"))
            .filter(|l| l.contains("cargo install "))
        {
            assert!(line.contains("--locked"), "{doc}: {line}");
        }
    }
    let pyproject = std::fs::read_to_string(repo().join("python/pyproject.toml")).unwrap();
    let requires = pyproject
        .lines()
        .find(|l| l.starts_with("requires = "))
        .expect("a build-system requires line");
    assert!(requires.contains("\"maturin=="), "{requires}");
    assert!(pyproject.contains("\nlocked = true\n"), "{pyproject}");
}

test!(readme_try_without_a_gpu_runs_as_pasted, needs: [Tool("bash")]);
pub(crate) fn readme_try_without_a_gpu_runs_as_pasted() {
    // The README's "Try it without a GPU" block, pasted into bash in a
    // checkout with the freshly built devlock first on PATH: it runs to the
    // end, shows the budgets, and leaves gpu:0 free.
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let block = readme
        .split("<!-- try-without-a-gpu -->\n```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the README's try-without-a-gpu block");
    let bin_dir = std::path::Path::new(crate::harness::BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("bash")
        .args(["-c", block])
        .current_dir(repo())
        .env("PATH", path)
        .env("DEVLOCK_NVML", "none")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("BUDGET"), "{stdout}{stderr}");
    let last = stdout.split("RESOURCE").last().unwrap();
    assert!(
        last.lines()
            .any(|l| l.starts_with("gpu:0") && l.ends_with("free")),
        "{stdout}"
    );
    assert!(!stderr.contains("cannot"), "{stderr}");
}

test!(the_listing_shows_nothing_ignored_without_its_reason, needs: []);
pub(crate) fn the_listing_shows_nothing_ignored_without_its_reason() {
    // What CI's log calls ignored is a test skipped for a reason it names
    // (a missing tool, or run on request); the signal tests' command is not
    // listed at all.
    let exe = std::env::current_exe().unwrap();
    let all = Command::new(&exe).arg("--list").output().unwrap();
    let all = String::from_utf8_lossy(&all.stdout);
    assert!(!all.contains("signal_counter"), "{all}");
    let ignored = Command::new(&exe)
        .args(["--list", "--ignored"])
        .output()
        .unwrap();
    for line in String::from_utf8_lossy(&ignored.stdout).lines() {
        if line.ends_with(": test") {
            assert!(line.starts_with('['), "ignored without a reason: {line}");
        }
    }
}
