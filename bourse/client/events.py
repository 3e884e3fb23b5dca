"""Reading the market's events: live (core NATS) or replayed from the event stream.

``EventFeed(nc, subjects, since=...)`` yields :class:`StreamedEvent` in stream order: with a
``since`` it replays the JetStream event stream from there and then follows it (an ordered
consumer: gap-free, no duplicates, re-created by the client after a reconnect); without one
it follows live events as they are published (at-most-once). ``parse_since`` reads the
``--since`` forms: a stream sequence, a duration back from now, or ``all``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy

from bourse.errors import BourseError
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import jetstream_available, stream_name
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import Event
from bourse.wire.subjects import Subjects

_json = msgspec.json.Encoder()
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class EventsError(BourseError, RuntimeError):
    """Events cannot be read as asked (bad --since, no JetStream, no stream)."""


@dataclass(frozen=True, slots=True)
class Since:
    """Where a replay starts: a stream sequence (``seq``), a time (``at``), or everything."""

    seq: int = 0
    at: datetime | None = None

    def consumer(self) -> ConsumerConfig:
        if self.seq:
            return ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.seq
            )
        if self.at is not None:
            return ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME,
                opt_start_time=self.at,
            )
        return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)

    def describe(self) -> str:
        if self.seq:
            return f"stream sequence {self.seq}"
        if self.at is not None:
            return self.at.astimezone().strftime("%Y-%m-%d %H:%M:%S")
        return "the oldest stored event"


def parse_since(text: str, now_s: float | None = None) -> Since:
    """``all``; a stream sequence (``1234``: from that event on); or a duration back from
    now (``90s``, ``15m``, ``2h``, ``7d``, ``500ms``). Raises EventsError naming the problem."""
    text = text.strip().lower()
    if text == "all":
        return Since()
    if text.isdigit():
        seq = int(text)
        if seq < 1:
            raise EventsError("--since: a stream sequence starts at 1")
        return Since(seq=seq)
    m = _DURATION.match(text)
    if m is None:
        raise EventsError(
            f"--since {text!r}: expected a stream sequence (e.g. 1234), a duration "
            "(e.g. 90s, 15m, 2h, 7d) or 'all'"
        )
    back_s = float(m.group(1)) * _UNIT_S[m.group(2)]
    now = time.time() if now_s is None else now_s
    return Since(at=datetime.fromtimestamp(now - back_s, tz=UTC))


@dataclass(frozen=True, slots=True)
class StreamedEvent:
    """One event and its stream sequence (0 for a live, core-NATS event)."""

    seq: int
    event: Event
    subject: str


def _sequence(msg: Msg) -> int:
    try:
        return int(msg.metadata.sequence.stream)
    except (nats.errors.Error, AttributeError, ValueError):
        return 0


def event_json(e: Event, seq: int) -> str:
    """One event as a JSON line for scripts: the Event with its stream sequence ``seq``
    (0 when it came live, not from the stream)."""
    return _json.encode({"seq": seq, **msgspec.structs.asdict(e), "type": "Event"}).decode()


class EventFeed:
    """Events matching the filters, oldest first, for as long as it is open::

        async with EventFeed(nc, subjects, kind="placed", since=Since(seq=42)) as feed:
            async for item in feed:
                print(item.seq, item.event.machine_id)

    With ``since``: replayed from the event stream, then followed (an ordered consumer);
    entering raises EventsError when the server has no JetStream or no event stream for
    this prefix. Without: live events (core NATS, at-most-once). An unreadable message is
    skipped after ``on_bad(subject, error)``.
    """

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        region: str = "*",
        worker: str = "*",
        kind: str = "*",
        since: Since | None = None,
        on_bad: Callable[[str, BadMessage], None] | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.subject = subjects.events(region, worker, kind)
        self.since = since
        self.on_bad = on_bad
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: Subscription | None = None

    async def _on_msg(self, msg: Msg) -> None:
        self._queue.put_nowait(msg)

    async def __aenter__(self) -> EventFeed:
        if self.since is None:
            self._sub = await self.nc.subscribe(self.subject, cb=self._on_msg)
            await flush_all(self.nc)  # the subscription is the server's before we return
            return self
        if not await jetstream_available(self.nc):
            raise EventsError(
                "--since needs JetStream on the NATS server (events are stored only there); "
                "without it, watch follows live events only"
            )
        name = stream_name(self.subjects.prefix)
        try:
            self._sub = await self.nc.jetstream().subscribe(
                self.subject,
                cb=self._on_msg,
                stream=name,
                ordered_consumer=True,
                config=self.since.consumer(),
            )
        except nats.js.errors.NotFoundError:
            raise EventsError(
                f"no event stream {name} on the server: no supplier with durable events has "
                "started on this prefix yet"
            ) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def __aiter__(self) -> EventFeed:
        return self

    async def __anext__(self) -> StreamedEvent:
        while True:
            msg = await self._queue.get()
            try:
                event = decode(msg.data, Event)
            except BadMessage as exc:
                if self.on_bad is not None:
                    self.on_bad(msg.subject, exc)
                continue
            seq = _sequence(msg) if self.since is not None else 0
            return StreamedEvent(seq, event, msg.subject)
