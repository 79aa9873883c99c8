//! The command line: every flag and subcommand, and the help text around them
//! (for the binary: not part of the library's API).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

const ABOUT: &str = "Run a command while holding a machine-wide lock on a device (a GPU above all)";

const LONG_ABOUT: &str = "\
devlock takes a kernel flock(2) on DIR/RESOURCE.lock, records who holds it, \
and becomes COMMAND (execve, as flock -F does: the same pid, exit status and \
signals), which inherits the locked file. The kernel \
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
  devlock -w 90 gpu -- ./eval.sh                 a bare number is seconds
  devlock --mem 20GiB gpu:0 -- python eval.py    share gpu:0 by a 20 GiB budget
  devlock --step nightly gpu -- ./run.sh         label the holder in status
  devlock status                                 who holds what, who waits
  devlock status --json gpu                      the same, for scripts
  devlock serve                                  the same for a browser and Prometheus
  devlock report --since 30d --by user           who used the GPUs, and how much
  devlock --idle-timeout 30m gpu:0 -- ./train    stop it if its GPU sits idle
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

/// `devlock report --help`, and the DESCRIPTION of devlock-report(1).
pub const REPORT_ABOUT: &str = "\
Sum the usage records of the jobs in a time window (--since, --until; the last 7 \
days unless told) by user, resource, step or UTC day: jobs, GPU-hours held, \
GPU-hours computing (and their share of the hours sampled), GPU-hours idle, the \
total and longest wait, the memory budgets asked (--mem) against the peak their \
jobs used, and how many were stopped idle, stopped over budget, or whose devlock \
was killed. --json prints {since, until, by, rows: [...], total, jobs: [...], \
notes}, --csv one line per row.\n\n\
Every hold (devlock RESOURCE -- COMMAND, and the Python library's blocks) appends \
JSON lines to its user's file in the usage directory, UID.jsonl: one when the \
command has started, one every 10 minutes while it runs and one when it has \
ended, with what its holder sampled of its GPUs every 5 seconds (peak memory of \
the job's processes, utilization). The directory is $DEVLOCK_USAGE_DIR (none: no \
records), else the one devlock setup recorded in the lock directory (--dir), \
DIR/.usage-dir (believed only as root's: a regular file with one link, not \
writable by group or others, in a directory of root's, at most 4096 bytes, an \
absolute path or none), else /var/lib/devlock/usage where devlock setup made \
it, else /var/tmp/devlock-usage (made sticky and world-writable on first use). \
Every run and the Python library's holds find it the same way. A file \
counts only for the user the kernel says owns it, and only when it is named for \
that user, a regular file with one link: nobody can write records counted as \
another user's. Where another user made UID.jsonl (or its .old) first, the \
holds' lines go to UID.TAG.jsonl (TAG random), which nobody can make first. A \
usage directory another user owns (not root, not the caller) is not written to \
(the run says so once) and the report notes that its records may be missing; \
none is reached through another user's directory or symbolic link (for root: \
anyone's but root's). A hold without an end line whose holder is gone (devlock was \
killed, the machine went down) counts up to its last line, marked observed \
later. A file over 16 MiB is renamed UID.jsonl.old (replacing the one before) as \
its next hold starts; both are read. Each line is checked against bounds (times, \
lists, figures) before use: one that fails is skipped and counted in one note \
naming its file.";

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

