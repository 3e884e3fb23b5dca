"""Order claims (docs/protocol.md §5.3c) on a real nats-server with JetStream: one order id,
at most one machine, whichever exchanges, direct buyers and retries send it, at once or
later; a retry of a placed order is answered from its claim; a fresh order with an id does
not wait out the retry gathering window; a dead auction's claim is taken over."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import Claim, fingerprint
from bourse.client import BourseClient, ClientError
from bourse.nats.connection import flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import claims_bucket_name
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Placed, PlaceOrder, Resources, Unfilled
from bourse.wire.subjects import Subjects
from tests.market import Market, order, outcome_trail, worker

Outcome = Placed | Unfilled | ClientError


async def _place(client: BourseClient, o: PlaceOrder) -> Outcome:
    try:
        return await client.place(o)
    except ClientError as exc:
        return exc


async def _live_machines(client: BourseClient, workers: list[str]) -> dict[str, list[str]]:
    """order id -> its live machines, from every worker's own listing."""
    by_order: dict[str, list[str]] = defaultdict(list)
    for w in workers:
        for m in (await client.machines(w)).machines:
            if m.state != "destroyed":
                by_order[m.order_id].append(m.machine_id)
    return by_order


async def _store(market: Market) -> ClaimStore:
    store = await ClaimStore.open(await market.connect("claims"), market.subjects)
    assert store is not None  # the test server runs JetStream
    return store


async def test_a_duplicate_storm_places_one_machine_per_order_id(market: Market) -> None:
    """60 order ids, each sent 8 times at once through 3 exchanges and 2 direct-mode buyers,
    two of the 8 for another image: every id has at most one live machine, every Placed a
    buyer got for it names that machine, and the other image is refused as a conflict."""
    workers = [f"w{i}" for i in range(4)]
    await market.host(*(worker(w, cpus=256, memory_mb=1 << 20) for w in workers))
    for _ in range(3):
        await market.exchange()
    paths = [await market.client() for _ in range(3)]
    paths += [await market.client(direct=True) for _ in range(2)]
    ids = [f"storm-{i}" for i in range(60)]
    sends = [
        (
            oid,
            paths[k % len(paths)],
            order(
                order_id=oid, image="api" if k >= 6 else "web", deadline_ms=5000, retry=k % 2 == 1
            ),
        )
        for oid in ids
        for k in range(8)
    ]
    results = await asyncio.gather(*(_place(c, o) for _, c, o in sends))

    live = await _live_machines(paths[0], workers)
    for oid in ids:
        got = [r for (i, _, _), r in zip(sends, results, strict=True) if i == oid]
        placed = {r.machine_id for r in got if isinstance(r, Placed)}
        assert len(live[oid]) <= 1, f"{oid}: {live[oid]}"
        assert placed <= set(live[oid]), f"{oid}: buyers were told {placed}, live {live[oid]}"
        refused = [r for r in got if isinstance(r, ClientError)]
        conflicts = [r for r in refused if r.code == "bad_request"]
        assert all("different order" in str(r) for r in conflicts)
        # the rest were refused as overloaded (480 orders at once) or placed it
        assert all(r.code == "overloaded" for r in refused if r not in conflicts), got
        if len(refused) < len(got):  # deadline 5 s, ample room: an admitted id is placed
            assert len(placed) == 1, f"{oid}: {got}"
    assert market.violations() == []


async def test_a_retry_of_a_placed_order_is_answered_from_its_claim(market: Market) -> None:
    """No bid goes out for it: the claim says which machine it is (Placed{existing})."""
    await market.host(worker("a"), worker("b"))
    await market.exchange()
    client = await market.client()
    first = await client.place(order(order_id="again"))
    assert isinstance(first, Placed) and not first.existing
    bids: list[str] = []

    async def spy(msg: Msg) -> None:
        bids.append(decode(msg.data, Bid).order_id)

    nc = await market.connect("spy")
    await nc.subscribe(market.subjects.bid("mad"), cb=spy)
    await flush_all(nc)
    for c in (client, await market.client(direct=True)):
        again = await c.place(order(order_id="again", retry=True, exclude_workers=["a", "b"]))
        assert isinstance(again, Placed) and again.existing
        assert (again.machine_id, again.worker_id) == (first.machine_id, first.worker_id)
    marker = await client.place(order(order_id="marker"))  # a bid the spy must see...
    assert isinstance(marker, Placed)
    await flush_all(nc)
    assert "marker" in bids and "again" not in bids  # ...while the retries sent none


