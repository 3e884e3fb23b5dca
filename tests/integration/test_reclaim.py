"""Reclaiming orphans (docs/protocol.md §5.3d) on a real nats-server with JetStream: a
worker's machine still reserved a while after its commit is kept when its order's claim
names it, destroyed when the claim names another machine or says the buyer was told
unfilled, adopted when the claim's auction died, and left alone while an auction is live or
when no exchange answers.

Each interleaving is forced, not hoped for: the claim is written first, exactly as the
auction that lost its abort (or died, or was taken over) left it; then the machine is
placed by a direct-mode auction that does not touch claims, as the lost commit did."""

from __future__ import annotations

from pathlib import Path

import msgspec

from bourse.auction.claim_store import ClaimStore
from bourse.auction.claims import Claim, ClaimState, fingerprint, order_shape
from bourse.client import BourseClient
from bourse.wire.messages import Machine, Offer, Placed, PlaceOrder, Unfilled, now_ms
from bourse.wire.resources import ZERO
from supplier.host import SupplierHost
from supplier.store import StoreError
from tests.market import Market, order, wait_until, worker

FAST = {"reclaim_after_s": 0.2, "reclaim_every_s": 0.05}


async def _store(market: Market) -> ClaimStore:
    store = await ClaimStore.open(await market.connect("claims"), market.subjects)
    assert store is not None  # the test server runs JetStream
    return store


async def _claim(store: ClaimStore, o: PlaceOrder, state: ClaimState, **kw: object) -> None:
    """Write the order's claim as an auction would have left it."""
    until = kw.pop("until_ms", now_ms())
    c = Claim(
        state=state,
        auction_id="A-dead",
        fingerprint=fingerprint(o),
        until_ms=until,
        shape=order_shape(o),
    )
    _, revision = await store.get(o.order_id)
    assert await store.put(o.order_id, msgspec.structs.replace(c, **kw), revision) is not None


async def _lost_commit(market: Market, o: PlaceOrder) -> Placed:
    """A machine for ``o`` that no claim knows of: a direct auction without claims."""
    lone = BourseClient(await market.connect("lost"), market.subjects, direct=True, claims=False)
    try:
        r = await lone.place(o)
    finally:
        await lone.close()
    assert isinstance(r, Placed), r
    return r


def _machine(host: SupplierHost, machine_id: str) -> Machine:
    return host.workers["a"].machines[machine_id]


async def test_an_order_placed_normally_is_kept(market: Market) -> None:
    host = await market.host(worker("a"), **FAST)
    await market.exchange()
    client = await market.client()
    r = await client.place(order(order_id="kept-1"))
    assert isinstance(r, Placed)
    reclaims = host.workers["a"].reclaims
    await wait_until(lambda: r.machine_id in reclaims.confirmed)
    assert _machine(host, r.machine_id).state == "reserved"  # a spare stays a spare


async def test_an_unfilled_orders_orphan_is_destroyed_and_the_id_is_free(market: Market) -> None:
    """The lost abort: the buyer was told Unfilled after a commit went out (the claim says
    unfilled), and the commit landed. The machine is destroyed; the order id is free."""
    host = await market.host(worker("a"), **FAST)
    await market.exchange()
    store = await _store(market)
    o = order(order_id="lost-abort-1")
    await _claim(store, o, "unfilled")
    orphan = await _lost_commit(market, o)

    await wait_until(lambda: _machine(host, orphan.machine_id).state == "destroyed")
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "reclaimed"
    assert claim.reclaimed == orphan.machine_id
    assert host.workers["a"].ledger.committed == ZERO  # its resources are back
    # the next attempt under the id places afresh (and is told that machine, not the orphan)
    again = await (await market.client()).place(o)
    assert isinstance(again, Placed) and not again.existing
    assert again.machine_id != orphan.machine_id


async def test_a_second_machine_beside_the_orders_machine_is_destroyed(market: Market) -> None:
    """A taken-over claim missed a stalled worker: the claim names the machine placed
    elsewhere, so this one is an orphan no buyer was told."""
    host = await market.host(worker("a"), **FAST)
    await market.exchange()
    store = await _store(market)
    o = order(order_id="taken-over-1")
    elsewhere = Placed(
        order_id=o.order_id,
        machine_id="b~01J0000000000000000000000B",
        worker_id="b",
        region=o.region,
        score=0.5,
        image_cached=False,
        elapsed_ms=1.0,
    )
    await _claim(store, o, "placed", placed=elsewhere)
    orphan = await _lost_commit(market, o)
    await wait_until(lambda: _machine(host, orphan.machine_id).state == "destroyed")
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.placed == elsewhere  # the order's machine stands


async def test_a_dead_auctions_machine_is_adopted(market: Market) -> None:
    """The auction died after its commit landed, before it wrote an outcome: the machine
    becomes the order's (the claim names it) and a retry is answered with it at once."""
    host = await market.host(worker("a"), **FAST)
    await market.exchange()
    store = await _store(market)
    o = order(order_id="dead-1")
    await _claim(store, o, "auctioning", until_ms=now_ms() - 60_000)
    lone = await _lost_commit(market, o)
    reclaims = host.workers["a"].reclaims
    await wait_until(lambda: lone.machine_id in reclaims.confirmed)
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "placed" and claim.placed is not None
    assert claim.placed.machine_id == lone.machine_id
    retry = await (await market.client()).place(msgspec.structs.replace(o, retry=True))
    assert isinstance(retry, Placed) and retry.existing and retry.machine_id == lone.machine_id
    assert _machine(host, lone.machine_id).state == "reserved"


