//! What `devlock setup` records in the lock directory for every hold there
//! (the site's idle timeout, `.idle-timeout`; where usage records go,
//! `.usage-dir`, whose directory it makes root's), and the boot snippet
//! (`--print-tmpfiles`) that makes the same set-up again, records included.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use nix::fcntl::OFlag;

use super::{Plan, Report, TRIES, c_string, unlink};
use crate::cli::SetupArgs;
use crate::exit::ExitCode;
use crate::flock::dir::ScratchDir;
use crate::show::{sanitize, show_path};
use crate::usage::site::{self, UsageDir};
use crate::walk::Parent;

/// Writes the site's default idle timeout ([`write_site_file`]).
pub(super) fn site_idle_timeout(
    dir: &ScratchDir,
    timeout: Duration,
    report: &mut Report,
) -> Result<()> {
    if crate::usage::idle::site_default(dir) == Some(timeout) {
        return Ok(());
    }
    let text = format!("{}\n", humantime::format_duration(timeout));
    let name = crate::usage::idle::SITE_FILE;
    write_site_file(dir, name, &text)?;
    report.changed(
        &dir.path().join(name),
        &format!("site idle timeout {}", text.trim()),
    );
    Ok(())
}

/// Records where usage records go ([`site::USAGE_FILE`], with
/// [`write_site_file`]), for every run, `report` and `serve` to find
/// without `DEVLOCK_USAGE_DIR`.
pub(super) fn record_usage_dir(
    dir: &ScratchDir,
    usage: &UsageDir,
    report: &mut Report,
) -> Result<()> {
    if site::usage_dir(dir.fd()).as_ref() == Some(usage) {
        return Ok(());
    }
    let text = site::usage_text(usage);
    write_site_file(dir, site::USAGE_FILE, &format!("{text}\n"))?;
    report.changed(
        &dir.path().join(site::USAGE_FILE),
        &match usage {
            UsageDir::Nowhere => "no usage records kept (none recorded)".to_owned(),
            UsageDir::At(_) => format!("usage directory recorded: {}", sanitize(&text)),
        },
    );
    Ok(())
}