async def test_one_order_written_two_ways_is_one_order(market: Market) -> None:
    """`--meta a=1 --meta b=2` then `--meta b=2 --meta a=1` under one order id, its
    constraints in another order too and its one CPU written with cpu_millis: the same
    order, answered with its one machine from the claim (not refused as another order)."""
    await market.host(worker("a", labels={"disk": "ssd", "zone": "z1"}))
    await market.exchange()
    client = await market.client()
    first = await client.place(
        order(
            order_id="written-twice",
            metadata={"a": "1", "b": "2"},
            constraints={"disk": "ssd", "zone": "z1"},
        )
    )
    assert isinstance(first, Placed)
    again = await client.place(
        msgspec.structs.replace(
            order(
                order_id="written-twice",
                metadata={"b": "2", "a": "1"},
                constraints={"zone": "z1", "disk": "ssd"},
                retry=True,
            ),
            resources=Resources(cpus=1, cpu_millis=1000, memory_mb=256),
        )
    )
    assert isinstance(again, Placed) and again.existing
    assert again.machine_id == first.machine_id


async def test_a_new_order_with_an_id_does_not_wait_out_the_retry_window(
    market: Market,
) -> None:
    """`buyer place --order-id` sends retry=true: without claims the auction gathers offers
    for min(quiet_ms, deadline/2) before it commits (here 5 s); a fresh claim proves no
    machine exists for the id, so it commits the first offer at once."""
    await market.host(worker("a"))
    client = await market.client(direct=True, quiet_ms=8000)
    r = await client.place(order(order_id="fresh-with-id", retry=True, deadline_ms=10_000))
    assert isinstance(r, Placed) and not r.existing
    assert r.elapsed_ms < 5000, "waited out the retry gathering window"


async def test_a_claim_of_a_dead_auction_is_taken_over(market: Market) -> None:
    """An exchange died mid-auction (its claim says 'auctioning', past its end): the next
    attempt takes the claim over and places the order."""
    await market.host(worker("a"))
    store = await _store(market)
    o = order(order_id="orphaned")
    dead = Claim(state="auctioning", auction_id="DEAD", fingerprint=fingerprint(o), until_ms=1)
    assert await store.put("orphaned", dead, 0) is not None
    client = await market.client(direct=True)
    r = await client.place(o)
    assert isinstance(r, Placed)
    claim, _ = await store.get("orphaned")
    assert claim is not None and claim.state == "placed" and claim.placed is not None
    assert claim.placed.machine_id == r.machine_id and claim.auction_id != "DEAD"


async def test_a_duplicate_waits_for_the_live_auction_and_takes_its_outcome(
    market: Market,
) -> None:
    """A claim still running elsewhere: the duplicate waits; when the claim turns placed it
    answers with that machine; a claim that never ends is unfilled by the deadline."""
    await market.host(worker("a"))
    store = await _store(market)
    o = order(order_id="elsewhere", deadline_ms=4000)
    running = Claim(
        state="auctioning",
        auction_id="LIVE",
        fingerprint=fingerprint(o),
        until_ms=int(time.time() * 1000) + 60_000,
    )
    revision = await store.put("elsewhere", running, 0)
    assert revision is not None
    client = await market.client(direct=True)
    waiting = asyncio.create_task(client.place(o))
    placed = Placed(
        order_id="elsewhere",
        machine_id="a~FROMTHEOTHER",
        worker_id="a",
        region="mad",
        score=0.5,
        image_cached=True,
        elapsed_ms=1.0,
    )
    done = msgspec.structs.replace(running, state="placed", placed=placed)
    assert await store.put("elsewhere", done, revision) is not None
    r = await asyncio.wait_for(waiting, 10)
    assert isinstance(r, Placed) and r.existing and r.machine_id == "a~FROMTHEOTHER"

    stuck = msgspec.structs.replace(running, auction_id="STUCK")
    assert await store.put("stuck", stuck, 0) is not None
    late = await client.place(order(order_id="stuck", deadline_ms=300))
    assert isinstance(late, Unfilled) and late.reason == "deadline"
    assert "being placed by another auction" in late.detail


