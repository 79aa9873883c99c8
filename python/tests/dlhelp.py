"""Helpers for the tests of the installed devlock wheel: a scratch directory
of our own, the real devlock binary (DEVLOCK_BIN, set by .ci/run to the
freshly built target/debug/devlock), holders and waiters in real processes,
and handshakes (a line, a file, a status) with a generous bound that only
fails on a hang."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

#: Upper bound for any handshake: fails only on a hang.
HANG = 60.0

REQUIRE_TOOLS = os.environ.get("DEVLOCK_TEST_REQUIRE_TOOLS") == "1"


def need(what: str, why: str) -> None:
    """A missing tool fails under DEVLOCK_TEST_REQUIRE_TOOLS=1, else skips, saying why."""
    message = f"{what} is missing: {why}"
    if REQUIRE_TOOLS:
        pytest.fail(message + " (DEVLOCK_TEST_REQUIRE_TOOLS=1)")
    pytest.skip(message)


def poll(what: str, fetch: Callable[[], Any], accept: Callable[[Any], bool]) -> Any:
    deadline = time.monotonic() + HANG
    while True:
        value = fetch()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; last: {value!r}")
        time.sleep(0.02)


def wait_file(path: Path) -> None:
    poll(f"{path}", path.exists, bool)


class Proc:
    """A child process whose stdout and stderr are read line by line (by a
    thread each, so that a process that says nothing fails the test after
    HANG instead of hanging it); stdin releases it."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.seen: List[str] = []
        self.seen_err: List[str] = []
        self._out = self._pump(popen.stdout)
        self._err = self._pump(popen.stderr)

    @staticmethod
    def _pump(stream: Any) -> "queue.Queue[Optional[str]]":
        lines: "queue.Queue[Optional[str]]" = queue.Queue()

        def pump() -> None:
            for line in stream:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        return lines

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _find(self, lines: "queue.Queue[Optional[str]]", seen: List[str], needle: str, what: str) -> str:
        deadline = time.monotonic() + HANG
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                lines.put(None)
                break
            seen.append(line)
            if needle in line:
                return line
        self.popen.kill()
        self.popen.wait()
        pytest.fail(f"no {what} line with {needle!r}; stdout {self.seen!r}, stderr {self.seen_err!r}")

    def line(self, needle: str) -> str:
        """Reads stdout lines until one contains ``needle``; fails on EOF or a hang."""
        return self._find(self._out, self.seen, needle, "stdout")

    def err_line(self, needle: str) -> str:
        """Reads stderr lines until one contains ``needle``; fails on EOF or a hang.
        What it read is part of ``finish()``'s stderr."""
        return self._find(self._err, self.seen_err, needle, "stderr")

    def release(self) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write("go\n")
        self.popen.stdin.flush()

    def _rest(self, lines: "queue.Queue[Optional[str]]", seen: List[str]) -> None:
        while True:
            try:
                line = lines.get(timeout=HANG)
            except queue.Empty:
                pytest.fail(f"process {self.popen.args!r} left its output open")
            if line is None:
                lines.put(None)
                return
            seen.append(line)

    def finish(self) -> subprocess.CompletedProcess:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.popen.wait(timeout=HANG)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            pytest.fail(f"process {self.popen.args!r} hung; stderr {self.seen_err!r}")
        self._rest(self._out, self.seen)
        self._rest(self._err, self.seen_err)
        return subprocess.CompletedProcess(
            self.popen.args, self.popen.returncode, "".join(self.seen), "".join(self.seen_err)
        )


class Scratch:
    """A scratch directory for one test, and the ways to use it."""

    def __init__(self, root: Path, bin: str) -> None:
        self.root = root
        self.dir = root / "locks"
        self.work = root / "work"
        self.work.mkdir()
        self.bin = bin

    def env(self, **extra: str) -> Dict[str, str]:
        env = dict(os.environ)
        env["DEVLOCK_DIR"] = str(self.dir)
        env.pop("NO_COLOR", None)
        env.update(extra)
        return env

    def run(self, *args: str, env: Optional[Dict[str, str]] = None, **kw: Any) -> subprocess.CompletedProcess:
        """``devlock ARGS`` run to completion."""
        return subprocess.run(
            [self.bin, *args],
            env=env if env is not None else self.env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=HANG,
            **kw,
        )

    def status(self, *resources: str) -> Dict[str, Any]:
        out = self.run("status", "--json", *resources)
        assert out.returncode == 0, out.stderr
        document: Dict[str, Any] = json.loads(out.stdout)
        return document

    def resource(self, name: str) -> Dict[str, Any]:
        view: Dict[str, Any] = self.status(name)["resources"][0]
        return view

    def wait_waiters(self, name: str, count: int) -> Dict[str, Any]:
        view: Dict[str, Any] = poll(
            f"{count} waiters of {name}",
            lambda: self.resource(name),
            lambda v: len(v["waiters"]) == count,
        )
        return view

    def spawn(self, argv: List[str], env: Optional[Dict[str, str]] = None) -> Proc:
        return Proc(
            subprocess.Popen(
                argv,
                env=env or self.env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )

    def cli_holder(self, *args: str) -> Proc:
        """``devlock ARGS -- sh -c 'echo ready; read x'``, once it holds."""
        proc = self.spawn([self.bin, *args, "--", "sh", "-c", "echo ready; read x"])
        proc.line("ready")
        return proc

    def cli_waiter(self, *args: str, script: str) -> Proc:
        """``devlock ARGS -- sh -c SCRIPT``, not waited for."""
        return self.spawn([self.bin, *args, "--", "sh", "-c", script])

    def python(self, script: str, **env: str) -> Proc:
        """The installed devlock in another interpreter: ``python -c SCRIPT``."""
        return self.spawn([sys.executable, "-c", script], env=self.env(**env))
