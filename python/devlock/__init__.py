"""Machine-wide device locks (a GPU above all), the same gate as the ``devlock`` command.

``devlock.lock`` takes the same kernel flock(2) on the same lock file in the
same scratch directory as ``devlock RESOURCE -- COMMAND``, waits in the same
first-come-first-served line, writes the same holder record and lets the
kernel release it on any death; a CLI waiter and a Python waiter are served in
arrival order, and ``devlock status`` shows a Python holder like any other::

    import devlock

    with devlock.lock("gpu:0", step="notebook-eval"):   # waits its turn
        model = load(...)                               # CUDA_VISIBLE_DEVICES=0 here

    try:
        with devlock.lock("gpu", wait=False):
            ...
    except devlock.Busy as e:                           # names the holder, like devlock -n
        print(e.holder.step, e.holder.pid, e.holder.user)

    devlock.status()                                    # the document of devlock status --json

A block over a GPU lets go when the device is free, not when the block ends
(``release="device"``, see :class:`lock`): while the driver still lists this
process on the GPU (a CUDA context, cached memory, a model a notebook keeps)
the lock is kept, and other users see why. For asyncio::

    async with devlock.lock_async("gpu:0"):             # waits without blocking the loop
        ...
    await devlock.run_in_thread(model.generate, prompt, resource="gpu:0")
                                                        # a cancel keeps the lock until the thread returns

Nesting, forks and subprocesses:

* A nested ``devlock.lock`` of something an enclosing block of the same
  thread (or asyncio task: the blocks held are a context variable) holds
  passes through, counted: the inner block's end releases nothing. Another
  thread of the process waits its turn like any other holder.
* Fork policy: a forked child (``os.fork``, ``multiprocessing`` with the
  fork start method) shares the open file description, and so the lock, of
  every block its parent held when it forked; inside it, a ``devlock.lock``
  of those passes through. Whichever process leaves the block lets go of its
  own descriptors only: a child leaving the block (or exiting) never releases
  the parent's hold, and never clears its label. The lock, and the holder's
  place at the head of the line, last until the last process holding the
  descriptors has left the block, closed them or died; the taker's label goes
  when the taker leaves (status then shows the children still holding it as
  inherited holders).
* A ``devlock`` command started inside the block passes through only on an
  inherited descriptor that holds the lock: pass
  ``subprocess.run(..., pass_fds=devlock.pass_fds())``, or take the block with
  ``inheritable=True`` and start children with ``close_fds=False`` (or
  ``os.system``).
"""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any, Dict, List, Literal, NamedTuple, Optional, Tuple, Type, Union

from . import _devlock as _native

# The exception classes are the native module's, raised from the library's
# typed error with the command line's line and exit code.
from ._devlock import (
    Busy,
    DeviceUnknown,
    Error,
    Holder,
    NotSupported,
    Timeout,
    UnsafeFile,
    UsageError,
)

__all__ = [
    "DEFAULT_DIR",
    "Busy",
    "DeviceUnknown",
    "Error",
    "Held",
    "Holder",
    "IdleStopped",
    "NotSupported",
    "OverBudget",
    "Timeout",
    "UnsafeFile",
    "UsageError",
    "lock",
    "lock_async",
    "pass_fds",
    "run_in_thread",
    "status",
]

__version__: str = _native.VERSION

#: The scratch directory when neither ``dir=`` nor ``DEVLOCK_DIR`` names one.
DEFAULT_DIR: str = _native.DEFAULT_DIR

#: Waiting is reported to this logger off a terminal.
logger = logging.getLogger("devlock")

# How often a waiting block looks for Ctrl-C (and other signals) between
# waits with the GIL released.
_POLL = 0.05
# How often the live line is redrawn on a terminal, as the command line does.
_REDRAW = 1.0


