"""An exchange in one cluster places orders in regions served by suppliers in other
clusters of a supercluster: placement stays strict to the region and immediate-or-cancel."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from bourse.client import BourseClient
from bourse.nats.connection import connect, shutdown
from bourse.nats.supercluster import Supercluster
from bourse.runtime.launcher import Program
from bourse.wire.messages import Placed, Unfilled
from bourse.wire.subjects import Subjects
from tests.market import order
from tests.topology.programs import exchange, supplier

pytestmark = pytest.mark.asyncio(loop_scope="module")

PREFIX = "topo"


@dataclass
class Market:
    sc: Supercluster
    programs: list[Program]
    buyer: BourseClient  # connected to cluster a, like the exchange


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def market(
    three_clusters: Supercluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Market]:
    """mad-1 (4 cpus) on cluster b, sjc-1 (32 cpus) on cluster c, the exchange on a."""
    root: Path = tmp_path_factory.mktemp("market")
    sc = three_clusters
    programs: list[Program] = []
    try:
        programs.append(await supplier(sc.urls("b"), PREFIX, root, "mad-1", "mad", 4))
        programs.append(await supplier(sc.urls("c"), PREFIX, root, "sjc-1", "sjc", 32))
        programs.append(await exchange(sc.urls("a"), PREFIX, root, "exchange-a"))
        nc = await connect(sc.urls("a"), name="buyer-a", service=False)
        try:
            buyer = BourseClient(nc, Subjects(PREFIX))
            await until_regions_answer(buyer, ["mad", "sjc"])
            yield Market(sc, programs, buyer)
        finally:
            await shutdown(nc)
    finally:
        for p in reversed(programs):
            assert await p.stop() == 0, p.log


async def until_regions_answer(buyer: BourseClient, regions: list[str]) -> None:
    """Until a status request from cluster a reaches every region's suppliers (their
    subscriptions' interest has crossed the gateways)."""
    deadline = time.monotonic() + 10
    while missing := [r for r in regions if not await buyer.status(r)]:
        assert time.monotonic() < deadline, f"no supplier answers from {missing}"


async def held_and_committed(buyer: BourseClient, region: str) -> list[tuple[int, int]]:
    return [(s.held.cpus, s.committed.cpus) for s in await buyer.status(region)]


async def test_each_program_is_on_the_cluster_it_was_given(market: Market) -> None:
    sc = market.sc
    assert sc.server_of("exchange-a").startswith("a-")
    assert sc.server_of("buyer-a").startswith("a-")
    assert sc.server_of("bourse-supplier:mad-1") == "b-1"
    assert sc.server_of("bourse-supplier:sjc-1") == "c-1"


async def test_exchange_in_a_places_in_a_region_served_by_b(market: Market) -> None:
    r = await market.buyer.place(order(region="mad", cpus=2, memory_mb=1024, image="web"))
    assert isinstance(r, Placed), r
    assert (r.worker_id, r.region, r.image_cached) == ("mad-1", "mad", True)
    # machine verbs go through the exchange in a to the worker in b, and back
    assert (await market.buyer.machine("start", r.machine_id)).state == "started"
    assert (await market.buyer.machine("destroy", r.machine_id)).state == "destroyed"
    assert await held_and_committed(market.buyer, "mad") == [(0, 0)]


async def test_a_region_too_small_never_borrows_another_region(market: Market) -> None:
    # 8 cpus: mad-1 (4) cannot, sjc-1 (32) could, but sjc is another region
    r = await market.buyer.place(order(region="mad", cpus=8, memory_mb=1024))
    assert isinstance(r, Unfilled), r
    assert (r.region, r.reason, r.offers, r.commits_tried) == ("mad", "no_offers", 0, 0)
    assert await held_and_committed(market.buyer, "sjc") == [(0, 0)]
    assert (await market.buyer.machines("sjc-1", include_destroyed=True)).machines == []


async def test_a_region_nobody_serves_in_any_cluster_is_unfilled_at_once(market: Market) -> None:
    # The 503 "no responders" crosses the gateways too: no cluster has interest in lhr.
    for _ in range(3):
        r = await market.buyer.place(order(region="lhr", deadline_ms=2000))
        assert isinstance(r, Unfilled), r
        assert (r.region, r.reason, r.offers) == ("lhr", "no_workers", 0)
        assert r.elapsed_ms < 1000  # answered, not timed out at the deadline
    assert await held_and_committed(market.buyer, "mad") == [(0, 0)]
    assert await held_and_committed(market.buyer, "sjc") == [(0, 0)]


async def test_ioc_across_the_gateway_releases_every_hold(market: Market) -> None:
    # offers come back from b, none is good enough: unfilled at once, nothing stays held
    r = await market.buyer.place(order(region="mad", cpus=4, memory_mb=1024, min_score=1.0))
    assert isinstance(r, Unfilled), r
    assert (r.reason, r.offers, r.commits_tried) == ("below_min_score", 1, 0)
    deadline = time.monotonic() + 5
    while (now := await held_and_committed(market.buyer, "mad")) != [(0, 0)]:
        assert time.monotonic() < deadline, f"still held/committed on mad-1: {now}"
    # the whole worker is free again: an order for all of it is placed
    r = await market.buyer.place(order(region="mad", cpus=4, memory_mb=1024))
    assert isinstance(r, Placed) and r.worker_id == "mad-1", r
    await market.buyer.machine("destroy", r.machine_id)


async def test_orders_go_to_an_exchange_in_the_buyers_own_cluster(
    market: Market, tmp_path: Path
) -> None:
    # NATS prefers a queue-group member in the publisher's cluster: with an exchange in b,
    # a buyer on b never sends its orders over the gateway to the exchange in a.
    sc = market.sc
    ex_b = await exchange(sc.urls("b"), PREFIX, tmp_path, "exchange-b")
    nc = await connect(sc.urls("b"), name="buyer-b", service=False)
    try:
        buyer_b = BourseClient(nc, Subjects(PREFIX))
        before, before_b = orders_to(sc, "exchange-a"), orders_to(sc, "exchange-b")
        placed = [await buyer_b.place(order(region="sjc")) for _ in range(10)]
        assert all(isinstance(r, Placed) and r.worker_id == "sjc-1" for r in placed), placed
        assert orders_to(sc, "exchange-a") == before
        assert orders_to(sc, "exchange-b") == before_b + 10
        for r in placed:
            assert isinstance(r, Placed)
            await buyer_b.machine("destroy", r.machine_id)
    finally:
        await shutdown(nc)
        assert await ex_b.stop() == 0


def orders_to(sc: Supercluster, connection: str) -> int:
    """Orders the server has delivered to a named client connection: the messages of its
    subscription to the order subjects (connz, subscription detail), not all it got (an
    exchange also gets its tag watch's heartbeats, a busy machine's slow test more)."""
    server = sc.server_of(connection)
    [conn] = [
        c
        for c in sc.monitor(server, "connz?subs=detail")["connections"]
        if c.get("name") == connection
    ]
    subject = Subjects(PREFIX).order_all
    return sum(int(s["msgs"]) for s in conn["subscriptions_list_detail"] if s["subject"] == subject)
