"""The duplicate storm under faults: order ids each sent 8 times at once through two
exchange processes and a direct-mode buyer, while one exchange is killed with -9 and a
supplier is stopped (SIGSTOP) past the orders' deadline. Afterwards every order id has at
most one machine in all the suppliers' files (the audit), and every Placed a buyer was told
names a machine that exists; a second machine for an id is only ever an orphan no buyer was
told (the gap docs/protocol.md §8 states). Real processes, real nats-server with JetStream
(claims on)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import anyio

from bourse.client import BourseClient, ClientError
from bourse.wire.messages import Machine, Placed, PlaceOrder, Resources
from loadtest.chaos import ChaosRun
from tests.faults.conftest import FLEET
from tests.market import wait_until

IDS = 40
SENDS = 8  # per order id, at once
ATTEMPTS = 6  # per send: an error (its exchange killed, NATS busy) is retried, same id


async def test_a_duplicate_storm_through_faults_places_one_machine_per_id(
    chaos: ChaosRun,
) -> None:
    region = chaos.p.region_names()[0]
    told: dict[str, set[str]] = defaultdict(set)  # order id -> machines buyers were told

    async def send(order_id: str, k: int) -> None:
        client: BourseClient = chaos.direct if k % 3 == 1 else chaos.market
        o = PlaceOrder(
            order_id=order_id,
            region=region,
            resources=Resources(cpus=1, memory_mb=64),
            image="img000",
            deadline_ms=FLEET.deadline_ms,
            retry=k > 0,
        )
        for attempt in range(ATTEMPTS):
            try:
                r = await client.place(o)
            except ClientError:
                await anyio.sleep(0.05 * 2**attempt)  # the retry pace, not a synchronisation
                continue
            if isinstance(r, Placed):
                told[order_id].add(r.machine_id)
                return
            # unfilled (e.g. its workers stopped, or another auction still had the id): the
            # next attempt asks again under the same id

    async def faults() -> None:
        await wait_until(lambda: len(told) >= 3, timeout_s=30)  # the storm is under way
        await chaos.kill_exchange(0, restart=False)
        await chaos.stall_supplier(1, stall_s=2 * FLEET.deadline_ms / 1000)

    storm = [send(f"dup-{i}", k) for i in range(IDS) for k in range(SENDS)]
    await asyncio.gather(faults(), *storm)

    assert len(chaos.stats.faults) == 2
    assert len(told) >= IDS // 2, f"only {len(told)} ids placed"
    for order_id, machines in told.items():
        assert len(machines) == 1, f"{order_id}: buyers were told {machines}"
        [machine_id] = machines
        m = await chaos.direct.machine("get", machine_id)
        assert m.order_id == order_id and m.state != "destroyed"
    # Every machine of a storm id, from every worker's own list. A second live machine for
    # an id can exist today in one case (docs/protocol.md §8): the killed exchange's commit
    # landed on the worker that was then stopped, so the auction that took its claim over
    # did not hear that worker and placed anew. Such a machine is an orphan: no buyer was
    # told it, it was never started. Reclaiming it (bounded) is not built yet.
    live: dict[str, list[Machine]] = defaultdict(list)
    for worker_id in chaos.region_of:
        for m in (await chaos.direct.machines(worker_id)).machines:
            if m.order_id.startswith("dup-") and m.state != "destroyed":
                live[m.order_id].append(m)
    orphaned = set()
    for order_id, machines in live.items():
        if len(machines) > 1:
            orphaned.add(order_id)
            handed = {m.machine_id for m in machines} & told[order_id]
            assert len(handed) == 1, f"{order_id}: {machines}, told {told[order_id]}"
            assert all(m.state == "reserved" for m in machines if m.machine_id not in handed)
    result = await chaos.finish()  # I3 across every supplier's file, I1 step by step
    expected = [f"I3 order {o} has {len(live[o])} machines" for o in orphaned]
    assert sorted(result.violations) == sorted(expected)
