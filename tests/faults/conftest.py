"""Fault tests: real supplier and exchange processes on their own nats-server, a client
placing orders while a fault is injected, then the audit of the suppliers' SQLite files."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from loadtest.chaos import ChaosRun
from loadtest.workload import Profile
from tests.market import wait_until

# 6 workers (32 CPUs each) in 3 supplier processes, 2 exchanges; about 40 orders/s, which
# needs ~67 CPUs at steady state: the fleet has room for it with a process down.
FLEET = Profile(
    name="faults",
    regions=1,
    workers=6,
    worker_cpus=32,
    supplier_processes=3,
    exchanges=2,
    rate=40,
    duration_s=3.0,
    lifetime_s=1.0,
    images=5,
    deadline_ms=500,
    reclaim_after_s=1.0,  # a lost abort's orphan (a supplier killed) is gone before the audit
)
# An answer comes by the deadline plus the commit grace (100 ms); the rest is scheduling
# slack on a busy 2-core machine. A hung order would take the client's timeout (2.5 s).
ANSWER_BOUND_MS = FLEET.deadline_ms + 100 + 900
# A second into the load (the trace is seeded: the same point of it every run).
ONE_SECOND_OF_LOAD = int(FLEET.rate)


def workers_of(run: ChaosRun, i: int) -> set[str]:
    """The worker ids that supplier process ``i`` hosts (fleet split round-robin)."""
    n = len(run.suppliers)
    return {w for k, w in enumerate(run.region_of) if k % n == i}


async def strike_during_load(
    run: ChaosRun, placed: int, fault: Callable[[], Awaitable[object]]
) -> tuple[float, float]:
    """Inject ``fault`` once the load has placed ``placed`` orders: it strikes while the
    load runs, at a point of the trace rather than at a guessed time. Returns when it
    struck and when it was over (the victim back), on the run's clock like every order's
    ``answered_at_s``: the windows a test checks are anchored there."""
    # generous: a loaded 2-core machine answers late, but the trace is only 3 s long
    await wait_until(lambda: run.stats.placed >= placed, timeout_s=10 * FLEET.duration_s)
    before = len(run.stats.faults)
    await fault()
    assert len(run.stats.faults) == before + 1, "the fault was not injected"
    return run.stats.faults[before].at_s, time.monotonic() - run.t0


@pytest.fixture
async def chaos(tmp_path: Path) -> AsyncIterator[ChaosRun]:
    run = ChaosRun(FLEET, tmp_path / "run", max_db_mb=8)
    await run.start()
    try:
        yield run
    finally:
        await run.close()
