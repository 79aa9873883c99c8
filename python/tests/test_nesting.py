"""Nested and inherited: re-entrant nesting in one process, forked workers
(os.fork, multiprocessing) and the fork policy, devlock commands started
with subprocess inside a block, and CUDA_VISIBLE_DEVICES for the block."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

import devlock
from dlhelp import HANG, Scratch


def test_a_nested_take_passes_through_and_is_counted(scratch: Scratch) -> None:
    with devlock.lock("r") as outer:
        assert not outer.nested
        with devlock.lock("r", wait=False) as inner:
            assert inner.nested and inner.fds == ()
            with devlock.lock("r") as innermost:
                assert innermost.nested
        # The inner blocks' ends released nothing.
        assert scratch.run("-n", "r", "--", "true").returncode == 75
        assert scratch.resource("r")["holders"][0]["pid"] == os.getpid()
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_a_group_holder_passes_members_through(scratch: Scratch) -> None:
    with devlock.lock("gpu"):
        with devlock.lock("gpu:3", wait=False) as member:
            assert member.nested and member.cuda_visible_devices == "3"
        with devlock.lock("gpu:0", "gpu:1", any=True, wait=False) as picked:
            assert picked.nested and picked.resources == ("gpu:0",)
    with devlock.lock("gpu:1"):
        # Holding gpu:1 holds the group only shared: taking it whole here
        # would wait for itself.
        with pytest.raises(devlock.Error, match="would wait for itself"):
            with devlock.lock("gpu"):
                pass
        # Another member inside it is outside its CUDA_VISIBLE_DEVICES=1, as
        # for a devlock started here.
        with pytest.raises(devlock.UsageError, match="gpu:2 is outside CUDA_VISIBLE_DEVICES=1"):
            with devlock.lock("gpu:2"):
                pass
        # Without that setting, another member beside it: the group is not
        # taken twice.
        cuda = os.environ.pop("CUDA_VISIBLE_DEVICES")
        with devlock.lock("gpu:2", wait=False) as second:
            assert not second.nested
            assert scratch.run("-n", "gpu:2", "--", "true").returncode == 75
        assert scratch.run("-n", "gpu:2", "--", "true").returncode == 0
        assert scratch.run("-n", "gpu:1", "--", "true").returncode == 75
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda


def test_another_thread_waits_its_turn(scratch: Scratch) -> None:
    import threading

    got = threading.Event()

    def other() -> None:
        with devlock.lock("r", quiet=True):
            got.set()

    with devlock.lock("r"):
        t = threading.Thread(target=other)
        t.start()
        scratch.wait_waiters("r", 1)
        assert not got.is_set()
    t.join(HANG)
    assert got.is_set()


def test_a_subprocess_devlock_passes_through_with_pass_fds(scratch: Scratch) -> None:
    env = scratch.env()
    with devlock.lock("gpu:0", step="py") as held:
        fds = devlock.pass_fds()
        assert fds and set(held.fds) <= set(fds)
        inside = subprocess.run(
            [scratch.bin, "-n", "gpu:0", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
            env=env, pass_fds=fds, capture_output=True, text=True, timeout=HANG,
        )
        assert (inside.returncode, inside.stdout.strip()) == (0, "0"), inside.stderr
        # Without the descriptors the CLI cannot tell it runs inside the hold.
        outside = subprocess.run(
            [scratch.bin, "-n", "gpu:0", "--", "true"], env=env, capture_output=True, text=True, timeout=HANG
        )
        assert outside.returncode == 75
        with devlock.lock("gpu:0"):
            assert devlock.pass_fds() == fds
    assert devlock.pass_fds() == ()


def test_inheritable_with_close_fds_false_and_os_system(scratch: Scratch) -> None:
    with devlock.lock("r", inheritable=True):
        out = subprocess.run(
            [scratch.bin, "-n", "r", "--", "true"], env=scratch.env(), close_fds=False, timeout=HANG
        )
        assert out.returncode == 0
        assert os.system(f"{scratch.bin} -n r -- true") == 0
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_python_under_a_devlock_command_passes_through_and_passes_on(scratch: Scratch) -> None:
    script = (
        "import devlock, subprocess, sys\n"
        "with devlock.lock('r', wait=False) as h:\n"
        "    assert h.nested, h\n"
        "    fds = devlock.pass_fds()\n"
        "    assert fds, 'the inherited descriptor is passed on'\n"
        f"    rc = subprocess.run([{scratch.bin!r}, '-n', 'r', '--', 'true'], pass_fds=fds).returncode\n"
        "    print('inner', rc, flush=True)\n"
    )
    out = scratch.run("--step", "outer", "r", "--", sys.executable, "-c", script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "inner 0"


FORK_POLICY = """
import devlock, os, sys, time
from pathlib import Path
work = Path(sys.argv[1])
parent_first = sys.argv[2] == 'parent-first'

