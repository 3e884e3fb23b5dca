"""One reply per supplier process per bid (docs/protocol.md §4.4.2): a bid with
``batch_offers`` gets one ``Offers`` message carrying every offer of the process, each
signed on its own; a bid without it (an older auction) one ``Offer`` per message; the
auction places either way."""

from __future__ import annotations

from nats.aio.msg import Msg

from bourse.nats.auth import new_seed
from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, BidReply, Offer, Offers, Placed, Resources
from bourse.wire.signing import OfferSigner, TrustStore
from tests.market import Market, answer_commits, order, wait_until, worker


def _bid(batch: bool) -> Bid:
    return Bid(
        order_id="o",
        region="mad",
        resources=Resources(cpus=1, memory_mb=64),
        image="x",
        hold_ms=5000,
        auction_id="A1",
        batch_offers=batch,
    )


async def test_a_bid_that_takes_batches_gets_all_offers_of_the_process_in_one_message(
    market: Market,
) -> None:
    signer = OfferSigner(new_seed())
    # w0 is the emptiest (spread likes it best), then w1, w2, w3
    host = await market.host(
        *(worker(f"w{i}", cpus=8 + 8 * (9 - i)) for i in range(4)), max_offers=3, signer=signer
    )
    nc = await market.connect("bidder")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(market.subjects.bid("mad"), encode(_bid(True)), reply=inbox)
    reply = decode((await sub.next_msg(2)).data, BidReply)
    assert isinstance(reply, Offers)
    assert [o.worker_id for o in reply.offers] == ["w0", "w1", "w2"]  # best first
    assert [o.score for o in reply.offers] == sorted((o.score for o in reply.offers), reverse=True)
    # every offer the process made is in it: as many as it holds
    assert sum("o" in w.ledger.holds for w in host.workers.values()) == 3
    trust = TrustStore({f"w{i}": signer.public_key for i in range(4)})
    assert [trust.check(o) for o in reply.offers] == [None, None, None]  # each signed alone


async def test_a_bid_without_the_flag_gets_one_offer_per_message(market: Market) -> None:
    host = await market.host(*(worker(f"w{i}", cpus=8 + 8 * (9 - i)) for i in range(4)))
    nc = await market.connect("bidder")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(market.subjects.bid("mad"), encode(_bid(False)), reply=inbox)
    got = [decode((await sub.next_msg(2)).data, BidReply) for _ in range(3)]
    assert all(isinstance(r, Offer) for r in got)
    assert [r.worker_id for r in got if isinstance(r, Offer)] == ["w0", "w1", "w2"]
    assert sum("o" in w.ledger.holds for w in host.workers.values()) == 3


async def test_auctions_place_with_and_without_batches(market: Market) -> None:
    host = await market.host(*(worker(f"w{i}") for i in range(5)))
    batched = await market.client(direct=True)  # batch_offers: the default
    single = await market.client(direct=True, batch_offers=False)
    for i, client in enumerate((batched, single, batched)):
        r = await client.place(order(order_id=f"o-{i}"))
        assert isinstance(r, Placed)
        assert (r.order_id, r.region) == (f"o-{i}", "mad")
    workers = host.workers.values()
    await wait_until(lambda: all(not w.ledger.holds for w in workers))  # losers released
    assert sum(len(w.by_order) for w in workers) == 3
    assert market.violations() == []


async def test_a_supplier_that_ignores_the_flag_is_placed_on_all_the_same(market: Market) -> None:
    """A v1 supplier that predates Offers answers a batch bid with one Offer per message."""
    nc = await market.connect("older-supplier")
    s = market.subjects
    bids: list[Bid] = []

    async def on_bid(msg: Msg) -> None:
        bid = decode(msg.data, Bid)
        bids.append(bid)
        for worker_id, score in (("old-2", 0.9), ("old-1", 0.5)):  # best first, as delays do
            o = Offer(
                order_id=bid.order_id,
                worker_id=worker_id,
                region="mad",
                score=score,
                auction_id=bid.auction_id,
            )
            await nc.publish(msg.reply, encode(o))

    await nc.subscribe(s.bid("mad"), cb=on_bid)
    await answer_commits(nc, s, "old-1", "old-2", score=0.9)
    await flush_all(nc)
    client = await market.client(direct=True)
    r = await client.place(order(order_id="o-old"))
    assert [b.batch_offers for b in bids] == [True]  # asked for a batch, got single offers
    assert isinstance(r, Placed) and (r.worker_id, r.score) == ("old-2", 0.9)
