//! A usage error as one line, with the hint a user needs.

/// One line out of clap's rendered error: the error itself, what it lists
/// (the missing arguments), and its tips ("did you mean '--no-wait'?"),
/// then a pointer to --help.
pub fn usage_line(rendered: &str) -> String {
    let mut lines = rendered.lines();
    let first = lines.next().unwrap_or("invalid command line");
    let mut line = first.strip_prefix("error: ").unwrap_or(first).to_owned();
    let mut listed = Vec::new();
    for more in lines {
        let text = more.trim();
        if more.starts_with("Usage:") || more.starts_with("For more information") {
            break;
        }
        if let Some(tip) = text.strip_prefix("tip: ") {
            if tip.starts_with("to pass ") {
                // "to pass '--nowait' as a value, use '-- --nowait'": not
                // what a misspelt flag needs.
                continue;
            }
            let tip = match tip
                .strip_prefix("a similar argument exists: ")
                .or_else(|| tip.strip_prefix("a similar value exists: "))
                .or_else(|| tip.strip_prefix("a similar subcommand exists: "))
            {
                Some(similar) => format!("did you mean {similar}?"),
                None => tip.to_owned(),
            };
            line.push_str(&format!("; {tip}"));
        } else if !text.is_empty() {
            listed.push(text.to_owned());
        }
    }
    if !listed.is_empty() {
        line = format!("{} {}", line.trim_end_matches(':'), listed.join(", "));
    }
    // etcdctl's spellings, which devlock does not take (see ACROSS MACHINES in devlock(1)).
    for (theirs, ours) in [
        ("'--cacert'", "--etcd-ca"),
        ("'--cert'", "--etcd-cert"),
        ("'--key'", "--etcd-key"),
    ] {
        if first.contains(&format!("unexpected argument {theirs}")) {
            line.push_str(&format!(
                "; etcdctl's {} is devlock's {ours}",
                theirs.trim_matches('\'')
            ));
        }
    }
    if let Some(hint) = flock_only_hint(first) {
        // Never clap's did-you-mean to an unrelated flag.
        let first = first.strip_prefix("error: ").unwrap_or(first);
        return format!("{first}; {hint}");
    }
    // One hint a message: a line that already says what to try gets no
    // second one.
    if line.contains("did you mean") || line.contains(" (") {
        return line;
    }
    format!("{line} (see {} --help)", help_of(rendered))
}

/// util-linux flock's options that devlock has no flag for, each with
/// what to do instead (those it has are accepted under flock's names:
/// -s, -x/-e, -n/--nb/--nonblock, -w/--wait/--timeout, -E, -h, -V).
const FLOCK_ONLY: &[(&[&str], &str)] = &[
    (
        &["-c", "--command"],
        "is `-- sh -c` here: devlock RESOURCE -- sh -c 'COMMAND'",
    ),
    (
        &["-u", "--unlock"],
        "has no equivalent: devlock releases the lock when its command exits",
    ),
    (
        &["-o", "--close"],
        "has no equivalent: devlock's command always inherits the lock, which is held \
         until everything it started has exited",
    ),
    (
        &["-F", "--no-fork"],
        "has no equivalent: devlock always runs the command as its child, which \
         inherits the lock",
    ),
    (
        &["--verbose"],
        "is devlock's default: it says what it waits for unless -q",
    ),
    (
        &["--fcntl"],
        "has no equivalent: devlock's locks are flock(2) locks",
    ),
];

/// For clap's `unexpected argument 'X'` where X is one of flock's options
/// devlock has no flag for: what to do instead.
fn flock_only_hint(first: &str) -> Option<String> {
    let (_, rest) = first.split_once("unexpected argument '")?;
    let (given, _) = rest.split_once('\'')?;
    let flag = given.split_once('=').map_or(given, |(flag, _)| flag);
    let (_, hint) = FLOCK_ONLY.iter().find(|(names, _)| names.contains(&flag))?;
    Some(format!("util-linux flock's {flag} {hint}"))
}

/// The command whose --help a usage error should point to: `devlock
/// status` for one of status's, from clap's usage line.
fn help_of(rendered: &str) -> String {
    let usage = rendered
        .lines()
        .find_map(|l| l.trim().strip_prefix("Usage: "))
        .unwrap_or("devlock");
    match usage.split_whitespace().nth(1) {
        Some(sub) if sub.chars().all(|c| c.is_ascii_lowercase()) => format!("devlock {sub}"),
        _ => "devlock".to_owned(),
    }
}