def wait_for(name):
    while not (work / name).exists():
        time.sleep(0.01)

with devlock.lock('r', step='parent', quiet=True):
    print('held', flush=True)
    pid = os.fork()
    if pid == 0:
        with devlock.lock('r', wait=False) as inner:
            assert inner.nested
        print('child-nested', flush=True)
        wait_for('child-leave')
    else:
        wait_for('parent-leave')
# Out of the block, both alive.
if pid == 0:
    print('child-left', flush=True)
    wait_for('child-exit')
    os._exit(0)
print('parent-left', flush=True)
_, status = os.waitpid(pid, 0)
print('child-status', status, flush=True)
"""


def _fork_policy(scratch: Scratch, order: str, contended: bool) -> None:
    holder = scratch.cli_holder("r") if contended else None
    proc = scratch.spawn(
        [sys.executable, "-c", FORK_POLICY, str(scratch.work), order], env=scratch.env()
    )
    if holder is not None:
        # The parent takes it through the line: it keeps a place in it too.
        scratch.wait_waiters("r", 1)
        holder.release()
        assert holder.finish().returncode == 0
    proc.line("held")
    proc.line("child-nested")
    first, second = ("parent", "child") if order == "parent-first" else ("child", "parent")
    (scratch.work / f"{first}-leave").touch()
    proc.line(f"{first}-left")
    # One of the two has left; the other still holds it.
    busy = scratch.run("-n", "r", "--", "true")
    assert busy.returncode == 75, busy.stderr
    view = scratch.resource("r")
    if first == "child":
        # The child left: the taker's label is intact.
        assert view["holders"][0]["step"] == "parent"
        assert view["holders"][0]["pid"] == proc.pid
    (scratch.work / f"{second}-leave").touch()
    proc.line(f"{second}-left")
    # Both have left the block, both are alive: free, and nobody in line.
    free = scratch.run("-n", "r", "--", "true")
    assert free.returncode == 0, free.stderr
    assert scratch.resource("r")["waiters"] == []
    (scratch.work / "child-exit").touch()
    proc.line("child-status 0")
    assert proc.finish().returncode == 0


@pytest.mark.parametrize("contended", [False, True], ids=["uncontended", "through-the-line"])
def test_fork_policy_parent_leaves_first(scratch: Scratch, contended: bool) -> None:
    _fork_policy(scratch, "parent-first", contended)


@pytest.mark.parametrize("contended", [False, True], ids=["uncontended", "through-the-line"])
def test_fork_policy_child_leaves_first(scratch: Scratch, contended: bool) -> None:
    _fork_policy(scratch, "child-first", contended)


def test_a_forked_child_that_exits_normally_leaves_the_parent_holding(scratch: Scratch) -> None:
    # sys.exit in the child: SystemExit leaves the block there, and its
    # interpreter shuts down normally; it closes its copies only.
    script = (
        "import devlock, os, sys\n"
        "with devlock.lock('r', step='parent'):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        sys.exit(0)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    print('child', status, flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    proc = scratch.python(script)
    proc.line("child 0")
    view = scratch.resource("r")
    assert view["state"] == "held"
    assert (view["holders"][0]["step"], view["holders"][0]["pid"]) == ("parent", proc.pid)
    assert scratch.run("-n", "r", "--", "true").returncode == 75
    proc.release()
    assert proc.finish().returncode == 0
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_a_multiprocessing_fork_worker_passes_through(scratch: Scratch) -> None:
    script = (
        "import multiprocessing, devlock\n"
        "def work(n):\n"
        "    with devlock.lock('gpu:0', wait=False) as h:\n"
        "        return h.nested\n"
        "if __name__ == '__main__':\n"
        "    ctx = multiprocessing.get_context('fork')\n"
        "    with devlock.lock('gpu:0', step='pool'):\n"
        "        with ctx.Pool(2) as pool:\n"
        "            print(pool.map(work, range(4)), flush=True)\n"
        "        with ctx.Pool(1, maxtasksperchild=1) as pool:\n"
        "            print(pool.map(work, range(3)), flush=True)\n"
    )
    out = scratch.python(script).finish()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[True, True, True, True]", "[True, True, True]"]
    assert scratch.run("-n", "gpu:0", "--", "true").returncode == 0


def test_a_forked_child_that_closed_its_descriptors_does_not_pass_through(scratch: Scratch) -> None:
    script = (
        "import devlock, os\n"
        "with devlock.lock('r'):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.closerange(3, 1024)\n"
        "        try:\n"
        "            with devlock.lock('r', wait=False):\n"
        "                os._exit(1)\n"
        "        except devlock.Busy:\n"
        "            os._exit(0)\n"
        "    _, status = os.waitpid(pid, 0)\n"
        "    print('child', status, flush=True)\n"
    )
    out = scratch.python(script).finish()
    assert out.stdout.strip() == "child 0", out.stderr


def test_cuda_visible_devices_set_and_restored(scratch: Scratch, monkeypatch: pytest.MonkeyPatch) -> None:
    # A site policy that lets this job use GPUs 1, 3 and 7.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3,7")
    with devlock.lock("gpu:3", "gpu:1") as held:
        assert held.cuda_visible_devices == "1,3"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        with devlock.lock("gpu:1"):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
        # The same a devlock command gives its command.
        out = subprocess.run(
            [scratch.bin, "-n", "gpu:1", "gpu:3", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER"],
            env=scratch.env(), pass_fds=devlock.pass_fds(), capture_output=True, text=True, timeout=HANG,
        )
        assert out.stdout.split() == ["1,3", "PCI_BUS_ID"], out.stderr
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3,7"
    assert "CUDA_DEVICE_ORDER" not in os.environ
    with devlock.lock("gpu"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3,7"
    # A GPU outside the caller's set is refused, in the command line's words,
    # and --any skips the candidates outside it.
    with pytest.raises(devlock.UsageError) as caught:
        with devlock.lock("gpu:2"):
            pass
    cli = scratch.run("gpu:2", "--", "true")
    assert (cli.returncode, cli.stderr) == (2, f"devlock: {caught.value}\n")
    with devlock.lock("gpu:0", "gpu:2", "gpu:7", any=True) as picked:
        assert picked.resources == ("gpu:7",)
    with devlock.lock("other"):
        assert "CUDA_DEVICE_ORDER" not in os.environ


def test_cuda_already_initialised_warns_once(scratch: Scratch) -> None:
    script = (
        "import sys, types, warnings\n"
        "torch = types.ModuleType('torch')\n"
        "torch.cuda = types.SimpleNamespace(is_initialized=lambda: False)\n"
        "sys.modules['torch'] = torch\n"
        "import devlock\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    with devlock.lock('gpu:0'):\n"
        "        pass\n"
        "    print('before init', len(seen), flush=True)\n"
        "    torch.cuda.is_initialized = lambda: True\n"
        "    for _ in range(2):\n"
        "        with devlock.lock('gpu:0'):\n"
        "            pass\n"
        "    print('after init', len(seen), flush=True)\n"
        "    print(seen[0].category.__name__, seen[0].message, flush=True)\n"
    )
    out = scratch.python(script).finish()
    lines = out.stdout.splitlines()
    assert lines[:2] == ["before init 0", "after init 1"], out.stderr
    assert lines[2].startswith("RuntimeWarning devlock: torch has initialised CUDA; CUDA_VISIBLE_DEVICES=0")


def test_warnings_module_is_used() -> None:
    assert warnings
