"""The order claim's writes under the faults only a real JetStream shows (docs/protocol.md
§5.3c): a write the server took but whose answer was lost reads back as the auction's own
(the create: the auction runs under it; the outcome: the buyer is told ``Placed``); a
placement whose claim cannot be made to name it is answered ``Error{internal, reason
"unrecorded"}``, duplicates joined to it too, and the order sent again under the same id is
answered with its one machine. Every other interleaving of the claim's requests is a row of
tests/unit/test_claiming.py.

Real nats-server with JetStream, the real claims bucket and a real supplier. The bucket is
the real one with one auction's writes of a state made to fail as a JetStream outage fails
them (a timeout, with or without the write taken), so each fault is forced, not hoped for."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from bourse.auction.auctioneer import Auctioneer
from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import KV_TIMEOUT_S, Claim
from bourse.client import UNRECORDED_CODE, ClientError
from bourse.client.policy import place_patiently
from bourse.wire.messages import Placed
from exchange.service import ExchangeService
from supplier.host import SupplierHost
from tests.market import Market, order, worker

Fault = Literal["unwritten", "lost_reply"]


class FaultyStore(ClaimStore):
    """The real claims bucket whose writes of ``state`` by the first auction to send one
    fail ``fail`` times: ``unwritten``, a timeout, the write not taken (JetStream without a
    quorum); ``lost_reply``, a timeout after the server took the write."""

    def __init__(self, real: ClaimStore, fault: Fault, fail: int, state: str = "placed") -> None:
        super().__init__(real.kv, real.name, real.nc)
        self.fault, self.fail, self.state = fault, fail, state
        self.victim: str | None = None  # the auction whose writes fail
        self.failed = 0

    async def put(
        self, order_id: str, claim: Claim, last: int, timeout_s: float = KV_TIMEOUT_S
    ) -> int | None:
        if claim.state == self.state and self.victim in (None, claim.auction_id):
            self.victim = claim.auction_id
            if self.failed < self.fail:
                self.failed += 1
                if self.fault == "lost_reply":
                    assert await super().put(order_id, claim, last, timeout_s) is not None
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


@pytest.mark.parametrize("state", ["auctioning", "placed"], ids=["create", "outcome"])
async def test_a_claim_write_whose_reply_is_lost_reads_back_as_the_auctions_own(
    market: Market, state: str
) -> None:
    """The server took the write, its answer never came: the next try's revision check
    fails, and the claim read back is this auction's (the create: the auction runs under
    it; the outcome: the buyer is told Placed). One machine, named by the claim."""
    host = await market.host(worker("a"))
    store = await _faulty(market, "lost_reply", fail=1, state=state)
    auctioneer = Auctioneer(await market.connect("buyer"), market.subjects, claim_store=store)
    o = order(order_id=f"lost-reply-{state}")
    r = await auctioneer.run(o)
    await auctioneer.close()
    assert isinstance(r, Placed) and not r.existing, r
    assert store.failed == 1
    assert _live(host, o.order_id) == [r.machine_id]
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "placed" and claim.placed is not None
    assert claim.placed.machine_id == r.machine_id and claim.auction_id == store.victim


async def test_a_placement_its_claim_cannot_name_is_not_told_placed_and_its_retry_gets_it(
    market: Market,
) -> None:
    """The claims bucket fails every placed write of the auction (an outage from the commit
    to the claim's end): the buyer, and the duplicates that joined its auction in the
    exchange, are told ``unrecorded``, not ``Placed``; the claim is left as it was; the
    order sent again under the same id (``place_patiently`` does it) is answered with the
    machine the first auction placed, which is the id's only one."""
    host = await market.host(worker("a"))
    store = await _faulty(market, "unwritten", fail=1_000)
    await _exchange(market, store)
    client = await market.client()
    o = order(order_id="unrecorded-1")
    answers = await asyncio.gather(*(client.place(o) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(a, ClientError) and a.code == UNRECORDED_CODE for a in answers), answers
    assert all("same order id" in str(a) for a in answers)
    assert store.failed > 1  # tried again until the claim's end
    placed = _live(host, o.order_id)
    assert len(placed) == 1  # placed, and not told
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "auctioning"  # as it was: nothing named

    again = await place_patiently(client, o)  # unrecorded: sent again as a retry at once
    assert isinstance(again, Placed), again
    assert again.existing and again.machine_id == placed[0]
    assert _live(host, o.order_id) == placed  # one machine for the id
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.placed is not None
    assert claim.placed.machine_id == placed[0]
