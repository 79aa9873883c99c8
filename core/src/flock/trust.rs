//! Who could break a gate: the scratch directory and the files in it that a
//! user other than root and ourselves owns, and so may rename or remove
//! while we hold them (the next taker then makes a fresh file and runs
//! beside us). In the open directory devlock keeps working and says so, once
//! per run; `devlock setup` makes them root's.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;

use crate::flock::dir::{OpenLog, ScratchDir};
use crate::proc;
use crate::resource::Resource;
use crate::show::sanitize;

/// One thing that lets another user break exclusion (or the line's order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Issue {
    pub path: String,
    /// The user who could do it: the owner (null when it is "anyone").
    pub owner: Option<String>,
    /// One sentence saying what they could do.
    pub reason: String,
}

/// How far a resource (or the directory) can be trusted by this user.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Trust {
    /// No other user but root could rename, remove or replace anything here.
    pub safe: bool,
    /// Owned by root throughout (made by `devlock setup`, or by root's
    /// devlock): no user can rename or remove it, whoever runs devlock.
    pub managed: bool,
    pub issues: Vec<Issue>,
}

impl Trust {
    fn from_issues(issues: Vec<Issue>, managed: bool) -> Trust {
        Trust {
            safe: issues.is_empty(),
            managed,
            issues,
        }
    }
}

/// The user whose exclusion is at stake: ours.
fn me() -> u32 {
    crate::sys::process::effective_uid()
}

/// Whether a file owned by `owner` can be renamed or removed by a user who
/// is neither root nor us.
pub(crate) fn foreign(owner: u32) -> bool {
    owner != 0 && owner != me()
}

fn user(uid: u32) -> String {
    sanitize(&proc::process::user_name(uid))
}

/// What an owner of `name` (a file in the scratch directory) could do.
fn file_issue(path: &Path, owner: u32, name: &str) -> Issue {
    let who = user(owner);
    let reason = if name.ends_with(".queue") {
        format!(
            "{} is owned by {who}, who can replace it and reorder the line",
            crate::show::show_path(path)
        )
    } else {
        format!(
            "{} is owned by {who}, who can rename or remove it while it is held and so let a second holder in",
            crate::show::show_path(path)
        )
    };
    Issue {
        path: crate::show::show_path(path),
        owner: Some(who),
        reason,
    }
}

/// The resource a file in the scratch directory belongs to: `R.lock`,
/// `.R.queue`, `.R.slotN`.
pub fn resource_of(name: &str) -> Option<Resource> {
    if let Some(r) = Resource::from_file_name(name) {
        return Some(r);
    }
    let inner = name.strip_prefix('.')?;
    let base = inner.strip_suffix(".queue").or_else(|| {
        let (base, n) = inner.rsplit_once(".slot")?;
        n.bytes().all(|b| b.is_ascii_digit()).then_some(base)
    })?;
    base.parse().ok()
}

/// The issues with the directory at `path`, open as `dir`: its owner and
/// mode, and those of every directory above it (whoever can replace one of
/// them can put another directory in its place).
pub fn dir_issues(dir: &ScratchDir) -> Vec<Issue> {
    let mut issues = Vec::new();
    let path = dir.path();
    if let Ok(st) = nix::sys::stat::fstat(dir.fd()) {
        if foreign(st.st_uid) {
            let who = user(st.st_uid);
            issues.push(Issue {
                path: crate::show::show_path(path),
                owner: Some(who.clone()),
                reason: format!(
                    "{} is owned by {who}, who can rename or remove every lock file in it",
                    crate::show::show_path(path)
                ),
            });
        }
        if let Some(issue) = loose_mode(path, st.st_mode, st.st_gid) {
            issues.push(issue);
        }
    }
    issues.extend(ancestor_issues(path));
    issues
}

/// A directory others may write without the sticky bit: they can rename
/// or remove what is in it.
fn loose_mode(path: &Path, mode: u32, gid: u32) -> Option<Issue> {
    let sticky = mode & libc::S_ISVTX != 0;
    if sticky {
        return None;
    }
    let who = if mode & 0o002 != 0 {
        "everyone".to_owned()
    } else if mode & 0o020 != 0 && gid != 0 {
        format!("group {}", group_name(gid))
    } else {
        return None;
    };
    Some(Issue {
        path: crate::show::show_path(path),
        owner: None,
        reason: format!(
            "{} is writable by {who} and not sticky, so they can rename or replace what is in it",
            crate::show::show_path(path)
        ),
    })
}

