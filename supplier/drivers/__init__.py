"""How a worker runs machines. A driver turns lifecycle verbs into reality:

- ``sim``: no process; a start pulls the image if it is not cached (simulated time: its
  size over ``pull_mb_per_s``), used by the load-test harness and virtual fleets.
- ``process``: a start runs a supervised subprocess with a restart policy, its output in a
  per-machine log file: an image named by digest runs its own files (the worker pulled it
  into its content cache first, supplier/images.py, and hands the driver an
  :class:`ImageRun`); a catalog image runs the command the worker's catalog gives it.

The worker writes every transition to its op log; the driver only does the work and
reports failures by raising DriverError (a clear message for the requester).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import anyio.abc

from bourse.errors import BourseError
from bourse.images.oci import RunConfig
from bourse.wire.messages import Machine, Resources
from supplier.drivers.confine import Mechanism

# A machine run without environment of its own (the default of Driver.start's ``env``).
NO_ENV: Mapping[str, str] = MappingProxyType({})


class DriverError(BourseError, RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class ImageRun:
    """A content image made ready for a machine: its unpacked root (read-only by
    convention: other machines share it) and what it runs (its config)."""

    root: Path
    config: RunConfig


class Driver(Protocol):
    name: str

    @property
    def runtime_version(self) -> str:
        """What runs its machines, with its version ("runc 1.1.5", "python 3.11.2",
        "simulated"): a worker's status says it."""
        ...

    @property
    def confinement(self) -> Mechanism:
        """How machines are held to their resources: cgroup2, cgroup1, rlimit or none
        (supplier/drivers/confine.py)."""
        ...

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = ...) -> None:
        """Own the driver's tasks (a process's supervisor) until cancelled; leave nothing
        running when it ends. Started by the worker's Machines.run before the host serves."""
        ...

    def can_run(self, image: str) -> bool:
        """Whether this worker can run the image at all (offers are only made if so)."""
        ...

    def refuses(self, r: Resources) -> str:
        """Why it cannot run a machine of these resources confined (an order it should
        decline), or ""."""
        ...

    async def pull(self, image: str) -> tuple[int, float]:
        """Fetch a catalog image that is not cached (a content image is the worker's
        business: supplier/images.py); returns the bytes and seconds it took."""
        ...

    async def start(
        self, m: Machine, image: ImageRun | None = None, env: Mapping[str, str] = NO_ENV
    ) -> None:
        """Run the machine: its content image's files (``image``), else its catalog
        image's command (cached by now), with ``env``, its run environment (the order's
        env and its ports, computed by the caller), above the image's own env and below
        Bourse's ids. Nothing of the supplier's own environment reaches a machine."""
        ...

    async def stop(self, m: Machine) -> None:
        """Stop it: gracefully, then forcibly after the grace period."""
        ...

    async def destroy(self, m: Machine) -> None:
        """Release whatever the machine held (it is stopped first if needed)."""
        ...

    def is_running(self, machine_id: str) -> bool: ...

    def logs(
        self, machine_id: str, tail: int, max_bytes: int, since: int = -1
    ) -> tuple[list[str], bool, int]:
        """The last ``tail`` lines of output (within ``max_bytes``), or with ``since`` >= 0
        the complete lines after that byte offset (within ``max_bytes``); whether some were
        left out; and the offset just past the last complete line read."""
        ...

    async def settle(self) -> None:
        """The supplier resumed the machines its store says should run: anything of an
        earlier run of it that none of them took over is stopped."""
        ...

    async def close(self) -> None:
        """The supplier is stopping: stop every machine (they keep their recorded state),
        or, where machines outlive their supplier, let go of them (they run on)."""
        ...
