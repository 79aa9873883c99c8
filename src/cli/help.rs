//! The long help texts of the command line (devlock --help and the
//! subcommands' DESCRIPTION in their man pages).

pub(crate) const ABOUT: &str =
    "Run a command while holding a machine-wide lock on a device (a GPU above all)";

pub(crate) const LONG_ABOUT: &str = "\
devlock takes a kernel flock(2) on DIR/RESOURCE.lock, records who holds it, \
and becomes COMMAND (execve, as flock -F does: the same pid, exit status and \
signals), which inherits the locked file. The kernel \
holds the lock until the command, and anything it started that inherited the lock, \
has exited, whatever kills whom; nothing is left to clean up after a crash. \
Waiters are served first come, first served. util-linux flock on the same file \
joins the same gate. With --etcd the locks live in etcd instead, for resources \
shared between machines; see ACROSS MACHINES in devlock(1).";

pub(crate) const EXAMPLES: &str = "\
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

/// `devlock serve --help`, and the DESCRIPTION of devlock-serve(1).
pub(crate) const SERVE_ABOUT: &str = "\
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
