"""Sampled bidding: workers in shards, bids to d random shards, broadcast as the fallback."""

from __future__ import annotations

import zlib
from collections import Counter

from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.wire.messages import Placed, Unfilled
from bourse.wire.subjects import sampled_shards, shard_of
from tests.market import Market, collect, order, wait_until, worker

SHARDS = 8


async def _count_bids(market: Market) -> Counter[str]:
    spy = await market.connect("spy")
    seen: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        seen[msg.subject.removeprefix(market.subjects.bid("mad"))] += 1

    await spy.subscribe(market.subjects.bid("mad") + ".>", cb=count)
    await spy.subscribe(market.subjects.bid("mad"), cb=count)
    await flush_all(spy)
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
    # One worker: with 8 shards, most samples of 2 miss its shard (a 503 each). The quiet
    # window is long, so that an auction that waited it out shows however busy the machine.
    await market.host(worker("only"), bid_shards=SHARDS)
    await market.exchange(bid_shards=SHARDS, bid_sample=2, quiet_ms=5_000)
    buyer = await market.client()
    results = [await buyer.place(order(order_id=f"o{i}")) for i in range(8)]
    assert all(isinstance(r, Placed) and r.worker_id == "only" for r in results)
    assert all(r.elapsed_ms < 5_000 for r in results)  # 503s answer at once, no quiet wait


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


def _in_shard(shard: int, shards: int, n: int, prefix: str) -> list[str]:
    """``n`` worker ids of ``shard``."""
    ids = (f"{prefix}{i}" for i in range(10_000))
    return [w for w in ids if shard_of(w, shards) == shard][:n]


async def test_a_sampled_bid_commits_once_the_shards_processes_answered(market: Market) -> None:
    # Two supplier processes, one per shard of two; each bid samples one shard (the image's
    # home). Once the exchange knows each shard's process, a bid's process answering ends
    # the collection: no quiet window when the shard has nothing (the broadcast goes out at
    # once), and the process that offered alone drops the other holds (no region release).
    home = zlib.crc32(b"web") % 2
    small = [worker(w, cpus=1) for w in _in_shard(home, 2, 4, "s")]
    big = [worker(w, cpus=64) for w in _in_shard(1 - home, 2, 2, "b")]
    small_host = await market.host(*small, bid_shards=2)
    big_host = await market.host(*big, bid_shards=2)
    # (batch_bids off: region releases go out alone, on the release subject)
    ex = await market.exchange(bid_shards=2, bid_sample=1, quiet_ms=5_000, batch_bids=False)
    spy = await market.connect("spy")
    releases = await collect(spy, market.subjects.region_release("mad"))
    buyer = await market.client()
    # learn both shards: an order for another image whose home is the other shard
    other = next(f"img{i}" for i in range(100) if zlib.crc32(f"img{i}".encode()) % 2 != home)
    for image in ("web", other):
        r = await buyer.place(order(image=image, order_id=f"learn-{image}"))
        assert isinstance(r, Placed)
    expected = {home: {small_host.responder_id}, 1 - home: {big_host.responder_id}}
    assert ex.auctioneer.expected_shard_responders("mad") == expected
    await flush_all(spy)
    before = len(releases)

    r = await buyer.place(order(order_id="fits", deadline_ms=8_000))
    assert isinstance(r, Placed) and r.worker_id in {w.worker_id for w in small}
    # only the home shard's process was asked, and it offered alone: it drops the rest
    assert sampled_shards("fits", "web", 2, 1) == [home]

    r = await buyer.place(order(order_id="too-big", cpus=32, deadline_ms=8_000))
    assert isinstance(r, Placed) and r.worker_id in {w.worker_id for w in big}
    # the home shard answered with nothing: the broadcast did not wait out the 5 s window
    assert r.elapsed_ms < 2_500
    await (await market.connect("flush")).flush()
    await flush_all(spy)
    # the fallback's order is released to the region (the broadcast reached both
    # processes); the sampled one that fit needed no region release
    await wait_until(lambda: len(releases) > before)
    released = [m.data for m in releases[before:]]
    assert any(b"too-big" in d for d in released)
    assert not any(b'"fits"' in d for d in released)
