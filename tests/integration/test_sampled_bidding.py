"""Sampled bidding: workers in shards, bids to d random shards, broadcast as the fallback."""

from __future__ import annotations

import zlib
from collections import Counter

from nats.aio.msg import Msg

from bourse.wire.messages import Placed, Unfilled
from bourse.wire.subjects import shard_of
from tests.market import Market, order, worker

SHARDS = 8


async def _count_bids(market: Market) -> Counter[str]:
    spy = await market.connect("spy")
    seen: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        seen[msg.subject.removeprefix(market.subjects.bid("mad"))] += 1

    await spy.subscribe(market.subjects.bid("mad") + ".>", cb=count)
    await spy.subscribe(market.subjects.bid("mad"), cb=count)
    await spy.flush()
    return seen


async def test_bids_go_to_sampled_shards_only(market: Market) -> None:
    workers = [worker(f"w{i}") for i in range(40)]
    await market.host(*workers, bid_shards=SHARDS)
    await market.exchange(bid_shards=SHARDS, bid_sample=2)
    seen = await _count_bids(market)
    buyer = await market.client()
    for _ in range(10):
        r = await buyer.place(order())
        assert isinstance(r, Placed)
        assert shard_of(r.worker_id, SHARDS) in {
            int(k[1:]) for k in seen if k
        }  # the winner is in a shard that got a bid
    await (await market.connect("flush")).flush()
    assert "" not in seen  # never broadcast: the sampled shards always had workers
    assert sum(seen.values()) == 20  # 10 orders x 2 shards
    # every bid asked the image's home shard (image locality builds there)
    assert seen[f".{zlib.crc32(b'web') % SHARDS}"] == 10


async def test_empty_sampled_shards_fall_back_to_the_whole_region(market: Market) -> None:
    # One worker: with 8 shards, most samples of 2 miss its shard (a 503 each).
    await market.host(worker("only"), bid_shards=SHARDS)
    await market.exchange(bid_shards=SHARDS, bid_sample=2)
    buyer = await market.client()
    results = [await buyer.place(order(order_id=f"o{i}")) for i in range(8)]
    assert all(isinstance(r, Placed) and r.worker_id == "only" for r in results)
    assert all(r.elapsed_ms < 100 for r in results)  # 503s answer at once, no quiet wait


async def test_sampled_shards_that_cannot_fit_fall_back_before_unfilled(market: Market) -> None:
    small = [worker(f"s{i}", cpus=1) for i in range(16)]
    big = worker("big", cpus=64)
    await market.host(*small, big, bid_shards=SHARDS)
    await market.exchange(bid_shards=SHARDS, bid_sample=1, quiet_ms=30)
    buyer = await market.client()
    r = await buyer.place(order(cpus=32, deadline_ms=1000))
    assert isinstance(r, Placed) and r.worker_id == "big"
    r = await buyer.place(order(cpus=128, deadline_ms=300))
    assert isinstance(r, Unfilled) and r.reason == "no_offers"


async def test_i3_a_retried_order_asks_the_same_shards_and_finds_its_machine(
    market: Market,
) -> None:
    # 8 shards, 1 sampled: with a draw per auction, most retries would miss the worker
    # that has the machine and place a second one elsewhere.
    host = await market.host(*(worker(f"w{i}") for i in range(40)), bid_shards=SHARDS)
    await market.exchange(bid_shards=SHARDS, bid_sample=1)
    buyer = await market.client()
    first = {}
    for i in range(12):
        r = await buyer.place(order(order_id=f"retry-{i}"))
        assert isinstance(r, Placed)
        first[r.order_id] = r.machine_id
    for i in range(12):
        again = await buyer.place(order(order_id=f"retry-{i}"))
        assert isinstance(again, Placed) and again.existing
        assert again.machine_id == first[again.order_id]
    assert sum(len(w.machines) for w in host.workers.values()) == 12
