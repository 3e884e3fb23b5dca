"""The ``process`` and ``oci`` drivers: one way to run a machine, under a shim of its own.

Every machine, process or container, runs through the same path: its :class:`Kind` makes
what it runs (a process's plan and its cgroups, supplier/machines/process.py; a
container's box and bundle, supplier/machines/oci/), then a shim
(supplier/machines/shim/) starts it and holds it: its output, its exit, its stop. The
shim outlives its supplier; whether the machine does is the plan's:

- ``keep_machines`` (``supplier run --keep-machines``, the default): the machine runs on
  when the supplier stops or dies; the next supplier on the data dir recovers it
  (:meth:`Runner.recover`, an exit that happened meanwhile included) and :meth:`settle`
  stops what no machine of its store recovered;
- otherwise (``--machines-stop-with-supplier``): the same shim, given the supplier's pid:
  the supplier's close stops every machine (:meth:`close`), and a supplier that dies takes
  them with it (each shim watches its pid, stops its machine and removes everything).

A start that is cut short (an error, a cancellation) undoes what it made, in one place
(:meth:`Runner.start`): the kind's ``undo``, once the shim did not take the machine over.
Restarts are not a driver's business (supplier/machines/restart.py).
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
import structlog

from bourse.wire.messages import IsolationLevel, Machine, Resources
from supplier.machines.api import (
    NO_ENV,
    DriverError,
    Entry,
    Exit,
    ImageRun,
    Mechanism,
    Pause,
    RunInfo,
)
from supplier.machines.host.confine import ConfineError, Confiner, too_small, weaker_than_cgroups
from supplier.machines.host.isolation import Isolation
from supplier.machines.host.output import LogCaps, Logs
from supplier.machines.shim import contract
from supplier.machines.shim.client import Shim, ShimError, discover, launch
from supplier.machines.shim.contract import ContractError, Plan, Run, read_plan

log = structlog.get_logger("bourse.driver")

# How long a stop's caller waits for the shims of a worker that stops with its supplier.
CLOSE_S = 30.0


class Kind(Protocol):
    """What one kind of machine is made of before its shim runs it."""

    name: str
    isolation: Isolation  # what its machines have of their own (users, a network)

    @property
    def runtime_version(self) -> str: ...

    def can_run(self, image: str) -> bool:
        """A catalog image this kind runs (a content image: every kind)."""
        ...

    async def plan(
        self, m: Machine, image: ImageRun | None, env: Mapping[str, str]
    ) -> tuple[Run, float]:
        """What the shim runs for ``m`` (made on the host: cgroups, a box) and its stop
        grace; DriverError naming the problem, with nothing left made."""
        ...

    async def undo(self, machine_id: str) -> None:
        """What :meth:`plan` made for the machine, removed (idempotent)."""
        ...

    async def forget(self, machine_id: str) -> None:
        """The machine was destroyed: what it kept between runs, removed too."""
        ...

    async def sweep(self, keep: Mapping[str, Run]) -> list[str]:
        """What dead shims left of this worker's machines but ``keep``'s (the runs that go
        on, by machine id), removed; what those runs hold is theirs again."""
        ...

    async def end(self) -> None:
        """The driver ends with no machine of its own left: the worker's empty trees."""
        ...

    async def background(self) -> None:
        """Work of its own until cancelled (a container's layers formatted ahead)."""
        ...


@dataclass(slots=True)
class _Run:
    """One machine's current run: its shim and its stop grace."""

    shim: Shim
    grace_s: float
    collecting: anyio.Event | None = None  # set once its shim and what it held are gone


