"""Batches (docs/protocol.md §4.4.4): the bids and region releases an auction process sends
to one region in the same instant go as one ``Batch`` message to the supplier processes
that take them, and each process sends its prompt answers to all of them as one
``Answers`` message; every order is still placed exactly as alone."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    Answers,
    Batch,
    BatchBid,
    Bid,
    Offers,
    Placed,
    Release,
    Resources,
)
from tests.market import Market, learn_processes, order, wait_until, worker


def _bid(order_id: str, auction_id: str, region: str = "mad") -> Bid:
    return Bid(
        order_id=order_id,
        region=region,
        resources=Resources(cpus=1, memory_mb=64),
        image="x",
        hold_ms=5000,
        auction_id=auction_id,
        batch_offers=True,
        prompt_offers=True,
    )


async def test_a_process_answers_a_batch_with_one_answers_message(market: Market) -> None:
    host = await market.host(*(worker(f"w{i}") for i in range(3)), max_offers=2)
    nc = await market.connect("bidder")
    answers_to = nc.new_inbox()
    sub = await nc.subscribe(answers_to)
    own = nc.new_inbox()  # each bid's own reply: nothing goes there when answers_to is set
    own_sub = await nc.subscribe(own + ".*")
    first = Batch(
        bids=[BatchBid(reply=f"{own}.A0", bid=_bid("o0", "A0"))],
        answers_to=answers_to,
    )
    await nc.publish(market.subjects.bid_batch("mad"), encode(first))
    held = decode((await sub.next_msg(2)).data, Answers)
    assert [a.auction_id for a in held.answers] == ["A0"]
    assert sum("o0" in w.ledger.holds for w in host.workers.values()) == 2
    batch = Batch(
        bids=[
            BatchBid(reply=f"{own}.A1", bid=_bid("o1", "A1")),
            BatchBid(reply="not.an.inbox", bid=_bid("o9", "A9")),  # refused alone
            BatchBid(reply=f"{own}.A2", bid=_bid("o2", "A2")),
            BatchBid(reply=f"{own}.A3", bid=_bid("o3", "A3", region="bcn")),  # refused alone
        ],
        releases=[Release(order_id="o0", auction_id="A0")],
        answers_to=answers_to,
    )
    await nc.publish(market.subjects.bid_batch("mad"), encode(batch))
    got = decode((await sub.next_msg(2)).data, Answers)
    assert [a.auction_id for a in got.answers] == ["A1", "A2"]
    assert all(a.responder == host.responder_id and len(a.offers) == 2 for a in got.answers)
    assert {o.order_id for a in got.answers for o in a.offers} == {"o1", "o2"}
    # the release went first: o0's holds are gone, o1's and o2's are held
    holds = [h for w in host.workers.values() for h in w.ledger.holds]
    assert sorted(holds) == ["o1", "o1", "o2", "o2"]
    assert host.bids_refused == 2
    assert own_sub.pending_msgs == 0


async def test_concurrent_orders_go_in_batches_and_are_all_placed(market: Market) -> None:
    hosts = [
        await market.host(*(worker(f"h{h}w{i}", cpus=64) for i in range(4)), max_offers=2)
        for h in range(2)
    ]
    nc = await market.connect("tap")
    seen: list[Batch] = []

    async def tap(msg: Msg) -> None:
        seen.append(decode(msg.data, Batch))

    await nc.subscribe(market.subjects.bid_batch("mad"), cb=tap)
    await flush_all(nc)
    client = await market.client(direct=True)
    auctioneer = client._broker.auctioneer if client._broker else None
    assert auctioneer is not None
    assert isinstance(await client.place(order(order_id="first")), Placed)
    assert auctioneer.batching("mad")  # both processes said they take batches
    results = await asyncio.gather(*(client.place(order(order_id=f"o-{i}")) for i in range(40)))
    assert all(isinstance(r, Placed) for r in results)
    assert len({r.machine_id for r in results if isinstance(r, Placed)}) == 40
    assert auctioneer.batches.sent > 0
    await wait_until(lambda: len(seen) == auctioneer.batches.sent)
    assert max(len(b.bids) for b in seen) >= 2  # several orders' bids in one message
    workers = [w for h in hosts for w in h.workers.values()]
    await wait_until(lambda: all(not w.ledger.holds for w in workers))  # losers released
    assert sum(len(w.by_order) for w in workers) == 41
    assert market.violations() == []


async def test_no_batches_where_a_supplier_does_not_take_them(market: Market) -> None:
    """A process that answers prompt bids but does not say ``batches`` keeps the region on
    single bids (it would never see a batch)."""
    await market.host(worker("w1", cpus=64))
    nc = await market.connect("prompt-supplier-without-batches")

    async def on_bid(msg: Msg) -> None:
        bid = decode(msg.data, Bid)
        answer = Offers(offers=[], responder="no-batches", auction_id=bid.auction_id)
        await nc.publish(msg.reply, encode(answer))

    await nc.subscribe(market.subjects.bid("mad"), cb=on_bid)
    await flush_all(nc)
    client = await market.client(direct=True)
    auctioneer = client._broker.auctioneer if client._broker else None
    assert auctioneer is not None
    assert not auctioneer.batching("mad")  # nothing known yet
    await learn_processes(client, auctioneer, "mad", 2)  # both answered, named
    assert not auctioneer.batching("mad")
    assert isinstance(await client.place(order(order_id="first")), Placed)
    results = await asyncio.gather(*(client.place(order(order_id=f"o-{i}")) for i in range(10)))
    assert all(isinstance(r, Placed) for r in results)
    assert auctioneer.batches.sent == 0
