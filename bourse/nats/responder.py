"""Answering requests: one place that turns outcomes into reply messages and counts them.

Every NATS handler of the supplier and the exchange goes through ``Responder``: bad input
becomes an ``Error{code: bad_request}`` that names the problem, an unexpected exception an
``Error{code: internal}`` (logged with its traceback), and nothing ever escapes into
nats-py's callback machinery, so a process keeps serving whatever it is sent (I6).

Work that must not hold up its subscription runs in a task of the task group the service
owns (``Responder(nc, component, tasks)``): nothing runs unowned, and the service's stop
waits for (or, past its bound, cancels) what is under way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.wire.codec import BadMessage, encode
from bourse.wire.messages import Error, ErrorCode

log = structlog.get_logger("bourse.replies")

Handler = Callable[[Msg], Awaitable[None]]


class Responder:
    """Replies for one service; ``tasks`` is the task group its spawned handlers run in.

    A spawned handler is shielded from its service's cancellation: a stop lets the answers
    under way go out, for at most the bound given to :meth:`finish` (their orders' deadlines
    usually end them sooner)."""

    def __init__(self, nc: NATS, component: str, tasks: anyio.abc.TaskGroup) -> None:
        self.nc = nc
        self.counts: Counter[str] = Counter()
        self.log = log.bind(component=component)
        self.tasks = tasks
        self._inflight: set[anyio.CancelScope] = set()
        self._idle = anyio.Event()
        self._idle.set()
        self._deadline = math.inf  # set by finish(): when the handlers still running end

    async def reply(self, msg: Msg, message: msgspec.Struct) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, encode(message))

    async def error(self, msg: Msg, code: ErrorCode, detail: str, reason: str = "") -> None:
        self.counts[f"error.{code}"] += 1
        self.log.info("request_refused", subject=msg.subject, code=code, detail=detail)
        if msg.reply:
            error = Error(code=code, detail=detail, reason=reason)
            await self.nc.publish(msg.reply, encode(error))

    def guard(self, handler: Handler) -> Handler:
        """Wrap a subscription handler: BadMessage -> bad_request, anything else -> internal."""

        async def guarded(msg: Msg) -> None:
            self.counts["requests"] += 1
            await self._answering(msg, handler(msg))

        return guarded

    def spawn(self, msg: Msg, work: Awaitable[None]) -> None:
        """Answer ``msg`` from a task of the owner's task group (work that must not hold up
        its subscription); whatever it raises becomes an Error reply, so a requester never
        waits for an answer that cannot come."""
        scope = anyio.CancelScope(shield=True, deadline=self._deadline)
        self._inflight.add(scope)
        if self._idle.is_set():
            self._idle = anyio.Event()
        self.tasks.start_soon(self._answering_within, scope, msg, work)

    async def finish(self, timeout_s: float) -> None:
        """Let the handlers under way finish; those still running after ``timeout_s`` are
        cancelled. Call once nothing new can arrive (the subscriptions are gone)."""
        self._deadline = anyio.current_time() + timeout_s
        for scope in self._inflight:
            scope.deadline = min(scope.deadline, self._deadline)
        with anyio.move_on_after(timeout_s + 0.1):  # their scopes end them; this is a backstop
            await self._idle.wait()
        if self._inflight:
            self.log.warning("handlers_cut_short", count=len(self._inflight))

    async def _answering_within(
        self, scope: anyio.CancelScope, msg: Msg, work: Awaitable[None]
    ) -> None:
        try:
            with scope:
                await self._answering(msg, work)
        finally:
            self._inflight.discard(scope)
            if not self._inflight:
                self._idle.set()

    async def _answering(self, msg: Msg, work: Awaitable[None]) -> None:
        try:
            await work
        except BadMessage as exc:
            await self._safe_error(msg, "bad_request", str(exc))
        except Exception as exc:
            self.log.exception("handler_failed", subject=msg.subject)
            await self._safe_error(msg, "internal", f"{type(exc).__name__}: {exc}")

    async def _safe_error(self, msg: Msg, code: ErrorCode, detail: str) -> None:
        try:
            await self.error(msg, code, detail)
        except Exception:  # the connection itself is gone: nothing more to do here
            self.log.warning("reply_failed", subject=msg.subject)


def subject_region_mismatch(kind: str, body_region: str, subject_region: Any) -> BadMessage:
    return BadMessage(
        f"{kind} region {body_region!r} does not match the subject's region {subject_region!r}"
    )
