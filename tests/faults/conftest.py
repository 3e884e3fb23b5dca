"""Fault tests: real supplier and exchange processes on their own nats-server, a client
placing orders while a fault is injected, then the audit of the suppliers' SQLite files."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtest.chaos import ChaosRun
from loadtest.workload import Profile

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
)
# An answer comes by the deadline plus the commit grace (100 ms); the rest is scheduling
# slack on a busy 2-core machine. A hung order would take the client's timeout (2.5 s).
ANSWER_BOUND_MS = FLEET.deadline_ms + 100 + 900


def workers_of(run: ChaosRun, i: int) -> set[str]:
    """The worker ids that supplier process ``i`` hosts (fleet split round-robin)."""
    n = len(run.suppliers)
    return {w for k, w in enumerate(run.region_of) if k % n == i}


@pytest.fixture
async def chaos(tmp_path: Path) -> AsyncIterator[ChaosRun]:
    run = ChaosRun(FLEET, tmp_path / "run", max_db_mb=8)
    await run.start()
    try:
        yield run
    finally:
        await run.close()
