"""The block lets go when the device is free (``release="device"``, the
default): against the fake NVML of the CLI's tests (tests/fixtures/fake-nvml,
built here with cc; its process list scripted through FAKE_NVML_PROCESSES)
and the fake nvidia-smi (contrib/fake-gpu), each scripted to list this test
process on gpu:0 after the block ends. A CLI ``-n`` is busy and names the
kept hold; a CLI waiter is served once the fake stops listing the process;
``release="block"`` and a machine without a GPU source let go at the block's
end."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

import devlock
from dlhelp import Scratch, need

ROOT = Path(__file__).resolve().parents[2]
FAKE_SMI = ROOT / "contrib" / "fake-gpu" / "nvidia-smi"
FAKE_NVML = ROOT / "tests" / "fixtures" / "fake-nvml" / "fake_nvml.c"


class Gpu:
    """One fake GPU 0 whose process list the test writes: ``list(pid, mib)``
    makes the driver list ``pid`` there, ``unlist(pid)`` stops it."""

    def __init__(self, source: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.source = source
        self.root = root
        self.procs: Dict[int, int] = {}
        for var in ("DEVLOCK_NVIDIA_SMI", "DEVLOCK_NVML", "DEVLOCK_AMD_SMI", "FAKE_NVML_PROCESSES"):
            monkeypatch.delenv(var, raising=False)
        if source == "nvml":
            cc = shutil.which("cc")
            if cc is None:
                need("a C compiler (cc)", "the fake NVML is built at run time")
            library = root / "libnvidia-ml.so.1"
            subprocess.run(
                [str(cc), "-shared", "-fPIC", "-fvisibility=hidden", "-o", str(library), str(FAKE_NVML), "-lpthread"],
                check=True,
            )
            (root / "scenario").write_text("gpu 0 GPU-3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e60 81920 0 0 NVIDIA A100\n")
            monkeypatch.setenv("DEVLOCK_NVML", str(library))
            monkeypatch.setenv("FAKE_NVML_PROCESSES", str(root / "procs"))
        else:
            (root / "gpus").write_text("0 81920\n")
            monkeypatch.setenv("DEVLOCK_NVML", "none")
            monkeypatch.setenv("DEVLOCK_NVIDIA_SMI", str(FAKE_SMI))
            monkeypatch.setenv("FAKE_GPU_DIR", str(root))

    def _write(self) -> None:
        if self.source == "nvml":
            text = "".join(f"0 {pid} {mib}\n" for pid, mib in self.procs.items())
            tmp = self.root / ".procs"
            tmp.write_text(text)
            tmp.rename(self.root / "procs")
            return
        for f in self.root.glob("use.*"):
            f.unlink()
        for pid, mib in self.procs.items():
            tmp = self.root / f".use.{pid}"
            tmp.write_text(f"0 {pid} {mib}\n")
            tmp.rename(self.root / f"use.{pid}")

    def list(self, pid: int, mib: int) -> None:
        self.procs[pid] = mib
        self._write()

    def unlist(self, pid: int) -> None:
        self.procs.pop(pid, None)
        self._write()


@pytest.fixture(params=["nvml", "nvidia-smi"])
def gpu(request: pytest.FixtureRequest, scratch: Scratch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Gpu:
    root = tmp_path / "gpu"
    root.mkdir()
    return Gpu(request.param, root, monkeypatch)


def end_lines(scratch: Scratch) -> List[Dict[str, Any]]:
    lines = []
    for f in (scratch.root / "usage").glob("*.jsonl"):
        for text in f.read_text().splitlines():
            line = json.loads(text)
            if line.get("event") == "end":
                lines.append(line)
    return lines


def test_a_block_whose_process_still_uses_the_gpu_is_kept_until_the_driver_stops_listing_it(
    scratch: Scratch, gpu: Gpu, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="devlock")
    me = os.getpid()
    with devlock.lock("gpu:0", step="py-kept"):
        # CUDA's context and cached memory outlive the block.
        gpu.list(me, 512)
    kept = [r.getMessage() for r in caplog.records if "kept after the block" in r.getMessage()]
    assert len(kept) == 1, kept
    assert "512 MiB on gpu:0" in kept[0] and "torch.cuda.empty_cache()" in kept[0], kept[0]
    # Another user's -n: busy, naming the kept hold in one phrase.
    out = scratch.run("-n", "gpu:0", "--", "true")
    assert out.returncode == 75, out.stderr
    assert out.stderr.startswith(f"devlock: gpu:0 is busy: held by py-kept (pid {me}, "), out.stderr
    assert "): block ended " in out.stderr and " ago, still 512 MiB on gpu:0" in out.stderr, out.stderr
    holder = scratch.resource("gpu:0")["holders"][0]
    assert (holder["pid"], holder["kept_mib"], holder["kept_gpu"]) == (me, 512, 0), holder
    assert "idle_for_ms" in holder, "a kept hold counts as idle"
    table = scratch.run("status").stdout
    assert "py-kept (kept: block ended" in table, table
    # A Busy from Python (another interpreter) says the same.
    other = scratch.python(
        "import devlock\n"
        "try:\n"
        "    with devlock.lock('gpu:0', wait=False): pass\n"
        "except devlock.Busy as e:\n"
        "    print('busy', e.holder.pid, e.message)\n"
    )
    line = other.line("busy")
    assert line.startswith(f"busy {me} gpu:0 is busy: held by py-kept (pid {me}, "), line
    assert "still 512 MiB on gpu:0" in line, line
    assert other.finish().returncode == 0
    # A CLI waiter in line is served once the driver no longer lists us.
    waiter = scratch.cli_waiter("gpu:0", script="echo got")
    scratch.wait_waiters("gpu:0", 1)
    gpu.unlist(me)
    waiter.line("got")
    assert waiter.finish().returncode == 0
    ends = [e for e in end_lines(scratch) if "block_end_ms" in e]
    assert len(ends) == 1 and ends[0]["end_ms"] >= ends[0]["block_end_ms"], ends


def test_a_child_started_inside_the_block_keeps_it_until_it_is_gone(scratch: Scratch, gpu: Gpu) -> None:
    with devlock.lock("gpu:0", step="py-child"):
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        gpu.list(child.pid, 300)
    out = scratch.run("-n", "gpu:0", "--", "true")
    assert out.returncode == 75 and "still 300 MiB on gpu:0" in out.stderr, out.stderr
    waiter = scratch.cli_waiter("gpu:0", script="echo got")
    scratch.wait_waiters("gpu:0", 1)
    # Listed still, but no longer a process this one started: it is gone.
    assert child.stdin is not None
    child.stdin.close()
    child.wait()
    waiter.line("got")
    assert waiter.finish().returncode == 0


def test_a_later_block_of_the_process_runs_inside_a_kept_hold(scratch: Scratch, gpu: Gpu) -> None:
    me = os.getpid()
    with devlock.lock("gpu:0", step="py-first"):
        gpu.list(me, 512)
    assert scratch.run("-n", "gpu:0", "--", "true").returncode == 75
    # Taking it again would wait for this very process: it takes it back.
    with devlock.lock("gpu:0", wait=False, step="py-again") as again:
        assert again.cuda_visible_devices == "0"
        holder = scratch.resource("gpu:0")["holders"][0]
        assert holder["pid"] == me and "kept_mib" not in holder, holder
    assert scratch.run("-n", "gpu:0", "--", "true").returncode == 75
    waiter = scratch.cli_waiter("gpu:0", script="echo got")
    scratch.wait_waiters("gpu:0", 1)
    gpu.unlist(me)
    waiter.line("got")
    assert waiter.finish().returncode == 0


def test_the_idle_policy_lets_a_kept_hold_go_and_stops_nothing(
    scratch: Scratch, gpu: Gpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVLOCK_SAMPLE_EVERY", "100ms")
    me = os.getpid()
    with devlock.lock("gpu:0", step="py-idle-kept", idle_timeout="1s"):
        gpu.list(me, 512)
    waiter = scratch.cli_waiter("gpu:0", script="echo got")
    scratch.wait_waiters("gpu:0", 1)
    # Still listed: the idle policy (1 s, then 1 s of grace) lets it go; no
    # SIGINT reaches this thread (the block is over, there is nothing to stop).
    waiter.line("got")
    assert waiter.finish().returncode == 0
    ends = [e for e in end_lines(scratch) if "block_end_ms" in e]
    assert len(ends) == 1 and ends[0]["how"] == "idle", ends


def test_release_block_lets_go_at_the_blocks_end(scratch: Scratch, gpu: Gpu) -> None:
    with devlock.lock("gpu:0", release="block"):
        gpu.list(os.getpid(), 512)
    out = scratch.run("-n", "gpu:0", "--", "true")
    assert out.returncode == 0, out.stderr
    with pytest.raises(devlock.UsageError):
        devlock.lock("gpu:0", release="thread")  # type: ignore[arg-type]


def test_a_free_device_is_let_go_at_the_blocks_end(scratch: Scratch, gpu: Gpu) -> None:
    with devlock.lock("gpu:0"):
        gpu.list(os.getpid(), 512)
        gpu.unlist(os.getpid())
    assert scratch.run("-n", "gpu:0", "--", "true").returncode == 0


def test_without_a_gpu_source_the_block_lets_go_at_its_end(
    scratch: Scratch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The fake nvidia-smi lists this process, but nothing asks it: no NVML,
    # no nvidia-smi or amd-smi on the path.
    gpu = Gpu("nvidia-smi", tmp_path, monkeypatch)
    monkeypatch.delenv("DEVLOCK_NVIDIA_SMI")
    true = shutil.which("true") or "/bin/true"
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    if Path("/sys/module/amdgpu").exists() or Path("/sys/module/nvidia").exists():
        pytest.skip("this machine has a GPU driver: it is a GPU source")
    caplog.set_level(logging.WARNING, logger="devlock")
    with devlock.lock("gpu:0"):
        gpu.list(os.getpid(), 512)
    assert scratch.run("-n", "gpu:0", "--", true).returncode == 0
    assert not [r for r in caplog.records if "kept" in r.getMessage()]
