//! The run's flags (`devlock [OPTIONS] RESOURCE... -- COMMAND...`) and the
//! rules of their command line, read once into the [`RunPlan`] a run acts on.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;

use crate::api::Wait;
use crate::plan::{Asks, Front, Plan};
use crate::resource::Resource;

use crate::units::{
    DEFAULT_IDLE_THRESHOLD_MIB, DEFAULT_MEM_HEADROOM_MIB, DEFAULT_SETTLE, parse_duration, parse_mib,
};

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

/// Everything a run needs, read once from its flags ([`RunPlan::from_args`],
/// for the fast parser's command line as for clap's): nothing below the
/// front end reads a flag again.
#[derive(Debug)]
pub(crate) struct RunPlan {
    /// The locks to take and how (the core's plan).
    pub(crate) locks: Plan,
    /// Not empty.
    pub(crate) command: Vec<OsString>,
    /// `--step`, or the command's basename.
    pub(crate) step: String,
    pub(crate) dir: PathBuf,
    pub(crate) wait: Wait,
    pub(crate) quiet: bool,
    pub(crate) report_every: Duration,
    /// `--idle-timeout` as given (the site's default is applied where the
    /// directory is open).
    pub(crate) idle_timeout: Option<Duration>,
    /// `--new`: names the directory does not declare are taken.
    pub(crate) new_names: bool,
    /// Not `--no-setup-warning`.
    pub(crate) setup_warning: bool,
    /// `--ttl`, `--kill-after` (etcd's alone: refused at parse without it).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))] // read by etcd's run alone
    pub(crate) lease: Lease,
}

/// An etcd lease's flags, as given (etcd applies its defaults).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Lease {
    pub(crate) ttl: Option<Duration>,
    pub(crate) kill_after: Option<Duration>,
}

impl RunPlan {
    /// The run's plan: every rule of the command line's flags, in its
    /// words, before anything is looked at or taken. `etcd`: whether the
    /// locks live in etcd (the lease's flags are refused otherwise).
    pub(crate) fn from_args(
        args: &RunArgs,
        dir: &Path,
        probe_timeout: Duration,
        etcd: bool,
    ) -> anyhow::Result<RunPlan> {
        // The plan's rules first: a missing RESOURCE is said before a missing
        // COMMAND (`devlock` alone).
        let asks = Asks {
            resources: Resource::parse_all(&args.resources)?,
            shared: args.shared,
            slots: args.slots,
            any: args.any,
            count: args.count,
            mem: args.mem,
            headroom: args.mem_headroom,
            settle: args.settle,
            strict: args.mem_strict,
            idle_threshold: args.require_idle.then(|| args.idle_threshold()),
        };
        let locks = Plan::new(asks, Front::Command, probe_timeout)?;
        if args.command.is_empty() {
            return usage(
                "missing `-- COMMAND`: put the command after `--`, as in `devlock gpu -- python train.py`",
            );
        }
        refuse_subcommand_names(&locks.resources)?;
        if args.no_wait && args.timeout.is_some() {
            return usage(
                "--no-wait and --timeout contradict each other: -n fails at once, -w DURATION \
                 waits up to DURATION; give one of them",
            );
        }
        if args.idle_threshold.is_some() && !args.require_idle {
            return usage(
                "--idle-threshold needs --require-idle: it is the memory --require-idle lets a \
                 process outside the gate hold",
            );
        }
        if args.conflict_exit_code == 0 {
            return usage(
                "--conflict-exit-code 0 would report a busy lock as success; give 1-255 \
                 (75 by default)",
            );
        }
        if args.report_every < Duration::from_millis(10) {
            return usage("--report-every must be at least 10ms");
        }
        let lease = Lease {
            ttl: args.ttl,
            kill_after: args.kill_after,
        };
        if !etcd && (lease.ttl.is_some() || lease.kill_after.is_some()) {
            return usage("--ttl and --kill-after apply only with --etcd");
        }
        Ok(RunPlan {
            locks,
            command: args.command.clone(),
            step: args.step_name(),
            dir: dir.to_owned(),
            wait: match (args.no_wait, args.timeout) {
                (true, _) => Wait::NoWait,
                (false, Some(timeout)) => Wait::Timeout(timeout),
                (false, None) => Wait::Block,
            },
            quiet: args.quiet,
            report_every: args.report_every,
            idle_timeout: args.idle_timeout,
            new_names: args.new,
            setup_warning: !args.no_setup_warning,
            lease,
        })
    }

    /// `-n`.
    pub(crate) fn no_wait(&self) -> bool {
        self.wait == Wait::NoWait
    }

    /// `-w`'s time.
    pub(crate) fn timeout(&self) -> Option<Duration> {
        match self.wait {
            Wait::Timeout(timeout) => Some(timeout),
            Wait::Block | Wait::NoWait => None,
        }
    }
}

fn usage<T>(message: &str) -> anyhow::Result<T> {
    Err(crate::error::usage(message.to_owned()))
}
