"""Fixtures for the tests of the installed devlock wheel (helpers in dlhelp.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dlhelp import Scratch, need


@pytest.fixture(scope="session")
def devlock_bin() -> str:
    path = os.environ.get("DEVLOCK_BIN")
    if not path or not os.access(path, os.X_OK):
        need("the devlock binary", f"set DEVLOCK_BIN to target/debug/devlock (got {path!r})")
    return str(path)


@pytest.fixture(scope="session")
def flock_bin() -> str:
    path = shutil.which("flock")
    if path is None:
        need("util-linux flock", "install util-linux")
    return str(path)


@pytest.fixture
def scratch(tmp_path: Path, devlock_bin: str, monkeypatch: pytest.MonkeyPatch) -> Scratch:
    s = Scratch(tmp_path, devlock_bin)
    monkeypatch.setenv("DEVLOCK_DIR", str(s.dir))
    # Usage records of this test's holds, CLI and library, kept here.
    monkeypatch.setenv("DEVLOCK_USAGE_DIR", str(tmp_path / "usage"))
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    return s
