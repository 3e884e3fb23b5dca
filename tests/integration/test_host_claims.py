"""What a supplier claims of its host (its workers' port ranges, its machines' user id blocks,
its workers' subnets: supplier/machines/host/claims.py) outlives the supplier while its data
dir records machines holding it, not while its pid lives (issue 36); and nothing of a
worker's is left on the host after its machines are destroyed, or after a supplier killed -9
starts again (tests/leftovers.py finds what is left by the worker's names). Real
``supplier run`` processes, on both drivers, as root where machines have users and networks
of their own (the test is skipped saying what is missing elsewhere)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bourse.client import BourseClient
from bourse.images import ImageStore, RunSpec
from bourse.runtime.launcher import Program, start_program
from bourse.wire.messages import Machine, Placed, WorkerStatus
from supplier.machines.host.ids import BLOCK, processes_of
from supplier.ports import PortRange, port_of
from tests.containers import busybox_root, need_isolation, reap_kept
from tests.isolation import own_worker_id
from tests.leftovers import (
    claims_of,
    leftovers,
    namespace_of,
    namespaces,
    processes_with,
    uid_of,
)
from tests.market import Market, alive, order, wait_until

IMAGE = "box:v1"
SCRIPT = 'trap "exit 0" TERM; sleep 600 & wait'
WAIT_S = 30.0


@pytest.fixture(autouse=True)
def _reaped(tmp_path: Path) -> Iterator[None]:
    """Kept machines a failed test left are killed, not left running on the host."""
    yield
    reap_kept(tmp_path)


class Supplier:
    """One ``supplier run`` process of one worker, started again on the same data dir."""

    def __init__(self, market: Market, tmp_path: Path, name: str, driver: str) -> None:
        self.worker_id = own_worker_id(name)
        self.data = tmp_path / name
        self.fleet = tmp_path / f"{name}.json"
        self.log = tmp_path / f"{name}.log"
        w = {"worker_id": self.worker_id, "region": "mad", "driver": driver}
        w |= {"capacity": {"cpus": 4, "memory_mb": 2048}, "keep_machines": True}
        self.fleet.write_text(json.dumps({"worker": [w]}))
        self.args = ("run", "--fleet", str(self.fleet), "--data-dir", str(self.data))
        self.args += ("--nats", market.url, "--prefix", market.subjects.prefix)
        self.program: Program | None = None

    async def start(self) -> None:
        self.program = await start_program(
            "supplier", *self.args, log_path=self.log, ready="supplier ready"
        )

    async def kill9(self) -> None:
        assert self.program is not None
        self.program.kill9()
        await self.program.proc.wait()

    async def stop(self) -> None:
        assert self.program is not None
        assert await self.program.stop() == 0, self.program.log

    async def status(self, buyer: BourseClient) -> WorkerStatus:
        [status] = [s for s in await buyer.status("mad") if s.worker_id == self.worker_id]
        return status

    def claimed(self, kind: str) -> list[dict[str, object]]:
        return [c for c in claims_of(self.data) if c["kind"] == kind]


async def started(buyer: BourseClient, on: Supplier, other: Supplier) -> Machine:
    placed = await buyer.place(
        order(image=IMAGE, ports=["web"], exclude_workers=[other.worker_id], deadline_ms=5000)
    )
    assert isinstance(placed, Placed) and placed.worker_id == on.worker_id, placed
    m = await buyer.machine("start", placed.machine_id)
    assert m.state == "started", m
    return m


async def pids_of(m: Machine) -> list[int]:
    """The machine's processes on the host, once it has one."""
    await wait_until(lambda: bool(processes_with(f"BOURSE_MACHINE_ID={m.machine_id}")), WAIT_S)
    return processes_with(f"BOURSE_MACHINE_ID={m.machine_id}")


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["process", "oci"])
async def test_claims_outlive_a_killed_supplier_and_nothing_is_left_behind(
    market: Market, tmp_path: Path, driver: str
) -> None:
    """A supplier killed -9 while its machine holds a port, a user id block and its
    worker's subnet; another supplier (another data dir) started in its place takes none
    of them; the first starts again on its own range and finds its machine; the
    namespaces its earlier run made ahead are swept; a destroy gives everything back, and
    once both stopped nothing of their workers is left on the host."""
    need_isolation()
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    await store.push_directory(
        busybox_root(tmp_path / "root"), IMAGE, RunSpec(cmd=("sh", "-c", SCRIPT))
    )
    buyer = await market.client(direct=True)
    first = Supplier(market, tmp_path, "first", driver)
    second = Supplier(market, tmp_path, "second", driver)
    await first.start()
    range_of_first = PortRange.parse((await first.status(buyer)).port_range)
    mine = await started(buyer, first, second)
    [pid, *_] = await pids_of(mine)
    block = uid_of(pid) // BLOCK * BLOCK
    [subnet] = [c["value"] for c in first.claimed("subnet")]
    assert [c["held"] for c in first.claimed("ports")] == [True]
    made_ahead = namespaces(first.data, first.worker_id) - {namespace_of(pid)}
    assert namespace_of(pid) and made_ahead

    await first.kill9()
    await second.start()
    theirs = await started(buyer, second, first)
    range_of_second = PortRange.parse((await second.status(buyer)).port_range)
    assert not range_of_second.overlaps(range_of_first), (range_of_first, range_of_second)
    assert port_of(theirs.addresses["web"]) in range_of_second
    [their_pid, *_] = await pids_of(theirs)
    their_block = uid_of(their_pid) // BLOCK * BLOCK
    assert their_block != block
    assert [c["value"] for c in second.claimed("subnet")] != [subnet]
    assert all(alive(p) for p in await pids_of(mine))  # it ran on without its supplier

    await first.start()
    assert (await first.status(buyer)).port_range == str(range_of_first)
    again = await buyer.machine("get", mine.machine_id)
    assert (again.state, again.addresses) == ("started", mine.addresses)
    # what the killed run made ahead is swept; the machine's own namespace is kept
    left = namespaces(first.data, first.worker_id)
    assert namespace_of(pid) in left and not left & made_ahead

    assert (await buyer.machine("destroy", mine.machine_id)).state == "destroyed"
    await wait_until(lambda: not processes_of(block), WAIT_S)
    assert first.claimed("uids") == []
    assert [c["held"] for c in first.claimed("ports")] == [False]
    assert [c["held"] for c in first.claimed("subnet")] == [False]
    assert (await buyer.machine("destroy", theirs.machine_id)).state == "destroyed"
    await wait_until(lambda: not processes_of(their_block), WAIT_S)
    await first.stop()
    await second.stop()
    assert leftovers(first.data, first.worker_id, (block,)) == []
    assert leftovers(second.data, second.worker_id, (their_block,)) == []