/// `devlock serve --help`, and the DESCRIPTION of devlock-serve(1).
const SERVE_ABOUT: &str = "\
Serve what devlock status shows, read-only, over HTTP at ADDR: / is a status page \
for a browser, which reloads itself every 5 seconds (HTML and CSS that devlock \
serves itself; no script): each GPU with its holders and line, its memory \
(budgeted, used by the gate's jobs, used outside the gate), the processes \
outside the gate and its last 24 hours of holds (labelled in UTC hours), then \
every other lock in use, the last 24 hours by user (devlock report --by user \
--since 24h's figures) and the site policy in force (set up or not, the idle \
timeout ceiling, the budgets held, where use is recorded), with a legend of \
every colour. A GPU is free only when nobody holds its lock and no process \
outside devlock uses it: one that does is 'in use outside devlock', with the \
process, its user (or 'user hidden' where /proc does not show it) and its \
memory; /metrics is the Prometheus text \
format (version 0.0.4), its families listed under METRICS in devlock-serve(1); \
/status.json is the document of devlock status --json.\n\n\
Every answer comes from one snapshot of the status model, taken at most once a \
second however many ask: the kernel's lock table, the lock files' records as \
labels, and the GPUs from NVML, nvidia-smi or amd-smi within --probe-timeout. It \
shows what devlock status shows the user it runs as, but never a command line \
(command is null in /status.json): command lines can hold secrets, and serve \
answers whoever can reach it. It takes no lock and writes nothing, except that, \
as status does, it removes the registrations of waiters that died.\n\n\
The default port, 10425, is outside Prometheus' list of exporter ports (full from \
9100 to 9999, so any port there is another exporter's), outside the kernel's \
range for ephemeral ports (32768-60999, where a client's port can take it first) \
and clear of what GPU machines often run (Jupyter, TensorBoard, Ray, the kubelet \
at 10250). A request is a GET or HEAD of one of those three paths, its request \
line and headers at most 8 KiB and in within 5 seconds of the connection (else \
408). It keeps 256 connections, waiting on all of them in one thread, so a \
client that sends half a request and waits costs it a slot, not a thread: one \
connection more drops the oldest idle or slow one (still sending its request, \
or not reading its answer), and is told 503 only while all 256 are being \
answered (see LIMITS in devlock-serve(1)). Listening on a loopback address, it answers only requests \
for localhost or an IP address (Host), so that a web page elsewhere cannot read \
it through DNS rebinding. To share it beyond this machine, put a reverse proxy \
with authentication in front (see WHO CAN SEE WHAT in devlock-serve(1)). It exits 1 when it cannot \
listen, and otherwise runs until it is stopped.";

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

