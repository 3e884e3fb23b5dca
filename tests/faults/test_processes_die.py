"""kill -9 of a supplier or an exchange, and a nats-server restart, in the middle of a load
run; afterwards I1-I5 are checked from the suppliers' own SQLite files (loadtest
.audit) against everything the client saw."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bourse.wire.messages import Placed
from loadtest.chaos import ChaosRun
from loadtest.workload import trace
from tests.faults.conftest import (
    ANSWER_BOUND_MS,
    ONE_SECOND_OF_LOAD,
    strike_during_load,
    workers_of,
)


@pytest.mark.slow
async def test_supplier_kill9_under_load(chaos: ChaosRun) -> None:
    victim = workers_of(chaos, 0)
    orders = trace(chaos.p, "ks")
    _, (killed_at, _) = await asyncio.gather(
        chaos.load(orders),
        strike_during_load(chaos, ONE_SECOND_OF_LOAD, lambda: chaos.kill_supplier(0, down_s=0.5)),
    )
    before_kill = [
        r for r in chaos.records.values() if r.worker_id in victim and r.answered_at_s < killed_at
    ]
    assert before_kill, "the victim had no machine before the kill: the test proves nothing"
    # every order ended (placed elsewhere, or unfilled), none hung past its deadline
    assert sum(chaos.stats.failed.values()) == 0, chaos.stats.failed
    assert all(r.slowest_ms < ANSWER_BOUND_MS for r in chaos.records.values())
    # its holds died with it: the restarted process holds nothing
    fresh = [s for s in await chaos.statuses() if s.worker_id in victim]
    assert len(fresh) == len(victim)
    result = await chaos.finish()
    assert result.violations == []
    assert result.machines >= chaos.stats.placed  # I2 checked machine by machine in audit


@pytest.mark.slow
async def test_exchange_kill9_under_load(chaos: ChaosRun) -> None:
    orders = trace(chaos.p, "kx")
    kill = strike_during_load(
        chaos, ONE_SECOND_OF_LOAD, lambda: chaos.kill_exchange(0, restart=False)
    )
    await asyncio.gather(chaos.load(orders), kill)
    # the other instance kept serving: with retries (same order id) every order ended well
    assert sum(chaos.stats.failed.values()) == 0, chaos.stats.failed
    assert chaos.stats.placed + sum(chaos.stats.unfilled.values()) == len(orders)
    # only orders in flight on the dead instance failed before their retry
    assert sum(chaos.stats.retried_errors.values()) <= 10, chaos.stats.retried_errors
    # retrying a placed order id again never makes a second machine (I3)
    await chaos.keep_machines()
    placed = [
        t
        for t in orders
        if chaos.records[t.order.order_id].outcome == "placed"
        and t.order.order_id not in chaos.destroyed
    ]
    assert len(placed) >= 10
    retries = [msgspec.structs.replace(t.order, retry=True) for t in placed[:10]]
    again = await asyncio.gather(*(chaos.market.place(o) for o in retries))
    for t, r in zip(placed[:10], again, strict=True):
        assert isinstance(r, Placed) and r.existing
        assert r.machine_id == chaos.records[t.order.order_id].machine_ids[0]
    result = await chaos.finish()
    assert result.violations == []


@pytest.mark.slow
async def test_nats_restart_under_load(chaos: ChaosRun) -> None:
    orders = trace(chaos.p, "kn")
    restart = strike_during_load(chaos, ONE_SECOND_OF_LOAD, lambda: chaos.restart_nats(down_s=0.5))
    _, (_, back_at) = await asyncio.gather(chaos.load(orders), restart)
    after = sorted(
        r.answered_at_s
        for r in chaos.records.values()
        if r.outcome == "placed" and r.answered_at_s > back_at
    )
    assert after, "nothing was placed after the server came back"
    assert after[0] - back_at < 5.0  # placements resume within seconds
    # every program reconnected and resubscribed by itself: all alive, all workers answer
    assert all(m.alive for m in chaos.suppliers + chaos.exchanges)
    assert len(await chaos.statuses()) == len(chaos.region_of)
    assert sum(chaos.stats.failed.values()) == 0, chaos.stats.failed
    result = await chaos.finish()
    assert result.violations == []  # nothing committed was lost (I2), nothing doubled (I3)
