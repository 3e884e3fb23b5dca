"""The order claim's create overlaps the bid (issue 16, docs/protocol.md §5.3c): on the first
try the auction bids while its claim is being written, and nothing is committed until the
claim is held. A create that loses or fails abandons that auction without a commit (its
holds released) and the claim loop goes on as before; a later auction bids under a fresh
auction id (suppliers ignore a bid whose pair they were told to release).

Real nats-server with JetStream and the real claims bucket. The claim store is the real
one with its create held back by an event the test releases (a "slow KV"), and the worker
is a hand-written responder (or a real supplier where its memory of released bids
matters), so each step is observed, not timed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import pytest
import structlog
from nats.aio.msg import Msg

from bourse.auction.claims import KV_TIMEOUT_S, Claim, ClaimStore, fingerprint
from bourse.auction.driver import AuctionConfig, Auctioneer, AuctionError
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Commit, Offer, Placed, PlaceOrder, Release, Unfilled
from tests.market import Market, order, outcome_trail, placed_for, wait_until, worker


class GatedStore(ClaimStore):
    """The real claims bucket whose creates (put at revision 0) wait for ``go``; the first
    ``fail`` of them raise ``error`` (after writing the claim when ``write``: a lost reply)."""

    def __init__(
        self,
        real: ClaimStore,
        *,
        error: BaseException | None = None,
        fail: int = 0,
        write: bool = True,
    ) -> None:
        super().__init__(real.kv, real.name, real.nc)
        self.go = asyncio.Event()
        self.asked = asyncio.Event()
        self.created: list[int | None] = []  # each create's answer, in order
        self.cancelled = False
        self.error, self.fail, self.write = error, fail, write

    async def put(
        self, order_id: str, claim: Claim, last: int, timeout_s: float = KV_TIMEOUT_S
    ) -> int | None:
        if last != 0:
            return await super().put(order_id, claim, last, timeout_s)
        self.asked.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.fail and self.error is not None:
            self.fail -= 1
            if self.write:
                self.created.append(await super().put(order_id, claim, last))
            raise self.error
        revision = await super().put(order_id, claim, last)
        self.created.append(revision)
        return revision


@dataclass
class FakeWorker:
    """Worker "a" of region mad as a responder: offers at once; at a commit it reads the
    order's claim from the bucket (what the worker would find there) and places."""

    store: ClaimStore
    bids: list[str] = field(default_factory=list)  # auction ids, in order
    commits: list[Claim | None] = field(default_factory=list)  # the claim at each commit
    releases: list[str] = field(default_factory=list)  # auction ids of region releases
    bid_seen: asyncio.Event = field(default_factory=asyncio.Event)
    created_at_bid: list[bool] = field(default_factory=list)

    async def start(self, market: Market, gated: GatedStore | None = None) -> None:
        nc = await market.connect("fake-worker")
        s = market.subjects

        async def on_bid(msg: Msg) -> None:
            bid = decode(msg.data, Bid)
            self.bids.append(bid.auction_id)
            self.created_at_bid.append(bool(gated and gated.created))
            self.bid_seen.set()
            offer = Offer(order_id=bid.order_id, worker_id="a", region="mad", score=0.9)
            await nc.publish(msg.reply, encode(offer))

        async def on_commit(msg: Msg) -> None:
            c = decode(msg.data, Commit)
            self.commits.append((await self.store.get(c.order_id))[0])
            placed = placed_for(c, f"a~M{len(self.commits)}", 0.9, image_cached=True)
            await nc.publish(msg.reply, encode(placed))

        async def on_release(msg: Msg) -> None:
            self.releases.append(decode(msg.data, Release).auction_id)

        await nc.subscribe(s.bid("mad"), cb=on_bid)
        await nc.subscribe(s.commit("a"), cb=on_commit)
        await nc.subscribe(s.region_release("mad"), cb=on_release)
        await nc.flush()