async def test_an_unfilled_orders_claim_is_removed_and_a_conflict_is_refused(
    market: Market,
) -> None:
    await market.host(worker("a"))
    store = await _store(market)
    client = await market.client(direct=True)
    big = await client.place(order(order_id="too-big", cpus=64))
    assert isinstance(big, Unfilled)
    assert (await store.get("too-big"))[0] is None  # removed: a later attempt starts afresh
    assert isinstance(await client.place(order(order_id="too-big")), Placed)
    other = await _place(client, order(order_id="too-big", image="api"))
    assert isinstance(other, ClientError) and other.code == "bad_request"


async def test_a_jetstream_that_does_not_answer_is_an_outage_not_no_claims(
    tmp_path: Path, subjects: Subjects
) -> None:
    """A JetStream API that times out (a node down, a cluster electing its leader) must not
    be read as "no JetStream": that ran auctions without claims for 30 s and placed an id's
    second machine (the storm found it). Here the API is a subscriber that never answers:
    the order is refused with nothing placed; once it answers "not here" the market runs
    without claims, as on a core-only server."""
    srv = EmbeddedNats(workdir=tmp_path / "core-nats", jetstream=False).start()
    try:
        async with Market(srv.url, subjects, tmp_path) as market:
            await market.host(worker("a"))
            mute = await market.connect("mute-jetstream")
            silent = await mute.subscribe("$JS.API.INFO")  # takes the request, answers never
            await flush_all(mute)
            direct = await market.client(direct=True)
            with pytest.raises(ClientError, match="order claims unavailable"):
                await direct.place(order(order_id="outage-1", deadline_ms=300))
            assert silent.pending_msgs >= 1  # it was asked
            assert not (await direct.machines("a")).machines  # nothing placed
            await silent.unsubscribe()  # now nothing serves the API: a core-only server
            await flush_all(mute)
            r = await direct.place(order(order_id="outage-1", deadline_ms=300))
            assert isinstance(r, Placed)  # placed without claims, as without JetStream
    finally:
        srv.stop()


async def test_the_buyer_is_answered_once_the_placed_claim_is_acknowledged(
    market: Market,
) -> None:
    """The exchange answers Placed only after JetStream acknowledged the claim's write that
    names the machine (I3: a buyer is never told of a machine its claim does not name), and
    publishes the region release after that acknowledgement too, so the write is not
    queued behind every supplier process handling the release. Two processes offer, so
    the release is not folded into the commit."""
    await market.host(worker("a"))
    await market.host(worker("b"))
    await market.exchange()
    nc = await market.connect("watcher")
    sub = await nc.subscribe(">")  # everything, in the order the server delivers it here
    await flush_all(nc)
    inbox = nc.new_inbox()
    bucket = claims_bucket_name(market.subjects.prefix)
    await nc.publish(market.subjects.order("mad"), encode(order(order_id="acked")), reply=inbox)
    release = market.subjects.region_release("mad")
    seen, answer = await outcome_trail(sub, bucket, release, inbox)
    reply = decode(answer, Placed)
    assert seen[:3] == ["auctioning", "placed", "ack"], seen
    assert sorted(seen[3:]) == ["answer", "release"], seen
    store = await _store(market)
    claim, _ = await store.get("acked")
    assert claim is not None and claim.placed is not None
    assert claim.placed.machine_id == reply.machine_id


async def test_a_duplicate_waits_for_the_claim_without_a_jetstream_consumer(
    market: Market,
) -> None:
    """Waiting for a live auction's outcome reads the claim; it does not watch it (a watch
    is a consumer, and a storm of waiting duplicates hit the server's consumer limit)."""
    store = await _store(market)
    o = order(order_id="waited-on")
    live = Claim(state="auctioning", auction_id="A", fingerprint=fingerprint(o), until_ms=1 << 60)
    revision = await store.put("waited-on", live, 0)
    assert revision is not None
    waiters = [asyncio.create_task(store.changed("waited-on", revision, 5.0)) for _ in range(20)]
    nc = await market.connect("inspector")
    js = nc.jetstream()
    info = await js.stream_info(f"KV_{store.name}")
    assert info.state.consumer_count == 0 and not any(w.done() for w in waiters)
    placed = msgspec.structs.replace(live, state="placed")
    assert await store.put("waited-on", placed, revision) is not None
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [True] * 20
    assert not await store.changed("waited-on", revision + 1, 0.05)  # nothing new: False
