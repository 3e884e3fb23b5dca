"""Prompt answers (docs/protocol.md §4.4.3): a bid with ``prompt_offers`` gets ONE Offers
message from each supplier process at once, naming the process and giving each offer the
delay it would have waited, or an empty one when the process has nothing to offer; the
auction learns how many processes answer in a region and commits once all have."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    Answers,
    Batch,
    Bid,
    BidReply,
    Commit,
    Offer,
    Offers,
    Placed,
    Release,
    Resources,
)
from bourse.wire.subjects import Subjects
from tests.market import (
    Market,
    answer_commits,
    learn_processes,
    order,
    placed_for,
    wait_until,
    worker,
)


def _bid(order_id: str = "o", cpus: int = 1) -> Bid:
    return Bid(
        order_id=order_id,
        region="mad",
        resources=Resources(cpus=cpus, memory_mb=64),
        image="x",
        hold_ms=5000,
        auction_id="A1",
        batch_offers=True,
        prompt_offers=True,
    )


async def test_a_prompt_bid_gets_one_named_answer_at_once_with_the_delays(
    market: Market,
) -> None:
    # w0 is the emptiest (spread likes it best), then w1, w2, w3
    host = await market.host(
        *(worker(f"w{i}", cpus=8 + 8 * (9 - i)) for i in range(4)), max_offers=3
    )
    nc = await market.connect("bidder")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(market.subjects.bid("mad"), encode(_bid()), reply=inbox)
    reply = decode((await sub.next_msg(2)).data, BidReply)
    assert isinstance(reply, Offers) and reply.responder == host.responder_id
    assert [o.worker_id for o in reply.offers] == ["w0", "w1", "w2"]  # best first
    delays = [o.delay_ms for o in reply.offers]
    assert delays == sorted(delays) and delays[0] > 0  # the spread, left to the auction
    # nothing can take 1,000 CPUs: an empty answer, so the auction need not wait for it
    await nc.publish(market.subjects.bid("mad"), encode(_bid("big", 1000)), reply=inbox)
    empty = decode((await sub.next_msg(2)).data, BidReply)
    assert empty == Offers(offers=[], responder=host.responder_id, auction_id="A1", batches=True)


async def test_the_auction_learns_the_processes_of_a_region(market: Market) -> None:
    hosts = [
        await market.host(*(worker(f"h{h}w{i}") for i in range(3)), max_offers=2) for h in range(2)
    ]
    client = await market.client(direct=True)
    auctioneer = client._broker.auctioneer if client._broker else None
    assert auctioneer is not None and auctioneer.expected_responders("mad") == set()
    await learn_processes(client, auctioneer, "mad", 2)
    # both answer every bid at once: the auctions heard both, by name
    assert auctioneer.expected_responders("mad") == {h.responder_id for h in hosts}
    for i in range(6):
        r = await client.place(order(order_id=f"o-{i}"))
        assert isinstance(r, Placed)
    assert auctioneer.expected_responders("mad") == {h.responder_id for h in hosts}
    workers = [w for h in hosts for w in h.workers.values()]
    await wait_until(lambda: all(not w.ledger.holds for w in workers))  # losers released
    assert sum(len(w.by_order) for w in workers) == 6
    assert auctioneer.expected_responders("elsewhere") == set()
    assert market.violations() == []


async def test_a_supplier_that_does_not_answer_promptly_turns_the_quorum_off(
    market: Market,
) -> None:
    """An older supplier answers a prompt bid with plain delayed offers: the auction then
    waits out delays in that region instead of committing when the known processes
    answered (so the older supplier's better offer can still win). new-1's offers would
    wait about 350 ms (a wide score spread): however busy the machine, the older
    supplier's offer comes within it."""
    await market.host(worker("new-1", pricing={"spread_ms": 1000}))
    nc = await market.connect("older-supplier")
    s = market.subjects

    async def on_bid(msg: Msg) -> None:
        bid = decode(msg.data, Bid)
        o = Offer(
            order_id=bid.order_id,
            worker_id="old-1",
            region="mad",
            score=0.99,
            auction_id=bid.auction_id,
        )
        await nc.publish(msg.reply, encode(o))

    await nc.subscribe(s.bid("mad"), cb=on_bid)
    await answer_commits(nc, s, "old-1", score=0.99)
    await flush_all(nc)
    client = await market.client(direct=True)
    auctioneer = client._broker.auctioneer if client._broker else None
    assert auctioneer is not None
    # too big for new-1: the auction commits the older supplier's offer, so it has seen it
    r = await client.place(order(order_id="o-1", cpus=16))
    assert isinstance(r, Placed) and r.worker_id == "old-1"
    assert auctioneer.expected_responders("mad") == set()  # an unnamed answer was seen
    r = await client.place(order(order_id="o-2"))
    assert isinstance(r, Placed) and r.worker_id == "old-1"  # the best offer, as before


async def test_one_offering_process_drops_the_other_holds_itself(market: Market) -> None:
    """Every offer came from one known process: its commit says ``release_others`` and the
    auction publishes no region release (protocol §4.6); with two offering processes it
    does."""
    host = await market.host(*(worker(f"w{i}") for i in range(3)), max_offers=3)
    nc = await market.connect("tap")
    releases: list[str] = []

    async def tap(msg: Msg) -> None:
        releases.append(msg.subject)

    await nc.subscribe(market.subjects.region_release("*"), cb=tap)
    await flush_all(nc)
    client = await market.client(direct=True)
    auctioneer = client._broker.auctioneer if client._broker else None
    assert auctioneer is not None
    assert isinstance(await client.place(order(order_id="learn")), Placed)  # learns the process
    await wait_until(lambda: not any(w.ledger.holds for w in host.workers.values()))
    await flush_all(nc)
    mad, bcn = market.subjects.region_release("mad"), market.subjects.region_release("bcn")
    assert releases == [mad]  # the first auction did not know the process yet
    r = await client.place(order(order_id="alone"))
    assert isinstance(r, Placed)
    # the other two holds are gone without any release message
    await wait_until(lambda: not any(w.ledger.holds for w in host.workers.values()))
    # a marker from the same connection: its release (bcn: nobody there) comes after any
    # release "alone" would have sent
    marker = await client.place(order(order_id="marker", region="bcn"))
    assert not isinstance(marker, Placed)
    await wait_until(lambda: bcn in releases)
    assert releases == [mad, bcn]  # none for "alone"
    assert market.violations() == []


class _LateProcess:
    """A supplier process the auction has not heard (it joined the region just now): it
    sees every bid of ``mad``, plain or in a ``Batch``, and answers only when told."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.bids: dict[str, tuple[Bid, str, str]] = {}  # order -> (bid, reply, answers_to)

    async def start(self) -> None:
        async def on_bid(msg: Msg) -> None:
            bid = decode(msg.data, Bid)
            self.bids[bid.order_id] = (bid, msg.reply, "")

        async def on_batch(msg: Msg) -> None:
            batch = decode(msg.data, Batch)
            for b in batch.bids:
                self.bids[b.bid.order_id] = (b.bid, b.reply, batch.answers_to)

        await self.nc.subscribe(self.subjects.bid("mad"), cb=on_bid)
        await self.nc.subscribe(self.subjects.bid_batch("mad"), cb=on_batch)

    async def offer(self, worker_id: str, *order_ids: str, as_answers: bool = False) -> None:
        """Offer ``worker_id`` for each order, to its bid's reply or, ``as_answers``, all
        in one Answers message (the bids came in one batch)."""
        answers: list[Offers] = []
        answers_to = ""
        for order_id in order_ids:
            bid, reply, answers_to = self.bids[order_id]
            offers = Offers(
                offers=[Offer(order_id=order_id, worker_id=worker_id, region="mad", score=0.99)],
                responder="late-process",
                auction_id=bid.auction_id,
            )
            answers.append(offers)
            if not as_answers:
                await self.nc.publish(reply, encode(offers))
        if as_answers:
            assert answers_to, "the bids did not come in a batch"
            await self.nc.publish(answers_to, encode(Answers(answers=answers)))


@pytest.mark.parametrize("as_answers", [False, True], ids=["to the reply", "in Answers"])
async def test_a_late_offer_after_a_folded_release_gets_its_worker_a_release(
    market: Market, as_answers: bool
) -> None:
    """A folded release (§4.6) reaches only the winner's process. A process the auction did
    not know yet that offers after the auction ended is told to drop that hold, one
    worker-form release per worker it offered, instead of keeping it until its TTL."""
    await market.host(worker("w0"), max_offers=3)
    nc = await market.connect("late")
    late = _LateProcess(nc, market.subjects)
    await late.start()
    told = await nc.subscribe(market.subjects.release("late-1"))
    regional = await nc.subscribe(market.subjects.region_release("mad"))
    await flush_all(nc)
    # Without claims, an auction queues its bid in the loop turn it starts in (no KV write
    # first), so two orders placed at once share a batch whatever the machine's load.
    client = await market.client(direct=True, claims=False)
    assert isinstance(await client.place(order(order_id="learn")), Placed)  # learns w0's
    await regional.next_msg(2)  # the first auction did not know the process: it released
    # two orders at once: their bids go in one batch (§4.4.4); both auctions fold
    both = await asyncio.gather(*(client.place(order(order_id=o)) for o in ("a1", "a2")))
    assert all(isinstance(r, Placed) and r.worker_id == "w0" for r in both)
    await late.offer("late-1", "a1", "a2", as_answers=as_answers)
    got = [decode((await told.next_msg(2)).data, Release) for _ in range(2)]
    assert sorted(got, key=lambda r: r.order_id) == [
        Release(order_id=o, worker_id="late-1", auction_id=late.bids[o][0].auction_id)
        for o in ("a1", "a2")
    ]
    # a late offer to an auction that released its region itself gets nothing more
    await late.offer("late-1", "learn")
    marker = await client.place(order(order_id="marker", region="bcn"))  # same connection
    assert not isinstance(marker, Placed)
    await flush_all(nc)
    with pytest.raises(nats.errors.TimeoutError):
        await told.next_msg(0.2)
    assert regional.pending_msgs == 0  # no region release for a1 and a2


async def test_an_offer_that_comes_during_the_folded_commit_gets_a_release(
    market: Market,
) -> None:
    """An offer from an unknown process that reaches the auction while its commit (with
    ``release_others``) is under way is too late for the auction; once it ends, that
    worker too is told to drop its hold."""
    nc = await market.connect("suppliers")
    s = market.subjects
    late = _LateProcess(nc, s)
    await late.start()
    go = asyncio.Event()

    async def on_bid(msg: Msg) -> None:  # a known process with one worker: answers at once
        bid = decode(msg.data, Bid)
        o = Offer(order_id=bid.order_id, worker_id="k1", region="mad", score=0.9, delay_ms=0)
        await nc.publish(msg.reply, encode(Offers(offers=[o], responder="known")))

    commits: asyncio.Queue[Commit] = asyncio.Queue()

    async def on_commit(msg: Msg) -> None:
        c = decode(msg.data, Commit)
        await commits.put(c)
        if c.order_id == "slow":
            await go.wait()
        placed = placed_for(c, f"k1~01M80QESDH2NAZQ4Z9ASNWXSK{len(c.order_id)}", 0.9)
        await nc.publish(msg.reply, encode(placed))

    await nc.subscribe(s.bid("mad"), cb=on_bid)
    await nc.subscribe(s.commit("k1"), cb=on_commit)
    told = await nc.subscribe(s.release("late-1"))
    await flush_all(nc)
    client = await market.client(direct=True)
    assert isinstance(await client.place(order(order_id="learn")), Placed)
    await commits.get()
    placing = asyncio.ensure_future(client.place(order(order_id="slow")))
    commit = await commits.get()
    assert commit.order_id == "slow" and commit.release_others
    await late.offer("late-1", "slow")  # before the commit's answer
    go.set()
    assert isinstance(await placing, Placed)
    msg = await told.next_msg(2)
    assert decode(msg.data, Release) == Release(
        order_id="slow", worker_id="late-1", auction_id=commit.auction_id
    )
