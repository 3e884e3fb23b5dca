"""A buyer is told ``Placed`` only once the order's claim names the machine (I3,
docs/protocol.md §5.3c): a placed claim write that fails is tried again while the claim is
the auction's; one that still fails, or finds the claim taken over, is answered
``Error{internal, reason "unrecorded"}`` and not ``Placed``, and the order sent again under
the same id is answered with its one machine.

Real nats-server with JetStream, the real claims bucket and a real supplier. The bucket is
the real one with the auction's ``placed`` writes made to fail as a JetStream outage fails
them (a timeout, with or without the write taken), or to find the claim taken over first,
so each interleaving is forced, not hoped for."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
import pytest
import structlog
from nats.aio.msg import Msg

from bourse.auction.broker import Broker, Refused
from bourse.auction.claims import KV_TIMEOUT_S, Claim, ClaimStore
from bourse.auction.driver import Auctioneer
from bourse.client import UNRECORDED_CODE, ClientError
from bourse.client.policy import place_patiently
from bourse.wire.codec import decode, encode
from bourse.wire.messages import UNRECORDED_REASON, Bid, Commit, Offer, Placed, Rejected, Unfilled
from exchange.service import ExchangeService
from supplier.host import SupplierHost
from tests.market import Market, order, worker

Fault = Literal["unwritten", "lost_reply", "taken_over"]


class FaultyStore(ClaimStore):
    """The real claims bucket whose outcome writes (``state``: ``placed`` unless told) by
    the first auction to send one fail ``fail`` times: ``unwritten``, a timeout, the write
    not taken (JetStream without a quorum); ``lost_reply``, a timeout after the server took
    the write; ``taken_over``, another auction's claim is written over the auction's just
    before its write."""

    def __init__(self, real: ClaimStore, fault: Fault, fail: int, state: str = "placed") -> None:
        super().__init__(real.kv, real.name, real.nc)
        self.fault, self.fail, self.state = fault, fail, state
        self.victim: str | None = None  # the auction whose outcome writes fail
        self.failed = 0

    async def put(
        self, order_id: str, claim: Claim, last: int, timeout_s: float = KV_TIMEOUT_S
    ) -> int | None:
        if claim.state == self.state and self.victim in (None, claim.auction_id):
            self.victim = claim.auction_id
            if self.failed < self.fail:
                self.failed += 1
                if self.fault == "taken_over":
                    taker = msgspec.structs.replace(claim, auction_id="A-taker", placed=None)
                    taker = msgspec.structs.replace(taker, state="auctioning")
                    assert await super().put(order_id, taker, last, timeout_s) is not None
                elif self.fault == "lost_reply":
                    assert await super().put(order_id, claim, last, timeout_s) is not None
                    raise TimeoutError
                else:
                    raise TimeoutError
        return await super().put(order_id, claim, last, timeout_s)


async def _faulty(market: Market, fault: Fault, fail: int, state: str = "placed") -> FaultyStore:
    real = await ClaimStore.open(await market.connect("claims"), market.subjects)
    assert real is not None  # the test server runs JetStream
    return FaultyStore(real, fault, fail, state)


async def _exchange(market: Market, store: ClaimStore) -> None:
    await market.serve(
        ExchangeService(await market.connect("exchange"), market.subjects, claim_store=store)
    )


def _live(host: SupplierHost, order_id: str) -> list[str]:
    """The worker's live machines for ``order_id``."""
    machines = host.workers["a"].machines.values()
    return [m.machine_id for m in machines if m.order_id == order_id and m.state != "destroyed"]


def _events(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event]


@pytest.mark.parametrize("fault", ["unwritten", "lost_reply"])
async def test_a_placed_claim_write_that_fails_once_is_tried_again(
    market: Market, fault: Fault
) -> None:
    host = await market.host(worker("a"))
    store = await _faulty(market, fault, fail=1)
    auctioneer = Auctioneer(await market.connect("buyer"), market.subjects, claim_store=store)
    o = order(order_id=f"write-again-{fault}")
    with structlog.testing.capture_logs() as logs:
        r = await auctioneer.run(o)
    await auctioneer.close()
    assert isinstance(r, Placed), r
    assert store.failed == 1
    assert len(_events(logs, "order_claim_failed")) == 1  # one failed try, then written
    assert not _events(logs, "order_claim_not_recorded")
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "placed" and claim.placed is not None
    assert claim.placed.machine_id == r.machine_id == _live(host, o.order_id)[0]


