//! Every sentence devlock says to people about locks, in one place, for
//! both backends: who holds a lock and who waits (`ns-train (pid 4242,
//! alice), held 5m03s`), what stands in the way of a request, and the busy,
//! timeout and waiting lines built from them. Built from the status model's
//! views (or, for etcd, from plain values); nothing here looks at a file.
//!
//! Split by subject: [`busy`] (who is in the way of a lock: holders,
//! waiters, the busy, timeout and budget lines), [`etcd`] and [`serve`]
//! (their backends' and server's lines), and here the rest (the
//! library's words, names, forget, idle, setup warnings).

pub(crate) mod busy;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod serve;

use crate::show::sanitize;
use crate::text::short_duration;
use crate::view::ResourceView;

/// What `--help` adds to a flag of the etcd feature in a build without it.
#[cfg(not(feature = "etcd"))]
pub(crate) const NOT_IN_THIS_BUILD: &str =
    "[not in this build: it was built without the etcd feature]";

/// How to get a devlock that has the etcd backend, from where a user is:
/// a checkout of devlock (the README's install), not the registry.
#[cfg(not(feature = "etcd"))]
pub(crate) const HOW_TO_GET_ETCD: &str = "this devlock was built without etcd support (--etcd, \
     DEVLOCK_ETCD); in a checkout of devlock, build one that has it with `cargo install --locked \
     --path . --features etcd` (needs protoc and a C compiler)";

/// A usage error of the command line's rules, in the library's words: its
/// `Spec` fields and Python's keyword arguments (`mem=` for `--mem`,
/// `wait=False` for `-n`), which is what a library or Python user wrote.
pub(crate) fn in_library_words(err: anyhow::Error) -> anyhow::Error {
    match err.downcast::<crate::error::Error>() {
        Ok(root) => {
            let words = library_words(root.message());
            anyhow::Error::new(root.with_message(words))
        }
        Err(err) => err,
    }
}

/// The command line's flags and examples in a sentence, as keywords.
fn library_words(text: &str) -> String {
    // Whole examples first, then each flag: `name="value"` before a size,
    // `name=N` before a number, the bare name before a word of the
    // sentence, `name=` elsewhere.
    let text = text
        .replace(
            "devlock --any --count 2 gpu:0 gpu:1 gpu:2 -- ...",
            "devlock.lock(\"gpu:0\", \"gpu:1\", \"gpu:2\", any=True, count=2)",
        )
        .replace(
            "-n fails at once, -w DURATION",
            "wait=False fails at once, timeout=",
        );
    const FLAGS: [(&str, &str, Option<&str>); 11] = [
        ("--mem-headroom", "mem_headroom", None),
        ("--mem-strict", "mem_strict", Some("mem_strict=True")),
        ("--mem", "mem", None),
        ("--settle", "settle", None),
        ("--no-wait", "wait=False", Some("wait=False")),
        ("--timeout", "timeout", None),
        ("--any", "any", Some("any=True")),
        ("--count", "count", None),
        ("--slots", "slots", None),
        ("--shared", "shared", Some("shared=True")),
        ("--step", "step", None),
    ];
    // clap's wording of a value it could not read: `for '--mem <SIZE>'`.
    let mut text = text;
    for (flag, name, _) in FLAGS {
        for value in ["<SIZE>", "<DURATION>", "<N>", "<K>"] {
            text = text.replace(&format!("'{flag} {value}'"), &format!("{name}="));
        }
    }
    let mut out = String::new();
    let mut rest = text.as_str();
    'scan: while !rest.is_empty() {
        for (flag, name, switch) in FLAGS {
            let Some(after) = rest.strip_prefix(flag) else {
                continue;
            };
            if after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-') {
                continue;
            }
            let next: String = after
                .strip_prefix(' ')
                .map(|a| {
                    a.chars()
                        .take_while(|c| !c.is_whitespace() && !matches!(c, ',' | ')' | ';'))
                        .collect()
                })
                .unwrap_or_default();
            let (said, used) = match next.chars().next() {
                Some(c) if c.is_ascii_digit() && switch.is_none() => {
                    let value = if next.chars().all(|c| c.is_ascii_digit()) {
                        next.clone()
                    } else {
                        format!("\"{next}\"")
                    };
                    (format!("{name}={value}"), 1 + next.len())
                }
                Some(c) if c.is_ascii_lowercase() && !matches!(next.as_str(), "and" | "or") => {
                    (switch.unwrap_or(name).to_owned(), 0)
                }
                _ => (switch.map_or(format!("{name}="), str::to_owned), 0),
            };
            out.push_str(&said);
            rest = &after[used..];
            continue 'scan;
        }
        let c = rest.chars().next().unwrap_or_default();
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// `timeout="5x" is not a duration (try 90, "90s", "10m" or "1h30m"; a
/// number is seconds)`: a duration the library was given as text.
pub(crate) fn library_duration(name: &str, text: &str) -> String {
    format!(
        "{name}={text:?} is not a duration (try 90, \"90s\", \"10m\" or \"1h30m\"; a number is seconds)"
    )
}

/// A name a managed directory does not declare: `GPU0 is not one of the
/// resources root declared in DIR (gpu, gpu:0, ...); did you mean gpu:0?
/// --new takes it as a new one`.
pub(crate) fn undeclared(
    name: &crate::Resource,
    dir: &str,
    declared: &[crate::Resource],
    close: Option<&crate::Resource>,
) -> String {
    let shown: Vec<&str> = declared.iter().take(12).map(|r| r.as_str()).collect();
    let more = if declared.len() > shown.len() {
        ", ..."
    } else {
        ""
    };
    let fix = match close {
        Some(close) => format!("did you mean {close}? (--new takes {name} as a new one)"),
        None => "--new takes it as a new one".to_owned(),
    };
    format!(
        "{name} is not one of the resources root declared in {} ({}{more}); {fix}",
        sanitize(dir),
        shown.join(", ")
    )
}