async def _store(market: Market) -> ClaimStore:
    store = await ClaimStore.open(await market.connect("claims"), market.subjects)
    assert store is not None  # the test server runs JetStream
    return store


async def _claim_names(store: ClaimStore, order_id: str, machine_id: str) -> None:
    """The order's claim says placed, with that machine."""
    claim, _ = await store.get(order_id)
    assert claim is not None and claim.state == "placed" and claim.placed is not None
    assert claim.placed.machine_id == machine_id


async def _auctioneer(market: Market, store: ClaimStore) -> Auctioneer:
    config = AuctionConfig(claim_beside_bid=True)  # off by default (bourse/auction/core.py)
    return Auctioneer(await market.connect("buyer"), market.subjects, config, claim_store=store)


def _said(logs: list[dict[str, Any]], event: str) -> bool:
    return any(e["event"] == event for e in logs)


def _live(o: PlaceOrder, auction_id: str) -> Claim:
    """Another auction's claim on the id, running for a minute yet."""
    return Claim(
        state="auctioning", auction_id=auction_id, fingerprint=fingerprint(o), until_ms=1 << 60
    )


async def test_the_bid_goes_out_while_the_claim_is_written_and_the_commit_waits_for_it(
    market: Market,
) -> None:
    real = await _store(market)
    gated = GatedStore(real)
    fake = FakeWorker(real)
    await fake.start(market, gated)
    auctioneer = await _auctioneer(market, gated)
    watcher = await market.connect("watcher")
    watched = await watcher.subscribe(">")  # everything, in the order the server delivers it
    await watcher.flush()
    with structlog.testing.capture_logs() as logs:
        placing = asyncio.create_task(auctioneer.run(order(order_id="overlap-1")))
        await asyncio.wait_for(fake.bid_seen.wait(), 5)
        assert fake.created_at_bid == [False]  # the bid is on the wire before the claim
        await wait_until(lambda: _said(logs, "commit_awaits_claim"))
        assert gated.asked.is_set() and gated.created == []  # the create is under way
        assert fake.commits == []  # an offer in hand, the commit held back for the claim
        gated.go.set()
        r = await asyncio.wait_for(placing, 5)
    assert isinstance(r, Placed) and r.machine_id == "a~M1" and not r.existing
    assert len(gated.created) == 1 and gated.created[0] is not None
    # when the commit reached the worker, the claim was in the bucket, this auction's
    [at_commit] = fake.commits
    assert at_commit is not None and at_commit.state == "auctioning"
    assert at_commit.auction_id == fake.bids[0]
    await _claim_names(real, "overlap-1", r.machine_id)
    # the region release went out once the outcome was recorded (protocol.md §5.2 step 8)
    release = market.subjects.region_release("mad")
    seen, _ = await outcome_trail(watched, real.name, release)
    assert seen == ["auctioning", "placed", "ack", "release"]
    await auctioneer.close()


async def test_a_duplicate_whose_create_loses_commits_nothing_and_takes_the_others_outcome(
    market: Market,
) -> None:
    real = await _store(market)
    o = order(order_id="dup-1", deadline_ms=4000)
    revision = await real.put("dup-1", _live(o, "OTHER"), 0)
    assert revision is not None
    gated = GatedStore(real)
    fake = FakeWorker(real)
    await fake.start(market)
    auctioneer = await _auctioneer(market, gated)
    with structlog.testing.capture_logs() as logs:
        placing = asyncio.create_task(auctioneer.run(o))
        await wait_until(lambda: _said(logs, "commit_awaits_claim"))  # ready to commit...
        gated.go.set()  # ...when the create answers: the id is claimed by OTHER
        await wait_until(lambda: fake.releases == fake.bids)  # abandoned: its holds go
    assert gated.created == [None] and fake.commits == []
    claim, now = await real.get("dup-1")
    assert claim is not None and claim.auction_id == "OTHER" and now == revision  # untouched
    theirs = Placed(
        order_id="dup-1",
        machine_id="a~THEIRS",
        worker_id="a",
        region="mad",
        score=0.5,
        image_cached=True,
        elapsed_ms=1.0,
    )
    done = msgspec.structs.replace(claim, state="placed", placed=theirs)
    assert await real.put("dup-1", done, revision) is not None  # OTHER places its machine
    r = await asyncio.wait_for(placing, 5)
    assert isinstance(r, Placed) and r.existing and r.machine_id == "a~THEIRS"
    assert fake.commits == [] and len(fake.bids) == 1  # no second auction
    await auctioneer.close()


