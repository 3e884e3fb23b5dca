"""Bids that wait for held capacity (Bid.wait_ms): a Waiting reply at once, then an Offer
when the hold is released, or a withdrawal when committed machines take the capacity."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, BidReply, Commit, Offer, Placed, Release, Resources, Waiting
from tests.market import Market, wait_until, worker

ONE_CPU = Resources(cpus=1, memory_mb=64)


async def _bid(nc: NATS, market: Market, order_id: str, wait_ms: int) -> tuple[str, object]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    bid = Bid(
        order_id=order_id,
        region="mad",
        resources=ONE_CPU,
        image="x",
        hold_ms=5000,
        auction_id=f"a-{order_id}",
        wait_ms=wait_ms,
    )
    await nc.publish(market.subjects.bid("mad"), encode(bid), reply=inbox)
    return inbox, sub


async def test_a_bid_blocked_by_a_hold_waits_then_gets_the_offer(market: Market) -> None:
    await market.host(worker("one", cpus=1))
    nc = await market.connect("bidder")
    _, first = await _bid(nc, market, "o1", wait_ms=0)
    assert isinstance(decode((await first.next_msg(2)).data, Offer), Offer)  # holds the cpu

    _, second = await _bid(nc, market, "o2", wait_ms=3000)
    w = decode((await second.next_msg(2)).data, BidReply)
    assert isinstance(w, Waiting) and (w.worker_id, w.wait_ms) == ("one", 3000)

    release = Release(order_id="o1", auction_id="a-o1")
    await nc.publish(market.subjects.region_release("mad"), encode(release))
    offer = decode((await second.next_msg(2)).data, BidReply)
    assert isinstance(offer, Offer) and offer.order_id == "o2"


async def test_a_waiting_bid_is_withdrawn_when_a_commit_takes_the_capacity(
    market: Market,
) -> None:
    await market.host(worker("one", cpus=1))
    nc = await market.connect("bidder")
    _, first = await _bid(nc, market, "o1", wait_ms=0)
    await first.next_msg(2)
    _, second = await _bid(nc, market, "o2", wait_ms=3000)
    assert isinstance(decode((await second.next_msg(2)).data, BidReply), Waiting)

    commit = Commit(order_id="o1", worker_id="one", resources=ONE_CPU, image="x")
    placed = await nc.request(market.subjects.commit("one"), encode(commit), timeout=2)
    assert isinstance(decode(placed.data, Placed), Placed)
    withdrawn = decode((await second.next_msg(2)).data, BidReply)
    assert isinstance(withdrawn, Waiting) and withdrawn.wait_ms == 0


async def test_without_wait_ms_a_blocked_worker_stays_silent(market: Market) -> None:
    host = await market.host(worker("one", cpus=1), worker("two", cpus=1))
    nc = await market.connect("bidder")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    only_one = Bid(
        order_id="o1",
        region="mad",
        resources=ONE_CPU,
        image="x",
        hold_ms=5000,
        exclude_workers=["two"],
    )
    await nc.publish(market.subjects.bid("mad"), encode(only_one), reply=inbox)
    assert decode((await sub.next_msg(2)).data, Offer).worker_id == "one"

    _, second = await _bid(nc, market, "o2", wait_ms=0)
    # The host prices a bid for all its workers in one pass before sending anything, so
    # once "two" answers, "one" has already decided: silent, nothing queued.
    assert decode((await second.next_msg(2)).data, Offer).worker_id == "two"
    assert list(host.workers["one"].ledger.holds) == ["o1"]
    assert not host.workers["one"].waiting


async def test_a_bid_that_arrives_after_its_own_release_is_ignored(market: Market) -> None:
    # The release and the bid travel on two subscriptions; if the release wins, the late
    # bid must not take a hold nobody will ever release (it would linger until its TTL).
    host = await market.host(worker("one"), worker("two"))
    nc = await market.connect("bidder")
    release = Release(order_id="late", auction_id="a-late")
    await nc.publish(market.subjects.region_release("mad"), encode(release))
    await flush_all(nc)
    _, sub = await _bid(nc, market, "late", wait_ms=0)  # same auction id "a-late"
    _, probe = await _bid(nc, market, "probe", wait_ms=0)
    # the host handles bids in order: once the probe is answered, "late" was seen
    assert decode((await probe.next_msg(2)).data, Offer).order_id == "probe"
    assert all("late" not in w.ledger.holds for w in host.workers.values())
    assert sub.pending_msgs == 0


async def test_an_overloaded_supplier_sheds_queued_bids_and_keeps_answering(
    market: Market,
) -> None:
    host = await market.host(worker("one", cpus=64, memory_mb=65536), max_bid_backlog=1)
    nc = await market.connect("bidder")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    for i in range(200):  # a burst: the supplier reads them far faster than it prices them
        bid = Bid(order_id=f"b{i}", region="mad", resources=ONE_CPU, image="x", hold_ms=200)
        await nc.publish(market.subjects.bid("mad"), encode(bid), reply=inbox)
    _, probe = await _bid(nc, market, "after", wait_ms=0)
    assert decode((await probe.next_msg(2)).data, Offer).order_id == "after"
    assert host.bids_shed > 0
    answered = sub.pending_msgs
    assert answered + host.bids_shed == 200  # every bid was either answered or shed


async def test_a_region_release_reaches_the_asked_workers_and_leaves_nothing_behind(
    market: Market,
) -> None:
    from bourse.auction.auctioneer import Auctioneer
    from bourse.auction.core import AuctionConfig
    from bourse.wire.messages import PlaceOrder

    host = await market.host(*(worker(f"w{i}") for i in range(30)), max_offers=3)
    auctioneer = Auctioneer(await market.connect("a"), market.subjects, AuctionConfig())
    for i in range(5):
        o = PlaceOrder(order_id=f"o{i}", region="mad", resources=ONE_CPU, image="x")
        assert isinstance(await auctioneer.run(o), Placed)
    await (await market.connect("flush")).flush()
    await wait_until(lambda: not host.desk.asked)  # every auction's release found its entry
    assert all(not w.ledger.holds for w in host.workers.values())
    await auctioneer.close()


async def test_a_release_without_auction_id_drops_the_hold_on_any_worker(market: Market) -> None:
    host = await market.host(worker("one"), worker("two"))
    nc = await market.connect("bidder")
    _, sub = await _bid(nc, market, "o1", wait_ms=0)
    await sub.next_msg(2)
    holders = [w for w in host.workers.values() if "o1" in w.ledger.holds]
    assert holders
    await nc.publish(market.subjects.region_release("mad"), encode(Release(order_id="o1")))
    await wait_until(lambda: all("o1" not in w.ledger.holds for w in host.workers.values()))
