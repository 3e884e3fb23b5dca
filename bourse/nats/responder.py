"""Answering requests: one place that turns outcomes into reply messages and counts them.

Every NATS handler of the supplier and the exchange goes through ``Responder``: bad input
becomes an ``Error{code: bad_request}`` that names the problem, an unexpected exception an
``Error{code: internal}`` (logged with its traceback), and nothing ever escapes into
nats-py's callback machinery, so a process keeps serving whatever it is sent (I6).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.wire.codec import BadMessage, encode
from bourse.wire.messages import Error, ErrorCode

log = structlog.get_logger("bourse.replies")

Handler = Callable[[Msg], Awaitable[None]]


class Responder:
    def __init__(self, nc: NATS, component: str) -> None:
        self.nc = nc
        self.counts: Counter[str] = Counter()
        self.log = log.bind(component=component)
        self.tasks: set[asyncio.Task[None]] = set()

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
        """Answer ``msg`` from a task (work that must not hold up its subscription). The task
        is tracked (``wait`` finishes them), and whatever it raises becomes an Error reply,
        so a requester never waits for an answer that cannot come."""
        task = asyncio.get_running_loop().create_task(self._answering(msg, work))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def wait(self, timeout_s: float) -> None:
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=timeout_s)

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