/// Writes a site record (`.idle-timeout`, `.usage-dir`), root's 0644, and
/// puts it in place of whatever was at its name in one `rename`: a run
/// reads the old record or the new one, never none or half of one. An
/// empty directory planted at the name is removed first; a link or another
/// user's file is replaced (in the directory root owns, relative to it).
fn write_site_file(dir: &ScratchDir, name: &str, text: &str) -> Result<()> {
    use std::io::Write;
    let path = dir.path().join(name);
    // A directory at the name (planted by whoever owned the lock directory
    // before setup took it over) would make the rename below fail: it is
    // moved aside, whatever it holds, and said. The directory stays sticky
    // and open to every user (1777), so a user racing setup can still plant
    // another between the move and the rename (or one at the aside name):
    // setup then fails with the error, changing nothing more, and is run
    // again.
    let planted = nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .ok()
        .filter(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
    if let Some(st) = planted {
        let aside = format!(".{name}.planted-{}", std::process::id());
        nix::fcntl::renameat(dir.fd(), name, dir.fd(), aside.as_str())
            .with_context(|| format!("moving aside the directory at {}", show_path(&path)))?;
        eprintln!(
            "devlock: {} was a directory of {}'s; moved aside to {}",
            show_path(&path),
            sanitize(&crate::proc::process::user_name(st.st_uid)),
            show_path(&dir.path().join(&aside))
        );
    }
    for n in 0..TRIES {
        let temp = format!(".{name}.setup-{}-{n}", std::process::id());
        let flags =
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let Ok(fd) = crate::sys::fs::openat(dir.fd(), &c_string(&temp)?, flags, 0o600) else {
            continue;
        };
        let placed = crate::sys::fs::fchmod(&fd, 0o644)
            .and_then(|()| std::fs::File::from(fd).write_all(text.as_bytes()))
            .and_then(|()| {
                nix::fcntl::renameat(dir.fd(), temp.as_str(), dir.fd(), name)
                    .map_err(std::io::Error::from)
            });
        if placed.is_err() {
            let _ = unlink(dir, &temp);
        }
        return placed.with_context(|| format!("writing {}", show_path(&path)));
    }
    Err(crate::error::unsafe_file(format!(
        "cannot make a temporary file in {}",
        show_path(dir.path())
    )))
}

/// The usage directory `--usage-dir` names, if it does (`none`, or `off`:
/// nowhere).
pub(super) fn usage_asked(args: &SetupArgs) -> Option<UsageDir> {
    args.usage_dir
        .as_deref()
        .map(|asked| UsageDir::named(asked.as_os_str()))
}

/// The usage directory where nothing else names one.
pub(super) fn usage_managed() -> UsageDir {
    UsageDir::At(crate::usage::MANAGED_DIR.into())
}

/// The usage directory setup makes root's (sticky, world-writable;
/// group-writable with --group, so each user makes and keeps files of
/// their own there), and the directory above it, walked to as `--dir` is
/// (directories missing on the way are made, root's 0755): `None` for
/// nowhere. Its real path must be one a record can hold.
pub(super) fn usage_way(usage: UsageDir) -> Result<Option<(std::path::PathBuf, Parent)>> {
    let UsageDir::At(path) = usage else {
        return Ok(None);
    };
    let way = crate::walk::Way {
        what: "the usage directory",
        make_missing: true,
        ..crate::walk::Way::SETUP
    };
    let parent = crate::walk::reach_by(&path, way)?;
    recordable(&parent.target())?;
    Ok(Some((path, parent)))
}

/// Refuses a usage directory whose path a record (and a boot snippet's
/// line) cannot hold: not UTF-8, or with a control or format character.
fn recordable(path: &Path) -> Result<()> {
    if path.to_str().is_some_and(site::recordable) {
        return Ok(());
    }
    Err(crate::error::usage(format!(
        "the usage directory {} is not UTF-8 or holds a control or format character \
             (shown as ?), which its record cannot hold; name a directory without one",
        show_path(path)
    )))
}

/// Prints the boot snippet ([`tmpfiles`]) for the set-up `plan` asks for
/// in `dir`, as it is now and as asked.
pub(super) fn print_tmpfiles(dir: &Path, mut plan: Plan, args: &SetupArgs) -> Result<ExitCode> {
    // The boot snippet makes the directory as it is now and as asked:
    // the resources already declared there (setup merges names too) and
    // the site's idle policy, so a reboot loses neither.
    let now = ScratchDir::open(dir).ok().flatten();
    let declared = now.as_ref().and_then(crate::flock::declared::read);
    plan.resources.extend(declared.unwrap_or_default());
    plan.resources.sort();
    plan.resources.dedup();
    let idle = args
        .idle_timeout
        .or_else(|| now.as_ref().and_then(crate::usage::idle::site_default));
    // The one recorded before a caller's variable: a user's own (where
    // their records go) must not move the site's in a snippet they print.
    let usage = usage_asked(args)
        .or_else(|| now.as_ref().and_then(|now| site::usage_dir(now.fd())))
        .or_else(crate::usage::named_by_env)
        .unwrap_or_else(usage_managed);
    let usage = match usage {
        UsageDir::At(path) => UsageDir::At(std::path::absolute(&path)?),
        nowhere => nowhere,
    };
    print!("{}", tmpfiles(dir, &plan, args, idle, &usage)?);
    Ok(ExitCode::Success)
}

/// The same set-up as a systemd-tmpfiles(5) snippet, to make it again at
/// every boot. Paths are quoted where needed and `%` escaped.
fn tmpfiles(
    dir: &Path,
    plan: &Plan,
    args: &SetupArgs,
    idle: Option<Duration>,
    usage: &UsageDir,
) -> Result<String> {
    let Some(dir_text) = dir.to_str().filter(|d| d.starts_with('/')) else {
        return Err(crate::error::usage(
            "--print-tmpfiles needs an absolute UTF-8 --dir",
        ));
    };
    // A newline would end the line and start a directive of its own (any
    // control or format character is refused: none belongs in a path an
    // administrator installs at boot). Spaces are quoted below.
    if dir_text.chars().any(crate::show::is_unsafe_char) {
        return Err(crate::error::usage(format!(
            "--print-tmpfiles: --dir {} holds a control or format character (shown as ?), \
                 which would break the snippet's lines; name a directory without one",
            show_path(dir)
        )));
    }
    let quote = |path: &str| {
        let escaped = path.replace('%', "%%");
        if escaped.contains(|c: char| c.is_whitespace() || c == '"' || c == '\\') {
            format!("\"{}\"", escaped.replace('\\', "\\\\").replace('"', "\\\""))
        } else {
            escaped
        }
    };
    let group = plan.group.as_deref().unwrap_or("root");
    if let UsageDir::At(path) = usage {
        recordable(path)?;
    }
    let usage_text = site::usage_text(usage);
    let invocation = invocation(dir, dir_text, plan, args, idle, &usage_text);
    let mut out = format!(
        "# devlock: a managed lock directory, made again at every boot (/run is a tmpfs).\n\
         # Root owns the directory and the declared resources' files, so no user can rename,\n\
         # remove or squat them; see ON A SHARED MACHINE in devlock(1).\n\
         # Made by: {invocation}\n\
         # Install: sudo cp devlock.conf /etc/tmpfiles.d/ && sudo systemd-tmpfiles --create devlock.conf\n\
         d {} {:04o} root {group} -\n",
        quote(dir_text),
        plan.dir_mode
    );
    // The waiters' directory: root's, as setup makes it (no user may make
    // one that is trusted).
    out.push_str(&format!(
        "d {} {:04o} root {group} -\n",
        quote(&format!("{dir_text}/{}", crate::flock::dir::WAIT_DIR)),
        plan.dir_mode
    ));
    for r in &plan.resources {
        for name in plan.files(r) {
            out.push_str(&format!(
                "f {} {:04o} root {group} -\n",
                quote(&format!("{dir_text}/{name}")),
                plan.file_mode
            ));
        }
    }
    if !plan.resources.is_empty() {
        // The declared names, one a line (tmpfiles writes the argument,
        // its \n escapes as newlines, into a file it creates).
        let names: String = plan.resources.iter().map(|r| format!("{r}\\n")).collect();
        out.push_str(&format!(
            "f {} 0644 root root - {names}\n",
            quote(&format!("{dir_text}/{}", crate::flock::declared::FILE))
        ));
    }
    if let Some(timeout) = idle {
        out.push_str(&format!(
            "f {} 0644 root root - {}\n",
            quote(&format!("{dir_text}/{}", crate::usage::idle::SITE_FILE)),
            humantime::format_duration(timeout)
        ));
    }
    // The usage directory (kept across reboots, made again if it went) and
    // its record, which /run loses at every boot. The record is the line's
    // argument, which tmpfiles writes as it is but for its escapes.
    if matches!(usage, UsageDir::At(_)) {
        out.push_str(&format!(
            "d {} {:04o} root {group} -\n",
            quote(&usage_text),
            plan.dir_mode
        ));
    }
    out.push_str(&format!(
        "f {} 0644 root root - {}\n",
        quote(&format!("{dir_text}/{}", site::USAGE_FILE)),
        usage_text.replace('\\', "\\\\").replace('%', "%%")
    ));
    Ok(out)
}

/// The command line that prints the same snippet again, for its header.
fn invocation(
    dir: &Path,
    dir_text: &str,
    plan: &Plan,
    args: &SetupArgs,
    idle: Option<Duration>,
    usage_text: &str,
) -> String {
    let mut invocation = "devlock setup --print-tmpfiles".to_owned();
    if dir != Path::new(crate::flock::dir::DEFAULT_DIR) {
        invocation.push_str(&format!(" --dir {dir_text}"));
    }
    if let Some(g) = &plan.group {
        invocation.push_str(&format!(" --group {g}"));
    }
    if let Some(n) = args.slots {
        invocation.push_str(&format!(" --slots {n}"));
    }
    if let Some(t) = idle {
        invocation.push_str(&format!(
            " --idle-timeout {}",
            humantime::format_duration(t)
        ));
    }
    if usage_text != crate::usage::MANAGED_DIR {
        invocation.push_str(&format!(" --usage-dir {usage_text}"));
    }
    for r in &plan.resources {
        invocation.push(' ');
        invocation.push_str(r.as_str());
    }
    invocation
}