/// Arguments for running a command under a lock.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Resource to lock: 1-64 of [A-Za-z0-9._:-], not starting with '.' or '-'
    #[arg(value_name = "RESOURCE")]
    pub resources: Vec<OsString>,

    /// The command to run while holding the lock, after --
    #[arg(last = true, value_name = "COMMAND", value_hint = clap::ValueHint::CommandWithArguments)]
    pub command: Vec<OsString>,

    /// Fail at once if the lock is busy, naming who holds it (flock's
    /// --nonblock and --nb work too)
    #[arg(short = 'n', long, aliases = ["nonblock", "nb"])]
    pub no_wait: bool,

    /// Give up after waiting this long (e.g. 90s, 10m, 1h30m; a bare number
    /// is seconds; flock's --wait works too)
    #[arg(short = 'w', long, alias = "wait", value_name = "DURATION", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub timeout: Option<Duration>,

    /// Exit code when the lock is busy or the wait times out (1-255)
    #[arg(short = 'E', long, value_name = "N", default_value_t = 75, value_parser = clap::value_parser!(u8), value_hint = clap::ValueHint::Other)]
    pub conflict_exit_code: u8,

    /// Take a name a managed directory does not declare (`devlock setup`
    /// lists its names), rather than refuse it as a likely typo; and say
    /// nothing of a new name close to a known one
    #[arg(long)]
    pub new: bool,

    /// Name the holder shows in status, and the waiter's lines in logs
    /// (default: the command's basename)
    #[arg(long, value_name = "NAME", value_hint = clap::ValueHint::Other)]
    pub step: Option<String>,

    /// Print nothing of devlock's own but errors: no waiting lines, no
    /// warnings (but one that a held lock file was renamed away), and a
    /// busy lock or a timeout only in the exit status
    #[arg(short, long)]
    pub quiet: bool,

    /// Say nothing of a lock directory that `devlock setup` has not made
    /// root's (the one-line warning before setup; `devlock status` still
    /// lists it), and keep the waiting lines; DEVLOCK_NO_SETUP_WARNING=1
    /// does the same
    #[arg(long)]
    pub no_setup_warning: bool,

    /// Take the first of the RESOURCEs that is or becomes free (see --count),
    /// skipping those outside the caller's CUDA_VISIBLE_DEVICES
    #[arg(long)]
    pub any: bool,

    /// With --any: how many of the RESOURCEs to take [default: 1]
    #[arg(long, value_name = "K", value_hint = clap::ValueHint::Other)]
    pub count: Option<u8>,

    /// Take the locks shared: shared holders run together, an exclusive
    /// holder runs alone, and a waiting exclusive request goes first
    #[arg(short, long)]
    pub shared: bool,

    /// Take the locks exclusive: the default, accepted (and -e) as util-linux
    /// flock spells it; its options devlock has no equivalent for (-c, -u, -o,
    /// -F, --verbose) are refused with what devlock does instead
    #[arg(short = 'x', long, short_alias = 'e', conflicts_with_all = ["shared", "mem", "slots"])]
    pub exclusive: bool,

    /// Admit up to N holders of the RESOURCE at once; each learns its slot in
    /// DEVLOCK_SLOT. Everyone using the resource must give the same N
    #[arg(long, value_name = "N", value_hint = clap::ValueHint::Other)]
    pub slots: Option<u16>,

    /// Before starting, check that no process outside the gate uses the GPUs
    /// (gpu:N is GPU N, gpu is all); else release and exit 69
    #[arg(long)]
    pub require_idle: bool,

    /// Device memory a process outside the gate may hold before --require-idle
    /// refuses (e.g. 256MiB, 1GiB) [default: 256MiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_mib, value_hint = clap::ValueHint::Other)]
    pub idle_threshold: Option<u64>,

    /// Share a GPU by memory: hold SIZE of gpu:N's memory (e.g. 20GiB), not
    /// the whole device; admitted, first come first served, while the
    /// budgets, the memory used outside the gate and the headroom fit
    #[arg(long, value_name = "SIZE", value_parser = parse_mib, value_hint = clap::ValueHint::Other)]
    pub mem: Option<u64>,

    /// With --mem: device memory left unbudgeted, for the driver and for
    /// estimates that were short [default: 2GiB]
    #[arg(long, value_name = "SIZE", value_parser = parse_mib, value_hint = clap::ValueHint::Other)]
    pub mem_headroom: Option<u64>,

    /// With --mem: the longest a newly admitted job is the one starting on
    /// its device (the next waits until its memory stops growing), and how
    /// long --mem-strict lets it stay over budget [default: 30s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub settle: Option<Duration>,

    /// With --mem: stop the job (as a signal to devlock would) when it stays
    /// more than 10% over its budget for --settle
    #[arg(long)]
    pub mem_strict: bool,

    /// Warn, and after a grace period (DURATION again, at most 10m) stop the
    /// job as a signal to devlock would, once its GPUs have computed nothing
    /// for DURATION (a job with no process on them is idle too); `devlock
    /// busy DUR` in the job says it works without the GPU [default: the
    /// site's, set by `devlock setup --idle-timeout`, which is also the
    /// longest allowed]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub idle_timeout: Option<Duration>,

    /// When stderr is not a terminal, how often to report a long wait
    #[arg(long, value_name = "DURATION", default_value = "1m", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub report_every: Duration,

    /// With --etcd: the lease's time to live [default: 10s]. If its watcher
    /// dies, the lock frees itself this long after its last renewal
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub ttl: Option<Duration>,

    /// With --etcd: when the lease cannot be renewed, the job's time
    /// between SIGTERM and SIGKILL [default: 2s]; both come before the lease
    /// could expire
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, value_hint = clap::ValueHint::Other)]
    pub kill_after: Option<Duration>,
}

/// devlock's subcommands (clap's `help` included): names a resource cannot
/// have, since as the first word they are read as the subcommand.
pub const SUBCOMMANDS: [&str; 7] = [
    "busy", "forget", "help", "report", "serve", "setup", "status",
];

