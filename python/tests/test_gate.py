"""One gate for the CLI and Python: exclusion both ways, one line in arrival
order, holders named either way, util-linux flock, the status document,
and the kernel's release on every death of the interpreter."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import devlock
from dlhelp import HANG, Scratch, poll


def test_the_tests_use_the_installed_wheel() -> None:
    here = Path(__file__).resolve().parent.parent
    assert here not in Path(devlock.__file__).resolve().parents, devlock.__file__
    assert "site-packages" in devlock.__file__


def test_a_python_holder_excludes_the_cli_and_is_named_by_it(scratch: Scratch) -> None:
    with devlock.lock("gpu", step="notebook-eval") as held:
        assert held.resources == ("gpu",) and not held.nested
        out = scratch.run("-n", "gpu", "--", "true")
        assert out.returncode == 75
        assert out.stderr.startswith(
            f"devlock: gpu is busy: held by notebook-eval (pid {os.getpid()}, "
        ), out.stderr
        view = scratch.resource("gpu")
        holder = view["holders"][0]
        assert (view["state"], holder["step"], holder["pid"]) == ("held", "notebook-eval", os.getpid())
        assert holder["user"] and holder["source"] == "record"
    assert scratch.run("-n", "gpu", "--", "true").returncode == 0
    assert scratch.resource("gpu")["state"] == "free"


def test_a_cli_holder_excludes_python_and_busy_names_it(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "ns-train", "gpu")
    with pytest.raises(devlock.Busy) as caught:
        with devlock.lock("gpu", wait=False):
            pass
    busy = caught.value
    assert not isinstance(busy, devlock.Timeout)
    assert busy.resource == "gpu" and busy.exit_code == 75
    assert busy.holder.step == "ns-train" and busy.holder.pid == holder.pid
    assert busy.holder.user == scratch.resource("gpu")["holders"][0]["user"]
    assert str(busy).startswith(f"gpu is busy: held by ns-train (pid {holder.pid}, ")
    # Word for word what devlock -n says (how long it has been held aside).
    cli = scratch.run("-n", "gpu", "--", "true")
    assert cli.returncode == 75
    held_for = lambda text: re.sub(r" for \d+s$", " for Ns", text.strip())
    assert held_for(f"devlock: {busy}") == held_for(cli.stderr), (str(busy), cli.stderr)
    # A failing wait=False never holds a place in line.
    assert scratch.resource("gpu")["waiters"] == []
    # devlock.status() shows the CLI holder as status --json does.
    seen = devlock.status("gpu", probe_timeout=None)["resources"][0]["holders"][0]
    assert (seen["step"], seen["pid"], seen["user"]) == ("ns-train", holder.pid, busy.holder.user)
    holder.release()
    assert holder.finish().returncode == 0
    with devlock.lock("gpu", wait=False):
        pass


def test_cli_and_python_waiters_are_served_in_arrival_order(scratch: Scratch) -> None:
    order = scratch.work / "order"
    first = scratch.cli_holder("--step", "first", "r")
    waiters = []
    for n, kind in enumerate(["cli", "python", "cli", "python"]):
        tag = f"{kind}{n}"
        if kind == "cli":
            proc = scratch.cli_waiter("-q", "--step", tag, "r", script=f"echo {tag} >> {order}")
        else:
            proc = scratch.python(
                "import devlock\n"
                f"with devlock.lock('r', step='{tag}'):\n"
                f"    open({str(order)!r}, 'a').write('{tag}\\n')\n"
            )
        waiters.append((tag, proc))
        view = scratch.wait_waiters("r", n + 1)
        assert view["waiters"][n]["step"] == tag
        assert view["waiters"][n]["pid"] == proc.pid
    first.release()
    for tag, proc in waiters:
        done = proc.finish()
        assert done.returncode == 0, (tag, done.stderr)
    assert order.read_text().split() == ["cli0", "python1", "cli2", "python3"]


def test_status_shows_a_python_waiter_with_step_pid_and_user(scratch: Scratch) -> None:
    holder = scratch.cli_holder("--step", "cli-holder", "r")
    waiter = scratch.python(
        "import devlock\nwith devlock.lock('r', step='py-waiter'):\n    print('got', flush=True)\n"
    )
    view = scratch.wait_waiters("r", 1)
    w = view["waiters"][0]
    assert (w["step"], w["pid"], w["source"]) == ("py-waiter", waiter.pid, "registration")
    assert w["user"] == view["holders"][0]["user"]
    table = scratch.run("status").stdout
    assert "py-waiter" in table and str(waiter.pid) in table
    holder.release()
    waiter.line("got")
    assert waiter.finish().returncode == 0


def test_util_linux_flock_joins_the_gate(scratch: Scratch, flock_bin: str) -> None:
    with devlock.lock("r"):
        out = subprocess.run(
            [flock_bin, "-n", str(scratch.dir / "r.lock"), "true"], timeout=HANG
        )
        assert out.returncode == 1
    holder = scratch.spawn([flock_bin, str(scratch.dir / "r.lock"), "sh", "-c", "echo ready; read x"])
    holder.line("ready")
    with pytest.raises(devlock.Busy) as caught:
        with devlock.lock("r", wait=False):
            pass
    assert caught.value.holder.pid == holder.pid
    assert caught.value.holder.step is None
    holder.release()
    assert holder.finish().returncode == 0


def test_status_is_the_document_of_status_json(scratch: Scratch) -> None:
    with devlock.lock("gpu:1", step="s"):
        ours = devlock.status()
        cli = scratch.status()
        assert ours.keys() == cli.keys()
        assert ours["dir"] == cli["dir"] == str(scratch.dir)
        assert ours["trust"] == cli["trust"]
        assert ours["device_info"] == cli["device_info"]
        assert "device_info" not in devlock.status(probe_timeout=None)

        def shape(doc):
            return [
                (r["name"], r["state"], [(h["step"], h["pid"], h["user"], h["via"] if "via" in h else None) for h in r["holders"]])
                for r in doc["resources"]
            ]

        assert shape(ours) == shape(cli) == [
            ("gpu", "shared", [("s", os.getpid(), cli["resources"][0]["holders"][0]["user"], "gpu:1")]),
            ("gpu:1", "held", [("s", os.getpid(), cli["resources"][0]["holders"][0]["user"], None)]),
        ]
        assert devlock.status("gpu:1", probe_timeout=None)["resources"][0]["name"] == "gpu:1"
    with pytest.raises(devlock.UsageError):
        devlock.status("-bad")


@pytest.mark.parametrize(
    "ending",
    ["raise RuntimeError('boom')", "sys.exit(3)", "os._exit(4)", "os.kill(os.getpid(), signal.SIGKILL)"],
)
def test_any_death_of_the_interpreter_releases_at_once(scratch: Scratch, ending: str) -> None:
    proc = scratch.python(
        "import devlock, os, signal, sys\n"
        "with devlock.lock('r', step='dying'):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.readline()\n"
        f"    {ending}\n"
    )
    proc.line("held")
    assert scratch.run("-n", "r", "--", "true").returncode == 75
    proc.release()
    done = proc.finish()
    assert done.returncode != 0
    # No retry, no wait: free the moment the interpreter is gone.
    out = scratch.run("-n", "r", "--", "true")
    assert out.returncode == 0, out.stderr


def test_kill_9_of_a_holding_interpreter_frees_it(scratch: Scratch) -> None:
    proc = scratch.python(
        "import devlock, sys\n"
        "with devlock.lock('gpu:0', step='killed'):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    proc.line("held")
    waiter = scratch.cli_waiter("-q", "gpu:0", script="echo got")
    scratch.wait_waiters("gpu:0", 1)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.finish().returncode == -signal.SIGKILL
    got = waiter.finish()
    assert got.returncode == 0 and got.stdout.strip() == "got"


def test_an_exception_leaving_the_block_releases_in_process(scratch: Scratch) -> None:
    with pytest.raises(KeyError):
        with devlock.lock("r"):
            raise KeyError("x")
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_options_by_the_cli_names(scratch: Scratch) -> None:
    # --shared: two shared holders at once, an exclusive one excluded.
    with devlock.lock("r", shared=True):
        assert scratch.run("-n", "--shared", "r", "--", "true").returncode == 0
        assert scratch.run("-n", "r", "--", "true").returncode == 75
    # --slots
    with devlock.lock("pool", slots=2) as a:
        assert a.slot == 1
        out = scratch.run("-n", "--slots", "2", "pool", "--", "sh", "-c", "echo $DEVLOCK_SLOT")
        assert (out.returncode, out.stdout.strip()) == (0, "2")
        # Everyone uses a resource the same way; this process would wait for itself.
        assert scratch.run("-n", "pool", "--", "true").returncode == 2
        with pytest.raises(devlock.Error, match="would wait for itself"):
            with devlock.lock("pool", wait=False):
                pass
    # --any --count, around a CLI holder of gpu:0
    holder = scratch.cli_holder("gpu:0")
    with devlock.lock("gpu:0", "gpu:1", "gpu:2", any=True, count=2, wait=False) as picked:
        assert picked.resources == ("gpu:1", "gpu:2")
        assert picked.cuda_visible_devices == "1,2"
    with pytest.raises(devlock.Busy) as caught:
        with devlock.lock("gpu:0", any=True, wait=False):
            pass
    # The CLI's words: each candidate and who holds it (durations aside).
    cli = scratch.run("-n", "--any", "gpu:0", "--", "true")
    assert cli.returncode == 75
    shape = lambda text: re.sub(r"\d+s\b", "Ns", text.strip())
    assert shape(f"devlock: {caught.value}") == shape(cli.stderr), (str(caught.value), cli.stderr)
    assert str(caught.value).startswith(f"all of gpu:0 are busy: gpu:0 held by sh (pid {holder.pid}, ")
    # A group: gpu:1 takes gpu shared, so a holder of gpu is in the way.
    with pytest.raises(devlock.Busy) as caught:
        with devlock.lock("gpu", wait=False):
            pass
    assert caught.value.resource == "gpu"
    holder.release()
    assert holder.finish().returncode == 0


def test_bad_options_are_usage_errors(scratch: Scratch) -> None:
    for bad in [
        lambda: devlock.lock(),
        lambda: devlock.lock("a", wait=False, timeout=1),
        lambda: devlock.lock("a", slots=0),
        lambda: devlock.lock("a", timeout=-1),
        lambda: devlock.lock("a", count=0),
    ]:
        with pytest.raises(devlock.UsageError):
            bad()
    with pytest.raises(devlock.UsageError, match="^slots takes exactly one resource, without any=True or shared=True$"):
        with devlock.lock("a", "b", slots=2):
            pass
    for name in ["-x", "a/b", "gpu:00", ""]:
        with pytest.raises(devlock.UsageError) as caught:
            with devlock.lock(name):
                pass
        assert caught.value.exit_code == 2
    with pytest.raises(devlock.UsageError, match="^count=3 needs at least that many resources after any=True, got 2$"):
        with devlock.lock("a", "b", any=True, count=3):
            pass
    # A budget on the whole group is the CLI's usage error (test_budget.py has the rest).
    with pytest.raises(devlock.UsageError, match=r"^mem budgets one GPU's memory: give gpu:N, not gpu \(without mem=, gpu is taken whole\)$"):
        with devlock.lock("gpu", mem="20GiB"):
            pass


def test_unsafe_files_are_unsafe_file(scratch: Scratch, tmp_path: Path) -> None:
    scratch.dir.mkdir(mode=0o1777)
    os.symlink(tmp_path / "elsewhere", scratch.dir / "r.lock")
    with pytest.raises(devlock.UnsafeFile) as caught:
        with devlock.lock("r"):
            pass
    assert caught.value.exit_code == 74
    assert str(scratch.dir / "r.lock") in str(caught.value)
    assert not (tmp_path / "elsewhere").exists()
    cli = scratch.run("-n", "r", "--", "true")
    assert cli.returncode == 74 and cli.stderr == f"devlock: {caught.value}\n"


def test_sys_is_imported_for_the_parametrized_endings() -> None:
    assert sys and signal and poll
