"""A full JetStream, from the operator's side (docs/operations.md, "Sizing the order claims"):
the claims bucket is made with its age and byte limits; once it (or the server's store) has
no room, new orders are refused at once with ``Error{reason: "store_full"}``, counted and
logged, never placed without their claim, and no order id gets two machines; once there
is room again, orders are placed."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from bourse.auction.claim_store import ClaimStore
from bourse.auction.core import AuctionConfig
from bourse.auction.room import CLAIM_BYTES, ROOM_SHARE, ClaimLimits
from bourse.client import BourseClient, ClientError
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import claims_bucket_name
from bourse.runtime.metrics import ExchangeMetrics
from bourse.wire.codec import decode, encode
from bourse.wire.messages import STORE_FULL_REASON, Error, Placed, Unfilled
from bourse.wire.subjects import Subjects
from exchange.service import ExchangeService
from tests.market import ROOMY_QUIET_MS, Market, order, wait_until, worker

# Room for about ten placed claims: new orders are refused from 95% of it.
SMALL = ClaimLimits(window_s=3600.0, max_bytes=6000)


async def _exchange(market: Market, limits: ClaimLimits) -> ExchangeService:
    """An exchange whose claims bucket has ``limits``; its auctions listen for a first offer
    as long as a busy machine needs (ROOMY_QUIET_MS: bursts of orders here)."""
    svc = ExchangeService(
        await market.connect("exchange"),
        market.subjects,
        claim_limits=limits,
        metrics=ExchangeMetrics(),
        auction=AuctionConfig(quiet_ms=ROOMY_QUIET_MS),
    )
    await market.serve(svc)
    market.exchanges.append(svc)
    return svc


async def _ask(nc: NATS, subjects: Subjects, order_id: str) -> Placed | Unfilled | Error:
    """One order on the wire, as any client sends it (its Error's reason is visible)."""
    msg = await nc.request(subjects.order("mad"), encode(order(order_id=order_id)), timeout=5)
    answer: Placed | Unfilled | Error = decode(msg.data, Placed | Unfilled | Error)
    return answer


def _refused_store_full(svc: ExchangeService) -> float:
    assert svc.metrics is not None
    labels = {"region": "mad", "outcome": "refused", "reason": "store_full"}
    return svc.metrics.registry.get_sample_value("bourse_orders_total", labels) or 0.0


async def test_a_full_claims_bucket_refuses_new_orders_until_there_is_room(
    market: Market,
) -> None:
    await market.host(worker("a", cpus=64, memory_mb=1 << 16))
    svc = await _exchange(market, SMALL)
    nc = await market.connect("buyer")
    with structlog.testing.capture_logs() as logs:
        answers = [await _ask(nc, market.subjects, f"fill-{i:02d}") for i in range(20)]
    placed = [a for a in answers if isinstance(a, Placed)]
    refused = [a for a in answers if not isinstance(a, Placed)]
    assert placed and refused, answers
    for r in refused:
        assert isinstance(r, Error) and (r.code, r.reason) == ("internal", STORE_FULL_REASON)
        assert r.detail.startswith("order claims store full (")
        assert "nothing was placed; send the order again later" in r.detail
        # refused only once one more claim would not fit by the count of that moment (each
        # counted at CLAIM_BYTES until a look at the bucket, every ROOM_LOOK_S, reads what
        # they take: in a slow run a look between two orders finds room, and more are placed)
        held = re.search(r"holds about (\d+) of its", r.detail)
        room = SMALL.max_bytes * (1 - ROOM_SHARE)
        assert held is None or int(held[1]) + CLAIM_BYTES > room, "refused with room left"
    assert _refused_store_full(svc) == len(refused)
    assert [e for e in logs if e["event"] == "order_claims_full"], "no log line says so"
    assert svc.auctioneer.bucket.room.full
    host = market.hosts[0]
    assert len(host.workers["a"].machines) == len(placed), "an order was placed unclaimed"

    # the bucket as made: the documented age limit and the byte limit asked for
    store = await ClaimStore.open(await market.connect("operator"), market.subjects)
    assert store is not None
    stored, max_bytes, max_age_s = await store.fill()
    assert (max_bytes, max_age_s) == (SMALL.max_bytes, SMALL.window_s)
    assert stored / len(placed) <= CLAIM_BYTES, "a placed claim takes more than the rule says"

    # the operator makes room: the next order after the bucket's next look is placed
    js = nc.jetstream()
    await js.purge_stream(f"KV_{claims_bucket_name(market.subjects.prefix)}")
    room = svc.auctioneer.bucket.room
    await wait_until(lambda: time.monotonic() >= max(room.next_look, room.refused_until))
    again = await _ask(nc, market.subjects, "after-room")
    assert isinstance(again, Placed), again
    assert not room.full
    assert [e for e in logs if e["event"] == "order_claims_full"]


async def test_a_burst_into_a_full_bucket_places_no_order_twice(market: Market) -> None:
    """Forty orders at once, each sent twice, through two exchanges, into a bucket with
    room for about ten (each exchange counts only its own claims until its next look):
    each is placed, refused store_full, or, where the last bytes went to another order's
    claim meanwhile, answered unrecorded (its duplicate: told to ask again); never two
    machines for one id, and every Placed names the id's one machine."""
    await market.host(worker("a", cpus=256, memory_mb=1 << 20))
    for _ in range(2):
        await _exchange(market, SMALL)
    clients = [await market.client(), await market.client()]
    ids = [f"burst-{i:02d}" for i in range(40)]

    async def send(client: BourseClient, oid: str) -> Placed | Unfilled | ClientError:
        try:
            # a duplicate whose order's claim is never written (unrecorded) waits out its
            # deadline, then asks again: long enough for a busy machine, not much longer
            return await client.place(order(order_id=oid, deadline_ms=3000))
        except ClientError as exc:
            return exc

    sends = [(oid, c) for oid in ids for c in clients]
    results = await asyncio.gather(*(send(c, oid) for oid, c in sends))
    kinds = Counter(_kind(r) for r in results)
    assert set(kinds) <= {"placed", "store_full", "unrecorded", "ask_again"}, results
    assert kinds["store_full"], kinds
    machines = market.hosts[0].workers["a"].machines.values()
    live: dict[str, list[str]] = {}
    for m in machines:
        if m.state != "destroyed":
            live.setdefault(m.order_id, []).append(m.machine_id)
    for (oid, _), r in zip(sends, results, strict=True):
        assert len(live.get(oid, [])) <= 1, f"{oid}: {live[oid]}"
        if isinstance(r, Placed):
            assert live[oid] == [r.machine_id]
    assert market.violations() == []


def _kind(r: Placed | Unfilled | ClientError) -> str:
    if isinstance(r, Placed):
        return "placed"
    if isinstance(r, ClientError) and r.code == "unrecorded":
        return "unrecorded"
    if isinstance(r, ClientError) and str(r).startswith("order claims store full ("):
        return "store_full"
    if isinstance(r, Unfilled) and "ask again for its outcome" in r.detail:
        return "ask_again"
    return repr(r)


async def test_a_jetstream_without_room_for_the_bucket_refuses_orders_at_once(
    tmp_path: Path,
) -> None:
    """A server whose store cannot hold the bucket's byte limit: the bucket cannot be made,
    and every order is refused store_full at once, naming why (not after its deadline as
    "claims unavailable")."""
    with EmbeddedNats(workdir=tmp_path / "nats", jetstream_max_store_mb=1) as srv:
        async with Market(srv.url, Subjects("small"), tmp_path) as market:
            await market.host(worker("a"))
            await _exchange(market, ClaimLimits())
            nc = await market.connect("buyer")
            t0 = time.monotonic()
            answer = await _ask(nc, market.subjects, "no-room")
            assert isinstance(answer, Error) and answer.reason == STORE_FULL_REASON, answer
            assert "insufficient storage resources" in answer.detail
            assert time.monotonic() - t0 < order().deadline_ms / 1000.0
            assert market.hosts[0].workers["a"].machines == {}
