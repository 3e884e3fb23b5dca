"""Answering requests: one place that turns outcomes into reply messages and counts them.

Every NATS handler of the supplier and the exchange goes through ``Responder``: bad input
becomes an ``Error{code: bad_request}`` that names the problem, an unexpected exception an
``Error{code: internal}`` (logged with its traceback), and nothing ever escapes into
nats-py's callback machinery, so a process keeps serving whatever it is sent (I6).

Replies go only to inboxes: a message whose reply subject is not an inbox (``_INBOX.``,
the per-user prefixes included: ``bourse.nats.auth.is_inbox``) is dropped before its
handler runs, counted (``reply_not_inbox``, the ``bourse_requests_dropped`` metric) and
logged. Otherwise a requester could make this program publish, with its rights, on a
subject the requester may not use (a worker's commit or destroy subject: a confused
deputy). The generated server permissions say the same (bourse/nats/permissions.py).

A fan-out request (status, explain: every worker of the region answers) is subscribed
with :meth:`Responder.subscribe` and a backlog bound: one queued behind more than
``FANOUT_BACKLOG`` others is dropped unanswered and counted (``fanout_shed``), so a flood
costs a supplier at most what it can answer, never an unbounded queue.

Work that must not hold up its subscription runs in a task the responder owns (a
``bourse.runtime.tasks.TaskSet``: an anyio task per message cost a measurable share of a
placement's CPU): nothing runs unowned, and the service's stop (:meth:`Responder.finish`)
waits for (or, past its bound, cancels) what is under way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.nats.auth import is_inbox
from bourse.runtime.tasks import TaskSet
from bourse.wire.codec import BadMessage, encode
from bourse.wire.messages import Error, ErrorCode

log = structlog.get_logger("bourse.replies")

Handler = Callable[[Msg], Awaitable[None]]

# Dropped requests are logged one by one up to this many, then every LOG_EVERY-th.
LOG_FIRST = 10
LOG_EVERY = 1000
# A fan-out request (status, explain: every worker here answers) queued behind more than
# this many on its subscription is dropped unanswered (a flood; its asker has moved on).
FANOUT_BACKLOG = 128


class Responder:
    """Replies for one service.

    A spawned handler is not cancelled with its service: a stop lets the answers under way
    go out, for at most the bound given to :meth:`finish` (their orders' deadlines usually
    end them sooner)."""

    def __init__(self, nc: NATS, component: str) -> None:
        self.nc = nc
        self.counts: Counter[str] = Counter()
        self.log = log.bind(component=component)
        self.handlers = TaskSet(f"{component}.handlers")

    async def reply(self, msg: Msg, message: msgspec.Struct) -> None:
        await self.forward(msg, encode(message))

    async def forward(self, msg: Msg, data: bytes) -> None:
        """Publish ``data`` to ``msg``'s reply subject, if it has one and it is an inbox."""
        if msg.reply and self.answerable(msg):
            await self.nc.publish(msg.reply, data)

    async def error(self, msg: Msg, code: ErrorCode, detail: str, reason: str = "") -> None:
        self.counts[f"error.{code}"] += 1
        self.log.info("request_refused", subject=msg.subject, code=code, detail=detail)
        await self.forward(msg, encode(Error(code=code, detail=detail, reason=reason)))

    def answerable(self, msg: Msg) -> bool:
        """True unless ``msg`` has a reply subject that is not an inbox (then dropped:
        counted and logged here)."""
        if not msg.reply or is_inbox(msg.reply):
            return True
        n = self.counts["reply_not_inbox"] = self.counts["reply_not_inbox"] + 1
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            self.log.warning(
                "reply_not_inbox_dropped", subject=msg.subject, reply=msg.reply[:200], total=n
            )
        return False

    def guard(self, handler: Handler, backlog: Callable[[], int] | None = None) -> Handler:
        """Wrap a subscription handler: a reply subject that is not an inbox -> dropped
        unhandled; with ``backlog`` (how many wait behind this message) past
        ``FANOUT_BACKLOG`` -> dropped; BadMessage -> bad_request, anything else -> internal."""

        async def guarded(msg: Msg) -> None:
            self.counts["requests"] += 1
            if not self.answerable(msg):
                return
            if backlog is not None and backlog() > FANOUT_BACKLOG:
                n = self.counts["fanout_shed"] = self.counts["fanout_shed"] + 1
                if n <= LOG_FIRST or n % LOG_EVERY == 0:
                    self.log.warning("fanout_request_shed", subject=msg.subject, total=n)
                return
            await self._answering(msg, handler(msg))

        return guarded

    async def subscribe_fanout(self, subject: str, handler: Handler) -> Subscription:
        """Subscribe ``handler`` to a fan-out subject (status, explain), guarded, with the
        backlog bound (``FANOUT_BACKLOG``)."""
        sub: Subscription | None = None

        def backlog() -> int:
            return sub.pending_msgs if sub is not None else 0

        sub = await self.nc.subscribe(subject, cb=self.guard(handler, backlog))
        return sub

    def spawn(self, msg: Msg, work: Awaitable[None]) -> None:
        """Answer ``msg`` from a task of this responder (work that must not hold up its
        subscription); whatever it raises becomes an Error reply, so a requester never
        waits for an answer that cannot come."""
        self.handlers.spawn(self._answering(msg, work))

    async def finish(self, timeout_s: float) -> None:
        """Let the handlers under way finish; those still running after ``timeout_s`` are
        cancelled. Call once nothing new can arrive (the subscriptions are gone)."""
        cut = await self.handlers.finish(timeout_s)
        if cut:
            self.log.warning("handlers_cut_short", count=cut)

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