async def test_after_a_lost_create_the_next_auction_bids_under_a_fresh_id(
    market: Market,
) -> None:
    """A real supplier, which ignores a bid of a released (order id, auction id): the other
    auction's claim goes away, this one claims the id and places it under a new id."""
    await market.host(worker("a"))
    real = await _store(market)
    o = order(order_id="dup-2", deadline_ms=4000)
    revision = await real.put("dup-2", _live(o, "OTHER"), 0)
    assert revision is not None
    spy = FakeWorker(real)  # listens only: bids and releases of the region
    nc = await market.connect("spy")

    async def on_bid(msg: Msg) -> None:
        spy.bids.append(decode(msg.data, Bid).auction_id)

    async def on_release(msg: Msg) -> None:
        spy.releases.append(decode(msg.data, Release).auction_id)

    await nc.subscribe(market.subjects.bid("mad"), cb=on_bid)
    await nc.subscribe(market.subjects.region_release("mad"), cb=on_release)
    await nc.flush()
    auctioneer = await _auctioneer(market, real)
    placing = asyncio.create_task(auctioneer.run(o))
    await wait_until(lambda: len(spy.releases) == 1)  # the speculative auction abandoned
    assert spy.bids == spy.releases
    await real.remove("dup-2", revision)  # OTHER ended without a machine (unfilled)
    r = await asyncio.wait_for(placing, 5)
    assert isinstance(r, Placed) and not r.existing and r.worker_id == "a"
    assert len(spy.bids) == 2 and spy.bids[0] != spy.bids[1]
    await _claim_names(real, "dup-2", r.machine_id)
    assert market.violations() == []
    await auctioneer.close()


@pytest.mark.parametrize("write", [True, False], ids=["reply-lost", "not-written"])
async def test_a_create_that_fails_abandons_the_auction_and_the_retry_places_it_claimed(
    market: Market, write: bool
) -> None:
    """The create raises a KV error (having written the claim or not): the speculative
    auction commits nothing; the retry path finds its own claim (or creates it) and the
    next auction, under a fresh auction id, commits with the claim in the bucket."""
    real = await _store(market)
    gated = GatedStore(real, error=nats.errors.TimeoutError(), fail=1, write=write)
    fake = FakeWorker(real)
    await fake.start(market)
    auctioneer = await _auctioneer(market, gated)
    with structlog.testing.capture_logs() as logs:
        placing = asyncio.create_task(auctioneer.run(order(order_id="kv-err", deadline_ms=3000)))
        await wait_until(lambda: _said(logs, "commit_awaits_claim"))
        assert fake.commits == []
        gated.go.set()
        r = await asyncio.wait_for(placing, 5)
    assert _said(logs, "order_claim_failed")
    assert isinstance(r, Placed) and r.machine_id == "a~M1"
    assert len(fake.bids) == 2 and fake.bids[0] != fake.bids[1]
    assert fake.releases[0] == fake.bids[0]  # the abandoned auction's holds released
    [at_commit] = fake.commits  # one commit, the second auction's, under the claim
    assert at_commit is not None and at_commit.state == "auctioning"
    await _claim_names(real, "kv-err", r.machine_id)
    await auctioneer.close()


