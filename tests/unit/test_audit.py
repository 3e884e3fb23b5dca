"""The post-fault audit finds each kind of violation in real SQLite files (and none in a
clean history): a checker that cannot fail would prove nothing."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bourse.wire.messages import Amount, Machine, Resources, WorkerStatus
from loadtest.audit import OrderRecord, audit
from supplier.oplog import Op
from supplier.store import Store

CAP = {"w-1": Amount(cpus=4, memory_mb=4096), "w-2": Amount(cpus=4, memory_mb=4096)}
REGION = {"w-1": "mad", "w-2": "mad"}


def mach(n: int, order: str, worker: str = "w-1", cpus: int = 2, **kw: object) -> Machine:
    return Machine(
        machine_id=f"{worker}~M{n:04d}",
        order_id=order,
        worker_id=worker,
        region=str(kw.pop("region", "mad")),
        state=kw.pop("state", "reserved"),  # type: ignore[arg-type]  # kw: any Machine field
        resources=Resources(cpus=cpus, memory_mb=256),
        image="web",
        **kw,  # type: ignore[arg-type]  # the tests pass Machine's own fields, each typed there
    )


def rec(order: str, *machine_ids: str, outcome: str = "placed", region: str = "mad") -> OrderRecord:
    r = OrderRecord(order, region, Resources(cpus=2, memory_mb=256), 500, outcome=outcome)
    r.machine_ids.extend(machine_ids)
    return r


async def store_of(tmp_path: Path, name: str, *ops: Op) -> Path:
    s = Store(tmp_path / name / "supplier.db")
    try:
        for op in ops:
            await s.write(op)
    finally:
        s.close()
    return s.path


async def test_clean_history_has_no_violation(tmp_path: Path) -> None:
    a, b = mach(1, "o-1"), mach(2, "o-2", cpus=2)
    gone = msgspec.structs.replace(a, state="destroyed")
    c = mach(3, "o-3", cpus=2)  # fits only because a was destroyed first
    path = await store_of(
        tmp_path, "s", Op("place", a), Op("place", b), Op("destroy", gone), Op("place", c)
    )
    records = [rec("o-1", a.machine_id), rec("o-2", b.machine_id), rec("o-3", c.machine_id)]
    result = audit(records, [path], CAP, REGION)
    assert result.violations == []
    assert (result.files, result.machines, result.ops) == (1, 3, 4)


async def test_overcommit_at_any_point_of_the_log_is_found(tmp_path: Path) -> None:
    a, b, c = mach(1, "o-1"), mach(2, "o-2"), mach(3, "o-3")
    gone = msgspec.structs.replace(a, state="destroyed")
    # 6 CPUs on a 4-CPU worker for a moment, even though the end state (4) is fine
    path = await store_of(
        tmp_path, "s", Op("place", a), Op("place", b), Op("place", c), Op("destroy", gone)
    )
    result = audit([], [path], CAP, REGION)
    assert result.violations == [f"I1 w-1: cpus 6 > 4 after {c.machine_id}"]


async def test_placed_machine_missing_from_every_file_is_found(tmp_path: Path) -> None:
    path = await store_of(tmp_path, "s", Op("place", mach(1, "o-1")))
    result = audit([rec("o-2", "w-2~M0009")], [path], CAP, REGION)
    assert result.violations == ["I2 order o-2: Placed w-2~M0009 is in no supplier's file"]


@pytest.mark.parametrize("aborted", [False, True])
async def test_two_machines_for_one_order_across_files(tmp_path: Path, aborted: bool) -> None:
    one = await store_of(tmp_path, "s1", Op("place", mach(1, "o-1")))
    state = "destroyed" if aborted else "reserved"
    other = mach(2, "o-1", worker="w-2", aborted=aborted, state=state)
    two = await store_of(tmp_path, "s2", Op("place", other))
    result = audit([rec("o-1", "w-1~M0001")], [one, two], CAP, REGION)
    # an aborted machine (the auction gave up on its commit) does not hold the order id
    assert result.violations == ([] if aborted else ["I3 order o-1 has 2 machines"])


async def test_client_saw_two_machines_for_one_order(tmp_path: Path) -> None:
    path = await store_of(tmp_path, "s", Op("place", mach(1, "o-1")))
    gone = mach(2, "o-1", state="destroyed", aborted=True)
    path2 = await store_of(tmp_path, "s2", Op("place", gone))
    result = audit([rec("o-1", "w-1~M0001", "w-1~M0002")], [path, path2], CAP, REGION)
    assert result.violations == ["I3 order o-1 was Placed as ['w-1~M0001', 'w-1~M0002']"]


async def test_unfilled_order_with_a_machine_and_leftover_holds(tmp_path: Path) -> None:
    path = await store_of(tmp_path, "s", Op("place", mach(1, "o-1")))
    held = WorkerStatus(
        worker_id="w-2",
        region="mad",
        labels={},
        capacity=CAP["w-2"],
        committed=Amount(),
        held=Amount(cpus=1),
        images=[],
        machines=0,
        draining=False,
        holds=1,
    )
    result = audit([rec("o-1", outcome="unfilled:deadline")], [path], CAP, REGION, [held])
    assert result.violations == [
        "I4 order o-1 was Unfilled but left ['w-1~M0001']",
        "I4 w-2 still holds 1 hold(s) after the longest TTL",
    ]


async def test_machine_outside_its_order_region(tmp_path: Path) -> None:
    m = mach(1, "o-1", region="fra")
    path = await store_of(tmp_path, "s", Op("place", m))
    result = audit([rec("o-1", m.machine_id)], [path], CAP, REGION)
    assert result.violations == [
        f"I5 {m.machine_id} says region fra, its worker is elsewhere",
        f"I5 {m.machine_id} in fra, order o-1 asked mad",
    ]


async def test_a_port_held_twice_is_found_in_the_log_and_across_files(tmp_path: Path) -> None:
    a = mach(1, "o-1", cpus=1, addresses={"http": "h:20000"})
    b = mach(2, "o-2", cpus=1, addresses={"http": "h:20000"})
    gone = msgspec.structs.replace(a, state="destroyed")
    c = mach(3, "o-3", cpus=1, addresses={"http": "h:20000"})  # after a gave it back: fine
    path = await store_of(tmp_path, "s", Op("place", a), Op("place", b), Op("destroy", gone))
    other = await store_of(tmp_path, "t", Op("place", c))
    result = audit([], [path, other], CAP, REGION)
    assert result.violations == [
        f"I8 h:20000 is held by {a.machine_id} and {b.machine_id}",  # in the log
        f"I8 h:20000 is held by {b.machine_id} and {c.machine_id}",  # at the end, two files
    ]
