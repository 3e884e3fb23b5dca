"""Admission (bourse/auction/admission.py) on a real market: past the limit an order waits a
share of its deadline for a slot, then is refused at once with a clear Error; the exchange
and a direct buyer behave the same."""

from __future__ import annotations

import asyncio

import pytest

from bourse.auction.admission import ConcurrencyLimit
from bourse.auction.auctioneer import Auctioneer
from bourse.client import OVERLOADED_CODE, BourseClient, ClientError
from bourse.wire.codec import decode, encode
from bourse.wire.messages import OVERLOADED_REASON, Error, Placed, Unfilled
from exchange.service import ExchangeService
from tests.market import Market, order, wait_until, worker


async def _one_slot_busy(buyer: BourseClient, limit: ConcurrencyLimit) -> None:
    """An order that holds the only slot for the quiet window (nobody can take 64 cpus),
    while a 100 ms order waits 25 ms for a slot and is refused."""
    slow = asyncio.ensure_future(buyer.place(order(cpus=64, order_id="slow")))
    await wait_until(lambda: limit.inflight == 1)  # it has the slot
    with pytest.raises(ClientError, match="exchange overloaded: 1 auctions in flight") as exc:
        await buyer.place(order(order_id="late", deadline_ms=100))
    assert exc.value.code == OVERLOADED_CODE  # told apart from other internal errors
    slow_result = await slow
    assert isinstance(slow_result, Unfilled) and slow_result.reason == "no_offers"
    placed = await buyer.place(order(order_id="late"))  # the slot is free
    assert isinstance(placed, Placed)


async def test_a_full_exchange_refuses_after_a_share_of_the_deadline(market: Market) -> None:
    await market.host(worker("mad-1"))
    svc = ExchangeService(
        await market.connect("ex"), market.subjects, max_inflight=1, target_auction_ms=0
    )
    await market.serve(svc)
    market.exchanges.append(svc)
    await _one_slot_busy(await market.client(), svc.admission)
    assert svc.responder.counts["shed"] == 1
    # the slot is given back once the placed claim's write is acknowledged, just after the
    # buyer was answered (the answer does not wait for it, docs/protocol.md §5.3c)
    await wait_until(lambda: svc.admission.inflight == 0)
    assert svc.admission.refused == 1


async def test_on_the_wire_a_refusal_is_an_internal_error_with_reason_overloaded(
    market: Market,
) -> None:
    """A v1 client that does not know Error.reason still sees an internal error; a newer
    one tells overload apart by the reason, not by the detail's words."""
    await market.host(worker("mad-1"))
    svc = ExchangeService(
        await market.connect("ex"), market.subjects, max_inflight=1, target_auction_ms=0
    )
    await market.serve(svc)
    market.exchanges.append(svc)
    assert svc.admission.try_acquire()  # the only slot is busy
    nc = await market.connect("raw")
    msg = await nc.request(market.subjects.order("mad"), encode(order(deadline_ms=40)), timeout=2)
    error = decode(msg.data, Error)
    assert (error.code, error.reason) == ("internal", OVERLOADED_REASON)
    assert error.detail.startswith("exchange overloaded: 1 auctions in flight (limit 1)")
    svc.admission.release(None)


async def test_a_direct_buyer_with_admission_refuses_the_same_way(market: Market) -> None:
    await market.host(worker("mad-1"))
    limit = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    buyer = BourseClient(
        await market.connect("buyer"), market.subjects, direct=True, admission=limit
    )
    await _one_slot_busy(buyer, limit)
    assert (limit.refused, limit.inflight) == (1, 0)


async def test_time_spent_waiting_for_a_slot_comes_off_the_auctions_deadline(
    market: Market,
) -> None:
    await market.host(worker("mad-1"))
    auctioneer = Auctioneer(await market.connect("auction"), market.subjects)
    try:
        # Nobody can take 64 cpus: the auction waits for offers until the quiet window
        # (100 ms) or its deadline, whichever comes first. 295 of 300 ms were spent in line.
        r = await auctioneer.run(order(cpus=64, order_id="late", deadline_ms=300), spent_ms=295)
        assert isinstance(r, Unfilled) and r.elapsed_ms < 80  # not the 100 ms quiet window
        full = await auctioneer.run(order(cpus=64, order_id="fresh", deadline_ms=300))
        assert isinstance(full, Unfilled) and full.elapsed_ms >= 100
    finally:
        await auctioneer.close()


async def test_a_burst_on_an_idle_fleet_with_room_is_placed_not_refused(market: Market) -> None:
    """200 orders at once through one exchange (the limit starts at 64), on an idle fleet
    with room for every one of them: admission refuses none as overloaded (the orders in
    line wait while their deadline leaves time for an auction), and every one is placed.
    Their deadline and the auctions' quiet window leave time on a busy machine too: there
    auctions are slower than the target, the limit is cut (to 32 under two CPU burners),
    the back of the line waits longer than the default 500 ms allows (refusing it would be
    right) and the supplier answers a slot's worth of bids later than the default 100 ms
    quiet window. How long an order may wait (its deadline less an average auction, not a
    quarter of it) is tests/unit/test_admission.py's."""
    await market.host(*(worker(f"mad-{i}", cpus=64, memory_mb=1 << 16) for i in range(4)))
    svc = await market.exchange()
    buyers = [await market.client() for _ in range(4)]

    async def place(i: int) -> Placed | Unfilled | ClientError:
        try:
            return await buyers[i % 4].place(order(order_id=f"burst-{i}"))
        except ClientError as exc:
            return exc

    results = await asyncio.gather(*(place(i) for i in range(200)))
    refused = [r for r in results if isinstance(r, ClientError)]
    assert not refused, f"{len(refused)} refused, e.g. {refused[0]}"
    assert svc.admission.refused == 0
    unplaced = [r for r in results if not isinstance(r, Placed)]
    assert not unplaced, unplaced[:3]
