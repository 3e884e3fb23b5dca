"""An order id reused for a different order (issue 17 item 1): refused with an error that
names the mismatch, never answered with the first order's machine. On the paths where no
claim remembers the first order: a server without claims (here: claims off), and a claim
gone past the idempotency window (here: deleted). Within the window, the claim refuses it
(tests/integration/test_claims.py)."""

from __future__ import annotations

import msgspec
import pytest

from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import key_of
from bourse.client import BourseClient, ClientError
from bourse.wire.messages import Placed, Resources
from tests.market import Market, order, worker


@pytest.mark.parametrize("claims", [False, True])
async def test_an_order_id_reused_for_another_order_is_refused_naming_the_mismatch(
    market: Market, claims: bool
) -> None:
    await market.host(worker("w1", labels={"disk": "ssd"}))
    client = BourseClient(
        await market.connect("buyer"), market.subjects, direct=True, claims=claims
    )
    market.clients.append(client)
    first = order(order_id="reused-1", image="web", constraints={"disk": "ssd"})
    placed = await client.place(first)
    assert isinstance(placed, Placed)
    if claims:  # the idempotency window passed: the claim is gone
        store = await ClaimStore.open(await market.connect("claims"), market.subjects)
        assert store is not None
        await store.kv.purge(key_of(first.order_id))

    # the same order again is still the same machine
    again = await client.place(msgspec.structs.replace(first, retry=True))
    assert isinstance(again, Placed) and again.machine_id == placed.machine_id and again.existing

    for change, named in (
        ({"image": "db"}, "image 'web', not 'db'"),
        ({"resources": Resources(cpus=2, memory_mb=256)}, "not 2 cpus + 256 MiB"),
        # w1 has no gpu label: the old machine there is not this order's
        ({"constraints": {"gpu": "a100"}}, "constraints disk=ssd, not gpu=a100"),
        ({"constraints": {}}, "constraints disk=ssd, not none"),  # as a claim would say
    ):
        if claims:
            await store.kv.purge(key_of(first.order_id))
        with pytest.raises(ClientError) as err:
            await client.place(msgspec.structs.replace(first, **change))
        assert err.value.code == "bad_request"
        detail = str(err.value)
        assert f"order id 'reused-1' was placed as machine {placed.machine_id}" in detail
        assert named in detail and "use a new id for a new order" in detail
    assert market.violations() == []