/// A new name close to a known one, said as its lock file is made: `GPU0
/// is a new name in DIR; did you mean gpu:0? (--new says it is meant)`.
pub(crate) fn new_name(name: &crate::Resource, dir: &str, close: &crate::Resource) -> String {
    format!(
        "{name} is a new name in {}; did you mean {close}? (--new says it is meant)",
        sanitize(dir)
    )
}

/// `devlock forget` in a directory that does not exist.
pub(crate) fn forget_nothing(dir: &str) -> String {
    format!(
        "{} does not exist: there is nothing to forget",
        sanitize(dir)
    )
}

/// `devlock forget` of a name with no lock file.
pub(crate) fn forget_unknown(name: &crate::Resource, dir: &str) -> String {
    format!(
        "{name} has no lock file in {}: there is nothing to forget",
        sanitize(dir)
    )
}

/// `devlock forget` by a user in a managed directory.
pub(crate) fn forget_needs_root(dir: &str) -> String {
    format!(
        "{} is managed (devlock setup declared its names): only root may forget one",
        sanitize(dir)
    )
}

/// `devlock forget` of a name in use: `gpu:0 is in use: held by train (pid
/// 4242, alice) for 5m03s; not forgotten`.
pub(crate) fn forget_in_use(name: &crate::Resource, view: Option<&ResourceView>) -> String {
    let who = view.map_or(String::new(), busy::busy_phrase);
    format!("{name} is in use{who}; not forgotten")
}

/// Said once a hold's GPUs have computed nothing for its idle timeout.
pub(crate) fn idle_warning(
    names: &str,
    step: &str,
    idle: std::time::Duration,
    grace: std::time::Duration,
) -> String {
    format!(
        "devlock: warning: {names}: {} is idle: its GPUs computed nothing for {} (idle timeout); \
         it is stopped in {} unless they compute (or the job runs `devlock busy DUR`)\n",
        sanitize(step),
        short_duration(idle),
        short_duration(grace)
    )
}

/// The longest setup warning: it fits one line of a wide terminal.
pub(crate) const SETUP_WARNING_MOST: usize = 159;

/// The one setup warning of a run in a directory other users can break
/// (the full list is `devlock status`'s and `--json`'s): `devlock: warning:
/// /run/lock/devlock is not set up: bob can let a second holder in; fix:
/// sudo devlock setup gpu:0`. At most
/// [`SETUP_WARNING_MOST`] characters: the first of `fixes` (each a whole
/// command, most precise first) that fits with the path, else with "the
/// lock directory" for it, else a shortened line.
pub(crate) fn setup_warning(
    dir: &std::path::Path,
    owners: &[&str],
    above: bool,
    fixes: &[String],
) -> String {
    let who = match owners {
        [] | [_] => owners.first().copied().unwrap_or("another user").to_owned(),
        [first, rest @ ..] => format!("{first} and {} more", rest.len()),
    };
    let said = |dir: &str, fix: &str| {
        if above {
            format!(
                "devlock: warning: {dir}, on the way to the locks, is {who}'s or open to \
                 all; choose a --dir under root's (details: devlock status)"
            )
        } else {
            format!(
                "devlock: warning: {dir} is not set up: {who} can let a second holder in; \
                 fix: {fix}"
            )
        }
    };
    let shown = crate::show::show_path(dir);
    let unnamed = if above {
        "a directory"
    } else {
        "the lock directory"
    };
    let generic = "sudo devlock setup (devlock status names what)";
    let line = fixes
        .iter()
        .map(|fix| said(&shown, fix))
        .chain(fixes.iter().map(|fix| said(unnamed, fix)))
        .chain([said(unnamed, generic)])
        .find(|line| line.chars().count() <= SETUP_WARNING_MOST)
        .unwrap_or_else(|| {
            said(unnamed, generic)
                .chars()
                .take(SETUP_WARNING_MOST)
                .collect()
        });
    format!("{line}\n")
}

/// Said as an idle hold is stopped.
pub(crate) fn idle_stop(names: &str, step: &str, idle: std::time::Duration) -> String {
    format!(
        "devlock: --idle-timeout: {names}: stopping {}: its GPUs computed nothing for {}\n",
        sanitize(step),
        short_duration(idle)
    )
}

#[cfg(test)]
mod library_words_tests {
    use super::library_words;

    #[test]
    fn flags_become_keywords() {
        assert_eq!(
            library_words("--mem must be more than 0 (e.g. --mem 20GiB); leave it out"),
            "mem must be more than 0 (e.g. mem=\"20GiB\"); leave it out"
        );
        assert_eq!(
            library_words("--mem-headroom, --settle and --mem-strict need --mem: they shape"),
            "mem_headroom=, settle= and mem_strict=True need mem=: they shape"
        );
        assert_eq!(
            library_words("--count 3 needs at least that many resources after --any, got 2"),
            "count=3 needs at least that many resources after any=True, got 2"
        );
        assert_eq!(
            library_words("--slots takes exactly one resource, without --any or --shared"),
            "slots takes exactly one resource, without any=True or shared=True"
        );
        assert_eq!(
            library_words(
                "--count needs --any: it says how many (devlock --any --count 2 gpu:0 gpu:1 gpu:2 -- ...)"
            ),
            "count needs any=True: it says how many (devlock.lock(\"gpu:0\", \"gpu:1\", \"gpu:2\", any=True, count=2))"
        );
        assert_eq!(
            library_words("a gpu:0 name --mem-x"),
            "a gpu:0 name --mem-x"
        );
    }
}
