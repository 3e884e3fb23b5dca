"""What a supplier host sends: bid replies that are due after their offer delay and
at-most-once events (:class:`Outbox`), and the events of committed state changes, exactly
once, from the store's outbox table (:class:`EventOutbox`).

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
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.nats.acks import Answer, StreamAcks
from bourse.nats.jetstream import DEGRADED, HEADER_MSG_ID, NO_JETSTREAM_FLAG, stream_name
from bourse.wire.subjects import Subjects
from supplier.oplog import OutboxRow
from supplier.store import Store

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


# Events that are not committed state: published at-most-once (the plain Outbox above), on
# the same subjects; every other kind comes from the store's outbox table (EventOutbox).
AT_MOST_ONCE_KINDS = frozenset({"hold_expired", "image_tampered"})
# Rows published per round: their acks are awaited together (pipelined, one round trip).
EVENT_BATCH = 512
ACK_TIMEOUT_S = 5.0
RETRY_S = 0.5
# While no stream takes the events, a round is tried again after twice the last wait, up to
# this: the stream comes with an exchange's start or the operator's set-up.
MISSING_RETRY_MAX_S = 5.0
# What makes the stream (said in the log line of a supplier whose events wait for it).
STREAM_FIX = "start an exchange (it makes the stream) or run `bourse jetstream init`"


class EventOutbox:
    """Publishes the store's outbox rows, in order, exactly once.

    Each row is an event written in the same SQLite transaction as the state change it
    reports (supplier/store.py). With JetStream (``durable``), a row is published with
    its ``Nats-Msg-Id`` (``OutboxRow.msg_id``) and deleted only after the stream's ack; a row
    whose ack was lost (a timeout, a reconnect, kill -9) is published again and the stream
    drops it as a duplicate. The supplier makes no stream: while none takes its events (the
    exchange has not started, or the operator has not set it up) the rows wait in the
    table, said once in the log and by ``stream_missing``, and go out once it is there. In
    the degraded mode (``--no-jetstream``) rows go out as plain publishes, at-most-once, and
    are deleted at once.

    The pump runs shielded in the host's task group, like :class:`Outbox`, so the events of
    a stop still go out; what :meth:`close` cannot send in its bound stays in the table for
    the next start.
    """

    def __init__(self, nc: NATS, store: Store, subjects: Subjects, durable: bool = True) -> None:
        self.nc = nc
        self.store = store
        self.subjects = subjects
        self.stream = stream_name(subjects.prefix)
        self.durable = durable
        self.stream_missing = False  # events wait: no stream takes them
        self._missing_wait_s = RETRY_S
        self._queue: deque[OutboxRow] = deque()
        self._ready = asyncio.Event()
        self._closing = False
        self._scope: anyio.CancelScope | None = None
        self._done = anyio.Event()
        self.published = 0  # rows acknowledged (or sent plainly without JetStream)
        self.duplicates = 0  # acks saying the stream already had the message id
        self.retries = 0  # rounds that failed and were tried again
        # the round being sent: each publish's ticket -> its answer (None: none yet)
        self._acks = StreamAcks(nc, self._answer)
        self._round: dict[int, Answer | None] = {}
        self._unanswered = 0
        self._sending = False
        self._answered = asyncio.Event()  # every publish of the round has its answer

    @property
    def backlog(self) -> int:
        """Rows committed and not yet acknowledged."""
        return len(self._queue)

    async def start(self) -> None:
        """Look the stream up (durable), load what the last run left unpublished. Called
        before any write of this run (the host's start), so rows stay in order."""
        if not self.durable:
            log.warning(
                "events_at_most_once",
                reason=f"{NO_JETSTREAM_FLAG}: events are plain publishes, a consumer that is "
                f"away misses them ({DEGRADED})",
            )
        elif not await self._stream_found():
            self._missing()
        left = self.store.pending_events()
        if left:
            log.info("outbox_resumed", events=len(left), first=left[0].msg_id)
        self._queue.extend(left)
        self.store.on_events = self.committed
        if self._queue:
            self._ready.set()

    def committed(self, rows: list[OutboxRow]) -> None:
        """The store made these rows durable (called on the event loop, in commit order)."""
        self._queue.extend(rows)
        self._ready.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The pump: publish the rows in order until :meth:`close`."""
        try:
            with anyio.CancelScope(shield=True) as self._scope:
                task_status.started()
                while not (self._closing and not self._queue):
                    await self._ready.wait()
                    self._ready.clear()
                    while self._queue:
                        batch = [self._queue[i] for i in range(min(EVENT_BATCH, len(self._queue)))]
                        sent = await self._publish(batch)
                        for _ in range(sent):
                            self._queue.popleft()
                        self.store.forget_events([r.id for r in batch[:sent]])
                        self.published += sent
                        if sent < len(batch):
                            if self._closing:
                                return  # the rest waits in the table for the next start
                            self.retries += 1
                            await anyio.sleep(self._retry_s())
        finally:
            self._done.set()

    async def _stream_found(self) -> bool:
        """Whether the event stream is there (one request; an unclear answer counts as
        there: the pump finds out)."""
        try:
            await self.nc.jetstream().stream_info(self.stream)
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("event_stream_not_checked", stream=self.stream, error=repr(exc))
        return True

    def _missing(self) -> None:
        """No stream takes our events: say it once, until they are stored again."""
        if not self.stream_missing:
            self.stream_missing = True
            log.warning(
                "event_stream_missing",
                stream=self.stream,
                waiting=len(self._queue),
                detail="events wait in the outbox, nothing is lost, until the stream takes "
                f"them: {STREAM_FIX}",
            )

    def _found(self) -> None:
        if self.stream_missing:
            self.stream_missing = False
            log.info("event_stream_found", stream=self.stream, waiting=len(self._queue))
        self._missing_wait_s = RETRY_S

    def _retry_s(self) -> float:
        """How long before the next round: RETRY_S, or, while no stream takes the events,
        twice the last wait up to MISSING_RETRY_MAX_S."""
        if not self.stream_missing:
            return RETRY_S
        wait, self._missing_wait_s = (
            self._missing_wait_s,
            min(2 * self._missing_wait_s, MISSING_RETRY_MAX_S),
        )
        return wait

    def _subject(self, row: OutboxRow) -> str:
        return self.subjects.event(row.region, row.worker_id, row.kind)

    async def _publish(self, batch: list[OutboxRow]) -> int:
        """Publish ``batch``; how many of its first rows are done (acknowledged)."""
        if not self.durable:
            for n, row in enumerate(batch):
                try:
                    await self.nc.publish(self._subject(row), row.data)
                except Exception as exc:
                    log.warning("event_publish_failed", error=repr(exc))
                    return n
            return len(batch)
        tickets: list[int] = []
        self._round, self._unanswered, self._sending = {}, 0, True
        self._answered.clear()
        try:
            for row in batch:
                headers = {HEADER_MSG_ID: row.msg_id}
                tickets.append(await self._acks.publish(self._subject(row), row.data, headers))
                self._round[tickets[-1]] = None
                self._unanswered += 1
            self._sending = False
            if self._unanswered:
                with anyio.fail_after(ACK_TIMEOUT_S):
                    await self._answered.wait()
        except Exception as exc:
            log.warning("event_publish_failed", error=repr(exc), rows=len(batch))
        self._sending = False
        answers = [self._round.get(t) for t in tickets]
        self._round = {}  # a late answer is ignored: its row goes again, a duplicate
        done = 0
        for answer in answers:
            if answer is None or not answer.stored:
                break
            done += 1
            self.duplicates += answer.duplicate
        if done:
            self._found()
        refused = answers[done] if done < len(answers) else None
        if refused is not None:
            if refused.no_stream:
                self._missing()  # no stream takes the subject
            else:
                log.warning("event_not_acked", error=refused.error)
        return done

    def _answer(self, ticket: int, answer: Answer) -> None:
        """A publish of the round has its answer (one of an earlier round: ignored)."""
        if ticket not in self._round or self._round[ticket] is not None:
            return
        self._round[ticket] = answer
        self._unanswered -= 1
        if not self._unanswered and not self._sending:
            self._answered.set()

    async def close(self, timeout_s: float = 1.0) -> None:
        """Publish what is queued (for at most ``timeout_s``), then end the pump; what is
        left stays in the store's outbox for the next start."""
        self._closing = True
        self._ready.set()
        if self._scope is None:
            return
        with anyio.move_on_after(timeout_s, shield=True):
            await self._done.wait()
        self._scope.cancel()
        if self._queue:
            log.warning("outbox_left_for_next_start", count=len(self._queue))
        await self._acks.close()
