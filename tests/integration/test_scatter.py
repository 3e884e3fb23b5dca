"""The one scatter-gather (bourse/nats/scatter.py) that the client's status, explain and
listings and the exchange's reclaim check read their replies through, on a real server:
every responder's reply, the server's no-responders answer at once, a timeout past the
last reply, and an inbox of its own per request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import nats.errors
import pytest
from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.nats.scatter import scatter
from tests.market import Market


async def test_every_responder_answers_into_an_inbox_of_the_requests_own(market: Market) -> None:
    asker, a, b = [await market.connect(n) for n in ("asker", "a", "b")]
    subject = f"{market.subjects.root}.fanout"
    inboxes: list[str] = []

    def answering(name: bytes) -> Callable[[Msg], Awaitable[None]]:
        async def answer(msg: Msg) -> None:
            inboxes.append(msg.reply)
            await msg.respond(name + b":" + msg.data)

        return answer

    for nc, name in ((a, b"a"), (b, b"b")):
        await nc.subscribe(subject, cb=answering(name))
        await flush_all(nc)

    async with scatter(asker, subject, b"hi") as replies:
        got = {await replies.next(5.0), await replies.next(5.0)}
        with pytest.raises(nats.errors.TimeoutError):
            await replies.next(0.05)  # two responders, two replies
    assert got == {b"a:hi", b"b:hi"}

    async with scatter(asker, subject, b"again") as replies:
        assert await replies.next(5.0) in (b"a:again", b"b:again")
    # one inbox per request, both of its replies there; the next request's another
    assert inboxes[0] == inboxes[1] and inboxes[2] != inboxes[0]


async def test_a_request_nobody_hears_is_said_at_once(market: Market) -> None:
    asker = await market.connect("asker")
    async with scatter(asker, f"{market.subjects.root}.nobody", b"hi") as replies:
        assert await replies.next(5.0) is None