fn group_name(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => sanitize(&g.name),
        _ => gid.to_string(),
    }
}

/// Issues with the directories above `path` (lexically, and through any
/// symbolic link on the way).
fn ancestor_issues(path: &Path) -> Vec<Issue> {
    let absolute = if path.is_absolute() {
        path.to_owned()
    } else {
        match std::env::current_dir() {
            Ok(cwd) => cwd.join(path),
            Err(_) => return Vec::new(),
        }
    };
    let mut issues = Vec::new();
    let mut through_link = false;
    check_chain(&absolute, &mut issues, &mut through_link);
    if through_link && let Ok(real) = std::fs::canonicalize(&absolute) {
        let mut ignored = false;
        check_chain(&real, &mut issues, &mut ignored);
    }
    issues.dedup();
    issues
}

fn check_chain(path: &Path, issues: &mut Vec<Issue>, through_link: &mut bool) {
    let mut prefix = PathBuf::new();
    let components: Vec<_> = path.components().collect();
    // Every proper ancestor: the directory itself is checked through its fd.
    for component in components.iter().take(components.len().saturating_sub(1)) {
        prefix.push(component);
        let Ok(meta) = std::fs::symlink_metadata(&prefix) else {
            return;
        };
        if foreign(meta.uid()) {
            let who = user(meta.uid());
            issues.push(Issue {
                path: crate::show::show_path(&prefix),
                owner: Some(who.clone()),
                reason: format!(
                    "{} is owned by {who}, who can replace the directory below it",
                    crate::show::show_path(&prefix)
                ),
            });
        }
        if meta.file_type().is_symlink() {
            *through_link = true;
            continue;
        }
        if let Some(issue) = loose_mode(&prefix, meta.mode(), meta.gid()) {
            issues.push(issue);
        }
    }
}

/// The trust of the directory, for status.
pub(crate) fn of_dir(dir: &ScratchDir) -> Trust {
    let managed = nix::sys::stat::fstat(dir.fd()).is_ok_and(|st| st.st_uid == 0);
    Trust::from_issues(dir_issues(dir), managed)
}

/// The trust of one resource's files (lock, queue, slots) that exist, for
/// status; `dir_managed` from [`of_dir`].
pub(crate) fn of_resource(
    dir: &ScratchDir,
    names: &[String],
    resource: &Resource,
    dir_managed: bool,
) -> Trust {
    let mut issues = Vec::new();
    let mut root_owned = dir_managed;
    let lock = resource.file_name();
    let queue = crate::flock::queue::queue_name(&lock);
    let slot_prefix = format!(".{resource}.slot");
    let slots = names.iter().filter(|n| {
        n.strip_prefix(slot_prefix.as_str())
            .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
    });
    let ours: Vec<&str> = [lock.as_str(), queue.as_str()]
        .into_iter()
        .chain(slots.map(String::as_str))
        .collect();
    for (i, name) in ours.into_iter().enumerate() {
        match nix::sys::stat::fstatat(dir.fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => {
                // Slot files are made on demand: they do not decide `managed`.
                if i < 2 {
                    root_owned &= st.st_uid == 0;
                }
                let path = dir.path().join(name);
                if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                    issues.push(Issue {
                        path: crate::show::show_path(&path),
                        owner: Some(user(st.st_uid)),
                        reason: format!(
                            "{} is a {} owned by {}, not a regular file: devlock refuses it (exit 74)",
                            crate::show::show_path(&path),
                            crate::show::kind_of(st.st_mode),
                            user(st.st_uid)
                        ),
                    });
                } else if foreign(st.st_uid) {
                    issues.push(file_issue(&path, st.st_uid, name));
                }
            }
            Err(_) if i < 2 => root_owned = false,
            Err(_) => {}
        }
    }
    Trust::from_issues(issues, root_owned)
}

/// The variable that silences the setup warning, as `--no-setup-warning`.
pub(crate) const NO_SETUP_WARNING_ENV: &str = "DEVLOCK_NO_SETUP_WARNING";

