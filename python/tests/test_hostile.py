"""Hostile input from another process (issue #32.9): a file lease on a lock
file is the same busy as a holder, so ``wait=False`` raises
:class:`devlock.Busy` naming the lease's holder, not the base
:class:`devlock.Error`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import devlock
from dlhelp import HANG, Scratch, wait_file

# A read lease whose holder ignores the kernel's call to let go (SIGIO):
# every open of the file for writing fails at once (O_NONBLOCK) until it is
# released, or until the kernel's lease-break-time (45 s by default).
STUBBORN_LEASE = """
import fcntl, os, signal, sys, time
path, ready, release = sys.argv[1:4]
signal.signal(signal.SIGIO, signal.SIG_IGN)
fd = os.open(path, os.O_RDONLY)
fcntl.fcntl(fd, 1024, fcntl.F_RDLCK)  # F_SETLEASE
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(ready + ".tmp", ready)
while not os.path.exists(release):
    time.sleep(0.01)
"""


def test_a_lease_is_busy_naming_its_holder(scratch: Scratch) -> None:
    assert scratch.run("-n", "l", "--", "true").returncode == 0
    path = scratch.dir / "l.lock"
    ready, release = scratch.work / "ready", scratch.work / "release"
    leaser = subprocess.Popen(
        [sys.executable, "-c", STUBBORN_LEASE, str(path), str(ready), str(release)],
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_file(ready)
        pid = int(ready.read_text())
        with pytest.raises(devlock.Busy) as caught:
            with devlock.lock("l", wait=False):
                pass
        busy = caught.value
        assert not isinstance(busy, devlock.Timeout)
        assert busy.resource == "l" and busy.exit_code == 75
        assert busy.holder.pid == pid
        assert str(busy).startswith(f"l is busy: a file lease on {path} (pid {pid}, "), str(busy)
        # A timeout waits for it to break, and gives up with Timeout.
        with pytest.raises(devlock.Timeout):
            with devlock.lock("l", timeout=0.2):
                pass
    finally:
        Path(release).touch()
        leaser.wait(timeout=HANG)
    with devlock.lock("l", wait=False):
        pass
