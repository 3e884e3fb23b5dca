"""A start cut short undoes what it did, in one place (supplier/machines/runner.py
``Runner.start``): cancelled at each step of a process's and a container's start, nothing of
the machine is left on the host: no process, no shim, no cgroup, no box, mount or loop
device. Real shims, cgroups where the host has them, runc where it is installed."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import anyio
import pytest

from bourse.images.oci import RunConfig
from bourse.wire.messages import Machine, Resources
from supplier.machines.api import ImageRun
from supplier.machines.host.confine import Confiner, owner_of
from supplier.machines.oci.kind import ContainerKind
from supplier.machines.process import ImageSpec, ProcessKind
from supplier.machines.runner import Kind, Runner
from supplier.machines.shim.contract import Run
from tests.containers import busybox_root, need_runc
from tests.isolation import own_worker_id

WAIT_S = 30.0
SLEEP = "exec sleep 61.77"  # names this module's machines among the host's processes


class Gated:
    """A kind that stops at a step until the test lets it on: ``made`` is set once the
    kind made what the machine runs (its cgroups, its box), then it waits for ``go``."""

    def __init__(self, inner: Kind) -> None:
        self.inner = inner
        self.name = inner.name
        self.isolation = inner.isolation
        self.made = anyio.Event()
        self.go = anyio.Event()
        self.undone: list[str] = []

    @property
    def runtime_version(self) -> str:
        return self.inner.runtime_version

    def can_run(self, image: str) -> bool:
        return self.inner.can_run(image)

    async def plan(
        self, m: Machine, image: ImageRun | None, env: Mapping[str, str]
    ) -> tuple[Run, float]:
        made = await self.inner.plan(m, image, env)
        self.made.set()
        await self.go.wait()
        return made

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


@pytest.fixture(params=["process", "oci"])
async def setup(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Runner, Gated, Confiner, Path, ImageRun | None]]:
    data = tmp_path / "data"
    wid = own_worker_id("cut")
    owner = owner_of(data)
    confiner, _ = Confiner.probe("auto", wid, owner=owner)
    image: ImageRun | None = None
    inner: Kind
    if request.param == "oci":
        runtime = need_runc()
        root = busybox_root(tmp_path / "root")
        image = ImageRun(root, RunConfig(cmd=["sh", "-c", SLEEP]))
        inner = ContainerKind.make(runtime, data, owner, confiner, "")
    else:
        catalog = {"sleeper": ImageSpec(command=["sh", "-c", SLEEP])}
        inner = ProcessKind(confiner, catalog, data / "work" / wid)
    gated = Gated(inner)
    runner = Runner(
        gated, confiner, data / "machines" / wid, data / "shims" / wid, keep_machines=False
    )
    # run in a task of its own: a fixture's set-up and tear-down are not one task
    started, stop, ended = anyio.Event(), anyio.Event(), anyio.Event()

    async def run() -> None:
        async with anyio.create_task_group() as tasks:
            await tasks.start(runner.run)
            started.set()
            await stop.wait()
            tasks.cancel_scope.cancel()
        ended.set()

    task = asyncio.get_running_loop().create_task(run())
    await started.wait()
    yield runner, gated, confiner, data, image
    stop.set()
    await ended.wait()
    await task


@pytest.mark.parametrize("step", ["made", "launching"])
async def test_a_start_cut_short_at_each_step_leaves_nothing(
    setup: tuple[Runner, Gated, Confiner, Path, ImageRun | None], step: str
) -> None:
    runner, gated, confiner, data, image = setup
    m = _machine(confiner.worker_id)
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tasks:

            async def start() -> None:
                await runner.start(m, image)

            tasks.start_soon(start)
            await gated.made.wait()  # cgroups made (a container: its box, mounts, bundle)
            assert _left(data, confiner, m.machine_id) != [] or confiner.mechanism == "none"
            if step == "launching":
                gated.go.set()  # the shim is being started when the cancellation comes
            tasks.cancel_scope.cancel()
    assert gated.undone == [m.machine_id]
    assert not runner.is_running(m.machine_id)
    assert _left(data, confiner, m.machine_id) == []


async def test_a_start_that_went_through_is_left_running(
    setup: tuple[Runner, Gated, Confiner, Path, ImageRun | None],
) -> None:
    runner, gated, confiner, data, image = setup
    m = _machine(confiner.worker_id)
    gated.go.set()
    with anyio.fail_after(WAIT_S):
        await runner.start(m, image)
    assert gated.undone == [] and runner.is_running(m.machine_id)
    await runner.destroy(m)
    assert _left(data, confiner, m.machine_id) == []
