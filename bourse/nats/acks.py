"""JetStream publishes whose answers come back on one subscription.

nats-py's ``publish_async`` gives each publish a future, a timer, a random reply subject and
a parsed ``PubAck``: about three times the client's CPU a message of a plain publish with a
reply subject. A supplier publishes every machine's row and event into streams (thousands a
second on a busy one), so it sends each with the reply ``<inbox>.<ticket>`` instead, and one
subscription on ``<inbox>.*`` reads the answers: a ticket and what became of its message
(:class:`Answer`), handed to a callback. Nothing here waits for an answer or gives one up:
the caller knows which tickets it sent and when (supplier/rows.py, supplier/outbox.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

NO_RESPONDERS = "503"  # the status a publish gets when no stream takes its subject


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server said of one publish: ``stored`` (``duplicate``: a message id it had
    already), else refused: ``no_stream`` (no stream takes the subject) or ``error`` (the
    stream's error object, e.g. ``{"code": 503, "err_code": 10077, ...}``)."""

    stored: bool
    duplicate: bool = False
    no_stream: bool = False
    error: object = None


def answer_of(data: bytes, status: str | None) -> Answer:
    """A publish's answer from its reply's body and status header (pure)."""
    if not data:
        return Answer(False, no_stream=status == NO_RESPONDERS, error=status)
    if b'"error"' in data:
        try:
            error = json.loads(data).get("error")
        except ValueError:
            error = data[:200].decode(errors="replace")
        return Answer(False, error=error)
    return Answer(True, duplicate=b'"duplicate":true' in data)


class StreamAcks:
    """Publishes into streams with their answers on one subscription (see the module doc):
    ``on_answer(ticket, answer)`` hears each, in the order they come (an answer to a
    ticket the caller gave up is the caller's to ignore)."""

    def __init__(self, nc: NATS, on_answer: Callable[[int, Answer], None]) -> None:
        self.nc = nc
        self.on_answer = on_answer
        self._tickets = 0
        self._prefix = ""
        self._sub: Subscription | None = None

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        """Publish; its ticket (the caller's key to its answer). Raises what the client's
        publish raises (a closed connection)."""
        if self._sub is None:
            self._prefix = self.nc.new_inbox() + "."
            self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._answer)
        self._tickets += 1
        ticket = self._tickets
        await self.nc.publish(subject, data, reply=f"{self._prefix}{ticket}", headers=headers)
        return ticket

    async def _answer(self, msg: Msg) -> None:
        try:
            ticket = int(msg.subject[len(self._prefix) :])
        except ValueError:
            return
        status = msg.headers.get("Status") if msg.headers else None
        self.on_answer(ticket, answer_of(msg.data, status))

    async def close(self) -> None:
        """Stop hearing answers (at most a second's wait on the server)."""
        sub, self._sub = self._sub, None
        if sub is not None and self.nc.is_connected:
            with anyio.move_on_after(1.0, shield=True), contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
