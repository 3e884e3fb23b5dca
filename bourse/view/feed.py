"""One consumer of the state stream for a view: a push consumer of its own (ephemeral,
in memory on the server, no acks) whose filter is in the subject that makes it, so a
tenant's key can be granted its own rows only (docs/security.md: nats-py's ordered
consumer is made without a filter in its subject, so no grant could limit it to a
tenant's rows), delivering from a stream sequence into the view's inbox, in order.

It does what an ordered consumer does: a gap in the consumer's sequence (messages the
client dropped), an idle heartbeat that says more was delivered than arrived, or silence
for STALLED_S (the server restarted, the consumer or the stream is gone) make it
broken, and the view makes it again from the last sequence it applied. Flow control is
answered, so the server never sends faster than the view reads.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

IDLE_HEARTBEAT_S = 1.0
STALLED_S = 3 * IDLE_HEARTBEAT_S
# The server removes a consumer this long after nobody reads it (a CLI's, once it answered).
INACTIVE_S = 10.0
CREATE_TIMEOUT_S = 2.0
# What a subscription may hold before nats-py drops (a view reads it in batches).
PENDING_MSGS = 1_000_000
PENDING_BYTES = 1024 * 1024 * 1024
# Past this many rows queued for the view, a flow control request is answered only once the
# view has taken them: the server then waits, and a build's memory stays bounded.
HOLD_ROWS = 8192


@dataclass(frozen=True, slots=True)
class Delivered:
    """One stream message: its subject and body, stream sequence and stored time (ms)."""

    subject: str
    data: bytes
    seq: int
    at_ms: int


def ack_fields(reply: str) -> tuple[int, int, int, int] | None:
    """``(stream seq, consumer seq, stored ns, pending)`` of a delivered message's reply
    subject (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>``, or
    the form with a domain and an account hash and a token after), None when it is no
    such subject."""
    t = reply.split(".")
    if len(t) < 9 or t[0] != "$JS" or t[1] != "ACK":
        return None
    at = 5 if len(t) == 9 else 7
    try:
        return int(t[at]), int(t[at + 1]), int(t[at + 2]), int(t[at + 3])
    except (ValueError, IndexError):
        return None


class Feed:
    """One filter subject's messages, from a sequence on, queued for the view in order."""

    def __init__(self, nc: NATS, stream: str, filter_subject: str, ready: asyncio.Event) -> None:
        self.nc = nc
        self.stream = stream
        self.filter = filter_subject
        self.ready = ready  # set when messages are queued (shared by a view's feeds)
        self.queue: deque[Delivered] = deque()
        self.last_seq = 0  # the last stream sequence handed to the view
        self.caught_up = False  # nothing pending on the server after what is queued
        self.broken = ""  # why it must be made again ("" while it runs)
        self._sub: Subscription | None = None
        self._held = ""  # a flow control answer held while the queue is long
        self._cseq = 0
        self._seen = time.monotonic()

    async def start(self, after_seq: int) -> None:
        """(Re)make the consumer, delivering from ``after_seq + 1``; nats-py's errors (no
        stream, a refusal, a timeout) go on to the caller."""
        await self.stop()
        self.queue.clear()
        self.last_seq = after_seq
        self._cseq = 0
        self._held = ""
        self.broken = ""
        self._seen = time.monotonic()
        inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(
            inbox, cb=self._on_msg, pending_msgs_limit=PENDING_MSGS,
            pending_bytes_limit=PENDING_BYTES,
        )  # fmt: skip
        config = ConsumerConfig(
            name=f"view_{secrets.token_hex(8)}",
            filter_subject=self.filter,
            deliver_subject=inbox,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=after_seq + 1,
            ack_policy=AckPolicy.NONE,
            flow_control=True,
            idle_heartbeat=IDLE_HEARTBEAT_S,
            inactive_threshold=INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
        )
        info = await self.nc.jetstream().add_consumer(self.stream, config, timeout=CREATE_TIMEOUT_S)
        if not self._cseq:  # else the messages delivered meanwhile say it better
            self.caught_up = not info.num_pending

    async def stop(self) -> None:
        """Stop reading (the server removes the consumer once it sees nobody reads it)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with suppress(nats.errors.Error):  # a closed connection: nothing reads it either
                await sub.unsubscribe()

    def take(self, n: int) -> list[Delivered]:
        """Up to ``n`` queued messages, in order (``last_seq`` moves to the last)."""
        out = [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
        if out:
            self.last_seq = out[-1].seq
        return out

    async def flow(self) -> None:
        """Answer the flow control held while the queue was long, once it is short again.
        The server sent nothing meanwhile, so its last message's count of what is pending
        is old news (rows published while the view applied a build's backlog: heartbeats):
        not caught up until it sends again (a message, or an idle heartbeat if it has
        none). Else a view applying for longer than a heartbeat's window would take what
        it was held from for silence, and every worker for gone."""
        if self._held and len(self.queue) < HOLD_ROWS:
            held, self._held = self._held, ""
            self.caught_up = False
            with suppress(nats.errors.Error):
                await self.nc.publish(held, b"")

    async def _answer(self, reply: str) -> None:
        if len(self.queue) >= HOLD_ROWS:
            self._held = reply
        else:
            await self.nc.publish(reply, b"")

    @property
    def current(self) -> bool:
        """Caught up, with nothing left to hand over."""
        return self.caught_up and not self.queue and not self.broken

    def stalled(self) -> bool:
        """Nothing (no message, no heartbeat) for STALLED_S: the consumer is gone."""
        return time.monotonic() - self._seen > STALLED_S

    def heard_within(self, seconds: float) -> bool:
        """Whether the server said something (a message, a heartbeat) in the last
        ``seconds``: a view busy for longer may have unread messages on its socket."""
        return time.monotonic() - self._seen <= seconds

    async def _on_msg(self, msg: Msg) -> None:
        self._seen = time.monotonic()
        status = msg.headers.get("Status") if msg.headers else None
        if status is not None:
            await self._status(msg, status)
            return
        fields = ack_fields(msg.reply)
        if fields is None or self.broken:
            return
        seq, cseq, stored_ns, pending = fields
        if cseq != self._cseq + 1:
            self.broken = f"consumer sequence {cseq} after {self._cseq}: messages were lost"
            self.ready.set()
            return
        self._cseq = cseq
        self.queue.append(Delivered(msg.subject, msg.data, seq, stored_ns // 1_000_000))
        self.caught_up = pending == 0
        self.ready.set()

    async def _status(self, msg: Msg, status: str) -> None:
        if status != "100":  # the consumer was deleted, or the like
            self.broken = (
                f"status {status} {msg.headers.get('Description', '') if msg.headers else ''}"
            )
            self.ready.set()
        elif msg.reply:  # flow control: the server waits for this before it sends on
            await self._answer(msg.reply)
        else:  # an idle heartbeat
            headers = msg.headers or {}
            stalled = headers.get("Nats-Consumer-Stalled")
            last = headers.get("Nats-Last-Consumer")
            if stalled:  # it waits for a flow control answer (held, or it came while busy)
                self.caught_up = False  # it holds back what it has: said once it sends on
                await self._answer(stalled)
            elif last is not None and int(last) > self._cseq:
                self.broken = f"idle heartbeat says {last} delivered, {self._cseq} arrived"
            else:  # nothing more to send: caught up (rows it counted may have left since)
                self.caught_up = True
            self.ready.set()
