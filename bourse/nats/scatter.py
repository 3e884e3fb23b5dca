"""Scatter-gather: one request published to a fan-out subject, every reply read.

nats-py's ``request`` returns the first reply only. A gather (a region's status, an
explanation, a machine listing, the exchange's check of a reclaimed machine) subscribes an
inbox of its own, publishes the request with that inbox as its reply subject and reads the
replies until it has what it wants or its time is up; the inbox goes with the gather.
Each inbox ends in a random token: a responder may publish into the requester's inbox
prefix, and one that could guess a gather's inbox could answer for others.

A request that reached nobody is answered by the server with a ``503`` status (no
responders): :meth:`Replies.next` says so with None, so "nobody serves this subject" is
known at once instead of at the gather's deadline.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


def no_responders(msg: Msg) -> bool:
    """A 503 status: the request reached nobody on its subject."""
    return msg.headers is not None and msg.headers.get("Status") == "503"


class Replies:
    """The replies to one scattered request, as they arrive."""

    def __init__(self, sub: Subscription) -> None:
        self._sub = sub

    async def next(self, timeout: float | None = None) -> bytes | None:
        """The next reply's bytes, or None when the request reached nobody (the server's
        503). ``timeout`` None: as long as the caller's scope allows; else
        ``nats.errors.TimeoutError`` (an asyncio TimeoutError too) once it passes."""
        msg = await self._sub.next_msg(timeout=timeout)
        return None if no_responders(msg) else msg.data


@contextlib.asynccontextmanager
async def scatter(nc: NATS, subject: str, body: bytes) -> AsyncIterator[Replies]:
    """Publish ``body`` to ``subject`` with an inbox of its own as the reply subject; its
    replies while the block runs (the inbox is unsubscribed at its end)."""
    inbox = f"{nc.new_inbox()}.{secrets.token_hex(16)}"
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, body, reply=inbox)
        yield Replies(sub)
    finally:
        with contextlib.suppress(nats.errors.Error):  # the connection is gone: so is it
            await sub.unsubscribe()
