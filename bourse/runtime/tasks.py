"""Tasks with an owner, one per message: what the hot paths spawn.

A reply that must wait (a commit's durable write, an auction) runs in a task of its own so
it does not hold up its subscription. At a thousand placements a second that is thousands
of tasks a second, and an anyio task group's ``start_soon`` costs about 33 µs of CPU per
task (with the shielded cancel scope each handler needed so that a stop would let it
finish, about 35 µs), against about 4 µs here (``python -m bourse.runtime.tasks``
measures the three on this machine). Several such tasks run per placement
(docs/performance.md).

A :class:`TaskSet` is that owner, on plain asyncio tasks: it keeps every task it started,
logs what one raised, and :meth:`TaskSet.finish` is the owner's end: it waits (bounded)
for the tasks under way and cancels, then awaits, those still running. The tasks are not
children of their owner's cancel scope, so cancelling the service (a stop) does not cut
them short: the owner's stop calls ``finish`` with the bound the stop allows, which is
what the shielded scopes did before. anyio's cancel scopes and timeouts work inside them
as in any asyncio task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("bourse.tasks")


class TaskSet:
    """Asyncio tasks owned by one object; see the module's docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[None]] = set()
        # set while no task runs; one event per busy stretch, shared by every waiter
        self._idle = asyncio.Event()
        self._idle.set()
        self.failed = 0  # tasks that raised (logged)

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task of this set (from the event loop's thread)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        if self._idle.is_set():
            self._idle = asyncio.Event()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            exc = task.exception()
            if exc is not None:
                self.failed += 1
                log.error("task_failed", owner=self.name, error=repr(exc), exc_info=exc)
        if not self._tasks:
            self._idle.set()

    async def wait(self) -> None:
        """Until no task of this set is running (tasks spawned meanwhile included)."""
        while self._tasks:
            await self._idle.wait()

    async def finish(self, timeout_s: float) -> int:
        """Let the tasks under way finish for at most ``timeout_s``, then cancel those
        left and wait for them to end. Returns how many were cut short. Cancelling the
        caller meanwhile cancels them all the same: no task outlives its owner's end."""
        cut = 0
        try:
            if self._tasks:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wait(), timeout_s)
        finally:
            left = list(self._tasks)
            cut = len(left)
            for task in left:
                task.cancel()
            if left:
                await asyncio.wait(left)
        return cut


def _bench(n: int = 20_000) -> dict[str, float]:
    """µs of CPU per task: this module against an anyio task group (with and without the
    shielded scope a handler used to need). ``python -m bourse.runtime.tasks``."""
    import anyio

    async def nothing() -> None:
        return None

    async def shielded() -> None:
        with anyio.CancelScope(shield=True):
            await nothing()

    out: dict[str, float] = {}

    async def main() -> None:
        for label, work in (("anyio", nothing), ("anyio+scope", shielded)):
            t = time.process_time()
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(work)
            out[label] = (time.process_time() - t) / n * 1e6
        tasks = TaskSet("bench")
        t = time.process_time()
        for _ in range(n):
            tasks.spawn(nothing())
        await tasks.wait()
        out["TaskSet"] = (time.process_time() - t) / n * 1e6

    anyio.run(main, backend_options={"use_uvloop": True})
    return out


if __name__ == "__main__":
    for label, us in _bench().items():
        print(f"{label:12s} {us:6.1f} µs per task")
