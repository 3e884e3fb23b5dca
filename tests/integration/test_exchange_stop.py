"""An exchange stopped by SIGTERM answers the buyers it has orders of, before it exits: an
order whose auction the stop cuts short and an order waiting for an admission slot each
get ``Error{internal, reason: "shutting_down"}`` at once, not silence until their own
timeout; the program still exits within the stop's bound. A real ``exchange serve``
process on a real nats-server."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from bourse.auction.broker import SHUTTING_DOWN
from bourse.nats.connection import flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.codec import decode, encode
from bourse.wire.messages import SHUTTING_DOWN_REASON, Error, Placed, Unfilled
from tests.integration.test_metrics import scrape, value
from tests.integration.test_signals import assert_stopped, exchange_args, program
from tests.market import Market, order, wait_until

DEADLINE_MS = 10_000  # without an answer, the buyers would wait out this and more


async def test_sigterm_answers_the_buyers_of_the_orders_in_flight(
    nats_server: EmbeddedNats, market: Market, tmp_path: Path
) -> None:
    s = market.subjects
    # a passive listener on the region's bids: the auction hears no "no responders" and
    # waits for offers until its deadline (its quiet window is longer)
    listener = await market.connect("listener")
    bids = await listener.subscribe(f"{s.bid('mad')}.>")
    plain = await listener.subscribe(s.bid("mad"))
    await flush_all(listener)
    args = [
        *exchange_args(nats_server.url, s.prefix),
        *("--max-inflight", "1", "--quiet-ms", "60000", "--metrics-addr", "127.0.0.1:0"),
    ]
    async with program("exchange", *args, log_path=tmp_path / "ex.log") as ex:
        ready = await ex.ready("exchange ready")
        found = re.search(r"metrics on (\S+)", ready)
        assert found is not None, ready
        metrics = found.group(1)
        buyer = await market.connect("buyer")

        async def ask(order_id: str) -> tuple[Placed | Unfilled | Error, float]:
            o = order(order_id=order_id, deadline_ms=DEADLINE_MS)
            msg = await buyer.request(s.order("mad"), encode(o), timeout=DEADLINE_MS / 2000)
            answer: Placed | Unfilled | Error = decode(msg.data, Placed | Unfilled | Error)
            return answer, time.monotonic()

        # One order's auction holds the only slot, the other waits in line: sent together,
        # so the second comes while the slot is fresh (one that came once no order had found
        # a free slot for 100 ms, a busy machine's, would wait only 25 ms: overload).
        running = asyncio.ensure_future(ask("in-auction"))
        waiting = asyncio.ensure_future(ask("in-line"))
        first = asyncio.ensure_future(plain.next_msg(timeout=5))
        batched = asyncio.ensure_future(bids.next_msg(timeout=5))
        await asyncio.wait([first, batched], return_when=asyncio.FIRST_COMPLETED)
        for f in (first, batched):  # a bid went out: its auction holds the only slot
            f.cancel()
        await wait_until(lambda: value(scrape(metrics), "bourse_admission_waiting") == 1)
        code, elapsed = await ex.stop()
        stopped = time.monotonic()
        for answer, at in (await running, await waiting):
            assert isinstance(answer, Error), answer
            assert (answer.code, answer.reason) == ("internal", SHUTTING_DOWN_REASON)
            assert answer.detail == SHUTTING_DOWN
            assert at <= stopped, "answered only after the exchange had gone"
        assert_stopped(code, elapsed, ex.log)


async def test_an_order_that_comes_once_the_stop_began_is_refused_at_once(
    market: Market,
) -> None:
    """Queued on the exchange's subscription when its stop began (the subscription is
    drained, not dropped): answered ``shutting_down``, counted, nothing bid."""
    svc = await market.exchange()
    svc.broker.stop()  # the stop's first step
    nc = await market.connect("buyer")
    msg = await nc.request(market.subjects.order("mad"), encode(order()), timeout=2)
    answer = decode(msg.data, Error)
    assert (answer.code, answer.reason) == ("internal", SHUTTING_DOWN_REASON)
    assert svc.admission.inflight == 0 and svc.responder.counts["error.internal"] == 1
