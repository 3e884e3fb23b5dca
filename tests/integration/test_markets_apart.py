"""Two markets on one nats-server, told apart only by their subject prefixes: prefixes that
differ in ``.`` against ``_`` or in case have claims buckets of their own, so the same order
id placed in each gets each market's own machine (never the other market's, from a shared
claim)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bourse.nats.embedded import EmbeddedNats
from bourse.wire.messages import Placed
from bourse.wire.subjects import Subjects
from tests.market import Market, order, worker


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    # a server of its own: these fixed prefixes must not meet another test's buckets
    with EmbeddedNats(workdir=tmp_path / "nats") as srv:
        yield srv


@pytest.mark.parametrize(("one", "other"), [("t.x", "t_x"), ("bourse", "Bourse")])
async def test_the_same_order_id_in_two_markets_gets_each_markets_machine(
    server: EmbeddedNats, tmp_path: Path, one: str, other: str
) -> None:
    got: dict[str, Placed] = {}
    for prefix, worker_id in ((one, "w-one"), (other, "w-other")):
        async with Market(server.url, Subjects(prefix), tmp_path / worker_id) as market:
            await market.host(worker(worker_id))
            await market.exchange()
            placed = await (await market.client()).place(order(order_id="shared-id"))
            assert isinstance(placed, Placed), placed
            got[prefix] = placed
    assert got[one].worker_id == "w-one" and got[other].worker_id == "w-other"
    assert not got[other].existing, "the second market answered from the first one's claim"