/// What one run met that another user could break, for its one warning
/// line: owned by the run (the command line; the library stays silent),
/// fed by its scratch directory's opens ([`ScratchDir::log_opens`]) and by
/// what its takes return, handed to the front end by [`Notes::drain`].
#[derive(Debug)]
pub struct Notes(Mutex<Found>);

#[derive(Debug, Default)]
struct Found {
    /// The setup warning was said (or silenced): once per run.
    said: bool,
    issues: Vec<Issue>,
    resources: BTreeSet<String>,
    lines: Vec<String>,
    dir: Option<PathBuf>,
    run_resources: Vec<String>,
    opens: Option<OpenLog>,
    /// Whether any issue was found in this run (said or not yet).
    any_issue: bool,
}

impl Notes {
    /// The notes of a run that uses `resources` in `dir`: the directory's
    /// issues now, and from now on every file opened in it.
    pub fn new(dir: &mut ScratchDir, resources: &[Resource]) -> Notes {
        let opens = OpenLog::default();
        dir.log_opens(opens.clone());
        let mut found = Found {
            dir: Some(dir.path().to_owned()),
            run_resources: resources.iter().map(Resource::to_string).collect(),
            opens: Some(opens),
            ..Found::default()
        };
        for issue in dir_issues(dir) {
            if !found.issues.contains(&issue) {
                found.issues.push(issue);
            }
        }
        Notes(Mutex::new(found))
    }

    /// Silences the setup warning (`--no-setup-warning`, or
    /// [`NO_SETUP_WARNING_ENV`] set to anything but empty, `0`, `false`,
    /// `no` or `off`), not the others.
    pub fn without_setup_warning(self, flag: bool) -> Notes {
        let env = std::env::var(NO_SETUP_WARNING_ENV).is_ok_and(|v| {
            !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "0" | "false" | "no" | "off"
            )
        });
        self.found().said |= flag || env;
        self
    }

    fn found(&self) -> std::sync::MutexGuard<'_, Found> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes another one-line warning (a file held without a record, say).
    pub fn line(&self, line: Option<String>) {
        let Some(line) = line else { return };
        let mut found = self.found();
        if !found.lines.contains(&line) {
            found.lines.push(line);
        }
    }

    /// Whether another user could rename or remove a file of this run (or
    /// its directory): then its holder must watch its paths.
    pub fn renamable(&self) -> bool {
        let mut found = self.found();
        found.take_opens();
        found.any_issue || !found.issues.is_empty()
    }

    /// What was noted since the last drain, for the front end to say: the
    /// trust issues as one note with the fix (once per run, unless
    /// silenced), then every other warning line.
    pub fn drain(&self) -> Vec<Note> {
        let mut found = self.found();
        found.take_opens();
        let issues = std::mem::take(&mut found.issues);
        found.any_issue |= !issues.is_empty();
        let lines = std::mem::take(&mut found.lines);
        let mut resources: Vec<String> = std::mem::take(&mut found.resources).into_iter().collect();
        if resources.is_empty() {
            resources = found.run_resources.clone();
        }
        let mut notes = Vec::new();
        if !issues.is_empty() && !found.said {
            found.said = true;
            // setup makes the directory and its files root's, but refuses
            // a way to it through what another user owns or may write.
            let dir = found.dir.clone().unwrap_or_default();
            let above = issues.iter().any(|i| !Path::new(&i.path).starts_with(&dir));
            let mut owners: Vec<String> = Vec::new();
            for owner in issues
                .iter()
                .map(|i| i.owner.as_deref().unwrap_or("anyone"))
            {
                if !owners.iter().any(|o| o == owner) {
                    owners.push(owner.to_owned());
                }
            }
            let mut fixes = vec![fix_command(
                Some(&dir),
                resources.iter().map(String::as_str),
            )];
            // GPUs alone: `--gpus` declares every one the driver lists.
            let gpu_family = |r: &String| r == "gpu" || r.starts_with("gpu:");
            if resources.iter().all(gpu_family) {
                fixes.push(fix_command(Some(&dir), ["--gpus"].into_iter()));
            }
            // Above the directory, the way that another user can swap.
            let named = issues
                .iter()
                .rfind(|i| !Path::new(&i.path).starts_with(&dir))
                .map_or(dir.clone(), |i| PathBuf::from(&i.path));
            notes.push(Note::NotSetUp {
                named,
                owners,
                above,
                fixes,
            });
        }
        notes.extend(lines.into_iter().map(Note::Line));
        notes
    }
}

