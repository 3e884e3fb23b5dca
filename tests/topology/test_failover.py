"""A cluster of 3 loses a server: clients that were given every URL of the cluster fail
over to the survivors, and placement resumes (asserted by behaviour)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from bourse.client import BourseClient, ClientError
from bourse.nats.connection import connect, shutdown
from bourse.nats.supercluster import Supercluster
from bourse.wire.messages import Placed
from bourse.wire.subjects import Subjects
from tests.market import order, wait_until
from tests.topology.programs import exchange, supplier

PREFIX = "fo"
RESUME_TIMEOUT_S = 15.0


async def test_killing_the_server_under_exchange_and_supplier_fails_them_over(
    tmp_path: Path,
) -> None:
    sc = Supercluster(tmp_path / "sc", {"a": 3, "b": 1})
    # Only a-1 of cluster a runs when the programs connect (with all three URLs), so both
    # land on it; then a-2 and a-3 join (JetStream has its quorum: the programs, which
    # waited for it, are ready), and a-1 is the one killed.
    sc.start(only=["a-1", "b-1"])
    programs = []
    starting = [
        asyncio.ensure_future(supplier(sc.urls("a"), PREFIX, tmp_path, "mad-1", "mad", 4)),
        asyncio.ensure_future(exchange(sc.urls("a"), PREFIX, tmp_path, "exchange-a")),
    ]
    try:
        names = {"bourse-supplier:mad-1", "exchange-a"}
        await wait_until(lambda: names <= set(sc.connections("a-1")), 30)
        sc.start()
        programs += [await p for p in starting]
        assert sc.server_of("bourse-supplier:mad-1") == sc.server_of("exchange-a") == "a-1"
        nc = await connect(sc.urls("b"), name="buyer-b", service=False)
        buyer = BourseClient(nc, Subjects(PREFIX))
        try:
            first = await place_until_placed(buyer)
            assert first.worker_id == "mad-1"

            sc.kill("a-1")
            t0 = time.monotonic()
            r = await place_until_placed(buyer)
            resumed_s = time.monotonic() - t0
            assert (r.worker_id, r.region) == ("mad-1", "mad")
            assert resumed_s < RESUME_TIMEOUT_S
            assert sc.server_of("exchange-a") in ("a-2", "a-3")
            assert sc.server_of("bourse-supplier:mad-1") in ("a-2", "a-3")
            # the machine placed before the kill is still there (the supplier's state)
            listed = await buyer.machines("mad-1")
            assert {m.machine_id for m in listed.machines} == {first.machine_id, r.machine_id}
        finally:
            await shutdown(nc)
    finally:
        for task in starting:  # one still starting is killed (start_program's own cleanup)
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        for p in reversed(programs):
            assert await p.stop() == 0, p.log
        sc.stop()


async def place_until_placed(buyer: BourseClient) -> Placed:
    """Place 1-cpu orders until one is placed (polling while the market recovers)."""
    failures: Counter[str] = Counter()
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            r = await buyer.place(order(region="mad", cpus=1, memory_mb=256, deadline_ms=300))
        except ClientError as exc:
            failures[exc.code] += 1
        else:
            if isinstance(r, Placed):
                return r
            failures[r.reason] += 1
        await asyncio.sleep(0.05)  # retry pace while reconnecting, not a synchronization
    raise AssertionError(f"placement did not resume in {RESUME_TIMEOUT_S}s: {dict(failures)}")