class OverBudget(KeyboardInterrupt):
    """With ``mem_strict=True``: the block's process tree stayed more than 10 %
    over its ``mem`` budget for ``settle`` seconds, and devlock stopped the
    work as Ctrl-C does (a SIGINT to the main thread). Raised from the
    block's ``__exit__`` in place of the ``KeyboardInterrupt`` that stopped
    it; a ``KeyboardInterrupt``, not a :class:`Error`, so that ``except
    Exception`` in the work does not swallow the stop. ``message`` is the
    command line's line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class IdleStopped(KeyboardInterrupt):
    """With ``idle_timeout=``: the block's GPUs computed nothing for the
    timeout and the grace after the warning, and devlock stopped the work as
    Ctrl-C does (a SIGINT to the main thread). Raised from the block's
    ``__exit__`` in place of the ``KeyboardInterrupt`` that stopped it, as
    :class:`OverBudget` is; its usage record says "stopped: idle".
    ``message`` is the command line's line."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Held(NamedTuple):
    """What a ``with devlock.lock(...)`` block holds (returned by ``__enter__``)."""

    #: The resources the block got (with ``any=True``: the ones picked).
    resources: Tuple[str, ...]
    #: The step status shows for the holder.
    step: str
    #: The semaphore slot (``slots=N``), from 1.
    slot: Optional[int]
    #: What the block set ``CUDA_VISIBLE_DEVICES`` to (for ``gpu:N``), else None.
    cuda_visible_devices: Optional[str]
    #: True when everything passed through an enclosing hold.
    nested: bool
    #: The descriptors a child process must inherit to run inside the hold.
    fds: Tuple[int, ...]
    #: The memory budget held (``mem=``), MiB; None without one (or nested).
    mem_mib: Optional[int] = None


class _Entry:
    """One block's native hold, the kept holds it took back (see
    :func:`_take_back_kept`), and the process that took it."""

    __slots__ = ("native", "pid", "locks", "adopted")

    def __init__(self, native: Any, locks: List[Tuple[str, bool]], adopted: List[Any]) -> None:
        self.native = native
        self.pid = os.getpid()
        self.locks = locks
        self.adopted = adopted


# --- Memory budgets -------------------------------------------------------

