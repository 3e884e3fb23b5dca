"""Reclaim checks (docs/protocol.md §5.3d) from the attacker's side, under the permissions
`bourse auth init` generates, on a real nats-server with JetStream: a supplier key cannot
make an order of another region adopt a machine it made up (the order's region vouches
for a machine, and only that region's suppliers can answer there), while an honest
worker's machine of a dead auction is still adopted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg
from ulid import ULID

from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import Claim, fingerprint, order_shape
from bourse.client import BourseClient
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    Machine,
    MachinePage,
    Placed,
    PlaceOrder,
    ReclaimCheck,
    ReclaimVerdicts,
    now_ms,
)
from exchange.service import ExchangeService
from supplier.host import SupplierHost
from supplier.store import Store
from tests.market import Market, order, wait_until, worker
from tests.security.conftest import Secured


@pytest.fixture
async def market(secured_js: Secured, tmp_path: Path) -> AsyncIterator[Market]:
    """The exchange and mad-1's supplier (reclaiming fast), each on its own key."""
    async with Market(secured_js.url, secured_js.subjects, tmp_path) as m:
        nc, _ = await secured_js.connect("exchange")
        m.exchanges.append(ExchangeService(nc, m.subjects))
        await m.serve(m.exchanges[0])
        nc, _ = await secured_js.connect("supplier:mad-1")
        store = Store(tmp_path / "mad-1" / "supplier.db")
        m.stores.append(store)
        host = SupplierHost(
            nc, [worker("mad-1")], store, m.subjects, reclaim_after_s=0.2, reclaim_every_s=0.05
        )
        await m.serve(host)
        m.hosts.append(host)
        yield m


async def _dead_auction(secured: Secured, o: PlaceOrder) -> tuple[ClaimStore, Claim]:
    """The claim of ``o`` as an exchange that died mid-auction left it."""
    nc, _ = await secured.connect("exchange")
    claims = await ClaimStore.open(nc, secured.subjects)
    assert claims is not None
    dead = Claim(
        state="auctioning",
        auction_id="A-dead",
        fingerprint=fingerprint(o),
        until_ms=now_ms() - 60_000,
        shape=order_shape(o),
    )
    assert await claims.put(o.order_id, dead, 0) is not None
    return claims, dead


async def test_a_supplier_cannot_make_another_regions_order_adopt_a_machine_it_made_up(
    secured_js: Secured, market: Market
) -> None:
    s = secured_js.subjects
    o = order(order_id="victim")  # region mad
    claims, dead = await _dead_auction(secured_js, o)
    rogue, rogue_v = await secured_js.connect("supplier:fleet-fra")
    made_up = f"fra-1~{ULID()}"

    async def listing(msg: Msg) -> None:
        """Its own region's listing: the made-up machine, shaped as the order's."""
        machine = Machine(
            machine_id=made_up,
            order_id=o.order_id,
            worker_id="fra-1",
            region="fra",
            state="reserved",
            resources=o.resources,
            image=o.image,
        )
        for region in ("fra", "mad"):  # as listed there, and lying about its region
            page = MachinePage(
                worker_id="fra-1",
                region=region,
                machines=[msgspec.structs.replace(machine, region=region)],
            )
            await rogue.publish(msg.reply, encode(page))

    await rogue.subscribe(s.machines("fra"), cb=listing)
    for region in ("mad", "fra"):  # the order's region (it cannot answer there), its own
        forged = Placed(
            order_id=o.order_id,
            machine_id=made_up,
            worker_id="fra-1",
            region=region,
            score=1.0,
            image_cached=True,
            elapsed_ms=1.0,
        )
        check = ReclaimCheck(worker_id="fra-1", machines=[forged])
        reply = await rogue.request(s.reclaim("fra-1"), encode(check), timeout=5)
        [verdict] = decode(reply.data, ReclaimVerdicts).verdicts
        assert verdict.verdict == "wait", verdict
        assert verdict.detail.startswith("not adopted: "), verdict
    assert (await claims.get(o.order_id))[0] == dead, "the claim was changed"
    assert rogue_v.none_yet()  # all it did, it was allowed to: only the check refused it

    buyer, _ = await secured_js.connect("buyer")
    retry = await BourseClient(buyer, s).place(msgspec.structs.replace(o, retry=True))
    assert isinstance(retry, Placed), retry
    assert (retry.worker_id, retry.existing) == ("mad-1", False)
    assert retry.machine_id != made_up


async def test_an_honest_workers_machine_of_a_dead_auction_is_adopted(
    secured_js: Secured, market: Market
) -> None:
    """The dead auction's commit landed on mad-1: mad-1 asks, its region lists it (the
    exchange may ask there), the claim adopts it and a retry gets it."""
    o = order(order_id="orphan-ok")
    claims, _ = await _dead_auction(secured_js, o)
    nc, violations = await secured_js.connect("exchange")
    lost = BourseClient(nc, secured_js.subjects, direct=True, claims=False)
    landed = await lost.place(o)  # the commit the dead auction sent
    assert isinstance(landed, Placed), landed
    reclaims = market.hosts[0].workers["mad-1"].reclaims
    await wait_until(lambda: landed.machine_id in reclaims.confirmed)
    claim, _ = await claims.get(o.order_id)
    assert claim is not None and claim.placed is not None
    assert claim.placed.machine_id == landed.machine_id
    assert violations.none_yet()
