"""A start cut short undoes what it did, in one place (supplier/machines/runner.py
``Runner.start``): cancelled at each step of a process's and a container's start (its image
pulling, its network taken, what it runs made, its shim spawned and starting the runtime,
the machine running before the start returned), nothing of the machine is left on the host:
no process, shim, cgroup, box, mount, loop device, namespace, veth or claim; a supplier
stopped in a start records the machine stopped, not starting. The steps are reached by the
start's hook (supplier/machines/api.py ``Pause``), no sleep. Real shims, cgroups where the
host has them, machines' users and networks of their own as root, runc where installed."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from bourse.images import ImageStore, RunSpec
from bourse.images.oci import RunConfig
from bourse.wire.messages import Machine, Placed, PlaceOrder, Resources
from supplier.machines.api import ImageRun
from supplier.machines.host.claims import host_claims
from supplier.machines.host.confine import Confiner, owner_of
from supplier.machines.host.ids import UidBlocks
from supplier.machines.host.isolation import Isolation
from supplier.machines.host.netns import available
from supplier.machines.host.network import WorkerNetwork
from supplier.machines.oci.kind import ContainerKind
from supplier.machines.process import ImageSpec, ProcessKind
from supplier.machines.runner import Kind, Runner
from supplier.machines.shim.contract import Run
from tests.containers import busybox_root, need_runc
from tests.isolation import own_worker_id
from tests.leftovers import left_below, leftovers
from tests.market import ROOMY_DEADLINE_MS, Market, worker

WAIT_S = 30.0
SLEEP = "exec sleep 61.77"  # names this module's machines among the host's processes
# The runner's steps (a cancellation at the shim's two is taken once its answer came)
RUNNER_STEPS = ["network", "made", "shim", "running"]


class PauseAt:
    """A start's hook that holds it at ``step`` until the test lets it on (``go``)."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def __call__(self, step: str, machine_id: str) -> None:
        if step == self.step:
            self.reached.set()
            await self.go.wait()


class Recorded:
    """A kind whose undos are counted (the one place a start cut short is undone)."""

    def __init__(self, inner: Kind) -> None:
        self.inner = inner
        self.name = inner.name
        self.isolation = inner.isolation
        self.undone: list[str] = []

    @property
    def runtime_version(self) -> str:
        return self.inner.runtime_version

    def can_run(self, image: str) -> bool:
        return self.inner.can_run(image)

    async def plan(
        self, m: Machine, image: ImageRun | None, env: Mapping[str, str]
    ) -> tuple[Run, float]:
        return await self.inner.plan(m, image, env)

    async def undo(self, machine_id: str) -> None:
        self.undone.append(machine_id)
        await self.inner.undo(machine_id)

    async def forget(self, machine_id: str) -> None:
        await self.inner.forget(machine_id)

    async def sweep(self, keep: Mapping[str, Run]) -> list[str]:
        return await self.inner.sweep(keep)

    async def end(self) -> None:
        await self.inner.end()

    async def background(self) -> None:
        await self.inner.background()


