//! The command line: every flag and subcommand, and the help text around them
//! (for the binary: not part of the library's API).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

mod fast;
mod help;
mod run;
#[cfg(test)]
mod tests;
mod usage;

use crate::units::parse_duration;
pub use help::REPORT_ABOUT;
use help::{ABOUT, EXAMPLES, LONG_ABOUT, SERVE_ABOUT};
pub(crate) use run::RunPlan;
pub use run::{RunArgs, SUBCOMMANDS, refuse_subcommand_names};
pub use usage::usage_line;

/// devlock's command line.
#[derive(Debug, Parser)]
#[command(
    name = "devlock",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_long_help = EXAMPLES,
    subcommand_negates_reqs = true,
    override_usage = "devlock [OPTIONS] <RESOURCE>... -- <COMMAND>...\n       devlock status [OPTIONS] [RESOURCE]...\n       devlock setup [OPTIONS] [RESOURCE]...\n       devlock serve [OPTIONS]\n       devlock report [OPTIONS]"
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
        default_value = crate::flock::dir::DEFAULT_DIR,
        // Not PathBufValueParser, which refuses an empty value before we can
        // tell an empty DEVLOCK_DIR (unset) from an empty --dir (a mistake).
        value_parser = clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from),
        value_hint = clap::ValueHint::DirPath
    )]
    pub dir: PathBuf,

    /// Longest wait for the GPU source (NVML, nvidia-smi or amd-smi) before a
    /// device counts as unknown (a bare number is seconds)
    #[arg(long, global = true, value_name = "DURATION", default_value = "5s", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
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
        hide_env_values = true,
        value_hint = clap::ValueHint::Other
    )]
    pub etcd_user: Option<String>,

    /// With https:// etcd endpoints: check the server's certificate against
    /// the CA certificates in FILE (PEM) instead of the system's
    #[arg(long, global = true, value_name = "FILE", env = "DEVLOCK_ETCD_CA", value_parser = path_parser(), value_hint = clap::ValueHint::FilePath)]
    pub etcd_ca: Option<PathBuf>,

    /// With https:// etcd endpoints: the client certificate to show etcd
    /// (PEM), with --etcd-key
    #[arg(long, global = true, value_name = "FILE", env = "DEVLOCK_ETCD_CERT", value_parser = path_parser(), value_hint = clap::ValueHint::FilePath)]
    pub etcd_cert: Option<PathBuf>,

    /// The private key of --etcd-cert (PEM; refused, as ssh refuses one, when
    /// others can read it)
    #[arg(long, global = true, value_name = "FILE", env = "DEVLOCK_ETCD_KEY", value_parser = path_parser(), value_hint = clap::ValueHint::FilePath)]
    pub etcd_key: Option<PathBuf>,

    /// What every etcd key devlock puts starts with: resource R is the lock
    /// `etcdctl lock PREFIXR` takes. Empty locks the bare name (so
    /// `etcdctl lock gpu` and `devlock --etcd-prefix= gpu` meet); an empty
    /// DEVLOCK_ETCD_PREFIX means that too
    #[arg(
        long,
        global = true,
        value_name = "PREFIX",
        env = "DEVLOCK_ETCD_PREFIX",
        default_value = "/devlock/",
        value_hint = clap::ValueHint::Other
    )]
    pub etcd_prefix: String,
}

/// The flags of the etcd feature, marked in --help when the build left it
/// out (they still parse, so that using one says how to get it).
#[cfg(not(feature = "etcd"))]
const ETCD_FLAGS: [&str; 8] = [
    "etcd",
    "etcd_user",
    "etcd_ca",
    "etcd_cert",
    "etcd_key",
    "etcd_prefix",
    "ttl",
    "kill_after",
];

/// The command line as this build takes it: flags of a feature the build
/// left out say so in --help. (The man page and completions, made from
/// [`Cli::command`], document every build.)
fn for_this_build(command: clap::Command) -> clap::Command {
    #[cfg(not(feature = "etcd"))]
    let command = ETCD_FLAGS.iter().fold(command, |command, id| {
        command.mut_arg(*id, |arg| {
            let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
            arg.help(format!("{help} {}", crate::messages::NOT_IN_THIS_BUILD))
        })
    });
    command
}

/// A path that may be empty, so that an empty variable (unset, as
/// `${VAR:-...}` has it) can be told from an empty flag (a mistake).
fn path_parser() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from)
}