async def test_a_live_auction_is_waited_for(market: Market) -> None:
    host = await market.host(worker("a"), **FAST)
    await market.exchange()
    store = await _store(market)
    o = order(order_id="live-1")
    await _claim(store, o, "auctioning", until_ms=now_ms() + 600_000)
    m = await _lost_commit(market, o)
    checks = market.exchanges[0].responder.counts
    await wait_until(lambda: checks["reclaim_checks"] >= 3)  # asked, told wait, asked again
    assert _machine(host, m.machine_id).state == "reserved"
    assert m.machine_id not in host.workers["a"].reclaims.confirmed
    # the live auction ends placing it here: from then on it is kept
    await _claim(store, o, "placed", placed=m)
    await wait_until(lambda: m.machine_id in host.workers["a"].reclaims.confirmed)


async def test_without_an_exchange_the_machine_stays(market: Market) -> None:
    """A direct-mode-only market: nobody answers the check; nothing is destroyed."""
    host = await market.host(worker("a"), **FAST)
    store = await _store(market)
    o = order(order_id="alone-1")
    await _claim(store, o, "unfilled")
    m = await _lost_commit(market, o)
    w = host.workers["a"]
    await wait_until(lambda: m.machine_id in w.reclaims.asking)  # it was asked about...
    await wait_until(lambda: m.machine_id not in w.reclaims.asking)  # ...and nobody answered
    assert _machine(host, m.machine_id).state == "reserved"


async def test_a_machine_being_asked_about_is_not_offered(market: Market) -> None:
    """While its verdict may still be "orphan", a retry's bid gets no existing-machine
    offer for it (it could be handed out and then destroyed)."""
    host = await market.host(worker("a"), reclaim_after_s=0)  # no loop: asked by hand
    o = order(order_id="asking-1")
    m = await _lost_commit(market, o)
    w = host.workers["a"]
    probe = await market.connect("probe")
    inbox = probe.new_inbox()
    sub = await probe.subscribe(inbox)
    bid = msgspec.json.encode(
        {
            "type": "Bid",
            "order_id": o.order_id,
            "region": o.region,
            "resources": msgspec.to_builtins(o.resources),
            "image": o.image,
            "hold_ms": 500,
            "auction_id": "probe-1",
        }
    )
    await probe.publish(market.subjects.bid(o.region), bid, reply=inbox)
    offer = msgspec.json.decode((await sub.next_msg(timeout=2)).data, type=Offer)
    assert offer.machine_id == m.machine_id  # not asked about: the retry gets its machine

    w.reclaims.after_ms = 1
    assert [x.machine_id for x in w.reclaims.due(w.machines.values(), now_ms() + 10)] == [
        m.machine_id
    ]
    await probe.publish(
        market.subjects.bid(o.region), bid.replace(b"probe-1", b"probe-2"), reply=inbox
    )
    # a fresh order's bid behind it on the same subject: its offer (delayed by the score
    # spread) comes after any at-once existing-machine offer for the first would have
    other = bid.replace(b"probe-1", b"probe-3").replace(o.order_id.encode(), b"fresh-1")
    await probe.publish(market.subjects.bid(o.region), other, reply=inbox)
    first = msgspec.json.decode((await sub.next_msg(timeout=2)).data, type=Offer)
    assert first.order_id == "fresh-1" and not first.machine_id


async def test_a_store_that_refuses_the_reclaim_drains_the_worker_and_asks_again(
    market: Market,
) -> None:
    """The orphan's destroy cannot be written (a full disk): the supplier keeps running,
    the worker drains, and the orphan is asked about again and destroyed once it can be."""
    host = await market.host(worker("a"), **FAST)
    await market.exchange()
    store = await _store(market)
    o = order(order_id="full-disk-1")
    await _claim(store, o, "unfilled")
    w = host.workers["a"]
    real = w.keeper.reclaim
    refused = 0

    async def full_once(m: Machine, why: str) -> None:  # a planted store failure, once
        nonlocal refused
        if not refused:
            refused += 1
            raise StoreError("database or disk is full")
        await real(m, why)

    w.keeper.reclaim = full_once  # type: ignore[method-assign]  # the planted failure
    orphan = await _lost_commit(market, o)
    await wait_until(lambda: _machine(host, orphan.machine_id).state == "destroyed")
    assert refused == 1 and w.drain_reason.startswith("store")


async def test_a_takeover_that_hears_nothing_keeps_the_claim_so_the_orphan_is_reclaimed(
    market: Market, tmp_path: Path
) -> None:
    """The storm's interleaving, forced: an auction died after its commit landed (M0 on a
    worker that is then away); a duplicate takes its claim over, hears no worker and ends
    unfilled without a commit. Its claim must not be deleted (that forgets M0, and a later
    order would place a second machine while M0 is kept for want of a claim): it says
    unfilled, and once M0's worker is back M0 is reclaimed."""
    data = tmp_path / "a"
    away = await market.host(worker("a"), data_dir=data, reclaim_after_s=0)
    store = await _store(market)
    o = order(order_id="takeover-1", deadline_ms=300)
    await _claim(store, o, "auctioning", until_ms=now_ms() - 60_000)  # its auction died
    m0 = await _lost_commit(market, o)  # ... after its commit landed
    await market.stop(away)  # the worker is away

    direct = await market.client(direct=True)
    r = await direct.place(msgspec.structs.replace(o, retry=True))
    assert isinstance(r, Unfilled) and r.commits_tried == 0  # nobody to hear
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "unfilled"  # not deleted

    back = await market.host(worker("a"), data_dir=data, **FAST)
    await market.exchange()
    await wait_until(lambda: _machine(back, m0.machine_id).state == "destroyed")
    claim, _ = await store.get(o.order_id)
    assert claim is not None and claim.state == "reclaimed" and claim.reclaimed == m0.machine_id
