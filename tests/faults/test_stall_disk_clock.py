"""A wedged supplier, a full or vanished data dir, and skewed clocks, under load."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path

import libfaketime
import msgspec
import pytest
import structlog

from bourse.nats.connection import STATS, connect, flush_all, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Offer, PlaceOrder, Resources, WorkerStatus
from loadtest.audit import OrderRecord
from loadtest.chaos import ChaosRun
from loadtest.faults import fill_store, free_store
from loadtest.workload import TraceOrder, trace
from tests.faults.conftest import (
    ANSWER_BOUND_MS,
    FLEET,
    ONE_SECOND_OF_LOAD,
    strike_during_load,
    workers_of,
)
from tests.market import ROOMY_DEADLINE_MS, wait_until


async def _until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Probe an observable condition until it holds (each probe places a real order)."""
    end = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # the pace of the probes, not a synchronisation


def _order(run: ChaosRun, n: int) -> PlaceOrder:
    """A probe, placed however busy the machine (the test market's deadline, not 500 ms)."""
    return PlaceOrder(
        order_id=f"disk-{n:04d}",
        region=run.p.region_names()[0],
        resources=Resources(cpus=1, memory_mb=256),
        image="img000",
        deadline_ms=ROOMY_DEADLINE_MS,
    )


async def _status_of(run: ChaosRun, workers: set[str]) -> list[WorkerStatus]:
    return [s for s in await run.direct.status(run.p.region_names()[0]) if s.worker_id in workers]