/// The subcommands (a run under a lock is the default, not a subcommand).
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show who holds each lock, for how long, and who waits
    #[command(
        long_about = "Show who holds each lock, for how long, and who waits.\n\n\
        Who holds and who waits comes from the kernel's lock table (/proc/locks), \
        users and command lines from /proc; a lock file's record only labels its \
        holder. Beside the locks it shows each GPU's memory, utilisation and \
        processes, from NVML, nvidia-smi or amd-smi, marking those outside the gate, \
        and warns of files another user could break. The table shows the locks held \
        or waited for and counts the unused ones (--all shows them); --json prints \
        every lock as one document, each field described under JSON OUTPUT in \
        devlock-status(1), and how to read the table under THE TABLE."
    )]
    Status(StatusArgs),

    /// Make the scratch directory and the resources' files root's, so that no
    /// user can rename, remove or replace them (run as root)
    #[command(
        long_about = "Make the scratch directory and the named resources' files root's, \
        so that no user can rename, remove, replace or squat them: a managed directory \
        for a shared machine. Run as root; running it again changes only what is not \
        as it should be.\n\n\
        The directory becomes root:root 1777 (sticky), or root:G 1770 with \
        --group G (only members of G can take the locks). Each RESOURCE gets its \
        lock file and queue file, root's, mode 0666 (root:G 0660 with --group), and \
        joins the declared names (.names, root's): a name the directory does not \
        declare is then refused as a likely typo unless the run says --new.\n\n\
        Setup never follows a path it does not own: every directory above --dir must \
        be root's and writable only by root (or sticky, like /tmp), and a symbolic \
        link on the way root's; else it exits 74 before changing anything, naming the \
        real path at fault. A directory at --dir that another user owns is taken over \
        in place. A lock file another user owns is replaced by a new root file when \
        nobody holds it (no lease or ACL of theirs carries over), and taken over in \
        place when held (the same inode: a job that holds it keeps holding it, alone; \
        a lease on it is named, exit 75). A FIFO, symbolic link, socket or directory \
        at a declared path is swapped for a new root file unless it is locked: a held \
        lock file is never replaced (that lets a second holder in), so setup names its \
        holder and exits 75. Without root it exits 77. With --print-tmpfiles it prints \
        the same set-up as a systemd-tmpfiles(5) snippet instead, to make it again at \
        every boot (/run is a tmpfs); a --dir with a control character is refused \
        (exit 2).\n\n\
        It also makes the usage directory (--usage-dir, else $DEVLOCK_USAGE_DIR, \
        else the one recorded before, else /var/lib/devlock/usage) root's, 1777 \
        (root:G 1770 with --group), where every user's holds keep their records (see \
        devlock-report(1)), reached as --dir is and checked before anything changes \
        (a directory missing above it is made, root's 0755), and records its real \
        path in DIR/.usage-dir (root's 0644; --usage-dir none: that no records are \
        kept), where every run, report and serve in DIR find it without \
        DEVLOCK_USAGE_DIR in anyone's environment (the variable still overrides \
        it); --print-tmpfiles carries both (the one recorded, not a caller's \
        variable, unless none is). With --idle-timeout DURATION it sets the \
        site's default idle timeout."
    )]
    Setup(SetupArgs),

    /// Serve the status read-only over HTTP: a page for a browser, /metrics
    /// for Prometheus, /status.json for scripts
    #[command(long_about = SERVE_ABOUT)]
    Serve(ServeArgs),

    /// Forget unused names: remove their lock, queue and slot files (in a
    /// managed directory, root only)
    #[command(
        long_about = "Forget names nobody uses: remove each RESOURCE's lock, queue and \
        slot files, so that a typo (GPU0.lock) no longer counts among the unused locks. \
        A name the kernel shows held, waited for or in line is refused (exit 75, \
        naming who), and so is any other that another process has open in a way \
        the kernel shows; the lock file is removed while devlock holds its lock, so \
        a devlock that opened it meanwhile finds it gone and takes the new one. In \
        a managed directory (devlock setup declared its names) only root may \
        forget, and the name leaves the declared list too (exit 77 otherwise)."
    )]
    Forget(ForgetArgs),

    /// Sum the usage records: jobs, GPU-hours held, computing and idle,
    /// waits, budgets against peaks, by user, resource, step or day
    #[command(long_about = REPORT_ABOUT)]
    Report(ReportArgs),

    /// Inside a job: count it as busy for its idle timeout for DURATION,
    /// through a phase without GPU work (loading data, checkpointing)
    #[command(
        long_about = "Inside a job that devlock runs (or a Python block holds): count the \
        job as busy for its idle timeout (--idle-timeout, or the site's) for DURATION from \
        now [default: 10m], through a phase that does no GPU work, such as loading data or \
        writing a checkpoint. It sets the time of $DEVLOCK_BUSY_FILE, the file devlock \
        names to its command, into the future: `touch -d '+10 min' \"$DEVLOCK_BUSY_FILE\"` \
        does the same. The report's computing hours stay what the GPUs did. In a hold \
        nothing watches (no GPU, so no idle timeout) $DEVLOCK_BUSY_FILE is empty and it \
        succeeds doing nothing. Outside a hold it exits 2."
    )]
    Busy(BusyArgs),
}

