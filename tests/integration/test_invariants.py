"""I1 no overcommit, I3 one machine per order id, I4 Unfilled leaves nothing, I5 strict region."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
from nats.aio.msg import Msg

from bourse.auction.core import AuctionConfig
from bourse.client import ClientError
from bourse.nats.connection import flush_all
from bourse.wire.messages import Placed, Unfilled
from tests.market import Market, order, wait_until, worker


async def test_i1_200_concurrent_orders_fill_exactly_the_fleet_and_never_overcommit(
    market: Market,
) -> None:
    # 3 workers x 6 cpus = 18 one-cpu slots (memory is not the limit).
    host = await market.host(*(worker(f"w{i}", cpus=6, memory_mb=65536) for i in range(3)))
    # two instances share the queue group; the protocol's quiet window, not the market's
    # roomy one: 182 orders end no_offers by design, and each would hold a slot that long
    # (the fleet fills whatever the window: an order that misses a free slot leaves it to
    # the next one)
    for _ in range(2):
        await market.exchange(quiet_ms=AuctionConfig().quiet_ms)
    buyer = await market.client()
    peaks: list[str] = []

    async def watch() -> None:  # I1 at all times, not only at the end
        while True:
            peaks.extend(market.violations())
            await asyncio.sleep(0.001)  # the sampling pace of the check, not a sync

    async def place() -> Placed | Unfilled:
        o = order(cpus=1, memory_mb=64, deadline_ms=2000)
        for _ in range(9):  # as a client does: an overloaded refusal says "try again"
            try:
                return await buyer.place(o)
            except ClientError as exc:
                if exc.code != "overloaded":
                    raise
                o = msgspec.structs.replace(o, retry=True)  # the same id
        return await buyer.place(o)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(place() for _ in range(200)))
    watcher.cancel()
    kinds = Counter(type(r).__name__ for r in results)
    assert kinds == {"Placed": 18, "Unfilled": 182}
    assert {r.reason for r in results if isinstance(r, Unfilled)} == {"no_offers"}
    assert peaks == []
    assert market.violations() == []
    per_worker = Counter(r.worker_id for r in results if isinstance(r, Placed))
    assert per_worker == {"w0": 6, "w1": 6, "w2": 6}
    assert all(w.ledger.committed[0] == 6000 for w in host.workers.values())  # millicores
    assert len({r.machine_id for r in results if isinstance(r, Placed)}) == 18


async def test_i3_same_order_id_twice_through_two_exchanges_gives_one_machine(
    market: Market,
) -> None:
    host = await market.host(*(worker(f"w{i}") for i in range(4)))
    await market.exchange()
    await market.exchange()
    buyers = [await market.client(), await market.client()]
    first = await buyers[0].place(order(order_id="dup-1"))
    # Sent again many times: the queue group spreads them over both exchange instances.
    again = await asyncio.gather(*(buyers[i % 2].place(order(order_id="dup-1")) for i in range(10)))
    assert isinstance(first, Placed) and first.existing is False
    placed = [r for r in again if isinstance(r, Placed)]
    assert len(placed) == len(again)
    assert {r.machine_id for r in placed} == {first.machine_id}
    assert all(r.existing for r in placed)
    machines = [m for w in host.workers.values() for m in w.machines.values()]
    assert [m.order_id for m in machines] == ["dup-1"]


async def test_i3_concurrent_duplicates_in_one_exchange_share_one_auction(market: Market) -> None:
    host = await market.host(*(worker(f"w{i}") for i in range(4)))
    await market.exchange()
    buyer = await market.client()
    rs = await asyncio.gather(*(buyer.place(order(order_id="dup-2")) for _ in range(8)))
    assert len({r.machine_id for r in rs if isinstance(r, Placed)}) == 1
    assert sum(len(w.machines) for w in host.workers.values()) == 1


async def test_i4_unfilled_leaves_no_machine_and_no_hold_past_the_ttl(market: Market) -> None:
    host = await market.host(worker("a"), worker("b"))
    await market.exchange()
    buyer = await market.client()
    r = await buyer.place(order(min_score=0.99, deadline_ms=100))
    assert isinstance(r, Unfilled) and r.offers == 2
    ws = list(host.workers.values())
    # Released at once by the auction; at the latest gone when the hold's TTL passes
    # (deadline 100 + commit grace 100 + margin 150 = 350 ms).
    await wait_until(lambda: all(not w.ledger.holds for w in ws), timeout_s=0.35)
    assert all(not w.machines for w in ws)
    assert all(w.ledger.committed == (0, 0, 0, 0, 0) for w in ws)


async def test_i4_a_hold_whose_auction_vanished_expires_by_its_ttl(market: Market) -> None:
    host = await market.host(worker("a"))
    nc = await market.connect("raw-bidder")
    from bourse.wire.codec import encode
    from bourse.wire.messages import Bid, Resources

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    bid = Bid(
        order_id="orphan",
        region="mad",
        resources=Resources(cpus=1, memory_mb=1),
        image="x",
        hold_ms=150,
    )
    await nc.publish(market.subjects.bid("mad"), encode(bid), reply=inbox)
    await sub.next_msg(timeout=2)  # the offer: a hold now exists, and nobody will commit
    w = host.workers["a"]
    assert "orphan" in w.ledger.holds
    await wait_until(lambda: "orphan" not in w.ledger.holds, timeout_s=2)
    assert w.ledger.held == (0, 0, 0, 0, 0)


async def test_i5_workers_of_other_regions_never_receive_the_bid(market: Market) -> None:
    await market.host(worker("mad-1", region="mad"), worker("fra-1", region="fra"))
    await market.exchange()
    spy = await market.connect("spy")
    seen: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        seen[msg.subject.rsplit(".", 1)[-1]] += 1

    await spy.subscribe(market.subjects.bid("*"), cb=count)
    await flush_all(spy)
    buyer = await market.client()
    rs = [await buyer.place(order(region="mad")) for _ in range(5)]
    await flush_all(spy)
    assert all(isinstance(r, Placed) and r.region == "mad" and r.worker_id == "mad-1" for r in rs)
    assert seen == {"mad": 5}


async def test_i3_a_second_process_for_the_same_worker_id_refuses_to_start(
    market: Market,
) -> None:
    import pytest

    from supplier.startup import WorkerIdInUse

    await market.host(worker("solo"))
    with pytest.raises(WorkerIdInUse, match="solo"):
        await market.host(worker("solo"))


async def test_an_order_without_a_reply_subject_places_nothing(market: Market) -> None:
    host = await market.host(worker("a"))
    svc = await market.exchange()
    nc = await market.connect("fire-and-forget")
    from bourse.wire.codec import encode

    await nc.publish(market.subjects.order("mad"), encode(order(order_id="no-reply")))
    await flush_all(nc)
    await wait_until(lambda: svc.responder.counts["order_without_reply"] == 1)
    assert not host.workers["a"].machines


async def test_i3_a_retry_that_excludes_the_machines_worker_still_gets_that_machine(
    market: Market,
) -> None:
    host = await market.host(worker("a"), worker("b"))
    await market.exchange()
    buyer = await market.client()
    first = await buyer.place(order(order_id="ex-1"))
    assert isinstance(first, Placed)
    again = await buyer.place(order(order_id="ex-1", exclude_workers=[first.worker_id]))
    assert isinstance(again, Placed) and again.machine_id == first.machine_id and again.existing
    assert sum(len(w.machines) for w in host.workers.values()) == 1


async def test_i3_attempts_that_differ_only_in_how_they_are_auctioned_share_one_run(
    market: Market,
) -> None:
    """Concurrent attempts in one process with the same id and the same order but other
    exclude_workers (or deadline, min_score, retry) join one auction: one machine, the
    joiner told it exists. (A run answers its buyer before it has settled its claim, so a
    retry sent right after an answer can find it still running.)"""
    host = await market.host(worker("a"), worker("b"))
    buyer = await market.client(direct=True)
    first, again = await asyncio.gather(
        buyer.place(order(order_id="ex-2")),
        buyer.place(order(order_id="ex-2", exclude_workers=["a", "b"], deadline_ms=900)),
    )
    assert isinstance(first, Placed) and isinstance(again, Placed)
    assert again.machine_id == first.machine_id
    assert sorted([first.existing, again.existing]) == [False, True]
    assert sum(len(w.machines) for w in host.workers.values()) == 1


async def test_i5_one_order_id_for_two_regions_at_once_is_refused_not_merged(
    market: Market,
) -> None:
    from bourse.client import ClientError

    await market.host(worker("m", region="mad"), worker("l", region="lis"))
    await market.exchange()
    buyer = await market.client()
    rs = await asyncio.gather(
        buyer.place(order(region="mad", order_id="same")),
        buyer.place(order(region="lis", order_id="same")),
        return_exceptions=True,
    )
    by_region = dict(zip(["mad", "lis"], rs, strict=True))
    placed = {region: r for region, r in by_region.items() if isinstance(r, Placed)}
    errors = [r for r in rs if isinstance(r, ClientError)]
    assert len(placed) == 1 and len(errors) == 1
    assert errors[0].code == "bad_request" and "already in use" in str(errors[0])
    [(asked, got)] = placed.items()
    assert got.region == asked  # never a Placed from the other region


async def test_a_passive_listener_on_all_subjects_does_not_block_a_supplier(
    market: Market,
) -> None:
    spy = await market.connect("spy")

    async def ignore(msg: Msg) -> None:
        pass

    await spy.subscribe(f"{market.subjects.root}.>", cb=ignore)
    await flush_all(spy)
    host = await market.host(worker("w1"))
    assert "w1" in host.workers
