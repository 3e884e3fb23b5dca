"""The broker (bourse/auction/broker.py): admission + the auction behind one ``place`` that
returns Placed, Unfilled or a typed Refused, for the exchange and direct mode alike. On a
real nats-server with real suppliers (how each refusal travels: tests/unit/test_broker.py)."""

from __future__ import annotations

import asyncio

import pytest

from bourse.auction.admission import ConcurrencyLimit
from bourse.auction.auctioneer import Auctioneer
from bourse.auction.broker import Broker, Refused
from bourse.auction.core import AuctionConfig
from bourse.client import OVERLOADED_CODE, BourseClient, ClientError
from bourse.wire.messages import Placed, Unfilled
from tests.market import ROOMY_QUIET_MS, Market, collect, order, wait_until, worker


async def _broker(market: Market, limit: ConcurrencyLimit | None = None) -> Broker:
    """A broker whose auctions listen as long as the market's do (ROOMY_QUIET_MS): an order
    nobody can fill stays under way that long, time for a busy machine's next step."""
    config = AuctionConfig(quiet_ms=ROOMY_QUIET_MS)
    return Broker(Auctioneer(await market.connect("broker"), market.subjects, config), limit)


async def test_a_placement_feeds_the_limit_and_frees_its_slot(market: Market) -> None:
    await market.host(worker("mad-1"))
    limit = ConcurrencyLimit(ceiling=100, target_ms=25, floor=4, initial=10)
    broker = await _broker(market, limit)
    try:
        placed = await broker.place(order())
        assert isinstance(placed, Placed) and placed.worker_id == "mad-1"
        assert limit.avg_ms is not None and limit.inflight == 0
        before = limit.avg_ms
        unfilled = await broker.place(order(cpus=64))  # no_offers: a quiet window by design
        assert isinstance(unfilled, Unfilled) and unfilled.reason == "no_offers"
        assert limit.avg_ms == before and limit.inflight == 0
    finally:
        await broker.close()


async def test_a_full_limit_refuses_as_overloaded(market: Market) -> None:
    await market.host(worker("mad-1"))
    limit = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    broker = await _broker(market, limit)
    try:
        assert limit.try_acquire()  # the only slot is busy
        refused = await broker.place(order(deadline_ms=40))  # waits 10 ms for a slot
        assert refused == Refused(
            "overloaded",
            "exchange overloaded: 1 auctions in flight (limit 1), 0 orders waiting, 0 queued; "
            "try again",
        )
        assert (limit.refused, limit.inflight) == (1, 1)
        limit.release(None)
        assert isinstance(await broker.place(order()), Placed)  # the slot is free
    finally:
        await broker.close()


async def test_an_order_id_in_use_by_another_order_is_refused(market: Market) -> None:
    await market.host(worker("mad-1", cpus=4))
    bids = await collect(await market.connect("spy"), market.subjects.bid("mad"))
    broker = await _broker(market)
    try:
        first = asyncio.ensure_future(broker.place(order(cpus=64, order_id="x")))  # no fit
        await wait_until(lambda: bool(bids))  # its auction is under way
        refused = await broker.place(order(cpus=2, order_id="x"))
        assert refused == Refused(
            "conflicting_order",
            "order id 'x' is already in use by a different order (region 'mad') that is "
            "being placed now",
        )
        same = await broker.place(order(cpus=64, order_id="x"))  # a duplicate: shares it
        assert same == await first and isinstance(same, Unfilled)
    finally:
        await broker.close()


async def test_a_disconnected_broker_cannot_run(market: Market) -> None:
    nc = await market.connect("gone")
    await nc.close()
    broker = Broker(Auctioneer(nc, market.subjects))
    assert await broker.place(order()) == Refused(
        "cannot_run", "not connected to NATS: refusing to send a bid that may go stale"
    )
    buyer = BourseClient(nc, market.subjects, direct=True)  # direct mode: the same refusal
    with pytest.raises(ClientError, match="not connected to NATS") as exc:
        await buyer.place(order())
    assert exc.value.code == "internal"


async def test_a_direct_buyer_maps_refusals_like_exchange_errors(market: Market) -> None:
    limit = ConcurrencyLimit(ceiling=1, target_ms=0, floor=1)
    buyer = BourseClient(
        await market.connect("buyer"), market.subjects, direct=True, admission=limit
    )
    assert limit.try_acquire()
    with pytest.raises(ClientError, match=r"^exchange overloaded: 1 auctions") as exc:
        await buyer.place(order(deadline_ms=4))
    assert exc.value.code == OVERLOADED_CODE
    await buyer.close()


async def test_overloaded_without_admission_still_says_why(market: Market) -> None:
    broker = await _broker(market)  # the exchange's backlog refusal, without a limit
    assert broker.overloaded(3) == Refused("overloaded", "overloaded: 3 queued; try again")