/// A resource named like a subcommand is a usage error with a hint: as the
/// first word of a run it would be read as the subcommand, so nobody could
/// take it (and setup would declare a lock nobody can use).
pub fn refuse_subcommand_names(resources: &[crate::resource::Resource]) -> anyhow::Result<()> {
    match resources.iter().find(|r| SUBCOMMANDS.contains(&r.as_str())) {
        Some(name) => Err(crate::error::usage(format!(
            "{name} is the name of devlock's subcommand `devlock {name}`, so it cannot be a \
                 resource (as the first word it would be read as the subcommand); choose another \
                 name, such as {name}-lock"
        ))),
        None => Ok(()),
    }
}

/// The device memory `--mem` leaves unbudgeted, when --mem-headroom is not
/// given: the CUDA context of each process and the driver's own take a few
/// hundred MiB each, and an estimate is seldom exact.
pub const DEFAULT_MEM_HEADROOM_MIB: u64 = 2048;

/// How long a newly admitted `--mem` job may be the one starting on its
/// device, when --settle is not given.
pub const DEFAULT_SETTLE: Duration = Duration::from_secs(30);

/// The memory a process outside the gate may hold before --require-idle
/// refuses, when --idle-threshold is not given.
pub const DEFAULT_IDLE_THRESHOLD_MIB: u64 = 256;

impl RunArgs {
    /// `--count`, 1 when not given.
    pub fn count(&self) -> u8 {
        self.count.unwrap_or(1)
    }

    /// `--mem-headroom` in MiB, or its default.
    pub fn mem_headroom(&self) -> u64 {
        self.mem_headroom.unwrap_or(DEFAULT_MEM_HEADROOM_MIB)
    }

    /// `--settle`, or its default.
    pub fn settle(&self) -> Duration {
        self.settle.unwrap_or(DEFAULT_SETTLE)
    }