/// Arguments of `devlock report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Start of the window: a duration back from now (7d, 12h) or a UTC time
    /// (2026-11-30, 2026-11-30T08:00:00Z)
    #[arg(long, value_name = "WHEN", default_value = "7d", value_hint = clap::ValueHint::Other)]
    pub since: String,

    /// End of the window, as --since [default: now]
    #[arg(long, value_name = "WHEN", value_hint = clap::ValueHint::Other)]
    pub until: Option<String>,

    /// One row per job instead of sums: user, step, resources, start, how
    /// long it held, its computing share, how it ended
    #[arg(long, conflicts_with_all = ["json", "csv"])]
    pub jobs: bool,

    /// Only the jobs of this user (a name or a numeric uid)
    #[arg(long, value_name = "USER", value_hint = clap::ValueHint::Username)]
    pub user: Option<String>,

    /// Only the jobs that held this resource (gpu also matches gpu:N)
    #[arg(long, value_name = "RESOURCE", value_hint = clap::ValueHint::Other)]
    pub resource: Option<String>,

    /// What each row sums
    #[arg(long, value_name = "WHAT", value_enum, default_value = "user")]
    pub by: ReportBy,

    /// Print one JSON document, with every job, instead of a table
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,

    /// Print CSV, one line per row and the total
    #[arg(long)]
    pub csv: bool,
}

/// What each row of `devlock report` sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReportBy {
    /// The user the kernel says owns the records
    User,
    /// Each resource held (a job holding two counts in both, its GPUs split)
    Resource,
    /// The step (--step, or the command's name)
    Step,
    /// The UTC day (a job over midnight counts in both days)
    Day,
}

/// Arguments of `devlock busy`.
#[derive(Debug, Args)]
pub struct BusyArgs {
    /// How long the job counts as busy from now (a bare number is seconds)
    #[arg(value_name = "DURATION", default_value = "10m", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub duration: Duration,
}

/// Arguments of `devlock forget`.
#[derive(Debug, Args)]
pub struct ForgetArgs {
    /// Resources to forget
    #[arg(value_name = "RESOURCE", required = true)]
    pub resources: Vec<OsString>,
}

/// Where `devlock serve` listens unless `--listen` says otherwise (see
/// SERVE_ABOUT for why this port).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10425";

/// Arguments of `devlock serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on: IP:PORT (IPv6 in brackets), or a bare PORT on
    /// 127.0.0.1 (0 lets the kernel choose a free port)
    #[arg(
        long,
        value_name = "ADDR",
        default_value = DEFAULT_LISTEN,
        value_parser = parse_listen,
        value_hint = clap::ValueHint::Other
    )]
    pub listen: std::net::SocketAddr,
}

/// Arguments of `devlock setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// Resources to declare: their lock and queue files become root's
    #[arg(value_name = "RESOURCE")]
    pub resources: Vec<OsString>,

    /// Only members of this group may take the locks (directory root:GROUP
    /// 1770, files root:GROUP 0660)
    #[arg(long, value_name = "GROUP", value_hint = clap::ValueHint::Other)]
    pub group: Option<String>,

    /// Declare gpu, gpu:0 .. gpu:N-1 and their MIG instances for the GPUs the
    /// probe (NVML, nvidia-smi, amd-smi) lists
    #[arg(long)]
    pub gpus: bool,

    /// Also make the semaphore slot files of each RESOURCE (for --slots N)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..), value_hint = clap::ValueHint::Other)]
    pub slots: Option<u16>,

    /// Print a systemd-tmpfiles snippet for this set-up instead of making it
    #[arg(long)]
    pub print_tmpfiles: bool,

    /// The site's --idle-timeout for every job in this directory, a ceiling
    /// (written to DIR/.idle-timeout, root's; a job may ask for a shorter
    /// one, and a longer one is refused)
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub idle_timeout: Option<Duration>,

    /// Where every job's usage records go (none: nowhere): made root's,
    /// 1777 (root:GROUP 1770 with --group), and recorded in DIR/.usage-dir,
    /// root's, where every run, report and serve find it without
    /// DEVLOCK_USAGE_DIR (which still overrides it) [default:
    /// $DEVLOCK_USAGE_DIR, else the one recorded, else
    /// /var/lib/devlock/usage]
    #[arg(long, value_name = "USAGE_DIR", value_hint = clap::ValueHint::DirPath)]
    pub usage_dir: Option<PathBuf>,
}