_BUDGET_VARS = ("DEVLOCK_MEM_MIB", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _set_budget_env(pairs: List[Tuple[str, str]]) -> Dict[str, Optional[str]]:
    saved = {k: os.environ.get(k) for k in _BUDGET_VARS}
    for key, value in pairs:
        os.environ[key] = value
    return saved


def _on_budget_event(kind: str, line: str) -> None:
    """The budget watch's words (on its thread): a ``logging`` record of
    logger ``devlock``, once per hold; with ``mem_strict``, the stop."""
    if kind == "stop":
        logger.error(line)
        # As Ctrl-C: the main thread's KeyboardInterrupt, which the block's
        # __exit__ turns into OverBudget.
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
    else:
        logger.warning(line)


def _on_idle_event(kind: str, line: str) -> None:
    """The idle policy's words (on the usage thread): a ``logging`` WARNING
    of logger ``devlock`` once per idle spell; with the stop, as Ctrl-C."""
    if kind == "stop":
        logger.error(line)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
    else:
        logger.warning(line)


# The blocks this thread or task is inside, innermost last.
_stack: contextvars.ContextVar[Tuple[_Entry, ...]] = contextvars.ContextVar(
    "devlock_held", default=()
)
# Every hold of this process not yet released, so that a forked child knows
# what it inherited (whatever thread of the parent held it).
_live: Dict[int, _Entry] = {}
_live_lock = threading.Lock()
# Holds of this process kept past their block's end while the device is
# busy (release="device"), each held by a keeper thread of the library.
_kept: List[Any] = []


def _after_fork_in_child() -> None:
    global _live_lock
    # Another thread of the parent may have held it at the fork.
    _live_lock = threading.Lock()
    # The parent's keepers decide when a kept hold goes; the child's copies
    # of its descriptors must not keep the lock past that.
    for kept in _kept:
        kept.forget_in_child()
    _kept.clear()


def _take_back_kept() -> List[Any]:
    """Every hold this process keeps past a block's end, taken back from its
    keeper: a new block runs inside them (taking one of their locks again
    would wait for this very process), and its end decides again."""
    if not _kept:
        return []
    with _live_lock:
        kept = list(_kept)
        _kept.clear()
    holds = []
    for k in kept:
        hold = k.take_back()
        if hold is not None:
            holds.append(hold)
    return holds


def _release_kept_at_exit() -> None:
    """The interpreter ends: its kept holds go with it (the kernel would let
    go anyway); letting go here writes their usage records' end lines."""
    for kept in list(_kept):
        kept.release()


atexit.register(_release_kept_at_exit)


def _say(line: str, level: int) -> None:
    """A ``logging`` record of logger ``devlock``; on stderr as the command
    line says it when nothing handles that logger."""
    if logger.hasHandlers():
        logger.log(level, line)
        return
    try:
        sys.stderr.write(f"devlock: {line}\n")
        sys.stderr.flush()
    except Exception:
        pass


def _let_go(holds: List[Any], release: str) -> None:
    """Lets go of a block's holds at its end: at once with
    ``release="block"``; else once the driver no longer lists this process
    (or one it started) on their GPUs, saying once why a hold is kept."""
    for hold in holds:
        if release == "block":
            hold.release()
            continue
        kept = hold.release_when_free()
        if kept is None:
            continue
        with _live_lock:
            _kept[:] = [k for k in _kept if k.is_held()]
            _kept.append(kept)
        _say(kept.line(), logging.WARNING)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _covering() -> List[_Entry]:
    """The holds a take in this context runs inside: this context's blocks,
    and in a forked child every hold inherited from the parent that the
    kernel says this process still holds."""
    stack = _stack.get()
    if not stack and not _live:
        return []
    me = os.getpid()
    entries = [e for e in stack if e.pid == me or e.native.holds_here()]
    with _live_lock:
        inherited = [e for e in _live.values() if e.pid != me]
    for e in inherited:
        if e not in entries and e.native.holds_here():
            entries.append(e)
    return entries


def pass_fds() -> Tuple[int, ...]:
    """The descriptors a child process must inherit to run inside the blocks
    this context holds, for ``subprocess.run(..., pass_fds=devlock.pass_fds())``:
    a ``devlock`` command started so passes through instead of waiting for its
    parent (the command line passes through only on an inherited descriptor
    that holds the lock). Empty outside any block."""
    fds = set()
    for entry in _covering():
        fds.update(entry.native.fds())
        for hold in entry.adopted:
            fds.update(hold.fds())
    return tuple(sorted(fds))


def status(
    *resources: str, dir: Optional[str] = None, probe_timeout: Optional[float] = 5.0
) -> Dict[str, Any]:
    """The same document as ``devlock status --json [RESOURCE...]``, parsed:
    ``{"dir", "trust", "resources": [...], "device_info", "devices": [...]}``
    (see ``devlock status --help``). Every resource in the directory when none
    is named. ``probe_timeout`` bounds the wait for nvidia-smi (None: no GPUs)."""
    for r in resources:
        if not isinstance(r, str):
            raise TypeError(f"resource names are str, not {type(r).__name__}")
    text = _native.status(_dir_of(dir), list(resources), probe_timeout)
    document: Dict[str, Any] = json.loads(text)
    return document


def _dir_of(dir: Optional[Union[str, "os.PathLike[str]"]]) -> str:
    if dir is not None:
        return os.fspath(dir)
    return os.environ.get("DEVLOCK_DIR") or DEFAULT_DIR


def _default_step() -> str:
    if "ipykernel" in sys.modules:
        return "jupyter"
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 and argv0 not in ("-c", "-"):
        return os.path.basename(argv0)
    return "python"


# --- CUDA -----------------------------------------------------------------

_CUDA_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
_cuda_warned = False


def _cuda_started() -> Optional[str]:
    """Why CUDA may already be initialised in this process, if it may."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch has initialised CUDA"
        except Exception:
            pass
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return "jax has initialised its backends"
    for name in ("tensorflow", "cupy", "numba.cuda", "pycuda.autoinit"):
        if name in sys.modules and _nvidia_device_open():
            return f"{name} is loaded and this process has an NVIDIA device open"
    return None


def _nvidia_device_open() -> bool:
    """Whether this process has an NVIDIA device file open (a CUDA context does)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


def _set_cuda(devices: str) -> Dict[str, Optional[str]]:
    global _cuda_warned
    saved = {k: os.environ.get(k) for k in _CUDA_VARS}
    why = _cuda_started()
    if why is not None and not _cuda_warned:
        _cuda_warned = True
        warnings.warn(
            f"devlock: {why}; CUDA_VISIBLE_DEVICES={devices} set now cannot take "
            "effect in this process (take the lock before CUDA starts)",
            RuntimeWarning,
            stacklevel=4,
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    # Without it CUDA numbers devices fastest first, not as nvidia-smi does.
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return saved


def _restore_env(saved: Dict[str, Optional[str]]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# --- The waiting display --------------------------------------------------


def _columns() -> Optional[int]:
    """The width of the terminal on stderr, as the command line fits its line to it."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or None
    except (OSError, AttributeError, ValueError):
        return None


class _Display:
    """The command line's waiting line on a terminal; a ``logging`` record
    (logger ``devlock``) otherwise, and always in Jupyter: no control
    characters there."""

    def __init__(self, quiet: bool, report_every: float) -> None:
        self.quiet = quiet
        self.report_every = report_every
        stream = sys.stderr
        try:
            tty = stream is not None and stream.isatty()
        except Exception:
            tty = False
        self.live = tty and "ipykernel" not in sys.modules
        self.next_at = 0.0
        self.shown = False

    def _write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:
            pass

    def _record(self, line: str) -> None:
        message = line[len("devlock: ") :] if line.startswith("devlock: ") else line
        if logger.hasHandlers():
            logger.info(message)
        else:
            # Nothing handles the logger: say it as the command line would.
            self._write(f"devlock: {message}\n")

    def tick(self, acquiring: Any) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if now < self.next_at:
            return
        line = acquiring.waiting_line(_columns() if self.live else None)
        if not line:
            return
        if self.live:
            self._write(f"\r\x1b[K{line}")
            self.next_at = now + _REDRAW
        else:
            self._record(line)
            self.next_at = now + self.report_every
        self.shown = True

    def clear(self) -> None:
        if self.live and self.shown:
            self._write("\r\x1b[K")

    def done(self, line: Optional[str]) -> None:
        self.clear()
        if not self.quiet and not self.live and self.shown and line:
            self._record(line)


# --- The lock -------------------------------------------------------------


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise UsageError(f"{name} must be between {low} and {high}, got {value}")
    return value


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, str):
        # The command line's durations: "90", "2s", "10m", "1h30m".
        return _native.seconds_of(name, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a number of seconds or a duration such as \"2s\", not {type(value).__name__}"
        )
    if not value >= 0 or value == float("inf"):
        raise UsageError(f"{name} must be a finite number of seconds >= 0, got {value}")
    return float(value)


class lock:
    """Hold machine-wide resources for a ``with`` block, as ``devlock RESOURCE... --`` does.

    ``resources`` are the command line's names: ``"gpu"`` (every GPU),
    ``"gpu:N"`` (one GPU; it also takes the group ``gpu`` shared, so a holder
    of the whole group excludes every member), or any name of 1-64 of
    ``[A-Za-z0-9._:-]``. The keyword arguments are the command line's options:

    * ``step`` (``--step``): the holder's label in status (default: the
      script's name, ``jupyter`` in a notebook, else ``python``).
    * ``wait=False`` (``-n``): fail at once with :class:`Busy` naming the
      holder instead of waiting.
    * ``timeout`` (``-w``, seconds, or the command line's durations as a
      string: ``"90"``, ``"2s"``, ``"10m"``, ``"1h30m"``): give up with :class:`Timeout` after
      waiting this long; the block leaves the line.
    * ``shared`` (``--shared``), ``slots`` (``--slots N``), ``any`` and
      ``count`` (``--any --count K``).
    * ``quiet`` (``-q``): show nothing while waiting; ``report_every``
      (``--report-every``, seconds): off a terminal, how often a long wait is
      reported (as a ``logging`` record of logger ``devlock``; printed to
      stderr when nothing handles that logger).
    * ``dir`` (``--dir``): the scratch directory (default ``DEVLOCK_DIR``,
      else :data:`DEFAULT_DIR`).
    * ``inheritable``: make the hold's descriptors inheritable for the block,
      so children started with ``close_fds=False`` (or ``os.system``) run
      inside it; such a child still running after the block keeps the lock
      until it exits. Without it, pass :func:`pass_fds` to ``subprocess``.
    * ``mem`` (``--mem``, ``"20GiB"``, ``"512MiB"``, or an int of MiB): hold
      that much of one ``gpu:N``'s memory (with ``any=True``: of the first
      candidate that admits it) instead of the whole device, by the command
      line's rules: admitted while the holders' budgets, the memory used
      outside the gate, this budget and ``mem_headroom`` fit; in the same
      fair line. The block sets ``DEVLOCK_MEM_MIB`` and (unless set)
      ``XLA_PYTHON_CLIENT_MEM_FRACTION`` in ``os.environ`` and restores them
      after. While it is held a thread of the library measures what this
      interpreter's process tree uses on the device: the block is
      ``starting`` in status (the next budget waits) until that stops
      growing or ``settle`` passes, and more than 10 % over the budget is
      said once as a ``logging`` WARNING record of logger ``devlock`` (and
      marked in status). ``mem_headroom`` (``--mem-headroom``, default
      2GiB), ``settle`` (``--settle``, seconds or a duration string, default 30) and
      ``mem_strict`` (``--mem-strict``): once over for ``settle``, the work
      is stopped as Ctrl-C stops it (SIGINT to the main thread; the block
      raises :class:`OverBudget`). A device whose memory cannot be learned
      raises :class:`DeviceUnknown`.
    - ``idle_timeout`` (``--idle-timeout``, seconds or a duration string):
      once the block's GPUs have computed nothing for that long (none of
      this process's tree on them counts as nothing), a WARNING record of
      logger ``devlock``; after a grace (the timeout again, at most 10
      minutes) the work is stopped as Ctrl-C stops it and the block raises
      :class:`IdleStopped`. A phase without GPU work says so by running
      ``devlock busy DUR`` (or touching ``$DEVLOCK_BUSY_FILE`` into the
      future, see devlock-busy(1)).

    * ``release`` (default ``"device"``): when the block lets go. The
      block's end asks the driver once (NVML, else ``nvidia-smi``, else AMD's
      source); when it still lists this process, or a process it started,
      on a GPU of the block (``gpu``, ``gpu:N``, a MIG instance), the lock is
      kept, by a thread of the library started only then, and let go as soon
      as the driver no longer lists them (memory freed, CUDA context
      destroyed, the process gone): the next job in line does not start on
      a GPU that still holds this process's memory. It says once why (a
      WARNING record of logger ``devlock``) with the remedies; while kept,
      ``devlock status``, ``devlock -n`` and :class:`Busy` name it (``held
      by notebook-eval (pid 4242, ana): block ended 3m ago, still 19.8 GiB on
      gpu:0``), it counts as idle (an ``idle_timeout`` lets it go rather
      than stop anything), and its usage record says when the block ended.
      A later block of this process takes a kept hold back and runs inside
      it. ``release="block"`` lets go at the block's end, as before, for
      code that frees the device itself. Without a driver to ask (no NVML,
      no ``nvidia-smi``, no AMD source), or when it fails, the block's end
      lets go. PyTorch keeps its CUDA context and cached memory for the
      life of the process: ``del model; gc.collect();
      torch.cuda.empty_cache()`` frees the memory, but the context (some
      hundreds of MiB) stays listed until the process ends::

          with devlock.lock("gpu:0", step="eval"):
              model = load().cuda()
              evaluate(model)
          del model; gc.collect(); torch.cuda.empty_cache()   # the lock goes once freed

    Worker threads: the lock belongs to the process, not to the thread that
    holds the block. Other threads' device work counts as this process's:
    a block that ends while another thread still computes on the device is
    kept until the driver no longer lists the process (with
    ``release="device"``), and another thread's own ``devlock.lock`` of the
    same resource waits its turn while the block runs.

    Every hold the block takes itself appends its usage record (start, end,
    what its GPUs did) to the user's file in the usage directory, as the
    command line does (``devlock report`` sums them; ``from`` is
    ``library``).

    The wait sleeps in the kernel with the GIL released, so other threads
    run; Ctrl-C raises ``KeyboardInterrupt`` within a fraction of a second
    and leaves the line. A wait is shown, as the command line shows it,
    once it has lasted 0.2 s. For ``gpu:N`` the block sets ``CUDA_VISIBLE_DEVICES``
    and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` in ``os.environ`` and restores them
    after; if CUDA is already initialised in the process it warns once that
    this cannot take effect. The kernel releases the lock on any death of the
    process (an exception leaving the block, ``sys.exit``, ``os._exit``,
    ``kill -9``). ``__enter__`` returns a :class:`Held`.

    Raises: :class:`Busy`, :class:`Timeout`, :class:`UnsafeFile`,
    :class:`UsageError`, :class:`DeviceUnknown`, :class:`Error`; and
    :class:`OverBudget` (a ``KeyboardInterrupt``) with ``mem_strict``;
    :class:`IdleStopped` (a ``KeyboardInterrupt``) with ``idle_timeout``.
    """

    def __init__(
        self,
        *resources: str,
        step: Optional[str] = None,
        wait: bool = True,
        timeout: Union[float, str, None] = None,
        shared: bool = False,
        slots: Optional[int] = None,
        any: bool = False,
        count: int = 1,
        quiet: bool = False,
        report_every: float = 60.0,
        dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        inheritable: bool = False,
        mem: Optional[Union[str, int]] = None,
        mem_headroom: Optional[Union[str, int]] = None,
        settle: Union[float, str, None] = None,
        mem_strict: bool = False,
        idle_timeout: Union[float, str, None] = None,
        release: Literal["device", "block"] = "device",
    ) -> None:
        if release not in ("device", "block"):
            raise UsageError(f"release must be \"device\" or \"block\", got {release!r}")
        for name, size in (("mem", mem), ("mem_headroom", mem_headroom)):
            if size is not None and (isinstance(size, bool) or not isinstance(size, (str, int))):
                raise TypeError(f"{name} must be a str such as '20GiB' or an int of MiB, not {type(size).__name__}")
        if not resources:
            raise UsageError("name at least one resource to lock, as in devlock.lock('gpu')")
        for r in resources:
            if not isinstance(r, str):
                raise TypeError(f"resource names are str, not {type(r).__name__}")
        if not wait and timeout is not None:
            raise UsageError("wait=False and timeout= exclude each other (as -n and -w do)")
        if step is not None and not isinstance(step, str):
            raise TypeError(f"step must be a str, not {type(step).__name__}")
        self._resources = list(resources)
        self._step = step
        self._wait = bool(wait)
        self._timeout = None if timeout is None else _check_seconds("timeout", timeout)
        self._shared = bool(shared)
        self._slots = None if slots is None else _check_int("slots", slots, 1, 65535)
        self._any = bool(any)
        self._count = _check_int("count", count, 1, 255)
        self._quiet = bool(quiet)
        self._report_every = _check_seconds("report_every", report_every)
        if self._report_every < 0.01:
            raise UsageError("report_every must be at least 0.01 seconds")
        self._dir = dir
        self._inheritable = bool(inheritable)
        # Passed as the command line's text; the native layer decides.
        self._mem = None if mem is None else str(mem)
        self._mem_headroom = None if mem_headroom is None else str(mem_headroom)
        self._settle = None if settle is None else _check_seconds("settle", settle)
        self._mem_strict = bool(mem_strict)
        self._idle_timeout = None if idle_timeout is None else _check_seconds("idle_timeout", idle_timeout)
        self._release = release
        # One per block entered with this object (it may be re-entered).
        self._blocks: List[Tuple[_Entry, "contextvars.Token[Tuple[_Entry, ...]]", Optional[Dict[str, Optional[str]]]]] = []

    def __repr__(self) -> str:
        return f"devlock.lock({', '.join(map(repr, self._resources))})"

    def _start(self) -> Tuple[Any, Optional[Any], List[Any]]:
        """Starts the take: (acquiring, the hold when taken at once, the
        kept holds taken back to run inside)."""
        step = self._step if self._step is not None else _default_step()
        adopted = _take_back_kept()
        inside = [lk for entry in _covering() for lk in entry.locks]
        inside += [lk for hold in adopted for lk in hold.locks()]
        try:
            acquiring = _native.start(
                self._resources,
                dir=_dir_of(self._dir),
                step=step,
                wait=self._wait,
                timeout=self._timeout,
                shared=self._shared,
                slots=self._slots,
                any=self._any,
                count=self._count,
                mem=self._mem,
                mem_headroom=self._mem_headroom,
                settle=self._settle,
                mem_strict=self._mem_strict,
                inside=inside,
                idle_timeout=self._idle_timeout,
            )
            hold = acquiring.wait(0.0)
        except BaseException:
            _let_go(adopted, self._release)
            raise
        return acquiring, hold, adopted

    def __enter__(self) -> Held:
        acquiring, hold, adopted = self._start()
        if hold is None:
            try:
                hold = self._wait_for(acquiring)
            except BaseException:
                _let_go(adopted, self._release)
                raise
        return self._entered(hold, adopted)

    def _entered(self, hold: Any, adopted: List[Any]) -> Held:
        step = self._step if self._step is not None else _default_step()
        resources, locks, fds, slot, cuda, nested = hold.info()
        mem_mib = hold.budget_mib()
        entry = _Entry(hold, locks + [lk for h in adopted for lk in h.locks()], adopted)
        saved: Optional[Dict[str, Optional[str]]] = None
        try:
            if mem_mib is not None:
                hold.on_budget_event(_on_budget_event)
            if self._idle_timeout is not None:
                hold.on_idle_event(_on_idle_event)
            if self._inheritable:
                for fd in fds:
                    os.set_inheritable(fd, True)
            saved = _set_cuda(cuda) if cuda is not None else None
            if mem_mib is not None:
                saved = dict(saved or {}, **_set_budget_env(hold.budget_env()))
        except BaseException:
            if saved is not None:
                _restore_env(saved)
            hold.release()
            _let_go(adopted, self._release)
            raise
        with _live_lock:
            _live[id(entry)] = entry
        token = _stack.set(_stack.get() + (entry,))
        self._blocks.append((entry, token, saved))
        return Held(tuple(resources), step, slot, cuda, nested, tuple(fds), mem_mib)

    def _wait_for(self, acquiring: Any) -> Any:
        display = _Display(self._quiet, self._report_every)
        try:
            display.tick(acquiring)
            while True:
                hold = acquiring.wait(_POLL)
                if hold is not None:
                    break
                # Back in Python between polls: a signal's handler
                # (KeyboardInterrupt) runs here.
                display.tick(acquiring)
        except BaseException:
            acquiring.cancel()
            display.clear()
            raise
        display.done(hold.done_line())
        return hold

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        holds, stop = self._leave(exc)
        _let_go(holds, self._release)
        if stop is not None:
            raise stop from exc

    def _leave(self, exc: Optional[BaseException]) -> Tuple[List[Any], Optional[BaseException]]:
        """Leaves the block but for letting go: (the holds to let go, the
        stop to raise in place of the ``KeyboardInterrupt`` that ended it)."""
        entry, token, saved = self._blocks.pop()
        try:
            _stack.reset(token)
        except ValueError:
            # Left in another context than it was entered in.
            _stack.set(tuple(e for e in _stack.get() if e is not entry))
        with _live_lock:
            _live.pop(id(entry), None)
        interrupted = isinstance(exc, KeyboardInterrupt)
        stopped = entry.native.stopped_over_budget() if interrupted else None
        idle = entry.native.stopped_idle() if interrupted and stopped is None else None
        if saved is not None:
            _restore_env(saved)
        stop: Optional[BaseException] = None
        if stopped is not None and not isinstance(exc, OverBudget):
            stop = OverBudget(stopped)
        elif idle is not None and not isinstance(exc, IdleStopped):
            stop = IdleStopped(idle)
        return [entry.native] + entry.adopted, stop


# asyncio's side is a module of its own, imported on first use: `import
# devlock` does not pay for asyncio.
if TYPE_CHECKING:
    from ._aio import lock_async, run_in_thread


def __getattr__(name: str) -> Any:
    if name in ("lock_async", "run_in_thread"):
        from . import _aio

        return getattr(_aio, name)
    raise AttributeError(f"module 'devlock' has no attribute {name!r}")
