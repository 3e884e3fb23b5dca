"""PlaceOrder.retry: the worker that already has a machine for the order answers a little
later than a fresh offer from another worker (a busy process); a retry still gets that
machine back, while a first attempt commits the first offer (the race the flag closes).

The two "workers" are hand-written responders on the real nats-server, so the order of
their answers is exact rather than left to scheduling.

This is the path without order claims (a server without JetStream, or a machine placed
before its claim existed): with claims, a retry of a placed order adopts the claim's
machine at once (tests/integration/test_claims.py)."""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.msg import Msg

from bourse.client import BourseClient
from bourse.nats.connection import connect, flush_all, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Commit, Machine, Offer, Placed, PlaceOrder, Resources
from bourse.wire.subjects import Subjects
from tests.market import placed_for

OWNER_DELAY_S = 0.03  # the owner's answer comes 30 ms after the other worker's


async def _run(
    nats_server: EmbeddedNats, subjects: Subjects, *retries: bool
) -> tuple[list[Placed], int]:
    """Place the same order once per entry of ``retries`` (concurrently, one client)."""
    nc = await connect(nats_server.url, name="retry-gather", service=False)
    commits_to_fresh = 0

    async def fresh(msg: Msg) -> None:  # worker "b": fits, answers at once
        bid = decode(msg.data, Bid)
        offer = Offer(order_id=bid.order_id, worker_id="b", region="mad", score=0.9)
        await nc.publish(msg.reply, encode(offer))

    async def owner(msg: Msg) -> None:  # worker "a": already runs the order's machine
        bid = decode(msg.data, Bid)
        await asyncio.sleep(OWNER_DELAY_S)  # the scenario: a slow owner, not a sync
        offer = Offer(
            order_id=bid.order_id, worker_id="a", region="mad", score=0.5, machine_id="a~M1"
        )
        await nc.publish(msg.reply, encode(offer))

    async def show_a(msg: Msg) -> None:  # worker "a" shows its machine (docs/security.md)
        m = Machine(
            machine_id="a~M1",
            order_id="o-retry",
            worker_id="a",
            region="mad",
            state="started",
            resources=Resources(cpus=1, memory_mb=64),
            image="web",
        )
        await nc.publish(msg.reply, encode(m))

    async def commit_b(msg: Msg) -> None:
        nonlocal commits_to_fresh
        commits_to_fresh += 1
        c = decode(msg.data, Commit)
        placed = placed_for(c, "b~M2", 0.9)
        await nc.publish(msg.reply, encode(placed))

    try:
        await nc.subscribe(subjects.bid("mad"), cb=fresh)
        await nc.subscribe(subjects.bid("mad"), cb=owner)
        await nc.subscribe(subjects.commit("b"), cb=commit_b)
        await nc.subscribe(subjects.worker_machine("a", "get"), cb=show_a)
        await flush_all(nc)
        client = BourseClient(nc, subjects, direct=True, claims=False)
        order = PlaceOrder(
            order_id="o-retry", region="mad", resources=Resources(cpus=1, memory_mb=64), image="web"
        )
        runs = [client.place(msgspec.structs.replace(order, retry=r)) for r in retries]
        results = await asyncio.gather(*runs)
        await client.close()
        assert all(isinstance(r, Placed) for r in results)
        return [r for r in results if isinstance(r, Placed)], commits_to_fresh
    finally:
        await shutdown(nc)


async def test_a_retry_waits_for_the_worker_that_has_the_machine(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    (r,), commits = await _run(nats_server, subjects, True)
    assert (r.machine_id, r.existing, commits) == ("a~M1", True, 0)


async def test_without_the_flag_the_first_offer_is_committed(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    (r,), commits = await _run(nats_server, subjects, False)
    assert (r.machine_id, r.existing, commits) == ("b~M2", False, 1)


async def test_a_retry_and_a_first_attempt_at_once_are_one_order(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    """The flag is a hint, not part of the order: concurrent runs of the same order id with
    and without it share one auction (no ConflictingOrder, one result)."""
    (first, second), commits = await _run(nats_server, subjects, False, True)
    assert commits == 1
    # one result: the run that joined the other's auction is told the machine exists
    assert isinstance(first, Placed) and isinstance(second, Placed)
    assert msgspec.structs.replace(second, existing=first.existing) == first
    assert sorted([first.existing, second.existing]) == [False, True]