/// One thing a run noted that its user should hear (see [`Notes::drain`]);
/// the front end words it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// The lock directory, or a directory on the way to it (`above`), is
    /// not set up: `named` is the one to name, `owners` those who could
    /// let a second holder in, `fixes` the setup commands, best first.
    NotSetUp {
        named: PathBuf,
        owners: Vec<String>,
        above: bool,
        fixes: Vec<String>,
    },
    /// Another one-line warning (a file held without a record, say).
    Line(String),
}

impl Found {
    /// The files opened since the last look that another user owns.
    fn take_opens(&mut self) {
        let opened = match &self.opens {
            Some(log) => std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner())),
            None => return,
        };
        for (path, owner, name) in opened {
            if !foreign(owner) {
                continue;
            }
            let issue = file_issue(&path, owner, &name);
            if !self.issues.contains(&issue) {
                self.issues.push(issue);
                if let Some(r) = resource_of(&name) {
                    self.resources.insert(r.to_string());
                }
            }
        }
    }
}

/// `sudo devlock setup [--dir D] R...`
pub fn fix_command<'a>(dir: Option<&Path>, resources: impl Iterator<Item = &'a str>) -> String {
    let mut command = "sudo devlock setup".to_owned();
    if let Some(dir) = dir.filter(|d| *d != Path::new(crate::flock::dir::DEFAULT_DIR)) {
        command.push_str(&format!(" --dir {}", crate::show::show_path(dir)));
    }
    for r in resources {
        command.push(' ');
        command.push_str(r);
    }
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The notes come out as data, each line once, the setup warning once
    /// per run, and nothing twice.
    #[test]
    fn notes_are_drained_as_data_and_said_once() {
        let dir = PathBuf::from("/srv/locks");
        let notes = Notes(Mutex::new(Found {
            dir: Some(dir.clone()),
            run_resources: vec!["gpu:0".to_owned()],
            ..Found::default()
        }));
        let issue = |path: &str, owner: Option<&str>| Issue {
            path: path.to_owned(),
            owner: owner.map(str::to_owned),
            reason: "may rename it".to_owned(),
        };
        notes.found().issues = vec![
            issue("/srv/locks/gpu:0.lock", Some("alice")),
            issue("/srv/locks", None),
            issue("/srv/locks/gpu.lock", Some("alice")),
        ];
        notes.line(Some("held without a record".to_owned()));
        notes.line(Some("held without a record".to_owned()));
        notes.line(None);
        assert_eq!(
            notes.drain(),
            vec![
                Note::NotSetUp {
                    named: dir.clone(),
                    owners: vec!["alice".to_owned(), "anyone".to_owned()],
                    above: false,
                    fixes: vec![
                        "sudo devlock setup --dir /srv/locks gpu:0".to_owned(),
                        "sudo devlock setup --dir /srv/locks --gpus".to_owned(),
                    ],
                },
                Note::Line("held without a record".to_owned()),
            ]
        );
        assert!(notes.drain().is_empty());
        assert!(notes.renamable(), "the issues still count after the drain");
        notes.found().issues = vec![issue("/srv", Some("bob"))];
        assert!(
            notes.drain().is_empty(),
            "the setup warning is said once a run"
        );
    }

    #[test]
    fn files_of_a_resource_are_recognised() {
        let r = |s: &str| resource_of(s).map(|r| r.to_string());
        assert_eq!(r("gpu:0.lock").as_deref(), Some("gpu:0"));
        assert_eq!(r(".gpu:0.queue").as_deref(), Some("gpu:0"));
        assert_eq!(r(".gpu.slot12").as_deref(), Some("gpu"));
        assert_eq!(r(".gpu@12.0.wait"), None);
        assert_eq!(r("notes.txt"), None);
    }

    #[test]
    fn the_fix_names_a_directory_only_when_not_the_default() {
        assert_eq!(
            fix_command(
                Some(Path::new(crate::flock::dir::DEFAULT_DIR)),
                ["gpu"].into_iter()
            ),
            "sudo devlock setup gpu"
        );
        assert_eq!(
            fix_command(Some(Path::new("/x")), ["a", "b"].into_iter()),
            "sudo devlock setup --dir /x a b"
        );
    }
}