    /// `--idle-threshold` in MiB, or its default.
    pub fn idle_threshold(&self) -> u64 {
        self.idle_threshold.unwrap_or(DEFAULT_IDLE_THRESHOLD_MIB)
    }

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
            crate::text::sanitize(&command.join(" ")),
            crate::text::sanitize(&command.join(" "))
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
        use clap::parser::ValueSource;
        use clap::{CommandFactory, FromArgMatches};
        let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
        if let Some(cli) = common_run(&args) {
            return Ok(cli);
        }
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

/// The command line most runs have, `devlock [-n] [-q] [-s] [--step NAME]
/// [--dir DIR] RESOURCE... -- COMMAND...`, read without clap: building
/// clap's tree of every flag and its help costs about a fifth of an
/// uncontended run's instructions. Anything else (another flag, a repeated
/// one, `--flag=value`, a value that looks like a flag, no `--`, a
/// subcommand's name, text that is not UTF-8 where clap wants a string, an
/// etcd variable in the environment) is `None`, for clap to parse, and
/// what this returns is what clap returns (a unit test holds them
/// together).
fn common_run(args: &[OsString]) -> Option<Cli> {
    if std::env::vars_os().any(|(name, _)| name.as_encoded_bytes().starts_with(b"DEVLOCK_ETCD")) {
        return None;
    }
    let dash = args.iter().position(|a| a == "--")?;
    let (before, command) = (args.get(1..dash)?, &args[dash + 1..]);
    if command.is_empty() {
        return None;
    }
    let (mut no_wait, mut quiet, mut shared) = (false, false, false);
    let (mut step, mut dir): (Option<String>, Option<PathBuf>) = (None, None);
    let mut resources = Vec::new();
    let mut words = before.iter();
    while let Some(word) = words.next() {
        let set = |flag: &mut bool| (!std::mem::replace(flag, true)).then_some(());
        match word.to_str() {
            Some("-n" | "--no-wait") => set(&mut no_wait)?,
            Some("-q" | "--quiet") => set(&mut quiet)?,
            Some("-s" | "--shared") => set(&mut shared)?,
            Some(flag @ ("--step" | "--dir")) => {
                let value = words.next()?;
                let text = value.to_str()?;
                if text.is_empty() || text.starts_with('-') {
                    return None;
                }
                if flag == "--step" && step.replace(text.to_owned()).is_some()
                    || flag == "--dir" && dir.replace(PathBuf::from(value)).is_some()
                {
                    return None;
                }
            }
            Some(word)
                if word.is_empty() || word.starts_with('-') || SUBCOMMANDS.contains(&word) =>
            {
                return None;
            }
            _ if word.as_encoded_bytes().starts_with(b"-") => return None,
            _ => resources.push(word.clone()),
        }
    }
    if resources.is_empty() {
        return None;
    }
    let dir = dir.unwrap_or_else(|| {
        std::env::var_os("DEVLOCK_DIR")
            .filter(|d| !d.is_empty())
            .map_or_else(
                || PathBuf::from(crate::flock::dir::DEFAULT_DIR),
                PathBuf::from,
            )
    });
    Some(Cli {
        subcommand: None,
        run: RunArgs {
            resources,
            command: command.to_vec(),
            no_wait,
            timeout: None,
            conflict_exit_code: 75,
            new: false,
            step,
            quiet,
            no_setup_warning: false,
            any: false,
            count: None,
            shared,
            exclusive: false,
            slots: None,
            require_idle: false,
            idle_threshold: None,
            mem: None,
            mem_headroom: None,
            settle: None,
            mem_strict: false,
            idle_timeout: None,
            report_every: Duration::from_secs(60),
            ttl: None,
            kill_after: None,
        },
        dir,
        probe_timeout: Duration::from_secs(5),
        etcd: Vec::new(),
        etcd_user: None,
        etcd_ca: None,
        etcd_cert: None,
        etcd_key: None,
        etcd_prefix: "/devlock/".to_owned(),
    })
}

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

/// A memory size in MiB: `256`, `256MiB`, `1GiB`, `1.5G`.
pub(crate) fn parse_mib(text: &str) -> Result<u64, String> {
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

/// A duration: `90s`, `10m`, `1h30m`, `250ms`, or a bare number of seconds
/// (`10`, `1.5`), as `flock -w 10` and `timeout 10` take it.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    let bare = !trimmed.is_empty()
        && trimmed.chars().all(|c| c.is_ascii_digit() || c == '.')
        && trimmed.chars().filter(|&c| c == '.').count() <= 1
        && trimmed != ".";
    if bare {
        return trimmed
            .parse::<f64>()
            .ok()
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
            .ok_or_else(|| format!("{trimmed} seconds is out of range (try 90s, 10m or 1h30m)"));
    }
    humantime::parse_duration(trimmed).map_err(|_| {
        "not a duration (try 90, 90s, 10m or 1h30m; a bare number is seconds)".to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definitions_are_consistent() {
        Cli::command().debug_assert();
        let mut cmd = Cli::command();
        cmd.build();
        let mut names: Vec<&str> = cmd.get_subcommands().map(|s| s.get_name()).collect();
        names.sort();
        assert_eq!(names, SUBCOMMANDS);
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
    fn serve_listens_on_loopback_unless_told() {
        let cli = Cli::try_parse_from(["devlock", "serve"]).unwrap();
        match cli.subcommand {
            Some(Command::Serve(args)) => assert_eq!(args.listen.to_string(), DEFAULT_LISTEN),
            other => panic!("{other:?}"),
        }
        assert_eq!(parse_listen("8080").unwrap().to_string(), "127.0.0.1:8080");
        assert_eq!(
            parse_listen("localhost:0").unwrap().to_string(),
            "127.0.0.1:0"
        );
        assert_eq!(parse_listen("[::1]:9").unwrap().to_string(), "[::1]:9");
        assert_eq!(parse_listen("0.0.0.0:1").unwrap().to_string(), "0.0.0.0:1");
        for bad in [
            "",
            ":10425",
            "example.org:80",
            "127.0.0.1",
            "70000",
            "[::1]",
        ] {
            assert!(parse_listen(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn durations_use_humantime_and_bare_numbers_are_seconds() {
        let cli = Cli::try_parse_from(["devlock", "-w", "1h30m", "r", "--", "true"]).unwrap();
        assert_eq!(cli.run.timeout, Some(Duration::from_secs(5400)));
        assert!(Cli::try_parse_from(["devlock", "-w", "soon", "r", "--", "true"]).is_err());
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration(" 1.5 "), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["", ".", "1.2.3", "-1", "1e400", "soon"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        let cli = Cli::try_parse_from(["devlock", "--report-every", "2", "r", "--", "x"]).unwrap();
        assert_eq!(cli.run.report_every, Duration::from_secs(2));
    }

    /// The tests that read or set devlock's variables, one at a time.
    static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn the_common_command_line_reads_as_clap_reads_it() {
        let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
        let clap_says = |argv: &[&str]| {
            let mut command = <Cli as clap::CommandFactory>::command();
            let matches = command.try_get_matches_from_mut(argv).ok()?;
            <Cli as clap::FromArgMatches>::from_arg_matches(&matches).ok()
        };
        let cases: &[&[&str]] = &[
            &["devlock", "gpu", "--", "true"],
            &[
                "devlock", "-n", "-q", "gpu:0", "gpu:1", "--", "python", "-n", "x",
            ],
            &[
                "devlock", "--step", "train", "--dir", "/tmp/d", "-s", "data", "--", "sh", "-c",
                "x",
            ],
            &["devlock", "r", "-n", "--", "--", "x"],
            &[
                "devlock",
                "--no-wait",
                "--quiet",
                "--shared",
                "r",
                "--",
                "x",
            ],
            &["devlock", "-n", "-n", "r", "--", "x"],
            &["devlock", "-nq", "r", "--", "x"],
            &["devlock", "--step=x", "r", "--", "x"],
            &["devlock", "--step", "-x", "r", "--", "x"],
            &["devlock", "--dir", "", "r", "--", "x"],
            &["devlock", "status", "--", "x"],
            &["devlock", "-w", "10", "r", "--", "x"],
            &["devlock", "r", "--"],
            &["devlock", "r", "true"],
            &["devlock", "--", "true"],
            &["devlock", "--any", "a", "b", "--", "x"],
            &["devlock", "-", "--", "x"],
        ];
        for &argv in cases {
            let args: Vec<OsString> = argv.iter().map(OsString::from).collect();
            let Some(fast) = common_run(&args) else {
                continue;
            };
            let slow = clap_says(argv).unwrap_or_else(|| panic!("clap refuses {argv:?}"));
            assert_eq!(format!("{fast:?}"), format!("{slow:?}"), "{argv:?}");
        }
        let read = |argv: &[&str]| common_run(&argv.iter().map(OsString::from).collect::<Vec<_>>());
        assert!(read(&["devlock", "gpu", "--", "true"]).is_some());
        for argv in [
            &["devlock", "-n", "-n", "r", "--", "x"][..],
            &["devlock", "-nq", "r", "--", "x"],
            &["devlock", "status", "--", "x"],
            &["devlock", "-w", "10", "r", "--", "x"],
            &["devlock", "r", "--"],
        ] {
            assert!(read(argv).is_none(), "{argv:?} is clap's to parse");
        }
    }

    #[test]
    fn an_empty_environment_variable_counts_as_unset() {
        let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
        use crate::sys::env::{remove_var, set_var};
        set_var("DEVLOCK_DIR", "");
        set_var("DEVLOCK_ETCD", "");
        set_var("DEVLOCK_ETCD_USER", "");
        let cli = Cli::parse_from_args(["devlock", "r", "--", "true"]).unwrap();
        assert_eq!(cli.dir, Path::new(crate::flock::dir::DEFAULT_DIR));
        assert!(cli.etcd.is_empty());
        assert_eq!(cli.etcd_user, None);
        assert!(Cli::parse_from_args(["devlock", "--dir", "", "r", "--", "true"]).is_err());
        set_var("DEVLOCK_DIR", "/tmp/x");
        let cli = Cli::parse_from_args(["devlock", "r", "--", "true"]).unwrap();
        assert_eq!(cli.dir, Path::new("/tmp/x"));
        remove_var("DEVLOCK_DIR");
        remove_var("DEVLOCK_ETCD");
        remove_var("DEVLOCK_ETCD_USER");
    }

    #[test]
    fn usage_errors_keep_their_tip_on_one_line() {
        let err = Cli::try_parse_from(["devlock", "--nowait", "r", "--", "true"]).unwrap_err();
        let line = usage_line(&err.render().to_string());
        assert!(
            line.contains("'--nowait'") && line.contains("did you mean '--no-wait'?"),
            "{line}"
        );
        assert_eq!(line.lines().count(), 1);
        assert!(!line.contains("(see"), "one hint: {line}");
        let err = Cli::try_parse_from(["devlock", "status", "-n"]).unwrap_err();
        assert!(
            usage_line(&err.render().to_string()).ends_with("(see devlock status --help)"),
            "{err}"
        );
        let listing =
            "error: the following required arguments were not provided:\n  --any\n\nUsage: x\n";
        assert_eq!(
            usage_line(listing),
            "the following required arguments were not provided --any (see devlock --help)"
        );
    }

    #[test]
    fn flocks_spellings_are_taken_or_answered_with_devlocks() {
        let take = |argv: &[&str]| Cli::try_parse_from(argv).map(|cli| cli.run);
        for argv in [
            &["devlock", "-x", "gpu", "--", "true"][..],
            &["devlock", "--exclusive", "gpu", "--", "true"],
            &["devlock", "-e", "gpu", "--", "true"],
        ] {
            let run = take(argv).unwrap();
            assert!(run.exclusive && !run.shared, "{argv:?}");
        }
        for argv in [
            &["devlock", "--nb", "r", "--", "true"][..],
            &["devlock", "--nonblock", "r", "--", "true"],
            &["devlock", "-xn", "r", "--", "true"],
        ] {
            assert!(take(argv).unwrap().no_wait, "{argv:?}");
        }
        let run = take(&["devlock", "--wait", "10", "-E", "3", "r", "--", "true"]).unwrap();
        assert_eq!(
            (run.timeout, run.conflict_exit_code),
            (Some(Duration::from_secs(10)), 3)
        );
        assert!(take(&["devlock", "-x", "-s", "r", "--", "true"]).is_err());
        for (argv, says) in [
            (&["devlock", "-c", "make", "r"][..], "-- sh -c 'COMMAND'"),
            (&["devlock", "--command", "make", "r"], "-- sh -c 'COMMAND'"),
            (
                &["devlock", "-u", "r", "--", "true"],
                "-u has no equivalent",
            ),
            (
                &["devlock", "--unlock", "r", "--", "true"],
                "--unlock has no",
            ),
            (
                &["devlock", "-o", "r", "--", "true"],
                "-o has no equivalent",
            ),
            (&["devlock", "--close", "r", "--", "true"], "--close has no"),
            (
                &["devlock", "-F", "r", "--", "true"],
                "-F has no equivalent",
            ),
            (
                &["devlock", "--no-fork", "r", "--", "true"],
                "--no-fork has no",
            ),
            (&["devlock", "--verbose", "r", "--", "true"], "unless -q"),
            (
                &["devlock", "-nu", "r", "--", "true"],
                "-u has no equivalent",
            ),
        ] {
            let err = Cli::try_parse_from(argv).unwrap_err();
            let line = usage_line(&err.render().to_string());
            assert!(line.contains(says), "{argv:?}: {line}");
            assert!(line.contains("util-linux flock's"), "{argv:?}: {line}");
            assert!(!line.contains("did you mean"), "{argv:?}: {line}");
            assert_eq!(line.lines().count(), 1);
        }
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
