"""A good citizen while waiting: the GIL released (another thread runs),
Ctrl-C (a real SIGINT) raises KeyboardInterrupt and leaves the line, a
timeout leaves it too, and the wait is shown as the CLI shows it: its live
line on a terminal, a logging record otherwise, no control characters in
Jupyter."""

from __future__ import annotations

import logging
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import devlock
from dlhelp import HANG, Scratch, poll


def test_another_thread_runs_during_the_wait(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "cli", "r")
    counted = []

    def other_thread() -> None:
        # Runs Python code while the main thread waits in devlock.lock; if
        # the wait held the GIL it could never release the holder.
        scratch.wait_waiters("r", 1)
        for n in range(10_000):
            counted.append(n)
        holder.release()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with devlock.lock("r", quiet=True) as held:
        assert held.resources == ("r",)
        assert len(counted) == 10_000
    worker.join(HANG)
    assert holder.finish().returncode == 0


def test_ctrl_c_while_waiting_raises_and_leaves_the_line(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "cli", "r")
    waiter = scratch.python(
        "import devlock, sys\n"
        "try:\n"
        "    with devlock.lock('r', step='py'):\n"
        "        print('got', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    view = scratch.wait_waiters("r", 1)
    assert view["waiters"][0]["pid"] == waiter.pid
    os.kill(waiter.pid, signal.SIGINT)
    waiter.line("interrupted")
    # Still alive, and out of the line: its place and registration are gone.
    view = poll("the line left", lambda: scratch.resource("r"), lambda v: v["waiters"] == [])
    assert view["holders"][0]["step"] == "cli"
    assert waiter.popen.poll() is None
    waiter.release()
    assert waiter.finish().returncode == 0
    # The line moves on without it: the next waiter gets the lock at once.
    holder.release()
    assert holder.finish().returncode == 0
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_ctrl_c_while_waiting_for_any_of_several(scratch: Scratch) -> None:
    a = scratch.cli_holder("gpu:0")
    b = scratch.cli_holder("gpu:1")
    waiter = scratch.python(
        "import devlock, sys\n"
        "try:\n"
        "    with devlock.lock('gpu:0', 'gpu:1', any=True):\n"
        "        print('got', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    scratch.wait_waiters("gpu:0", 1)
    scratch.wait_waiters("gpu:1", 1)
    os.kill(waiter.pid, signal.SIGINT)
    waiter.line("interrupted")
    for name in ("gpu:0", "gpu:1"):
        poll(f"{name}'s line left", lambda: scratch.resource(name), lambda v: v["waiters"] == [])
    assert waiter.popen.poll() is None
    waiter.release()
    assert waiter.finish().returncode == 0
    for h in (a, b):
        h.release()
        assert h.finish().returncode == 0


def _blocked_on(path: Path, pid: int) -> bool:
    """Whether /proc/locks shows ``pid`` asleep in flock(2) on ``path``."""
    try:
        ino = path.stat().st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and "FLOCK" in fields:
                rest = fields[fields.index("->") + 1 :]
                if rest[3] == str(pid) and rest[4].endswith(f":{ino}"):
                    return True
    return False


def test_ctrl_c_while_waiting_for_a_slot_at_the_front_of_the_line(scratch: Scratch) -> None:
    # The front of the line, asleep on the slot files themselves (one racing
    # thread per slot): Ctrl-C must reach those threads too, not only the
    # place in line, and leave at once, while the slot is still held.
    holder = scratch.cli_holder("--step", "cli", "--slots", "1", "pool")
    waiter = scratch.python(
        "import devlock, sys, time\n"
        "try:\n"
        "    with devlock.lock('pool', slots=1, step='py'):\n"
        "        print('got', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    scratch.wait_waiters("pool", 1)
    slot = scratch.dir / ".pool.slot1"
    poll("the waiter asleep on the slot", lambda: _blocked_on(slot, waiter.pid), bool)
    os.kill(waiter.pid, signal.SIGINT)
    waiter.line("interrupted")
    # Out of the line and off the slot while the holder still holds it.
    assert not _blocked_on(slot, waiter.pid)
    view = poll("the line left", lambda: scratch.resource("pool"), lambda v: v["waiters"] == [])
    assert view["holders"][0]["step"] == "cli"
    assert waiter.popen.poll() is None
    waiter.release()
    assert waiter.finish().returncode == 0
    holder.release()
    assert holder.finish().returncode == 0


def test_a_timeout_is_a_busy_naming_the_holder_and_leaves_the_line(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "long-job", "r")
    with pytest.raises(devlock.Timeout) as caught:
        with devlock.lock("r", timeout=0.2, quiet=True):
            pass
    err = caught.value
    assert isinstance(err, devlock.Busy) and err.exit_code == 75
    assert err.holder.step == "long-job" and err.holder.pid == holder.pid
    assert str(err).startswith(f"timed out after 200ms waiting for r: held by long-job (pid {holder.pid}, ")
    poll("the line left", lambda: scratch.resource("r"), lambda v: v["waiters"] == [])
    # The CLI words it the same way.
    cli = scratch.run("-q", "-w", "200ms", "r", "--", "true")
    assert cli.returncode == 75
    holder.release()
    assert holder.finish().returncode == 0


def test_durations_are_the_command_lines_strings_too(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "long-job", "r")
    for timeout in ("0.2s", "200ms", "0.2"):
        with pytest.raises(devlock.Timeout) as caught:
            with devlock.lock("r", timeout=timeout, quiet=True):
                pass
        assert str(caught.value).startswith("timed out after 200ms waiting for r"), str(caught.value)
    with pytest.raises(devlock.UsageError) as bad:
        devlock.lock("r", timeout="5x")
    assert str(bad.value) == 'timeout="5x" is not a duration (try 90, "90s", "10m" or "1h30m"; a number is seconds)'
    with pytest.raises(TypeError):
        devlock.lock("r", timeout=[2])
    holder.release()
    assert holder.finish().returncode == 0


def _shape(line: str) -> str:
    """A waiting line with its numbers (and ordinals) taken out."""
    return re.sub(r"\d+", "N", re.sub(r"\d+(st|nd|rd|th)\b", "Nth", line.strip()))


def test_off_a_terminal_the_wait_is_a_logging_record_like_the_cli_line(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "holder", "r")
    # Off a terminal, both say a line once the wait has lasted 0.2 s.
    cli = scratch.cli_waiter("--step", "py", "r", script="true")
    scratch.wait_waiters("r", 1)
    py = scratch.python(
        "import logging, devlock\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s|%(levelname)s|%(message)s')\n"
        "with devlock.lock('r', step='py'):\n"
        "    pass\n"
    )
    scratch.wait_waiters("r", 2)
    cli.err_line("waiting")
    py.err_line("waiting")
    holder.release()
    cli_out = cli.finish()
    py_out = py.finish()
    assert cli_out.returncode == 0 and py_out.returncode == 0, py_out.stderr
    cli_lines = cli_out.stderr.splitlines()
    py_lines = py_out.stderr.splitlines()
    assert py_lines[0].startswith("devlock|INFO|r · waiting "), py_lines
    assert "\x1b" not in py_out.stderr and "\r" not in py_out.stderr
    # Record for record, the CLI's words: the CLI is 1st in line, Python 2nd
    # and behind it, named as the CLI names waiters.
    assert f" · behind py (pid {cli.pid}, " in py_lines[0], py_lines
    first = re.sub(r" · behind [^·]*?(?= · )", "", py_lines[0].split("|", 2)[2])
    assert _shape("devlock: " + first) == _shape(cli_lines[0]), (py_lines, cli_lines)
    assert "for holder (pid " in py_lines[0] and "· 2nd in line (py)" in py_lines[0]
    assert re.fullmatch(r"devlock\|INFO\|got r after \d+s \(py\)", py_lines[-1]), py_lines
    assert _shape("devlock: " + py_lines[-1].split("|", 2)[2]) == _shape(cli_lines[-1]), cli_lines


def test_without_a_logging_handler_it_prints_the_cli_line(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "holder", "r")
    py = scratch.python("import devlock\nwith devlock.lock('r'):\n    pass\n")
    scratch.wait_waiters("r", 1)
    py.err_line("waiting")
    holder.release()
    out = py.finish()
    lines = out.stderr.splitlines()
    assert lines[0].startswith("devlock: r · waiting ") and "for holder (pid " in lines[0], lines
    assert re.fullmatch(r"devlock: got r after \d+s \(python\)", lines[-1]), lines
    quiet = scratch.python("import devlock\nwith devlock.lock('r', quiet=True):\n    pass\n").finish()
    assert quiet.returncode == 0 and quiet.stderr == ""


def _on_a_pty(scratch: Scratch, script: str) -> str:
    """Runs ``python -c script`` with stderr on a pty; returns what it wrote there."""
    holder = scratch.cli_holder("--step", "holder", "r")
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=scratch.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    scratch.wait_waiters("r", 1)
    chunks = b""
    # The live line is written at once; read until it is there.
    deadline = time.monotonic() + HANG
    while b"waiting" not in chunks and time.monotonic() < deadline:
        chunks += os.read(master, 4096)
    holder.release()
    assert proc.wait(HANG) == 0
    try:
        while True:
            data = os.read(master, 4096)
            if not data:
                break
            chunks += data
    except OSError:
        pass
    os.close(master)
    assert holder.finish().returncode == 0
    return chunks.decode()


def test_on_a_terminal_the_wait_is_the_cli_live_line(scratch: Scratch) -> None:
    text = _on_a_pty(scratch, "import devlock\nwith devlock.lock('r'):\n    pass\n")
    assert text.startswith("\r\x1b[Kdevlock: r · waiting "), repr(text)
    assert "for holder (pid " in text
    assert text.endswith("\r\x1b[K"), repr(text)


def test_in_jupyter_no_control_characters(scratch: Scratch) -> None:
    # ipykernel's presence is what tells a kernel; its streams are no tty
    # either, but a kernel started from a terminal may still have one at fd 2.
    text = _on_a_pty(
        scratch,
        "import sys, types\n"
        "sys.modules['ipykernel'] = types.ModuleType('ipykernel')\n"
        "import devlock\n"
        "with devlock.lock('r'):\n    pass\n",
    )
    assert "\x1b" not in text, repr(text)
    assert text.replace("\r\n", "\n").startswith("devlock: r · waiting "), repr(text)


def test_logging_is_the_devlock_logger(caplog: pytest.LogCaptureFixture, scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "holder", "r")

    def release_when_waiting() -> None:
        poll("a devlock record", lambda: [r for r in caplog.records if r.name == "devlock"], bool)
        holder.release()

    t = threading.Thread(target=release_when_waiting)
    t.start()
    with caplog.at_level(logging.INFO, logger="devlock"):
        with devlock.lock("r"):
            pass
    t.join(HANG)
    records = [r for r in caplog.records if r.name == "devlock"]
    assert records[0].levelno == logging.INFO
    assert records[0].getMessage().startswith("r · waiting ")
    assert records[-1].getMessage().startswith("got r after ")
    assert holder.finish().returncode == 0
