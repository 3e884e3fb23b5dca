"""Placements end to end through a real exchange on a real nats-server."""

from __future__ import annotations

import asyncio
import re

import pytest
from nats.aio.msg import Msg

from bourse.wire.codec import decode
from bourse.wire.messages import Event, Placed
from tests.market import Market, order, wait_until, worker

ULID_RE = r"[0-9A-HJKMNP-TV-Z]{26}"


async def test_placement_through_the_exchange_fills_every_field(market: Market) -> None:
    host = await market.host(worker("mad-1", cpus=8, memory_mb=8192, images=["web"]))
    await market.exchange()
    buyer = await market.client()
    events: list[Event] = []
    placed_seen = asyncio.Event()

    async def on_event(msg: Msg) -> None:
        events.append(decode(msg.data, Event))
        placed_seen.set()

    sub = await buyer.nc.subscribe(market.subjects.events(), cb=on_event)

    o = order(cpus=2, memory_mb=2048, image="web", order_id="order-1", metadata={"app": "api"})
    r = await buyer.place(o)

    assert isinstance(r, Placed)
    assert r.order_id == "order-1"
    assert r.worker_id == "mad-1"
    assert r.region == "mad"
    assert re.fullmatch(rf"mad-1~{ULID_RE}", r.machine_id)
    assert r.image_cached is True
    # spread: cpus f(2/8) = 0.75, memory f(2048/8192) = 0.75, utility 0.75;
    # score = 0.7 * 0.75 + 0.3 * 1 (image cached) = 0.825
    assert r.score == pytest.approx(0.825)
    assert r.subscores == {"cpus": 0.75, "memory_mb": 0.75, "utility": 0.75, "image": 1.0}
    assert 0 < r.elapsed_ms < o.deadline_ms
    assert r.existing is False

    m = host.workers["mad-1"].machines[r.machine_id]
    assert (m.order_id, m.state, m.image, m.metadata) == (
        "order-1",
        "reserved",
        "web",
        {"app": "api"},
    )
    assert host.workers["mad-1"].ledger.committed == (2000, 2048, 0, 0, 0)  # CPU in millicores
    await asyncio.wait_for(placed_seen.wait(), 5)
    assert events[0].kind == "placed" and events[0].machine_id == r.machine_id
    await sub.unsubscribe()


async def test_cached_image_beats_an_emptier_worker_and_subscores_say_why(market: Market) -> None:
    await market.host(
        worker("cold", cpus=16, memory_mb=16384),
        worker("warm", cpus=8, memory_mb=8192, images=["web"]),
    )
    await market.exchange()
    r = await (await market.client()).place(order(cpus=2, memory_mb=2048, image="web"))
    assert isinstance(r, Placed)
    assert r.worker_id == "warm"
    # cold: utility 0.875 -> 0.7*0.875 = 0.6125; warm: utility 0.75 -> 0.525 + 0.3 = 0.825
    assert r.subscores["image"] == 1.0
    assert r.score == pytest.approx(0.825)


async def test_emptier_worker_wins_under_spread_fuller_under_binpack(market: Market) -> None:
    spread = {"preset": "spread"}
    binpack = {"preset": "binpack"}
    await market.host(
        worker("big", region="spr", cpus=32, memory_mb=32768, pricing=spread),
        worker("small", region="spr", cpus=4, memory_mb=4096, pricing=spread),
        worker("big-b", region="bin", cpus=32, memory_mb=32768, pricing=binpack),
        worker("small-b", region="bin", cpus=4, memory_mb=4096, pricing=binpack),
    )
    await market.exchange()
    buyer = await market.client()
    r1 = await buyer.place(order(region="spr", cpus=2, memory_mb=1024, image="x"))
    r2 = await buyer.place(order(region="bin", cpus=2, memory_mb=1024, image="x"))
    assert isinstance(r1, Placed) and isinstance(r2, Placed)
    assert r1.worker_id == "big"  # u = 2/32: spread likes it
    assert r2.worker_id == "small-b"  # u = 2/4: binpack likes it
    assert r1.subscores["cpus"] == pytest.approx(1 - 2 / 32)
    assert r2.subscores["cpus"] == pytest.approx(2 / 4)


async def test_direct_mode_places_without_an_exchange(market: Market) -> None:
    await market.host(worker("mad-1"))
    r = await (await market.client(direct=True)).place(order())
    assert isinstance(r, Placed) and r.worker_id == "mad-1"


async def test_constraints_and_exclusions_pick_the_matching_worker(market: Market) -> None:
    await market.host(
        worker("a", labels={"disk": "hdd"}),
        worker("b", labels={"disk": "ssd"}),
        worker("c", labels={"disk": "ssd"}),
    )
    await market.exchange()
    buyer = await market.client()
    r = await buyer.place(order(constraints={"disk": "ssd"}, exclude_workers=["b"]))
    assert isinstance(r, Placed) and r.worker_id == "c"


async def test_losing_offers_have_their_holds_released_at_once(market: Market) -> None:
    host = await market.host(*(worker(f"w{i}") for i in range(5)))
    await market.exchange()
    r = await (await market.client()).place(order())
    assert isinstance(r, Placed)
    workers = host.workers.values()
    # The region-wide Release follows the Placed reply; no TTL wait is needed (the holds
    # live the order's deadline, 10 s, and more: nothing else drops them this soon).
    await wait_until(lambda: all(not w.ledger.holds for w in workers), timeout_s=5)
    assert sum(w.ledger.committed[0] for w in workers) == 1000  # one CPU, in millicores


async def _offers_for_one_bid(market: Market) -> list[str]:
    from bourse.wire.codec import encode
    from bourse.wire.messages import Bid, Offer, Resources

    nc = await market.connect("bidder")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    bid = Bid(
        order_id="o",
        region="mad",
        resources=Resources(cpus=1, memory_mb=64),
        image="x",
        hold_ms=5000,
    )
    await nc.publish(market.subjects.bid("mad"), encode(bid), reply=inbox)
    first = decode((await sub.next_msg(2)).data, Offer)
    got = [first.worker_id]
    # The host sends its offers from one pass; once the first arrived, the rest follow in
    # order within spread_ms. Read until the holds say how many were made.
    host = market.hosts[0]
    held = sum("o" in w.ledger.holds for w in host.workers.values())
    while len(got) < held:
        got.append(decode((await sub.next_msg(2)).data, Offer).worker_id)
    return got


async def test_a_big_host_offers_only_its_best_workers(market: Market) -> None:
    # w0 is the emptiest (spread likes it), then w1, w2...
    host = await market.host(
        *(worker(f"w{i}", cpus=8 + 8 * (9 - i)) for i in range(10)), max_offers=3
    )
    offers = await _offers_for_one_bid(market)
    assert offers == ["w0", "w1", "w2"]  # best first; only 3 holds exist
    assert sum(bool(w.ledger.holds) for w in host.workers.values()) == 3


async def test_max_offers_0_offers_every_fitting_worker(market: Market) -> None:
    await market.host(*(worker(f"w{i}") for i in range(10)), max_offers=0)
    assert len(await _offers_for_one_bid(market)) == 10
