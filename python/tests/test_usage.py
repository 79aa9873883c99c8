"""Usage records and ``idle_timeout=`` from Python, against the fake
nvidia-smi of the CLI's tests (scripted utilization: FAKE_GPU_DIR/util.N):
a block's record is the CLI's (``devlock report`` reads it), and an idle
block is warned and then stopped, raising IdleStopped, while its record
says "stopped: idle"."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict

import pytest

import devlock
from dlhelp import HANG, Scratch

FAKE = Path(__file__).resolve().parents[2] / "contrib" / "fake-gpu" / "nvidia-smi"


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state = tmp_path / "gpus"
    state.mkdir()
    (state / "gpus").write_text("0 81920\n")
    monkeypatch.setenv("DEVLOCK_NVIDIA_SMI", str(FAKE))
    monkeypatch.setenv("FAKE_GPU_DIR", str(state))
    monkeypatch.setenv("DEVLOCK_SAMPLE_EVERY", "200ms")
    # This interpreter uses 512 MiB on GPU 0 whenever a job of it runs (and
    # after: the blocks here let go at their end, release="block").
    (state / "use.py").write_text(f"0 {os.getpid()} 512\n")
    return state


def job(scratch: Scratch, step: str) -> Dict[str, Any]:
    out = scratch.run("report", "--json", "--since", "1d")
    assert out.returncode == 0, out.stderr
    jobs = [j for j in json.loads(out.stdout)["jobs"] if j["step"] == step]
    assert len(jobs) == 1, out.stdout
    found: Dict[str, Any] = jobs[0]
    return found


def test_a_blocks_record_is_the_clis(scratch: Scratch, gpu: Path) -> None:
    (gpu / "util.0").write_text("50\n")
    probes = gpu / "probes"
    probes.write_text("")
    with devlock.lock("gpu:0", step="py-train", release="block"):
        # Two whole probes (two queries each): the first sample is in.
        deadline = time.monotonic() + HANG
        while len(probes.read_text().splitlines()) < 4:
            assert time.monotonic() < deadline, "the holder never sampled"
            time.sleep(0.01)
    record = job(scratch, "py-train")
    assert record["from"] == "library"
    assert record["how"] == "released"
    assert record["ending"] == "recorded"
    assert record["resources"] == ["gpu:0"]
    assert record["peak_mib"] == 512
    assert record["busy_gpu_s"] > 0


def test_an_idle_block_is_warned_then_stopped(
    scratch: Scratch, gpu: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (gpu / "util.0").write_text("0\n")
    caplog.set_level(logging.WARNING, logger="devlock")
    deadline = time.monotonic() + HANG
    with pytest.raises(devlock.IdleStopped) as caught:
        with devlock.lock("gpu:0", step="py-idle", idle_timeout="1s", release="block"):
            while time.monotonic() < deadline:
                time.sleep(0.02)
    assert time.monotonic() < deadline, "never stopped"
    assert "stopping py-idle" in caught.value.message, caught.value.message
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("py-idle is idle" in m for m in warned), warned
    assert job(scratch, "py-idle")["how"] == "stopped: idle"


def test_idle_timeout_takes_the_clis_durations(scratch: Scratch, gpu: Path) -> None:
    with pytest.raises(devlock.UsageError):
        with devlock.lock("gpu:0", idle_timeout="soon"):
            pass
