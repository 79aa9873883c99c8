"""asyncio: :class:`lock_async` (a :class:`devlock.lock` entered with ``async
with``, whose wait never blocks the event loop) and :func:`run_in_thread`
(work in a thread that keeps the lock until it returns, whatever cancels the
awaiting task)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from types import TracebackType
from typing import Any, List, Optional, Tuple, Type, Union

from . import _POLL, Held, _Display, _let_go, lock

def _wake(future: "asyncio.Future[None]") -> None:
    if not future.done():
        future.set_result(None)


async def _through_cancels(future: "asyncio.Future[Any]") -> Any:
    """Awaits ``future`` to its end whatever cancels the awaiting task: each
    cancel is absorbed while it runs, and the first is raised once it is done
    (its own outcome then unread)."""
    cancelled: Optional[BaseException] = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as e:
            own = future.done() and (
                future.cancelled() or isinstance(future.exception(), asyncio.CancelledError)
            )
            if not own and cancelled is None:
                cancelled = e
        except BaseException:
            # The future's own failure: result() below raises it.
            pass
    if cancelled is not None:
        if not future.cancelled():
            future.exception()
        raise cancelled
    return future.result()


class lock_async(lock):
    """``async with devlock.lock_async(...)``: :class:`lock` for asyncio code
    (an inference server, an async job runner), with the same arguments and
    rules: the same line, ``Busy``, ``Timeout``, durations as strings,
    budgets, idle policy, records, and the release when the device is free.

    The wait never blocks the event loop: the library waits in line on a
    thread of its own and wakes the loop through a pipe once the lock is
    taken (or the timeout passes), so other tasks run meanwhile. Cancelling
    the waiting task (``task.cancel()``, ``asyncio.timeout``) leaves the line
    at once; nothing is left queued. Nesting is per task: a ``lock_async`` or
    ``lock`` of a resource that an enclosing block of the same task holds
    passes through (each task has its own blocks: the blocks held are a
    context variable, copied into a task when it is created). The block's
    end asks the driver on a worker thread, off the loop::

        import devlock

        async def generate(prompt):
            async with devlock.lock_async("gpu:0", step="api", timeout="30s"):
                return await asyncio.to_thread(model.generate, prompt)

    A cancel inside the block (the client went away) ends the block at once,
    whatever the threads it started still do on the device; for work in a
    thread use :func:`run_in_thread`, which keeps the lock until the thread
    has returned.
    """

    def __repr__(self) -> str:
        return f"devlock.lock_async({', '.join(map(repr, self._resources))})"

    def __enter__(self) -> Held:
        raise TypeError("devlock.lock_async is entered with `async with`; `with` takes devlock.lock")

    async def __aenter__(self) -> Held:
        return await self._aenter()

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        await self._aexit(exc)

    async def _aenter(self) -> Held:
        acquiring, hold, adopted = self._start()
        if hold is None:
            try:
                hold = await self._wait_async(acquiring)
            except BaseException:
                await _through_cancels(asyncio.get_running_loop().run_in_executor(None, _let_go, adopted, self._release))
                raise
        return self._entered(hold, adopted)

    async def _wait_async(self, acquiring: Any) -> Any:
        """Waits for the take's outcome without blocking the event loop: the
        library's waiting thread wakes it through a pipe; a cancel leaves the
        line at once."""
        loop = asyncio.get_running_loop()
        display = _Display(self._quiet, self._report_every)
        # An event loop's stderr is a log, not a line to redraw.
        display.live = False
        fd = acquiring.ready_fd()
        try:
            while True:
                hold = acquiring.wait(0.0)
                if hold is not None:
                    break
                display.tick(acquiring)
                woken: "asyncio.Future[None]" = loop.create_future()
                # The first look at 0.25 s shows a wait as the command line does.
                delay = self._report_every if display.shown else 0.25
                if fd is None:
                    delay = min(delay, _POLL)
                left = acquiring.time_left()
                if left is not None:
                    delay = min(delay, left)
                timer = loop.call_later(delay, _wake, woken)
                if fd is not None:
                    loop.add_reader(fd, _wake, woken)
                try:
                    await woken
                finally:
                    timer.cancel()
                    if fd is not None:
                        loop.remove_reader(fd)
        except BaseException:
            acquiring.cancel()
            raise
        display.done(hold.done_line())
        return hold

    async def _aexit(self, exc: Optional[BaseException]) -> None:
        holds, stop = self._leave(exc)
        if self._release == "device" and any(h.asks_the_driver() for h in holds):
            # The device check is a driver query (a cold nvidia-smi takes
            # seconds): off the loop, and carried through a cancel.
            await _through_cancels(asyncio.get_running_loop().run_in_executor(None, _let_go, holds, self._release))
        else:
            _let_go(holds, self._release)
        if stop is not None:
            raise stop from exc



async def run_in_thread(fn: Any, /, *args: Any, resource: Union[str, Tuple[str, ...], List[str]], **options: Any) -> Any:
    """Runs ``fn(*args)`` in a worker thread of its own under the lock of
    ``resource`` (one name, or a list of names), taken as
    :class:`lock_async` takes it (``options`` are its keyword arguments), and
    returns what it returns::

        result = await devlock.run_in_thread(model.generate, prompt, resource="gpu:0")

    The fix for ``await asyncio.to_thread(...)`` inside the block, which lets
    go when the awaiting task is cancelled while the thread still computes
    on the device: here a cancel while the thread runs keeps the lock until
    the thread has returned (a thread cannot be stopped; its GPU work goes
    on), absorbing any further cancels, and then raises the cancellation
    (the thread's own outcome is dropped). A cancel while still waiting for
    the lock leaves the line at once, and ``fn`` never runs. ``fn`` runs in a
    copy of the task's context, so a ``devlock.lock`` of the same resource
    inside it passes through.
    """
    resources = (resource,) if isinstance(resource, str) else tuple(resource)
    async with lock_async(*resources, **options):
        loop = asyncio.get_running_loop()
        done: "asyncio.Future[Any]" = loop.create_future()
        context = contextvars.copy_context()

        def settle(result: Any, error: Optional[BaseException]) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        def work() -> None:
            try:
                result = context.run(fn, *args)
            except BaseException as e:
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        name = getattr(fn, "__name__", "fn")
        threading.Thread(target=work, name=f"devlock-run-{name}", daemon=True).start()
        return await _through_cancels(done)