/// Arguments of `devlock status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Resources to show, held or not (default: the locks held or waited
    /// for, and a count of the unused ones)
    #[arg(value_name = "RESOURCE")]
    pub resources: Vec<OsString>,

    /// Show every lock file in the directory, unused ones too
    #[arg(long)]
    pub all: bool,

    /// Print one JSON document instead of a table (every lock file, unused
    /// ones too)
    #[arg(long)]
    pub json: bool,

    /// Whatever came after `--`: status runs nothing, so this is a mistake
    /// to point out rather than resources to show.
    #[arg(last = true, hide = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

impl StatusArgs {
    /// `devlock status -- COMMAND` runs nothing, which is never what was
    /// meant: a usage error that says so.
    pub fn refuse_command(&self) -> anyhow::Result<()> {
        if self.command.is_empty() {
            return Ok(());
        }
        let command: Vec<String> = self
            .command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        Err(crate::error::usage(format!(
            "`devlock status` shows the locks and runs nothing, so it takes no `-- {}`; \
                 to run it under a lock, name the resource: devlock RESOURCE -- {}",
            crate::show::sanitize(&command.join(" ")),
            crate::show::sanitize(&command.join(" "))
        )))
    }
}

pub use crate::sys::args::from_main as args_from_main;

impl Cli {
    /// Parses `args` (the first is the program's name). A `DEVLOCK_*`
    /// variable set to the empty string counts as unset, as `${VAR:-...}`
    /// would have it: an empty `DEVLOCK_DIR=` means the default directory,
    /// an empty `DEVLOCK_ETCD=` no etcd.
    pub fn parse_from_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        if let Some(cli) = fast::common_run(&args) {
            return Ok(cli);
        }
        Cli::parse_with_clap(args)
    }

    /// What the common run's own parser left: clap's. Out of line, so that
    /// the 30 kB of it are not among the code every take runs (a waiting
    /// devlock keeps the pages of that code resident: bench/run, section 5).
    #[inline(never)]
    fn parse_with_clap(args: Vec<OsString>) -> Result<Cli, clap::Error> {
        use clap::parser::ValueSource;
        use clap::{CommandFactory, FromArgMatches};
        let mut command = for_this_build(Cli::command());
        let matches = command.try_get_matches_from_mut(args)?;
        let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut command))?;
        let from_env = |id: &str| matches.value_source(id) == Some(ValueSource::EnvVariable);
        if cli.dir.as_os_str().is_empty() {
            if !from_env("dir") {
                return Err(command.error(
                    clap::error::ErrorKind::InvalidValue,
                    "--dir needs a directory, got an empty one (leave it out for the default, \
                     /run/lock/devlock)",
                ));
            }
            cli.dir = PathBuf::from(crate::flock::dir::DEFAULT_DIR);
        }
        if from_env("etcd") && cli.etcd.iter().all(String::is_empty) {
            cli.etcd.clear();
        }
        // The one variable whose empty value is a value: the bare names.
        if matches.value_source("etcd_prefix") == Some(ValueSource::DefaultValue)
            && std::env::var_os("DEVLOCK_ETCD_PREFIX").is_some_and(|v| v.is_empty())
        {
            cli.etcd_prefix.clear();
        }
        if from_env("etcd_user") && cli.etcd_user.as_deref() == Some("") {
            cli.etcd_user = None;
        }
        for (id, path) in [
            ("etcd_ca", &mut cli.etcd_ca),
            ("etcd_cert", &mut cli.etcd_cert),
            ("etcd_key", &mut cli.etcd_key),
        ] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                if !from_env(id) {
                    return Err(command.error(
                        clap::error::ErrorKind::InvalidValue,
                        format!("--{} needs a file, got an empty name", id.replace('_', "-")),
                    ));
                }
                *path = None;
            }
        }
        // devlock exits soon: freeing clap's tree is work for nothing.
        std::mem::forget(command);
        Ok(cli)
    }
}

/// `--listen`: `IP:PORT`, `[IPv6]:PORT`, `localhost:PORT` (127.0.0.1), or a
/// bare `PORT` on 127.0.0.1.
pub(crate) fn parse_listen(text: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::{Ipv4Addr, SocketAddr};
    let text = text.trim();
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    if let Some(port) = text.strip_prefix("localhost:")
        && let Ok(port) = port.parse::<u16>()
    {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    text.parse::<SocketAddr>().map_err(|_| {
        format!(
            "not an address to listen on: {text:?} (try {DEFAULT_LISTEN}, [::1]:10425, \
             0.0.0.0:10425 for every interface, or a port)"
        )
    })
}
