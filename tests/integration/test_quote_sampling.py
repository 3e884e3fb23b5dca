"""A host with many workers in one region prices a bid on a sample of them
(supplier/candidates.py): the owner of a retried order, the workers caching its image,
a window at random; and all of them when the sample cannot take the bid."""

from __future__ import annotations

from zlib import crc32

from bourse.wire.messages import Placed
from supplier.candidates import window
from tests.market import Market, order, worker

SAMPLE = 2


async def test_sampled_quoting_keeps_image_locality(market: Market) -> None:
    workers = [worker(f"w{i:02d}", images=["hot"] if i == 37 else []) for i in range(40)]
    host = await market.host(*workers, quote_sample=SAMPLE)
    await market.exchange()
    buyer = await market.client()
    r = await buyer.place(order(image="hot", order_id="o-hot"))
    assert isinstance(r, Placed)
    assert r.worker_id == "w37" and r.image_cached  # the only holder was priced, and won
    assert host.groups[market.subjects.bid("mad")].by_image["hot"] == [host.workers["w37"]]


async def test_a_retry_finds_its_machine_on_an_unsampled_worker(market: Market) -> None:
    workers = [worker(f"w{i:02d}", images=["hot"] if i == 37 else []) for i in range(40)]
    host = await market.host(*workers, quote_sample=SAMPLE)
    await market.exchange()
    buyer = await market.client()
    # w37 wins the first auction through its cached image, outside the random window...
    group = host.groups[market.subjects.bid("mad")]
    assert host.workers["w37"] not in window(group.workers, crc32(b"o-retry") >> 8, SAMPLE)
    first = await buyer.place(order(image="hot", order_id="o-retry"))
    assert isinstance(first, Placed) and first.worker_id == "w37"
    # ...and a retry whose image is cached nowhere is still priced there, as the owner.
    again = await buyer.place(order(image="hot", order_id="o-retry", retry=True))
    evicted = host.workers["w37"]
    group.image_changed(evicted, "hot", False)  # no image path to w37 any more
    third = await buyer.place(order(image="hot", order_id="o-retry", retry=True))
    for r in (again, third):
        assert isinstance(r, Placed)
        assert (r.machine_id, r.existing) == (first.machine_id, True)  # I3


async def test_a_full_sample_falls_back_to_every_worker(market: Market) -> None:
    # 39 workers too small for the order, one that fits: a sample of 2 + 2 rarely holds it.
    workers = [worker(f"s{i:02d}", cpus=1) for i in range(39)] + [worker("big", cpus=16)]
    await market.host(*workers, quote_sample=SAMPLE)
    await market.exchange()
    buyer = await market.client()
    placed = [await buyer.place(order(cpus=4, order_id=f"o{i}")) for i in range(3)]
    assert all(isinstance(r, Placed) and r.worker_id == "big" for r in placed)
    assert not market.violations()
