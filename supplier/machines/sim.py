"""The ``sim`` driver: machines without processes. A start whose image is not cached waits
the simulated pull time: its size (a catalog image's ``size_mb``, a content image's layers)
over ``pull_mb_per_s`` (default ``MEASURED_PULL_MB_PER_S``); everything else is instant."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import anyio
import anyio.abc

from bourse.wire.messages import IsolationLevel, Machine, Resources, now_ms
from supplier.images import DEFAULT_IMAGE_MB, MIB
from supplier.machines.api import NO_ENV, Entry, Exit, ImageRun, Mechanism, RunInfo

# A real pull from the image store into a worker's cache, measured (docs/performance.md,
# "pulls"): one 100 MB image pulled alone, 53 MiB/s; concurrent pulls of the pulls
# scenario from one nats-server, 11-18 MiB/s each. A worker passes its configured
# pull_mb_per_s (WorkerConfig), which has a default of its own.
MEASURED_PULL_MB_PER_S = 50.0


class SimDriver:
    name = "sim"
    runtime_version = "simulated"
    confinement: Mechanism = "none"  # nothing runs: nothing to confine
    isolation: IsolationLevel = "none"  # nor to isolate

    def __init__(
        self,
        pull_mb_per_s: float = MEASURED_PULL_MB_PER_S,
        size_mb: Callable[[str], int] = lambda _: DEFAULT_IMAGE_MB,
    ) -> None:
        self.pull_mb_per_s = pull_mb_per_s
        self.size_mb = size_mb  # an image's size in MiB (the worker's images say)
        self.running: dict[str, anyio.Event] = {}  # machine id -> set when it is stopped

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Nothing to own (a simulated machine is a set entry): ready at once."""
        task_status.started()

    def can_run(self, image: str) -> bool:
        return True

    def refuses(self, r: Resources) -> str:
        return ""

    def private_address(self, machine_id: str, kept: str = "") -> str:
        return ""

    def give_back_address(self, machine_id: str) -> None:
        pass

    def pull_seconds(self, image: str) -> float:
        if self.pull_mb_per_s <= 0:
            return 0.0
        return self.size_mb(image) / self.pull_mb_per_s

    async def pull(self, image: str) -> tuple[int, float]:
        seconds = self.pull_seconds(image)
        if seconds > 0:
            await anyio.sleep(seconds)  # the simulated pull's time, not a synchronisation
        return self.size_mb(image) * MIB, seconds

    async def start(
        self, m: Machine, image: ImageRun | None = None, env: Mapping[str, str] = NO_ENV
    ) -> None:
        self.running.setdefault(m.machine_id, anyio.Event())

    async def wait(self, machine_id: str) -> Exit:
        """A simulated machine never ends by itself: only a stop ends it."""
        stopped = self.running.get(machine_id)
        if stopped is not None:
            await stopped.wait()
        return Exit(signal=15, at_ms=now_ms())

    async def stop(self, machine_id: str) -> Exit | None:
        stopped = self.running.pop(machine_id, None)
        if stopped is None:
            return None
        stopped.set()
        return Exit(signal=15, at_ms=now_ms())

    async def destroy(self, m: Machine) -> None:
        await self.stop(m.machine_id)

    async def recover(self, m: Machine) -> bool:
        return False  # nothing outlives a simulation

    def inspect(self, machine_id: str) -> RunInfo | None:
        return RunInfo(0, 0, True) if machine_id in self.running else None

    async def entry(self, machine_id: str) -> Entry | None:
        return None  # a simulated machine runs nothing to enter

    def logs(
        self, machine_id: str, tail: int, max_bytes: int, since: int = -1
    ) -> tuple[list[str], bool, int]:
        return [], False, 0  # simulated machines print nothing

    async def settle(self) -> None:
        pass  # nothing outlives a simulation

    async def close(self) -> None:
        for stopped in self.running.values():
            stopped.set()
        self.running.clear()
