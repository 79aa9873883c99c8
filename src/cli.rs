//! The command line: every flag and subcommand, and the help text around them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

const ABOUT: &str = "Run a command while holding a machine-wide lock on a device (a GPU above all)";

const LONG_ABOUT: &str = "\
devlock takes a kernel flock(2) on DIR/RESOURCE.lock, records who holds it, \
runs COMMAND as a child that inherits the locked file, and waits for it. The kernel \
holds the lock until the command, and anything it started that inherited the lock, \
has exited, whatever kills whom; nothing is left to clean up after a crash. \
Waiters are served first come, first served. util-linux flock on the same file \
joins the same gate. With --etcd the locks live in etcd instead, for resources \
shared between machines; see ACROSS MACHINES in devlock(1).";

const EXAMPLES: &str = "\
Examples:
  devlock gpu -- python train.py --epochs 3      wait for the GPU, then train
  devlock -n gpu -- ./eval.sh                    busy? say who holds it, exit 75
  devlock -w 10m gpu -- make bench               give up after ten minutes
  devlock --step nightly gpu -- ./run.sh         label the holder in status
  devlock status                                 who holds what, who waits
  devlock status --json gpu                      the same, for scripts
  sudo devlock setup --gpus                      a directory and GPU locks no user can break
  flock /run/lock/devlock/gpu.lock -c ./x.sh     util-linux flock, same gate
  devlock --etcd http://10.0.0.5:2379 licence -- ./solve.sh
                                                 one licence, across machines";

/// devlock's command line.
#[derive(Debug, Parser)]
#[command(
    name = "devlock",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_long_help = EXAMPLES,
    subcommand_negates_reqs = true,
    override_usage = "devlock [OPTIONS] <RESOURCE>... -- <COMMAND>...\n       devlock status [OPTIONS] [RESOURCE]...\n       devlock setup [OPTIONS] [RESOURCE]..."
)]
#[allow(missing_docs)] // clap turns doc comments into help text
pub struct Cli {
    #[command(subcommand)]
    pub subcommand: Option<Command>,

    #[command(flatten)]
    pub run: RunArgs,

    /// Scratch directory holding the lock files (created sticky and
    /// world-writable when missing; `devlock setup` makes it root's)
    #[arg(
        long,
        global = true,
        value_name = "DIR",
        env = "DEVLOCK_DIR",
        default_value = crate::scratch::DEFAULT_DIR,
        value_hint = clap::ValueHint::DirPath
    )]
    pub dir: PathBuf,

    /// Longest wait for nvidia-smi before a device counts as unknown
    #[arg(long, global = true, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    pub probe_timeout: Duration,

    /// Lock in etcd at these endpoints instead of the scratch directory, for
    /// resources shared between machines (needs the `etcd` build feature)
    #[arg(
        long,
        global = true,
        value_name = "URL[,URL...]",
        env = "DEVLOCK_ETCD",
        value_delimiter = ',',
        value_hint = clap::ValueHint::Url
    )]
    pub etcd: Vec<String>,

    /// etcd user and password, as NAME:PASSWORD (prefer the environment
    /// variable: the command line is visible to every user)
    #[arg(
        long,
        global = true,
        value_name = "NAME:PASSWORD",
        env = "DEVLOCK_ETCD_USER",
        hide_env_values = true
    )]
    pub etcd_user: Option<String>,
}

