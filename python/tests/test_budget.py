"""``mem=``: the CLI's ``--mem`` from Python, with the same fake nvidia-smi
as tests/devlock/budgets.rs (DEVLOCK_NVIDIA_SMI; a process "allocates" by
writing a file naming its pid): admission beside CLI budgets and refusal
with the figures, the whole device either way, status, the environment,
staggered start, the over-budget record, mem_strict, any=, and every
failure in the CLI's words."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest

import devlock
from dlhelp import HANG, Scratch, poll

GIB = 1024
FAKE = Path(__file__).resolve().parents[2] / "contrib" / "fake-gpu" / "nvidia-smi"


class Gpus:
    """A fake GPU state (FAKE_GPU_DIR) for this process and the CLI it starts.
    A process listed here stays listed after its block: blocks that must let
    go at their end say release="block" (see test_device_free.py)."""

    def __init__(self, state: Path) -> None:
        self.state = state

    def use(self, tag: str, gpu: int, pid: int, mib: int) -> None:
        """Process ``pid`` uses ``mib`` on GPU ``gpu`` from now on."""
        tmp = self.state / f".{tag}.tmp"
        tmp.write_text(f"{gpu} {pid} {mib}\n")
        tmp.rename(self.state / f"use.{tag}")

    def alloc_script(self, tag: str, gpu: int, mib: int) -> str:
        """A CLI job's ``sh -c`` that uses ``mib``, says ready, and holds until stdin."""
        return f"echo {gpu} $$ {mib} > {self.state}/use.{tag}; echo \"ready $DEVLOCK_MEM_MIB\"; read x"


