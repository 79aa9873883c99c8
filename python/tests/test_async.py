"""asyncio: ``lock_async`` waits without blocking the event loop and leaves
the line at once when its task is cancelled; ``run_in_thread`` keeps the lock
until its worker thread has returned, whatever cancels its task, then raises
the cancellation. CLI holders and waiters on the other side; handshakes
(lines, status, events), no sleeps."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, List

import pytest

import devlock
from dlhelp import HANG, Scratch


async def off_loop(fn: Any, *args: Any) -> Any:
    """A blocking helper (a status poll, a line read) without blocking the loop."""
    return await asyncio.wait_for(asyncio.to_thread(fn, *args), HANG)


def test_a_cancelled_waiter_leaves_the_line_and_the_next_cli_waiter_is_served(scratch: Scratch) -> None:
    holder = scratch.cli_holder("r")

    async def main() -> None:
        async def take() -> None:
            async with devlock.lock_async("r", step="py-async"):
                raise AssertionError("a cancelled waiter must never hold the lock")

        task = asyncio.create_task(take())
        view = await off_loop(scratch.wait_waiters, "r", 1)
        assert view["waiters"][0]["step"] == "py-async"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Out of line at once: nobody waits any more.
        assert scratch.resource("r")["waiters"] == []

    asyncio.run(main())
    waiter = scratch.cli_waiter("r", script="echo got")
    scratch.wait_waiters("r", 1)
    holder.release()
    waiter.line("got")
    assert waiter.finish().returncode == 0
    assert holder.finish().returncode == 0


def test_the_event_loop_keeps_running_while_a_lock_async_waits(scratch: Scratch) -> None:
    holder = scratch.cli_holder("r")

    async def main() -> None:
        ticks: List[int] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(1)
                await asyncio.sleep(0.001)

        async def take() -> str:
            async with devlock.lock_async("r", step="py-async") as held:
                return held.resources[0]

        tick_task = asyncio.create_task(ticker())
        task = asyncio.create_task(take())
        await off_loop(scratch.wait_waiters, "r", 1)
        before = len(ticks)
        # Ticks go on while the take waits (a blocking take would stop them).
        while len(ticks) < before + 20:
            await asyncio.sleep(0.001)
        assert not task.done()
        holder.release()
        assert await asyncio.wait_for(task, HANG) == "r"
        stop.set()
        await tick_task

    asyncio.run(main())
    assert holder.finish().returncode == 0
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_run_in_thread_keeps_the_lock_until_the_worker_returns_through_two_cancels(scratch: Scratch) -> None:
    started = threading.Event()
    finish = threading.Event()
    returned = threading.Event()

    def work(x: int) -> int:
        started.set()
        finish.wait(HANG)
        returned.set()
        return x * 2

    async def main() -> None:
        task = asyncio.create_task(devlock.run_in_thread(work, 21, resource="r", step="py-worker"))
        await off_loop(started.wait, HANG)
        task.cancel()
        # Held while the worker runs, cancel or not.
        out = await off_loop(scratch.run, "-n", "r", "--", "true")
        assert out.returncode == 75 and "py-worker" in out.stderr, out.stderr
        assert not task.done()
        task.cancel()
        out = await off_loop(scratch.run, "-n", "r", "--", "true")
        assert out.returncode == 75, out.stderr
        assert not task.done()
        finish.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert returned.is_set()
        # Free right after.
        out = await off_loop(scratch.run, "-n", "r", "--", "true")
        assert out.returncode == 0, out.stderr

    asyncio.run(main())


def test_run_in_thread_returns_and_raises_what_the_worker_does(scratch: Scratch) -> None:
    def work() -> str:
        # Inside the lock, in a copy of the task's context: a nested take passes through.
        with devlock.lock("r", wait=False) as inner:
            assert inner.nested
        return "done"

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> None:
        assert await devlock.run_in_thread(work, resource="r") == "done"
        with pytest.raises(ValueError, match="boom"):
            await devlock.run_in_thread(fail, resource=["r"])

    asyncio.run(main())
    assert scratch.run("-n", "r", "--", "true").returncode == 0


def test_lock_async_follows_the_blocking_rules(scratch: Scratch) -> None:
    holder = scratch.cli_holder("taken")

    async def main() -> None:
        with pytest.raises(devlock.Busy) as caught:
            async with devlock.lock_async("taken", wait=False):
                pass
        assert caught.value.holder.pid is not None
        with pytest.raises(devlock.Timeout):
            async with devlock.lock_async("taken", timeout="100ms", quiet=True):
                pass
        assert scratch.resource("taken")["waiters"] == []
        go = asyncio.Event()

        async def other() -> None:
            await go.wait()
            async with devlock.lock_async("r", wait=False):
                pass

        # Made outside the block: a task of its own (a task made inside a
        # block copies its context, and runs inside the block).
        other_task = asyncio.create_task(other())
        async with devlock.lock_async("r") as outer:
            assert not outer.nested
            # Nesting passes through within a task...
            async with devlock.lock_async("r", wait=False) as inner:
                assert inner.nested
            # ...and another task waits its turn like anyone else.
            go.set()
            with pytest.raises(devlock.Busy):
                await other_task

    asyncio.run(main())
    holder.release()
    assert holder.finish().returncode == 0
    with pytest.raises(TypeError, match="async with"):
        with devlock.lock_async("r"):
            pass