/// The subcommands (a run under a lock is the default, not a subcommand).
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show who holds each lock, for how long, and who waits
    #[command(
        long_about = "Show who holds each lock, for how long, and who waits.\n\n\
        Whether a lock is held comes from the kernel (/proc/locks); users come from \
        the kernel too (the uid of the live process), and command lines are read \
        live from /proc, never from a file. A record in a lock file only labels its \
        holder (step, since), and only when the process it names, pid and start \
        time, is the holder the kernel lists; a record whose process is gone is \
        shown as stale. When status cannot see who holds a lock (a file it cannot \
        open, a holder outside its PID namespace) it says held by unknown, never \
        free. status never takes a lock to find out, except inside a child PID \
        namespace (see devlock(1)). With nvidia-smi (or DEVLOCK_NVIDIA_SMI) it also \
        shows each GPU's memory, utilisation and processes, and which of them are \
        outside the gate. Files another user could rename or replace are named in a \
        warning, with the fix.\n\n\
        --json prints one document: {dir, trust: {safe, managed, issues: [{path, \
        owner, reason}]}, resources: [{name, state (free, held, shared or unknown), \
        slots, holders: [{step, pid, pids, user, since, held_for_ms, command, name, \
        exclusive, via, slot, stopped, devices, source (record, no-record, inherited \
        or unknown), note}], waiters: [{step, pid, user, since, waiting_for_ms, \
        position, ticket, stopped, source (registration, flock or unregistered)}], \
        record (unreadable or private), stale_record, foreign_locks: [{path, range, \
        exclusive, pid, user, effect}], conflicts: [{pid, user, step, since}], trust}], \
        device_info: {status (none, unknown or ok), reason}, devices: [{index, uuid, \
        name, memory_used_mib, memory_total_mib, utilization_pct, processes: [{pid, \
        name, user, used_mib, gated, gate}]}]}. Unknown values are null; text from \
        files and processes has control and format characters replaced by '?'.\n\n\
        With --etcd URL it shows the locks in etcd instead, across machines: \
        {etcd, prefix, resources: [{name, state, holders: [{step, pid, child, user, \
        host, since, held_for_ms, command, exclusive, via, key, revision, lease, \
        lease_ttl_s, alive}], waiters: [{... waiting_for_ms, position}]}]}."
    )]
    Status(StatusArgs),

    /// Make the scratch directory and the resources' files root's, so that no
    /// user can rename, remove or replace them (run as root)
    #[command(
        long_about = "Make the scratch directory and the named resources' files root's, \
        so that no user can rename, remove, replace or squat them: a managed directory \
        for a shared machine. Run as root; running it again changes only what is not \
        as it should be.\n\n\
        The directory becomes root:root 1777 (sticky, so users can still lock names \
        nobody declared, which stay open and draw a warning), or root:G 1770 with \
        --group G (only members of G can take the locks). Each RESOURCE gets its \
        lock file and queue file, root's, mode 0666 (root:G 0660 with --group). A \
        directory or a lock file another user owns is taken over in place (the same \
        inode: a job that holds it keeps holding it, alone). A FIFO, symbolic link, \
        socket or directory at a declared path is swapped for a new root file unless \
        it is locked: a held lock file is never replaced (that lets a second holder \
        in), so setup names its holder and exits 75. Without root it exits 77. With \
        --print-tmpfiles it prints the same set-up as a systemd-tmpfiles(5) snippet \
        instead, to make it again at every boot (/run is a tmpfs)."
    )]
    Setup(SetupArgs),
}

/// Arguments of `devlock setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// Resources to declare: their lock and queue files become root's
    #[arg(value_name = "RESOURCE")]
    pub resources: Vec<OsString>,

    /// Only members of this group may take the locks (directory root:GROUP
    /// 1770, files root:GROUP 0660)
    #[arg(long, value_name = "GROUP")]
    pub group: Option<String>,

    /// Declare gpu and gpu:0 .. gpu:N-1 for the GPUs nvidia-smi lists
    #[arg(long)]
    pub gpus: bool,

    /// Also make the semaphore slot files of each RESOURCE (for --slots N)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub slots: Option<u16>,

    /// Print a systemd-tmpfiles snippet for this set-up instead of making it
    #[arg(long)]
    pub print_tmpfiles: bool,
}

/// Arguments for running a command under a lock.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Resource to lock: 1-64 of [A-Za-z0-9._:-], not starting with '.' or '-'
    #[arg(value_name = "RESOURCE")]
    pub resources: Vec<OsString>,

    /// The command to run while holding the lock, after --
    #[arg(last = true, value_name = "COMMAND", value_hint = clap::ValueHint::CommandWithArguments)]
    pub command: Vec<OsString>,

    /// Fail at once if the lock is busy, naming who holds it
    #[arg(short = 'n', long, conflicts_with = "timeout")]
    pub no_wait: bool,

    /// Give up after waiting this long (e.g. 90s, 10m, 1h30m)
    #[arg(short = 'w', long, value_name = "DURATION", value_parser = parse_duration)]
    pub timeout: Option<Duration>,

    /// Exit code when the lock is busy or the wait times out
    #[arg(long, value_name = "N", default_value_t = 75, value_parser = clap::value_parser!(u8))]
    pub conflict_exit_code: u8,

    /// Name the holder shows in status (default: the command's basename)
    #[arg(long, value_name = "NAME")]
    pub step: Option<String>,

    /// Print nothing while waiting, and no warnings
    #[arg(short, long)]
    pub quiet: bool,

    /// Take the first of the RESOURCEs that is or becomes free (see --count)
    #[arg(long)]
    pub any: bool,

    /// With --any: how many of the RESOURCEs to take
    #[arg(long, value_name = "K", default_value_t = 1, requires = "any")]
    pub count: u8,

    /// Take the locks shared: shared holders run together, an exclusive
    /// holder runs alone, and a waiting exclusive request goes first
    #[arg(short, long)]
    pub shared: bool,

    /// Admit up to N holders of the RESOURCE at once; each learns its slot in
    /// DEVLOCK_SLOT. Everyone using the resource must give the same N
    #[arg(long, value_name = "N")]
    pub slots: Option<u16>,

    /// Before starting, check that no process outside the gate uses the GPUs
    /// (gpu:N is GPU N, gpu is all); else release and exit 69
    #[arg(long)]
    pub require_idle: bool,

    /// Device memory a process outside the gate may hold before --require-idle
    /// refuses (e.g. 256MiB, 1GiB)
    #[arg(long, value_name = "SIZE", default_value = "256MiB", value_parser = parse_mib, requires = "require_idle")]
    pub idle_threshold: u64,

    /// When stderr is not a terminal, how often to report a long wait
    #[arg(long, value_name = "DURATION", default_value = "1m", value_parser = parse_duration)]
    pub report_every: Duration,

    /// With --etcd: the lease's time to live [default: 10s]. If devlock dies,
    /// the lock frees itself this long after its last renewal
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub ttl: Option<Duration>,

    /// With --etcd: when the lease cannot be renewed, the command's time
    /// between SIGTERM and SIGKILL [default: 2s]; both come before the lease
    /// could expire
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub kill_after: Option<Duration>,
}