def _processes(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(cmdline)
    return found


def _left(data: Path, confiner: Confiner, mid: str) -> list[str]:
    """What the host holds of machine ``mid`` of a driver on ``data``."""
    left = [f"process {p}" for p in _processes(SLEEP) + _processes(mid)]
    left += [f"cgroup {d}" for d in confiner.dirs(mid).values() if d.exists()]
    shim = data / "shims" / mid
    left += [f"shim dir {shim}"] if shim.exists() else []
    boxes = data / "containers" / confiner.worker_id / "machines"
    left += [f"box {b}" for b in boxes.iterdir()] if boxes.is_dir() else []
    mounts = Path("/proc/self/mountinfo").read_text()
    left += [f"mount {line}" for line in mounts.splitlines() if str(data) in line]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    left += [f"loop {line}" for line in loops.splitlines() if str(data) in line]
    return left


def _machine(wid: str) -> Machine:
    return Machine(
        machine_id=f"{wid}~{uuid.uuid4().hex.upper()}",
        order_id=f"o-{uuid.uuid4().hex[:8]}",
        worker_id=wid,
        region="mad",
        state="starting",
        resources=Resources(cpus=1, memory_mb=64, disk_mb=16),
        image="sleeper",
    )


def _isolation(data: Path, wid: str) -> Isolation:
    """What a root supplier's worker gives its machines (supplier/worker.py
    ``isolation_of``): users of their own, and a network each where the host can."""
    if os.geteuid() != 0:
        return Isolation()
    owner = owner_of(data)
    claims = host_claims()
    claims.live(owner, data)
    network = WorkerNetwork(claims, owner, wid) if not available() else None
    return Isolation(UidBlocks(claims, owner), network)


@dataclass
class Harness:
    """A driver running in a task of its own (a fixture's set-up and tear-down are not one
    task); ``end`` stops it, as its supplier's stop would."""

    runner: Runner
    kind: Recorded
    confiner: Confiner
    data: Path
    image: ImageRun | None
    stop: anyio.Event
    ended: anyio.Event

    async def end(self) -> None:
        self.stop.set()
        await self.ended.wait()

    def left(self, mid: str) -> list[str]:
        """What the host holds of machine ``mid`` and of its ended worker (its user ids
        and the uid claim are the machine's until it is destroyed)."""
        ids = self.runner.kind.isolation.ids
        base = ids.get(mid) if ids is not None else None
        blocks = (base,) if base is not None else ()
        found = _left(self.data, self.confiner, mid)
        return found + leftovers(self.data, self.confiner.worker_id, blocks, recorded=[mid])


@pytest.fixture(params=["process", "oci"])
async def setup(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    wid = own_worker_id("cut")
    owner = owner_of(data)
    confiner, _ = Confiner.probe("auto", wid, owner=owner)
    image: ImageRun | None = None
    isolation = _isolation(data, wid)
    inner: Kind
    if request.param == "oci":
        runtime = need_runc()
        root = busybox_root(tmp_path / "root")
        image = ImageRun(root, RunConfig(cmd=["sh", "-c", SLEEP]))
        inner = ContainerKind.make(runtime, data, owner, confiner, "", isolation)
    else:
        catalog = {"sleeper": ImageSpec(command=["sh", "-c", SLEEP])}
        inner = ProcessKind(confiner, catalog, data / "work" / wid, isolation)
    kind = Recorded(inner)
    runner = Runner(
        kind, confiner, data / "machines" / wid, data / "shims" / wid, keep_machines=False
    )
    started, stop, ended = anyio.Event(), anyio.Event(), anyio.Event()

    async def run() -> None:
        try:
            async with anyio.create_task_group() as tasks:
                await tasks.start(runner.run)
                started.set()
                await stop.wait()
                tasks.cancel_scope.cancel()
        finally:
            ended.set()

    task = asyncio.get_running_loop().create_task(run())
    await started.wait()
    h = Harness(runner, kind, confiner, data, image, stop, ended)
    try:
        yield h
    finally:
        await h.end()
        await task
        if isolation.ids is not None:  # the test's machines' user ids back to the session
            for claim in host_claims().owned("uids", owner):
                isolation.ids.give_back(claim.holder)
        host_claims().gone(owner)


@pytest.mark.parametrize("step", RUNNER_STEPS)
async def test_a_start_cut_short_at_each_step_leaves_nothing(setup: Harness, step: str) -> None:
    h, m = setup, _machine(setup.confiner.worker_id)
    pause = h.runner.pause = h.runner.kind.isolation.pause = PauseAt(step)
    if step == "network" and h.runner.kind.isolation.network is None:
        pytest.skip("machines share the host's network here: no network step")
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tasks:

            async def start() -> None:
                await h.runner.start(m, h.image)

            tasks.start_soon(start)
            await pause.reached.wait()
            tasks.cancel_scope.cancel()  # the stop arrives at this step
            pause.go.set()  # a shielded step (the shim's) goes on to its end first
    assert h.kind.undone == [m.machine_id]
    assert not h.runner.is_running(m.machine_id)
    assert _left(h.data, h.confiner, m.machine_id) == []
    await h.end()
    assert h.left(m.machine_id) == []


async def test_a_start_that_went_through_is_left_running(setup: Harness) -> None:
    h, m = setup, _machine(setup.confiner.worker_id)
    with anyio.fail_after(WAIT_S):
        await h.runner.start(m, h.image)
    assert h.kind.undone == [] and h.runner.is_running(m.machine_id)
    await h.runner.destroy(m)
    assert _left(h.data, h.confiner, m.machine_id) == []


def _state(data: Path, machine_id: str) -> str:
    db = sqlite3.connect(f"file:{data / 'supplier.db'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT state FROM machines WHERE machine_id = ?", (machine_id,))
        return str(row.fetchone()[0])
    finally:
        db.close()


@pytest.mark.parametrize("step", ["pulling", "network", "made"])
@pytest.mark.parametrize("driver", ["process", "oci"])
async def test_a_supplier_stopped_in_a_start_records_it_stopped_and_leaves_nothing(
    market: Market, tmp_path: Path, driver: str, step: str
) -> None:
    """A buyer's start held at ``step`` when its supplier stops (its handlers' bound, then
    cancelled): nothing of the machine is left, and its record says stopped."""
    if driver == "oci":
        need_runc()
    root = busybox_root(tmp_path / "root")
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    await store.push_directory(root, "sleeper:1", RunSpec(cmd=("sh", "-c", SLEEP)))
    data = tmp_path / "data"
    wid = own_worker_id(f"cs{driver[0]}")
    w = worker(
        wid, cpus=4, memory_mb=1024, capacity={"disk_mb": 1024}, driver=driver, keep_machines=False
    )
    host = await market.host(w, data_dir=data)
    await market.exchange()
    buyer = await market.client()
    runner = host.workers[wid].driver
    assert isinstance(runner, Runner)
    if step == "network" and runner.kind.isolation.network is None:
        pytest.skip("machines share the host's network here: no network step")
    pause = PauseAt(step)  # never let on: the stop cancels the start there
    host.workers[wid].keeper.pulls.pause = runner.pause = runner.kind.isolation.pause = pause
    order = PlaceOrder(
        region="mad",
        resources=Resources(cpus=1, memory_mb=64, disk_mb=16),
        image="sleeper:1",
        deadline_ms=ROOMY_DEADLINE_MS,  # the first commit may make the first network
    )
    placed = await buyer.place(order)
    assert isinstance(placed, Placed), placed
    starting = asyncio.ensure_future(buyer.machine("start", placed.machine_id))
    try:
        with anyio.fail_after(WAIT_S):
            await pause.reached.wait()
        await market.stop(host)
    finally:
        starting.cancel()
    assert _state(data, placed.machine_id) == "stopped"
    assert left_below(data) == []
