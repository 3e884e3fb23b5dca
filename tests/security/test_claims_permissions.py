"""Order claims under the generated permissions (`bourse auth init`), on a server with
JetStream: the exchange opens the claims bucket and creates, reads, watches, updates and
removes a claim without a permission violation; a supplier or a buyer, which run no
auction under auth, cannot write one."""

from __future__ import annotations

import asyncio

import pytest

from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import Claim
from bourse.nats.connection import flush_all
from tests.security.conftest import PREFIX, Secured


def claim(auction: str) -> Claim:
    return Claim(state="auctioning", auction_id=auction, fingerprint="f", until_ms=1)


@pytest.mark.parametrize("user", ["exchange"])
async def test_who_runs_auctions_can_use_the_claims(secured: Secured, user: str) -> None:
    nc, violations = await secured.connect(user)
    store = await ClaimStore.open(nc, secured.subjects)
    assert store is not None, "the claims bucket could not be opened"
    key = f"perm-{user}"
    first = await store.put(key, claim("A"), 0)
    assert first is not None
    assert await store.put(key, claim("B"), 0) is None  # create-if-absent holds
    assert (await store.get(key)) == (claim("A"), first)
    moved = asyncio.ensure_future(store.changed(key, first, 5.0))
    second = await store.put(key, claim("C"), first)
    assert second is not None and await moved
    await store.remove(key, second)
    assert (await store.get(key))[0] is None
    await flush_all(nc)
    assert violations.none_yet(), await violations.next()


@pytest.mark.parametrize("user", ["supplier:mad-1", "buyer"])
async def test_who_runs_no_auction_cannot_write_a_claim(secured: Secured, user: str) -> None:
    owner, _ = await secured.connect("exchange")
    assert await ClaimStore.open(owner, secured.subjects) is not None  # the bucket exists
    nc, violations = await secured.connect(user)
    await nc.publish(f"$KV.{PREFIX.upper()}_ORDERS.forged", b"{}")
    assert "permissions violation" in await violations.next()
