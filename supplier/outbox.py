"""What a supplier host sends from plain (non-async) code: events, and bid replies that are
due after their offer delay.

One long-lived task publishes whatever is queued, in order, so a message costs a deque
append (and a timer handle for a delayed one) instead of a task of its own: at a thousand
placements a second a supplier process sent several thousand such messages a second, and
creating a task for each was a measurable share of its CPU.

That task (:meth:`Outbox.run`) runs in its host's task group, shielded from the host's
cancellation: the events of a stop (machines stopped, holds released) still go out, until
:meth:`Outbox.close` says nothing more will come and bounds the wait.
"""

from __future__ import annotations

import asyncio
from collections import deque

import anyio
import anyio.abc
import structlog
from nats.aio.client import Client as NATS

log = structlog.get_logger("bourse.supplier")


class Outbox:
    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._queue: deque[tuple[str, bytes]] = deque()
        # An asyncio event (anyio runs on asyncio): post() is plain code and must clear it.
        self._ready = asyncio.Event()
        self._closing = False
        self._scope: anyio.CancelScope | None = None
        self._done = anyio.Event()
        self.failed = 0  # publishes that raised (a closed connection): logged, not retried

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The pump: publish what is queued, in order, until :meth:`close`."""
        try:
            with anyio.CancelScope(shield=True) as self._scope:
                task_status.started()
                while not (self._closing and not self._queue):
                    await self._ready.wait()
                    self._ready.clear()
                    await self._publish_queued()
        finally:
            self._done.set()

    def post(self, subject: str, data: bytes) -> None:
        """Queue one message; it goes out after everything queued before it."""
        self._queue.append((subject, data))
        self._ready.set()

    def __len__(self) -> int:
        return len(self._queue)

    async def _publish_queued(self) -> None:
        while self._queue:
            subject, data = self._queue.popleft()
            try:
                await self.nc.publish(subject, data)
            except Exception as exc:
                self.failed += 1
                log.warning("publish_failed", subject=subject, error=repr(exc))

    async def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then end the pump."""
        self._closing = True
        self._ready.set()
        if self._scope is None:  # the pump never ran
            return
        with anyio.move_on_after(timeout_s, shield=True):
            await self._done.wait()
        self._scope.cancel()
        if self._queue:
            log.warning("outbox_left_unsent", count=len(self._queue))
