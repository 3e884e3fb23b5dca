"""A worker's reclaim bookkeeping (supplier/reclaim.py): which reserved machines are asked
about, and what the verdicts do."""

from __future__ import annotations

import msgspec

from bourse.wire.messages import RECLAIM_BATCH, Machine, ReclaimVerdict, Resources
from supplier.reclaim import Reclaims

NOW = 1_000_000
AFTER = 10_000


def machine(n: int, *, age: int = AFTER, state: str = "reserved", aborted: bool = False) -> Machine:
    return msgspec.convert(
        {
            "machine_id": f"w~M{n}",
            "order_id": f"o-{n}",
            "worker_id": "w",
            "region": "mad",
            "state": state,
            "resources": msgspec.to_builtins(Resources(cpus=1, memory_mb=64)),
            "image": "web",
            "created_at_ms": NOW - age,
            "updated_at_ms": NOW - age,
            "aborted": aborted,
        },
        Machine,
    )


def verdict(n: int, kind: str) -> ReclaimVerdict:
    return msgspec.convert({"machine_id": f"w~M{n}", "verdict": kind}, ReclaimVerdict)


def test_due_are_reserved_machines_past_the_age_not_asked_or_confirmed() -> None:
    r = Reclaims(AFTER)
    ms = [
        machine(1),  # due: reserved exactly AFTER ago
        machine(2, age=AFTER - 1),  # too young: its auction may still hand it out
        machine(3, state="started"),  # a buyer started it: someone holds it
        machine(4, state="destroyed", aborted=True),
    ]
    assert [m.machine_id for m in r.due(ms, NOW)] == ["w~M1"]
    assert r.orders == {"o-1"}  # not handed out while asked about
    assert r.due(ms, NOW) == []  # asked already


def test_keep_confirms_wait_asks_again_orphan_is_returned_until_done() -> None:
    r = Reclaims(AFTER)
    ms = [machine(1), machine(2), machine(3), machine(4)]
    batch = r.due(ms, NOW)
    orphans = r.settle(batch, [verdict(1, "keep"), verdict(2, "wait"), verdict(3, "orphan")])
    assert [v.machine_id for v in orphans] == ["w~M3"]
    assert r.orders == {"o-3"}  # the orphan stays unhandable until it is destroyed
    r.done("w~M3")
    assert r.orders == set()
    # kept: never again; wait and no verdict (M4): asked again next round
    assert [m.machine_id for m in r.due(ms, NOW)] == ["w~M2", "w~M3", "w~M4"]


def test_a_failed_check_asks_again() -> None:
    r = Reclaims(AFTER)
    ms = [machine(1)]
    batch = r.due(ms, NOW)
    assert r.settle(batch, []) == []
    assert [m.machine_id for m in r.due(ms, NOW)] == ["w~M1"]


def test_one_check_at_most_a_batch_and_zero_turns_it_off() -> None:
    ms = [machine(n) for n in range(RECLAIM_BATCH + 5)]
    assert len(Reclaims(AFTER).due(ms, NOW)) == RECLAIM_BATCH
    assert Reclaims(0).due(ms, NOW) == []