@pytest.fixture
def gpus(scratch: Scratch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Gpus:
    state = tmp_path / "gpus"
    state.mkdir()
    (state / "gpus").write_text(f"0 {80 * GIB}\n1 {80 * GIB}\n")
    monkeypatch.setenv("DEVLOCK_NVIDIA_SMI", str(FAKE))
    monkeypatch.setenv("FAKE_GPU_DIR", str(state))
    for var in ("DEVLOCK_MEM_MIB", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(var, raising=False)
    return Gpus(state)


def holders(scratch: Scratch, name: str = "gpu:0") -> List[Dict[str, Any]]:
    found: List[Dict[str, Any]] = scratch.resource(name)["holders"]
    return found


def settled(scratch: Scratch, count: int) -> List[Dict[str, Any]]:
    """Status once ``count`` budget holders are there, none starting."""
    found: List[Dict[str, Any]] = poll(
        f"{count} settled budget holders",
        lambda: holders(scratch),
        lambda hs: len(hs) == count and all(h.get("starting") is False for h in hs),
    )
    return found


PY_HOLDER = r"""
import os, sys, devlock
with devlock.lock("gpu:0", mem="20GiB", settle=0.2, step="py-eval", release="block") as held:
    with open(os.environ["FAKE_GPU_DIR"] + "/use.py", "w") as f:
        f.write(f"0 {os.getpid()} {20 * 1024}\n")
    print("ready", held.mem_mib, os.environ["DEVLOCK_MEM_MIB"], flush=True)
    sys.stdin.readline()
"""


def test_a_python_and_a_cli_budget_share_a_device_and_a_third_is_busy_with_figures(
    scratch: Scratch, gpus: Gpus
) -> None:
    # Two interpreters side by side (a budget holder's use counts its whole
    # process tree, so the CLI job is not started from inside the block).
    py = scratch.python(PY_HOLDER)
    assert py.line("ready") == f"ready {20 * GIB} {20 * GIB}\n"
    cli = scratch.spawn(
        [scratch.bin, "--step", "cli-eval", "--mem", "20GiB", "--settle", "0.2s", "gpu:0", "--", "sh", "-c",
         gpus.alloc_script("cli", 0, 20 * GIB)]
    )
    assert cli.line("ready") == f"ready {20 * GIB}\n"
    hs = settled(scratch, 2)
    by_step = {h["step"]: h for h in hs}
    mine = by_step["py-eval"]
    assert (mine["pid"], mine["mem_mib"], mine["used_mib"], mine["over_budget"]) == (
        py.pid, 20 * GIB, 20 * GIB, False
    )
    assert by_step["cli-eval"]["mem_mib"] == 20 * GIB
    view = scratch.resource("gpu:0")
    assert view["memory"]["budgets_mib"] == 40 * GIB, view
    # A third, 40 GiB (40 + 40 + 2 > 80): refused from Python and the CLI alike.
    with pytest.raises(devlock.Busy) as caught:
        with devlock.lock("gpu:0", mem="40GiB", wait=False):
            pass
    busy = caught.value
    assert busy.resource == "gpu:0" and busy.exit_code == 75
    assert busy.holder.step in ("py-eval", "cli-eval"), busy.holder
    message = str(busy)
    assert message.startswith("no room for this budget on gpu:0: 40 GiB of 80 GiB budgeted ("), message
    assert "py-eval 20 GiB" in message and "cli-eval 20 GiB" in message, message
    assert message.endswith("0 MiB outside the gate; 40 GiB asked, 2 GiB headroom"), message
    out = scratch.run("-n", "--mem", "40GiB", "gpu:0", "--", "true")
    assert out.returncode == 75
    assert out.stderr == f"devlock: {message}\n"
    # The refusal left no place in line behind; 10 GiB still fit.
    assert scratch.resource("gpu:0")["waiters"] == []
    with devlock.lock("gpu:0", mem="10GiB", wait=False, release="block") as third:
        assert third.mem_mib == 10 * GIB
    for proc in (cli, py):
        proc.release()
        assert proc.finish().returncode == 0
    assert holders(scratch) == []
    assert scratch.run("-n", "gpu:0", "--", "true").returncode == 0


def test_the_python_holder_is_starting_until_its_memory_settles(scratch: Scratch, gpus: Gpus) -> None:
    # settle= far beyond the handshake bound: only the memory can settle it.
    with devlock.lock("gpu:0", mem="10GiB", settle=10 * HANG, step="py-start", release="block"):
        (mine,) = holders(scratch)
        assert mine["starting"] is True and mine["mem_mib"] == 10 * GIB
        out = scratch.run("-n", "--mem", "1GiB", "gpu:0", "--", "true")
        assert out.returncode == 75
        assert out.stderr.startswith(f"devlock: gpu:0 is busy: py-start (pid {os.getpid()}, "), out.stderr
        assert "is starting under its 10 GiB budget" in out.stderr, out.stderr
        gpus.use("py", 0, os.getpid(), 8 * GIB)
        (mine,) = settled(scratch, 1)
        assert mine["used_mib"] == 8 * GIB
        assert scratch.run("-n", "--mem", "1GiB", "gpu:0", "--", "true").returncode == 0


def test_a_cli_budget_waits_behind_a_python_whole_device_holder(scratch: Scratch, gpus: Gpus) -> None:
    with devlock.lock("gpu:0", step="py-whole"):
        waiter = scratch.cli_waiter("--mem", "10GiB", "gpu:0", script='echo "ready $DEVLOCK_MEM_MIB"; read x')
        view = scratch.wait_waiters("gpu:0", 1)
        assert view["waiters"][0]["mem_mib"] == 10 * GIB
        assert view["holders"][0]["step"] == "py-whole"
    assert waiter.line("ready") == f"ready {10 * GIB}\n"
    waiter.release()
    assert waiter.finish().returncode == 0


def test_a_python_budget_waits_behind_a_cli_whole_device_holder(scratch: Scratch, gpus: Gpus) -> None:
    holder = scratch.cli_holder("--step", "cli-whole", "gpu:0")
    got: List[Any] = []

    def take() -> None:
        with devlock.lock("gpu:0", mem="10GiB", settle=0.2, step="py-waiter") as held:
            got.append((held.mem_mib, [h["step"] for h in holders(scratch)]))

    thread = threading.Thread(target=take)
    thread.start()
    view = scratch.wait_waiters("gpu:0", 1)
    assert (view["waiters"][0]["step"], view["waiters"][0]["mem_mib"]) == ("py-waiter", 10 * GIB)
    assert not got
    holder.release()
    assert holder.finish().returncode == 0
    thread.join(HANG)
    assert got == [(10 * GIB, ["py-waiter"])]


def test_a_cli_whole_device_waiter_behind_a_python_budget(scratch: Scratch, gpus: Gpus) -> None:
    with devlock.lock("gpu:0", mem="10GiB", settle=0.2, step="py-budget"):
        waiter = scratch.cli_waiter("gpu:0", script="echo ready; read x")
        scratch.wait_waiters("gpu:0", 1)
        # Still held: the whole device waits for the budget to be let go.
        assert [h["step"] for h in holders(scratch)] == ["py-budget"]
    waiter.line("ready")
    waiter.release()
    assert waiter.finish().returncode == 0


def test_the_budget_env_is_set_for_the_block_and_restored(
    scratch: Scratch, gpus: Gpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    with devlock.lock("gpu:0", mem="20GiB", settle=0.2):
        assert os.environ["DEVLOCK_MEM_MIB"] == str(20 * GIB)
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
        # A child started inside sees them too.
        out = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ['DEVLOCK_MEM_MIB'])"],
            capture_output=True, text=True, timeout=HANG,
        )
        assert out.stdout == f"{20 * GIB}\n"
    for var in ("DEVLOCK_MEM_MIB", "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES"):
        assert var not in os.environ, var
    # The caller's own fraction is kept, and an outer value comes back.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    monkeypatch.setenv("DEVLOCK_MEM_MIB", "7")
    with devlock.lock("gpu:0", mem=4096, settle=0.2) as held:
        assert held.mem_mib == 4096
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
        assert os.environ["DEVLOCK_MEM_MIB"] == "4096"
    assert (os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"], os.environ["DEVLOCK_MEM_MIB"]) == ("0.9", "7")
    # Nested inside a budget: passes through, no budget of its own.
    with devlock.lock("gpu:0", mem="20GiB", settle=0.2):
        with devlock.lock("gpu:0", mem="20GiB") as inner:
            assert inner.nested and inner.mem_mib is None
        assert os.environ["DEVLOCK_MEM_MIB"] == str(20 * GIB)


USAGE = [
    # (keywords, resources, the CLI's flags for the same)
    (dict(mem="0"), ["gpu:0"], ["--mem", "0"]),
    (dict(mem="20XB"), ["gpu:0"], ["--mem", "20XB"]),
    (dict(mem="lots"), ["gpu:0"], ["--mem", "lots"]),
    (dict(mem="20GiB", mem_headroom="x"), ["gpu:0"], ["--mem", "20GiB", "--mem-headroom", "x"]),
    (dict(mem="20GiB"), ["gpu"], ["--mem", "20GiB"]),
    (dict(mem="20GiB"), ["scratch"], ["--mem", "20GiB"]),
    (dict(mem="20GiB", shared=True), ["gpu:0"], ["--mem", "20GiB", "--shared"]),
    (dict(mem="20GiB", slots=2), ["gpu:0"], ["--mem", "20GiB", "--slots", "2"]),
    (dict(mem="20GiB"), ["gpu:0", "gpu:1"], ["--mem", "20GiB"]),
    (dict(mem="20GiB", any=True, count=2), ["gpu:0", "gpu:1"], ["--mem", "20GiB", "--any", "--count", "2"]),
    (dict(settle=1), ["gpu:0"], ["--settle", "1"]),
    (dict(mem_headroom="1GiB"), ["gpu:0"], ["--mem-headroom", "1GiB"]),
    (dict(mem_strict=True), ["gpu:0"], ["--mem-strict"]),
    (dict(mem="79GiB"), ["gpu:0"], ["--mem", "79GiB"]),
]


@pytest.mark.parametrize("keywords,resources,flags", USAGE)
def test_usage_errors_are_the_clis_rules_in_pythons_words(
    scratch: Scratch, gpus: Gpus, keywords: Dict[str, Any], resources: List[str], flags: List[str]
) -> None:
    with pytest.raises(devlock.UsageError) as caught:
        with devlock.lock(*resources, **keywords):
            pass
    assert caught.value.exit_code == 2
    message = str(caught.value)
    # The rule the command line applies, said with the keywords the caller
    # wrote (mem=, mem_headroom=, shared=True), never with its flags.
    assert "--" not in message, message
    assert any(k in message for k in keywords), (keywords, message)
    out = scratch.run(*flags, *resources, "--", "true")
    assert out.returncode == 2, out.stderr
    assert flags[0] in out.stderr, out.stderr


def test_memory_unknown_is_device_unknown_as_the_clis_exit_69(scratch: Scratch, gpus: Gpus) -> None:
    (gpus.state / "fail").touch()
    with pytest.raises(devlock.DeviceUnknown) as caught:
        with devlock.lock("gpu:0", mem="20GiB"):
            pass
    err = caught.value
    assert isinstance(err, devlock.Error) and err.exit_code == 69
    out = scratch.run("--mem", "20GiB", "gpu:0", "--", "true")
    assert out.returncode == 69
    # The command line's sentence, with the keyword for its flag.
    assert str(err).startswith("mem needs gpu:0's memory"), str(err)
    assert out.stderr == "devlock: --mem" + str(err).removeprefix("mem") + "\n"
    # A GPU the probe does not list: the same.
    (gpus.state / "fail").unlink()
    with pytest.raises(devlock.DeviceUnknown):
        with devlock.lock("gpu:7", mem="20GiB"):
            pass


def test_any_takes_the_first_candidate_with_room(scratch: Scratch, gpus: Gpus) -> None:
    # 70 GiB of gpu:0 used outside the gate, by a process that is not ours.
    outsider = subprocess.Popen(["sleep", str(10 * HANG)])
    try:
        gpus.use("outsider", 0, outsider.pid, 70 * GIB)
        with devlock.lock("gpu:0", "gpu:1", any=True, mem="20GiB", settle=0.2) as held:
            assert held.resources == ("gpu:1",) and held.mem_mib == 20 * GIB
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
            assert holders(scratch, "gpu:1")[0]["mem_mib"] == 20 * GIB
            poll("settled", lambda: holders(scratch, "gpu:1"), lambda hs: hs[0].get("starting") is False)
            # Another process (in this block's thread it would pass through),
            # without the block's CUDA_VISIBLE_DEVICES=1.
            env = scratch.env()
            env.pop("CUDA_VISIBLE_DEVICES")
            other = scratch.spawn(
                [sys.executable, "-c",
                 "import devlock\n"
                 "try:\n"
                 "    with devlock.lock('gpu:0', 'gpu:1', any=True, mem='60GiB', wait=False): pass\n"
                 "except devlock.Busy as e:\n"
                 "    print('busy', e.resource, '|', e, flush=True)\n"],
                env=env,
            )
            line = other.line("busy")
            assert other.finish().returncode == 0
            assert line.startswith("busy gpu:0 gpu:1 | no room for this budget on gpu:0: 0 MiB of 80 GiB budgeted, "
                                   "70 GiB outside the gate"), line
            assert "gpu:1: 20 GiB of 80 GiB budgeted" in line, line
            busy = line.split(" | ", 1)[1].rstrip("\n")
            out = scratch.run("-n", "--any", "--mem", "60GiB", "gpu:0", "gpu:1", "--", "true", env=env)
            assert out.stderr == f"devlock: {busy}\n"
    finally:
        outsider.kill()
        outsider.wait()


def test_over_budget_is_one_logging_record_and_marked_in_status(
    scratch: Scratch, gpus: Gpus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="devlock")
    with devlock.lock("gpu:0", mem="1GiB", settle=0.2, step="py-greedy", release="block"):
        gpus.use("py", 0, os.getpid(), 4 * GIB)
        poll("the holder marked over budget", lambda: holders(scratch)[0], lambda h: h.get("over_budget") is True)
        records = poll(
            "the over-budget record",
            lambda: [r for r in caplog.records if r.name == "devlock"],
            lambda rs: len(rs) >= 1,
        )
        # Measured again since (a second sample), still one record.
        poll("another sample", lambda: holders(scratch)[0], lambda h: h.get("used_mib") == 4 * GIB)
    records = [r for r in caplog.records if r.name == "devlock"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING
    assert records[0].getMessage() == (
        "warning: gpu:0: py-greedy uses 4 GiB of its 1 GiB budget "
        "(over budget: other jobs on the device may run out of memory)"
    )


STRICT = r"""
import os, sys, time, devlock
state = os.environ["FAKE_GPU_DIR"]
try:
    with devlock.lock("gpu:0", mem="1GiB", settle=0.3, mem_strict=True, step="py-strict", release="block"):
        with open(state + "/use.py", "w") as f:
            f.write(f"0 {os.getpid()} 4096\n")
        print("ready", flush=True)
        time.sleep(600)
        print("not stopped", flush=True)
except devlock.OverBudget as e:
    print("stopped:", isinstance(e, KeyboardInterrupt), e, flush=True)
with devlock.lock("gpu:0", wait=False):
    print("free after", flush=True)
"""


def test_mem_strict_stops_the_block_as_ctrl_c_does_with_over_budget(scratch: Scratch, gpus: Gpus) -> None:
    proc = scratch.python(STRICT)
    proc.line("ready")
    line = proc.line("stopped:")
    assert line.startswith("stopped: True --mem-strict: gpu:0: stopping py-strict: over budget (4 GiB of 1 GiB)"), line
    proc.line("free after")
    done = proc.finish()
    assert done.returncode == 0, done.stderr
    assert "not stopped" not in done.stdout
    # The logging records, on stderr by logging's last resort: said once each.
    assert done.stderr.count("over budget: other jobs") == 1, done.stderr
    assert done.stderr.count("--mem-strict: gpu:0: stopping py-strict") == 1, done.stderr


def test_a_budget_wait_is_left_at_once_on_ctrl_c(scratch: Scratch, gpus: Gpus) -> None:
    holder = scratch.spawn(
        [scratch.bin, "--step", "big", "--mem", "70GiB", "--settle", "0.1s", "gpu:0", "--", "sh", "-c",
         "echo ready; read x"]
    )
    holder.line("ready")
    settled(scratch, 1)
    waiter = scratch.python(
        "import devlock\n"
        "try:\n"
        "    with devlock.lock('gpu:0', mem='20GiB', step='py-wait'):\n"
        "        print('got', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
    )
    scratch.wait_waiters("gpu:0", 1)
    waiter.popen.send_signal(2)
    waiter.line("interrupted")
    assert waiter.finish().returncode == 0
    assert scratch.resource("gpu:0")["waiters"] == []
    holder.release()
    assert holder.finish().returncode == 0


def test_a_budget_wait_and_its_timeout_give_the_clis_figures(
    scratch: Scratch, gpus: Gpus, caplog: pytest.LogCaptureFixture
) -> None:
    holder = scratch.spawn(
        [scratch.bin, "--step", "big", "--mem", "70GiB", "--settle", "0.1s", "gpu:0", "--", "sh", "-c",
         "echo ready; read x"]
    )
    holder.line("ready")
    settled(scratch, 1)
    figures = "gpu:0: 70 GiB of 80 GiB budgeted (big 70 GiB), 0 MiB outside the gate; 20 GiB asked, 2 GiB headroom"
    caplog.set_level(logging.INFO, logger="devlock")
    with pytest.raises(devlock.Timeout) as caught:
        with devlock.lock("gpu:0", mem="20GiB", timeout=0.5, report_every=0.1, step="py-small"):
            pass
    assert str(caught.value) == f"timed out after 500ms waiting for {figures}", str(caught.value)
    out = scratch.run("-w", "0.5", "--mem", "20GiB", "gpu:0", "--", "true")
    assert out.returncode == 75
    assert out.stderr.splitlines()[-1] == f"devlock: {caught.value} (true)", out.stderr
    waiting = [r.getMessage() for r in caplog.records if r.name == "devlock" and "waiting" in r.getMessage()]
    assert waiting and all(figures.split(": ", 1)[1] in m for m in waiting), waiting
    holder.release()
    assert holder.finish().returncode == 0