@pytest.mark.slow
async def test_stalled_supplier_does_not_stall_the_auction(chaos: ChaosRun) -> None:
    """SIGSTOP one supplier process for 2 s under load: auctions still end by their
    deadline, the others keep placing, and the stale bids it answers on waking are
    ignored (no hold outlives its TTL, nothing is placed twice)."""
    stalled = workers_of(chaos, 0)
    orders = trace(chaos.p, "st")
    # half a second into the load; the stall's 2 s are the fault itself
    stall = strike_during_load(chaos, ONE_SECOND_OF_LOAD // 2, lambda: chaos.stall_supplier(0, 2.0))
    _, (at, _) = await asyncio.gather(chaos.load(orders), stall)
    # orders sent while it was stopped (an order whose commit it held at the stop may end
    # unfilled by its deadline: immediate-or-cancel); answered_at_s - slowest_ms is never
    # after its final attempt was sent
    during = [
        r
        for r in chaos.records.values()
        if r.answered_at_s - r.slowest_ms / 1000 > at and r.answered_at_s < at + 1.9
    ]
    assert during
    missed = [(r.order_id, r.outcome, r.worker_id, round(r.answered_at_s - at, 3)) for r in during]
    assert all(r.outcome == "placed" for r in during), [m for m in missed if m[1] != "placed"]
    assert all(r.worker_id not in stalled for r in during if r.answered_at_s > at + 0.3)
    assert all(r.slowest_ms < ANSWER_BOUND_MS for r in chaos.records.values())
    assert sum(chaos.stats.failed.values()) == 0
    result = await chaos.finish()  # includes: every hold gone after its TTL
    assert result.violations == []


async def test_slow_consumer_is_counted_and_logged(nats_server: EmbeddedNats) -> None:
    """A subscription that falls behind loses messages: each drop is counted per
    connection and logged (rate-limited) with the running total."""
    nc = await connect(nats_server.url, name="slow-test", service=True)
    gate = asyncio.Event()

    async def wedged(msg: object) -> None:
        await gate.wait()

    try:
        with structlog.testing.capture_logs() as logs:
            await nc.subscribe("slow.test", cb=wedged, pending_msgs_limit=5)
            for _ in range(50):
                await nc.publish("slow.test", b"x")
            await flush_all(nc)
            # drops are counted as they happen, not when the handler catches up
            await wait_until(lambda: STATS["slow-test"].slow_consumer_drops >= 40, timeout_s=10)
        gate.set()
    finally:
        await shutdown(nc)
    assert STATS["slow-test"].slow_consumer_drops >= 40
    lines = [e for e in logs if e["event"] == "nats_slow_consumer"]
    assert lines and lines[0]["dropped_total"] >= 1 and lines[0]["subject"] == "slow.test"
    assert len(lines) < 5  # rate-limited, not one line per dropped message


@pytest.mark.slow
async def test_full_disk_drains_then_resumes(chaos: ChaosRun) -> None:
    """The state file of supplier 0 is filled to its cap from outside: its next commit
    fails, every worker of that process drains (stops offering) with a clear log line,
    orders go elsewhere; once space is freed, a probe lifts the drain."""
    victim = workers_of(chaos, 0)
    db = chaos.db_path(0)
    await asyncio.to_thread(fill_store, db, chaos.max_db_mb or 0)
    n = 0

    async def drained() -> bool:
        nonlocal n
        n += 1
        r: OrderRecord = await chaos.place(_trace(chaos, n))
        assert r.outcome == "placed", r  # a failed commit falls back to another offer
        return all(s.draining for s in await _status_of(chaos, victim))

    await _until("the victim to drain", drained, timeout_s=20)
    states = await _status_of(chaos, victim)
    assert all("disk is full" in s.drain_reason for s in states)
    # while drained, it offers nothing: every order lands elsewhere
    for _ in range(10):
        n += 1
        r = await chaos.place(_trace(chaos, n))
        assert r.outcome == "placed" and r.worker_id not in victim
    await asyncio.to_thread(free_store, db)

    async def resumed() -> bool:
        return not any(s.draining for s in await _status_of(chaos, victim))

    await _until("the victim to resume", resumed)
    prog = chaos.suppliers[0].prog
    assert prog is not None
    log = prog.log
    assert "supplier_draining" in log and "database or disk is full" in log
    assert "supplier_resumed" in log
    result = await chaos.finish()
    assert result.violations == []


def _trace(run: ChaosRun, n: int) -> TraceOrder:
    return TraceOrder(0.0, _order(run, n), lifetime_s=30.0)


async def test_removed_data_dir_drains_for_good(chaos: ChaosRun) -> None:
    """The data dir vanishes under a running supplier (an operator's rm -rf, a lost
    mount). SQLite would go on writing to the unlinked file, and those machines would be
    gone after a restart; the store checks that its path still names its file, so the
    process drains instead, and nothing is Placed that was not stored for good."""
    victim = workers_of(chaos, 0)
    data_dir = chaos.suppliers[0].spec.data_dir
    assert data_dir is not None
    await asyncio.to_thread(shutil.rmtree, data_dir)
    n = 100

    async def drained() -> bool:
        nonlocal n
        n += 1
        r = await chaos.place(_trace(chaos, n))
        assert r.outcome == "placed", r
        return all(s.draining for s in await _status_of(chaos, victim))

    await _until("the victim to drain", drained, timeout_s=20)
    states = await _status_of(chaos, victim)
    assert all("removed or replaced" in s.drain_reason for s in states), states[0].drain_reason
    placed_on_victim = [r for r in chaos.records.values() if r.worker_id in victim]
    assert placed_on_victim == []  # a commit that could not be stored was never Placed


@pytest.mark.slow
async def test_clock_skew_changes_nothing(tmp_path: Path) -> None:
    """Suppliers whose wall clocks are hours apart (libfaketime, a real LD_PRELOAD on the
    real processes) and an exchange skewed too: holds and deadlines use durations on each
    process's own monotonic clock, so placement and hold expiry work as without skew."""
    lib = str(Path(libfaketime.__file__).parent / "vendor/libfaketime/src/libfaketime.so.1")

    def skew(offset: str) -> dict[str, str]:
        return {
            "LD_PRELOAD": lib,
            "FAKETIME": offset,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # wall clocks drift; monotonic is local
        }

    # A generous deadline (holds and the settling wait follow it) and quiet window: what is
    # under test is that skewed wall clocks break nothing (a hold or deadline read from the
    # wall clock would fail orders wholesale), not that a 2-core machine running six
    # processes (each slowed by libfaketime) never stalls 500 ms, nor answers a bid within
    # the default 100 ms of silence that ends an auction without offers (Unfilled no_offers).
    run = ChaosRun(
        msgspec.structs.replace(FLEET, deadline_ms=2000, exchange_quiet_ms=1000),
        tmp_path / "run",
        supplier_env={0: skew("+2h"), 1: skew("-3h"), 2: skew("+1d")},
        exchange_env=skew("-45m"),
    )
    async with run:
        probe = await run.statuses()
        assert len(probe) == len(run.region_of)
        orders = trace(run.p, "sk")
        await run.load(orders)
        assert run.stats.placed == len(orders)
        bound_ms = run.p.deadline_ms + 100 + 900  # as ANSWER_BOUND_MS, for this deadline
        assert all(r.slowest_ms < bound_ms for r in run.records.values())
        # a bid nobody commits or releases: every skewed worker holds for it, and the
        # hold must expire by its own duration (300 ms), whatever the wall clocks say
        assert run.nc is not None
        region = run.p.region_names()[0]
        bid = Bid(
            order_id="skew-orphan-bid",
            region=region,
            resources=Resources(cpus=1, memory_mb=64),
            image="img000",
            hold_ms=300,
        )
        inbox = run.nc.new_inbox()
        sub = await run.nc.subscribe(inbox)
        await run.nc.publish(run.subjects.bid(region), encode(bid), reply=inbox)
        offer = decode((await sub.next_msg(timeout=5)).data, Offer)
        await sub.unsubscribe()
        # a wide gather: the skewed processes run under libfaketime and may answer late
        statuses = await run.direct.status(region, within_s=3, quiet_s=1)
        held = [s for s in statuses if s.worker_id == offer.worker_id]
        assert held[0].holds == 1
        # the skew is real: supplier 2 stamps its log lines a day ahead of this process
        skewed = run.suppliers[2].prog
        assert skewed is not None
        stamps = re.findall(r"timestamp='([^']+)'", skewed.log)
        ahead = datetime.fromisoformat(stamps[-1]).timestamp() - time.time()
        assert 23 * 3600 < ahead < 25 * 3600
        result = await run.finish()  # statuses after the longest TTL: no hold left
        assert result.violations == []