async def test_creates_that_keep_failing_refuse_the_order_with_nothing_committed(
    market: Market,
) -> None:
    real = await _store(market)
    gated = GatedStore(real, error=nats.errors.TimeoutError(), fail=1000, write=False)
    gated.go.set()
    fake = FakeWorker(real)
    await fake.start(market)
    auctioneer = await _auctioneer(market, gated)
    with pytest.raises(AuctionError, match="order claims unavailable"):
        await auctioneer.run(order(order_id="kv-down", deadline_ms=300))
    assert fake.bids and fake.commits == []
    assert (await real.get("kv-down"))[0] is None
    await auctioneer.close()


async def test_a_claim_not_written_by_the_deadline_ends_unfilled_and_is_removed(
    market: Market,
) -> None:
    real = await _store(market)
    gated = GatedStore(real)
    fake = FakeWorker(real)
    await fake.start(market)
    auctioneer = await _auctioneer(market, gated)
    with structlog.testing.capture_logs() as logs:
        placing = asyncio.create_task(auctioneer.run(order(order_id="late", deadline_ms=300)))
        await wait_until(lambda: _said(logs, "order_unfilled"))  # the deadline, at the gate
        assert not placing.done()  # the outcome waits for the claim's
        gated.go.set()
        r = await asyncio.wait_for(placing, 5)
    assert isinstance(r, Unfilled) and r.reason == "deadline" and r.commits_tried == 0
    assert r.offers == 1 and fake.commits == []
    assert gated.created and gated.created[0] is not None  # written after the deadline...
    assert (await real.get("late"))[0] is None  # ...and removed: nothing was committed
    await auctioneer.close()


@pytest.mark.parametrize("at", ["commit_awaits_claim", "order_unfilled"])
async def test_a_run_cancelled_before_its_claim_answers_cancels_the_create(
    market: Market, at: str
) -> None:
    """Cancelled at the gate of its first commit, or with its (unfilled) result in hand
    while it waits for the claim: the create is cancelled and awaited, never left behind."""
    real = await _store(market)
    gated = GatedStore(real)
    fake = FakeWorker(real)
    await fake.start(market)
    auctioneer = await _auctioneer(market, gated)
    o = order(order_id="cancelled", deadline_ms=300)
    with structlog.testing.capture_logs() as logs:
        placing = asyncio.create_task(auctioneer.run(o))
        await wait_until(lambda: _said(logs, at))
        placing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await placing
    assert gated.cancelled and gated.created == [] and fake.commits == []
    await wait_until(lambda: fake.releases == fake.bids)  # its holds released all the same
    assert (await real.get("cancelled"))[0] is None
    await auctioneer.close()


async def test_a_retry_creates_its_claim_before_it_bids(market: Market) -> None:
    """A retry may find its id placed and adopt the machine without a bid, so it does not
    bid (and hold capacity on every fitting worker) before it knows."""
    real = await _store(market)
    gated = GatedStore(real)
    fake = FakeWorker(real)
    await fake.start(market, gated)
    auctioneer = await _auctioneer(market, gated)
    placing = asyncio.create_task(auctioneer.run(order(order_id="retried", retry=True)))
    await asyncio.wait_for(gated.asked.wait(), 5)
    gated.go.set()
    r = await asyncio.wait_for(placing, 5)
    assert isinstance(r, Placed)
    assert fake.created_at_bid == [True]  # the claim was written before the bid went out
    await auctioneer.close()


async def test_by_default_the_claim_is_written_before_the_bid(market: Market) -> None:
    """claim_beside_bid is off by default: a concurrent duplicate's early bid would replace
    the claim holder's holds (a worker keeps one hold per order id)."""
    real = await _store(market)
    gated = GatedStore(real)
    fake = FakeWorker(real)
    await fake.start(market, gated)
    auctioneer = Auctioneer(await market.connect("buyer"), market.subjects, claim_store=gated)
    placing = asyncio.create_task(auctioneer.run(order(order_id="first-try")))
    await asyncio.wait_for(gated.asked.wait(), 5)
    assert fake.bids == []  # nothing bid while the create is held back
    gated.go.set()
    r = await asyncio.wait_for(placing, 5)
    assert isinstance(r, Placed)
    assert fake.created_at_bid == [True]
    await auctioneer.close()
