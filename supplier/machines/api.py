"""The driver API: how a worker runs machines, whatever runs them.

A driver only knows how to run one thing, as Nomad's driver plugins and containerd's
runtimes do: start a machine, wait for its end, stop it, destroy what it held, recover a
machine an earlier supplier left running, and say what it knows of one. Restarts, backoff
and health live outside every driver, once (supplier/machines/restart.py, applied by the
worker's keeper, supplier/machines/keeper.py).

The drivers:

- ``sim`` (supplier/machines/sim.py): no process; a start pulls a catalog image that is not
  cached in simulated time. For the load-test harness and virtual fleets.
- ``process`` and ``oci`` (supplier/machines/runner.py): every machine runs under a shim
  of its own (supplier/machines/shim/), which holds it beyond its supplier's life; a
  process machine is a confined process (supplier/machines/process.py), an ``oci`` one a
  container of its content image (supplier/machines/oci/).

The worker writes every transition to its op log; a driver only does the work and reports
failures by raising :class:`DriverError` (a clear message for the requester).
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Protocol

import anyio.abc

from bourse.errors import BourseError
from bourse.images.oci import RunConfig
from bourse.wire.messages import Event, IsolationLevel, Machine, Resources
from supplier.machines.shim.contract import Run

# A machine run without environment of its own (the default of Driver.start's ``env``).
NO_ENV: Mapping[str, str] = MappingProxyType({})

# A test's hook, awaited at a named step of a machine's start (step, machine id): its image
# ``pulling``, its ``network`` taken, what it runs ``made`` (cgroups, a box and bundle), its
# ``shim`` spawned (starting the runtime), the machine ``running`` (the shim answered, the
# start not returned yet). None in production: each step then costs an attribute test.
Pause = Callable[[str, str], Awaitable[None]]

# How machines are held to what was sold: cgroup2, cgroup1, rlimit or none
# (supplier/machines/host/confine.py).
Mechanism = Literal["cgroup2", "cgroup1", "rlimit", "none"]


class DriverError(BourseError, RuntimeError):
    pass


class LaunchFailed(DriverError):
    """The driver could not start a machine after its image was pulled (``pulled``: the
    pull's events, recorded all the same)."""

    def __init__(self, cause: DriverError, pulled: tuple[Event, ...]) -> None:
        super().__init__(str(cause))
        self.pulled = pulled


@dataclass(frozen=True, slots=True)
class Exit:
    """How a machine's run ended: ``code`` (>= 0) or ``signal``; ``oom`` when the kernel
    killed it at its memory limit (SIGKILL while its cgroup's oom_kill counter grew);
    ``at_ms`` when, if it was recorded then (0: now), which an equality leaves out."""

    code: int | None = None
    signal: int | None = None
    oom: bool = False
    at_ms: int = field(default=0, compare=False)

    @property
    def reason(self) -> Literal["exit", "signal", "oom"]:
        return "oom" if self.oom else "signal" if self.signal is not None else "exit"

    @property
    def failed(self) -> bool:
        """Killed (at its limit or by a signal), as opposed to exiting with a code."""
        return self.oom or self.signal is not None

    @property
    def clean(self) -> bool:
        return self.code == 0

    def describe(self) -> str:
        if self.oom:
            return "oom: killed at its memory limit"
        if self.signal is not None:
            return f"killed by signal {self.signal}"
        return f"exited with code {self.code}"


def exit_of(returncode: int, oom_kills: int) -> Exit:
    """Read a returncode (negative: a signal) and the oom kills seen since the start."""
    if returncode < 0:
        sig = -returncode
        return Exit(signal=sig, oom=sig == signal.SIGKILL and oom_kills > 0)
    return Exit(code=returncode)


@dataclass(frozen=True, slots=True)
class ImageRun:
    """A content image made ready for a machine: its unpacked root (read-only by
    convention: other machines share it) and what it runs (its config)."""

    root: Path
    config: RunConfig


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a driver knows of a machine's current run (``inspect``)."""

    pid: int
    started_at_ms: int
    running: bool
    address: str = ""  # its private address, in its network of its own ("": the host's)


@dataclass(frozen=True, slots=True)
class Entry:
    """What a command entered into a machine's current run joins (docs/protocol.md §4.24):
    its run as its shim runs it (a process machine's confinement, or a container's runtime
    and id) and the pid of its first process."""

    run: Run
    pid: int


class Driver(Protocol):
    name: str

    @property
    def runtime_version(self) -> str:
        """What runs its machines, with its version ("runc 1.1.5", "python 3.11.2",
        "simulated"): a worker's status says it."""
        ...

    @property
    def confinement(self) -> Mechanism:
        """How machines are held to their resources: cgroup2, cgroup1, rlimit or none."""
        ...

    @property
    def isolation(self) -> IsolationLevel:
        """What machines have of their own: users and a network, users, or none."""
        ...

    def private_address(self, machine_id: str, kept: str = "") -> str:
        """The machine's address in its network of its own, from its commit to its destroy:
        ``kept`` (its record's, when the supplier resumes it) where it is still free, else
        a free one; "" where machines share the host's network."""
        ...

    def give_back_address(self, machine_id: str) -> None:
        """A machine that was never recorded (its commit could not be written): its private
        address is free again (a destroy gives it back on its own)."""
        ...

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = ...) -> None:
        """Own the driver's tasks until cancelled. Started by the worker's keeper before
        the host serves; when it ends, nothing of the driver's runs unowned."""
        ...

    def can_run(self, image: str) -> bool:
        """Whether this worker can run the catalog image at all (offers are only made if
        so); a content image is the worker's business (supplier/images.py)."""
        ...

    def refuses(self, r: Resources) -> str:
        """Why it cannot run a machine of these resources confined (an order it should
        decline), or ""."""
        ...

    async def pull(self, image: str) -> tuple[int, float]:
        """Fetch a catalog image that is not cached; the bytes and seconds it took."""
        ...

    async def start(
        self, m: Machine, image: ImageRun | None = None, env: Mapping[str, str] = NO_ENV
    ) -> None:
        """StartTask: run the machine once: its content image's files (``image``), else
        its catalog image's command, with ``env``, its run environment (the order's env
        and its ports, computed by the caller), above the image's own env and below
        Bourse's ids. Nothing of the supplier's own environment reaches a machine. Returns
        once it runs; a run that cannot start raises DriverError and leaves nothing."""
        ...

    async def wait(self, machine_id: str) -> Exit:
        """WaitTask: how the current run ended, once it ended (by itself or a stop)."""
        ...

    async def stop(self, machine_id: str) -> Exit | None:
        """StopTask: SIGTERM, then SIGKILL after the machine's grace period; how it ended
        (None: it was not running)."""
        ...

    async def destroy(self, m: Machine) -> None:
        """DestroyTask: release whatever the machine held, its logs and working directory
        (stopped first if it runs)."""
        ...

    async def recover(self, m: Machine) -> bool:
        """RecoverTask: take over the run an earlier supplier left of ``m`` (it ran on, or
        it ended meanwhile: ``wait`` then says how); False when there is none."""
        ...

    def inspect(self, machine_id: str) -> RunInfo | None:
        """InspectTask: the current run, if any."""
        ...

    async def entry(self, machine_id: str) -> Entry | None:
        """What a command entered into the machine's current run joins; None when it does
        not run (or runs nothing: the sim driver)."""
        ...

    def logs(
        self, machine_id: str, tail: int, max_bytes: int, since: int = -1
    ) -> tuple[list[str], bool, int]:
        """The last ``tail`` lines of output (within ``max_bytes``), or with ``since`` >= 0
        the complete lines after that byte offset (within ``max_bytes``); whether some were
        left out; and the offset just past the last complete line read."""
        ...

    async def settle(self) -> None:
        """The supplier resumed (recovered or started) the machines its store says should
        run: anything an earlier run left that none of them took over is stopped."""
        ...

    async def close(self) -> None:
        """The supplier is stopping: stop every machine (they keep their recorded state),
        or, where machines outlive their supplier, let go of them (they run on)."""
        ...