async def test_a_placement_its_claim_cannot_name_is_not_told_placed_and_its_retry_gets_it(
    market: Market,
) -> None:
    """The claims bucket fails every placed write of the auction (an outage from the commit
    to the claim's end): the buyer is told ``unrecorded``, not ``Placed``; the claim is
    left as it was; the order sent again under the same id (``place_patiently`` does it) is
    answered with the machine the first auction placed, which is the id's only one."""
    host = await market.host(worker("a"))
    store = await _faulty(market, "unwritten", fail=1_000)
    await _exchange(market, store)
    client = await market.client()
    o = order(order_id="unrecorded-1")
    with structlog.testing.capture_logs() as logs, pytest.raises(ClientError) as refused:
        await client.place(o)
    assert refused.value.code == UNRECORDED_CODE
    assert "same order id" in str(refused.value)
    assert store.failed > 1  # tried again until the claim's end
    [unrecorded] = _events(logs, "order_claim_not_recorded")
    placed = _live(host, o.order_id)
    assert placed == [unrecorded["machine_id"]]  # placed, and not told
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "auctioning"  # as it was: nothing named

    again = await place_patiently(client, o)  # unrecorded: sent again as a retry at once
    assert isinstance(again, Placed), again
    assert again.existing and again.machine_id == placed[0]
    assert _live(host, o.order_id) == placed  # one machine for the id
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.placed is not None
    assert claim.placed.machine_id == placed[0]


async def test_a_claim_taken_over_before_the_placed_write_is_not_told_placed(
    market: Market,
) -> None:
    """Another auction took the claim over between the commit and the write: the claim is
    no longer this auction's to name a machine in, so the broker (a direct buyer's, as the
    exchange's) refuses it ``unrecorded`` too, and the taker's claim is left as written."""
    await market.host(worker("a"))
    store = await _faulty(market, "taken_over", fail=1)
    auctioneer = Auctioneer(await market.connect("buyer"), market.subjects, claim_store=store)
    o = order(order_id="taken-over-1")
    refused = await Broker(auctioneer).place(o)
    await auctioneer.close()
    assert isinstance(refused, Refused) and refused.kind == "unrecorded", refused
    assert "taken over" in refused.detail
    error = refused.error()
    assert (error.code, error.reason) == ("internal", UNRECORDED_REASON)
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.auction_id == "A-taker"  # not overwritten


async def test_a_duplicate_joined_to_an_unrecorded_placement_is_not_told_placed(
    market: Market,
) -> None:
    """Duplicates of the order in the same process wait for the one auction: they are
    refused ``unrecorded`` with it, never told its machine."""
    await market.host(worker("a"))
    store = await _faulty(market, "unwritten", fail=1_000)
    await _exchange(market, store)
    client = await market.client()
    o = order(order_id="unrecorded-dup")
    answers = await asyncio.gather(*(client.place(o) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(a, ClientError) and a.code == UNRECORDED_CODE for a in answers), answers


async def test_an_unfilled_claim_write_that_fails_once_is_tried_again(market: Market) -> None:
    """A commit went out and was rejected: the buyer is told Unfilled and the claim must say
    ``unfilled`` (a worker may hold a machine whose abort is lost: the next attempt adopts
    it, or the worker reclaims it, §5.3d). A write that fails once is tried again; left
    "auctioning", the claim would later let the worker's check adopt such a machine."""
    nc = await market.connect("rejecting-worker")
    s = market.subjects

    async def on_bid(msg: Msg) -> None:
        bid = decode(msg.data, Bid)
        o = Offer(order_id=bid.order_id, worker_id="a", region="mad", score=0.9)
        await nc.publish(msg.reply, encode(o))

    async def on_commit(msg: Msg) -> None:
        c = decode(msg.data, Commit)
        no = Rejected(order_id=c.order_id, worker_id="a", reason="insufficient")
        await nc.publish(msg.reply, encode(no))

    await nc.subscribe(s.bid("mad"), cb=on_bid)
    await nc.subscribe(s.commit("a"), cb=on_commit)
    await nc.flush()
    store = await _faulty(market, "unwritten", fail=1, state="unfilled")
    auctioneer = Auctioneer(await market.connect("buyer"), s, claim_store=store)
    o = order(order_id="unfilled-write-1")
    with structlog.testing.capture_logs() as logs:
        r = await auctioneer.run(o)
    await auctioneer.close()
    assert isinstance(r, Unfilled) and r.reason == "all_commits_rejected", r
    assert store.failed == 1 and len(_events(logs, "order_claim_failed")) == 1
    assert not _events(logs, "order_claim_not_recorded")
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "unfilled"
