"""What a supplier host sends from plain (non-async) code: events, and bid replies that are
due after their offer delay.

One long-lived task publishes whatever is queued, in order, so a message costs a deque
append (and a timer handle for a delayed one) instead of a task of its own: at a thousand
placements a second a supplier process sent several thousand such messages a second, and
creating a task for each was a measurable share of its CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import structlog
from nats.aio.client import Client as NATS

log = structlog.get_logger("bourse.supplier")


class Outbox:
    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._queue: deque[tuple[str, bytes]] = deque()
        self._ready = asyncio.Event()
        self._drained = asyncio.Event()  # set while nothing is queued
        self._drained.set()
        self._task: asyncio.Task[None] | None = None
        self.failed = 0  # publishes that raised (a closed connection): logged, not retried

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())

    def post(self, subject: str, data: bytes) -> None:
        """Queue one message; it goes out after everything queued before it."""
        self._queue.append((subject, data))
        self._drained.clear()
        self._ready.set()

    def __len__(self) -> int:
        return len(self._queue)

    async def _pump(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                subject, data = self._queue.popleft()
                try:
                    await self.nc.publish(subject, data)
                except Exception as exc:
                    self.failed += 1
                    log.warning("publish_failed", subject=subject, error=repr(exc))
            self._drained.set()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then stop the pump."""
        task, self._task = self._task, None
        if task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout_s)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