class Runner:
    """A worker's driver: its kind's machines, each under a shim in ``shims_dir``."""

    def __init__(
        self,
        kind: Kind,
        confiner: Confiner,
        log_dir: Path,
        shims_dir: Path,
        *,
        keep_machines: bool = True,
        log_caps: LogCaps | None = None,
    ) -> None:
        self.kind = kind
        self.name = kind.name
        self.confiner = confiner
        self.log_dir = log_dir
        self.shims_dir = shims_dir
        self.keep_machines = keep_machines
        self.log_caps = log_caps or LogCaps()
        self.output = Logs(log_dir)
        self._runs: dict[str, _Run] = {}
        self._found: dict[str, Shim] = {}  # shims an earlier supplier left, not recovered yet
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s: the shims followed
        self.pause: Pause | None = None  # a test's, at its start's steps (api.py)
        self.log = log.bind(worker_id=confiner.worker_id)

    # -- what it is ---------------------------------------------------------------------------
    @property
    def confinement(self) -> Mechanism:
        return self.confiner.mechanism

    @property
    def runtime_version(self) -> str:
        return self.kind.runtime_version

    @property
    def isolation(self) -> IsolationLevel:
        return self.kind.isolation.describe()

    def private_address(self, machine_id: str, kept: str = "") -> str:
        return self.kind.isolation.reserve(machine_id, kept)

    def give_back_address(self, machine_id: str) -> None:
        if self.kind.isolation.network is not None:
            self.kind.isolation.network.give_back(machine_id)

    def refuses(self, r: Resources) -> str:
        return too_small(r.memory_mb, self.confiner.mechanism)

    def can_run(self, image: str) -> bool:
        return self.kind.can_run(image)

    async def pull(self, image: str) -> tuple[int, float]:
        return 0, 0.0  # catalog commands are local: nothing to fetch

    # -- its life -----------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Find what an earlier supplier left (shims to recover; leftovers of dead ones
        swept), then follow the shims until cancelled; at the end let go of them (keep) or
        stop what is left (their machines stop with the supplier)."""
        c = self.confiner
        if weaker_than_cgroups(c.mechanism):
            self.log.warning("confinement_weaker_than_cgroups", confinement=c.mechanism)
        else:
            self.log.info("confinement", confinement=c.mechanism)
        try:  # a stop while it starts undoes the start here too (its network, the shims found)
            self._found = await discover(self.shims_dir)
            if self._found:
                self.log.info("shims_found", machines=sorted(self._found))
            await self.kind.isolation.start()  # what its machines share (its network) first
            swept = await self.kind.sweep(keep=_runs_of(self._found))
            if swept:
                self.log.warning("machines_swept", machines=swept)
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self.kind.background)
                for shim in self._found.values():
                    if shim.attached:
                        tasks.start_soon(shim.follow)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tasks = None
            with anyio.CancelScope(shield=True):
                if self.keep_machines:
                    await self._detach_all()
                    if not self._runs and not self._found:  # none kept: nothing of them left
                        await self.kind.end()
                else:
                    # what close() did not stop in its time is killed now, and what the
                    # shims found hold that a stop during the resume left unrecovered
                    with anyio.move_on_after(CLOSE_S):
                        await self._stop_all(grace_s=0.0)
                        await self.settle()
                    await self.kind.end()
                await self.kind.isolation.close()  # what no machine uses any more

    async def settle(self) -> None:
        """The supplier resumed its machines: a shim found that no machine recovered holds
        one its store says should not run (stopped, destroyed meanwhile): stop it."""
        found, self._found = self._found, {}
        for mid, shim in found.items():
            self.log.warning("shim_not_recovered", machine_id=mid)
            with anyio.CancelScope(shield=True):
                await shim.stop(0.0)
                await shim.collect()

    async def close(self) -> None:
        """Stop every machine, all at once (they come back when the supplier starts again:
        their recorded state still says started); machines kept run on."""
        if self.keep_machines:
            await self._detach_all()
        else:
            await self._stop_all()

    async def _detach_all(self) -> None:
        """Let go of every shim (its machine runs on), those found included."""
        for run in list(self._runs.values()):
            await run.shim.detach()
        for shim in self._found.values():
            await shim.detach()

    async def _stop_all(self, grace_s: float | None = None) -> None:
        async with anyio.create_task_group() as tasks:
            for mid in list(self._runs):
                tasks.start_soon(self.stop, mid, grace_s)

    # -- the verbs ------------------------------------------------------------------------------
    async def start(
        self, m: Machine, image: ImageRun | None = None, env: Mapping[str, str] = NO_ENV
    ) -> None:
        mid = m.machine_id
        current = self._runs.get(mid)
        if current is not None and not current.shim.ended.is_set():
            return
        if self._tasks is None:
            raise DriverError(f"the {self.name} driver is not running")
        if current is not None:
            await self._collect(mid, current)
        try:  # the one place a start cut short is undone: whatever the kind made is removed
            run, grace = await self.kind.plan(m, image, env)
            if self.pause is not None:
                await self.pause("made", mid)
            plan = Plan(
                machine_id=mid,
                run=run,
                log_dir=str(self.log_dir),
                machine_log_mb=self.log_caps.machine_mb,
                worker_log_mb=self.log_caps.worker_mb,
                stop_grace_s=grace,
                supplier_pid=0 if self.keep_machines else os.getpid(),
            )
            shim = await launch(self.shims_dir / mid, plan, self.pause)  # stopped if cut
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.kind.undo(mid)
            if isinstance(exc, ShimError):
                raise DriverError(str(exc)) from None  # the caller names the machine
            raise
        self._runs[mid] = _Run(shim, grace)
        self._tasks.start_soon(shim.follow)

    async def wait(self, machine_id: str) -> Exit:
        run = self._runs.get(machine_id)
        if run is None:
            raise DriverError(f"machine {machine_id} has no run on this worker")
        await run.shim.ended.wait()
        how = run.shim.exit()
        await self._collect(machine_id, run)
        return how

    async def _collect(self, machine_id: str, run: _Run) -> None:
        """The run ended and its exit was read: its shim may go, and what the run held. A
        second caller (a stop and the run's follower both collect it) waits for the first:
        when either returns, nothing of the run is left (its network, its ports)."""
        with anyio.CancelScope(shield=True):
            if run.collecting is None:
                run.collecting = anyio.Event()
                try:
                    await run.shim.collect()
                    await self.kind.isolation.leave(machine_id)  # what the run alone held
                finally:
                    run.collecting.set()
            else:
                await run.collecting.wait()
        if self._runs.get(machine_id) is run:
            del self._runs[machine_id]

    async def stop(self, machine_id: str, grace_s: float | None = None) -> Exit | None:
        """SIGTERM, SIGKILL after the machine's grace (or ``grace_s``). Cut short, the run
        is killed at once, and the stop ends only once it ended."""
        run = self._runs.get(machine_id)
        if run is None:
            return None
        try:
            how = await run.shim.stop(run.grace_s if grace_s is None else grace_s)
        finally:
            with anyio.CancelScope(shield=True):
                if not run.shim.ended.is_set():
                    await run.shim.stop(0.0)
                await self._collect(machine_id, run)
        return how

    async def destroy(self, m: Machine) -> None:
        await self.stop(m.machine_id)
        with anyio.CancelScope(shield=True):
            await self.kind.forget(m.machine_id)
            await anyio.to_thread.run_sync(self.output.remove, m.machine_id)

    async def recover(self, m: Machine) -> bool:
        shim = self._found.pop(m.machine_id, None)
        if shim is None:
            return False
        grace = _grace(shim.directory)
        self._runs[m.machine_id] = _Run(shim, grace)
        self.log.info(
            "machine_recovered", machine_id=m.machine_id, pid=shim.pid, ended=shim.ended.is_set()
        )
        return True

    def inspect(self, machine_id: str) -> RunInfo | None:
        run = self._runs.get(machine_id)
        if run is None:
            return None
        return RunInfo(
            pid=run.shim.pid or 0,
            started_at_ms=run.shim.started_at_ms,
            running=not run.shim.ended.is_set(),
            address=self.kind.isolation.private(machine_id),
        )

    async def entry(self, machine_id: str) -> Entry | None:
        """The machine's current run as its shim's plan says it, with its first process."""
        run = self._runs.get(machine_id)
        pid = run.shim.pid if run is not None else None
        if run is None or not pid:
            return None
        try:
            plan = await anyio.to_thread.run_sync(read_plan, run.shim.directory)
        except (OSError, ContractError):
            return None  # an older shim's, or gone meanwhile
        return Entry(plan.run, pid)

    def is_running(self, machine_id: str) -> bool:
        info = self.inspect(machine_id)
        return info is not None and info.running

    def pid(self, machine_id: str) -> int | None:
        """The machine's first process while it runs."""
        info = self.inspect(machine_id)
        return info.pid if info is not None and info.running else None

    def logs(
        self, machine_id: str, tail: int, max_bytes: int, since: int = -1
    ) -> tuple[list[str], bool, int]:
        return self.output.read(machine_id, tail, max_bytes, since)

    def log_path(self, machine_id: str) -> Path:
        return self.output.path(machine_id)

    def usage_ns(self, machine_id: str) -> int | None:
        """CPU time used by the machine's cgroup (ns), from the cgroup's own counter."""
        return self.confiner.usage_ns(machine_id)


def _runs_of(found: Mapping[str, Shim]) -> dict[str, Run]:
    """What the shims found run (their plans: a plan of an older shim has none)."""
    runs: dict[str, Run] = {}
    for mid, shim in found.items():
        with contextlib.suppress(contract.ContractError):
            runs[mid] = contract.read_plan(shim.directory).run
    return runs


def _grace(directory: Path) -> float:
    try:
        return contract.read_plan(directory).stop_grace_s
    except contract.ContractError:
        return 10.0


async def confine(confiner: Confiner, machine_id: str, r: Resources) -> tuple[list[str], list[str]]:
    """The machine's cgroups made (the files to join) and its rlimits."""
    try:
        return await anyio.to_thread.run_sync(confiner.prepare, machine_id, r)
    except (ConfineError, OSError) as exc:
        raise DriverError(f"cannot confine machine {machine_id}: {exc}") from None


def python_runtime() -> str:
    """What runs a process machine: the shim, on this Python."""
    return f"python {platform.python_version()}"