impl RunArgs {
    /// The command line as text, for labels.
    pub fn command_line(&self) -> Vec<String> {
        self.command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    /// `--step`, or the command's basename.
    pub fn step_name(&self) -> String {
        self.step.clone().unwrap_or_else(|| {
            let program = Path::new(&self.command[0]);
            program
                .file_name()
                .unwrap_or(program.as_os_str())
                .to_string_lossy()
                .into_owned()
        })
    }
}

/// Arguments of `devlock status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Resources to show (default: every lock file in the directory)
    #[arg(value_name = "RESOURCE")]
    pub resources: Vec<OsString>,

    /// Print one JSON document instead of a table
    #[arg(long)]
    pub json: bool,
}

/// `NAME:PASSWORD` split at the first colon.
pub fn split_user(text: &str) -> Option<(&str, &str)> {
    text.split_once(':').filter(|(name, _)| !name.is_empty())
}

/// A memory size in MiB: `256`, `256MiB`, `1GiB`, `1.5G`.
fn parse_mib(text: &str) -> Result<u64, String> {
    let lower = text.trim().to_ascii_lowercase();
    let split = lower
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(lower.len());
    let (number, unit) = lower.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("not a size: {text:?} (try 256MiB or 1GiB)"))?;
    let scale = match unit.trim() {
        "" | "m" | "mb" | "mib" => 1.0,
        "g" | "gb" | "gib" => 1024.0,
        "k" | "kb" | "kib" => 1.0 / 1024.0,
        _ => return Err(format!("unknown size unit in {text:?} (use MiB or GiB)")),
    };
    Ok((number * scale).round() as u64)
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (try 90s, 10m or 1h30m)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definitions_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn resources_and_command_are_split_at_the_double_dash() {
        let cli = Cli::try_parse_from(["devlock", "-n", "gpu", "--", "python", "-n", "x"]).unwrap();
        assert!(cli.run.no_wait);
        assert_eq!(cli.run.resources, ["gpu"]);
        assert_eq!(cli.run.command, ["python", "-n", "x"]);
    }

    #[test]
    fn status_is_a_subcommand() {
        let cli = Cli::try_parse_from(["devlock", "status", "--json", "gpu"]).unwrap();
        match cli.subcommand {
            Some(Command::Status(args)) => {
                assert!(args.json);
                assert_eq!(args.resources, ["gpu"]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn setup_is_a_subcommand() {
        let cli =
            Cli::try_parse_from(["devlock", "setup", "--gpus", "--group", "gpu", "x"]).unwrap();
        match cli.subcommand {
            Some(Command::Setup(args)) => {
                assert!(args.gpus && !args.print_tmpfiles);
                assert_eq!(args.group.as_deref(), Some("gpu"));
                assert_eq!(args.resources, ["x"]);
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["devlock", "setup", "--slots", "0", "x"]).is_err());
    }

    #[test]
    fn durations_use_humantime() {
        let cli = Cli::try_parse_from(["devlock", "-w", "1h30m", "r", "--", "true"]).unwrap();
        assert_eq!(cli.run.timeout, Some(Duration::from_secs(5400)));
        assert!(Cli::try_parse_from(["devlock", "-w", "soon", "r", "--", "true"]).is_err());
    }

    #[test]
    fn sizes_are_mebibytes() {
        assert_eq!(parse_mib("256"), Ok(256));
        assert_eq!(parse_mib("256MiB"), Ok(256));
        assert_eq!(parse_mib("1GiB"), Ok(1024));
        assert_eq!(parse_mib("1.5g"), Ok(1536));
        assert!(parse_mib("lots").is_err());
        assert!(parse_mib("5 parsecs").is_err());
    }
}
