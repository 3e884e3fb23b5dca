"""Container machines (the ``oci`` driver's kind, supplier/machines/runner.py): a machine of
a content image runs as a container through an OCI runtime, with a root of its own.

What a container is (bundle.py makes its spec, boxes.py its box, its shim runs it):

- its root: the image's unpacked root from the worker's content cache, read-only, under an
  overlay whose writable layer is a loop-mounted ext4 file of the order's ``disk_mb``
  (:data:`DEFAULT_DISK_MB` when the order buys none): a machine that writes past it gets
  "no space left on device"; the layer is new at each start and removed when the
  container ends;
- its process: the image's entrypoint and cmd, working directory and user (resolved in
  the image's own ``/etc/passwd``), the image's env, then the run's (the order's env, its
  ports), then ``BOURSE_MACHINE_ID``/``BOURSE_ORDER_ID``; no new privileges, a reduced
  capability set; its own pid, mount, ipc and uts namespaces; the host's network;
- its limits: the order's CPU (a CFS quota), memory (and swap, where accounted) and pids
  (the worker's ``pids_max``);
- it sees none of the supplier: not its environment, data dir or credentials.

Catalog images (no content) are not run: the worker declines them (``image_not_runnable``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import anyio
import msgspec
import structlog

from bourse.wire.messages import Machine
from supplier.machines.api import DriverError, ImageRun
from supplier.machines.host.confine import SUBTREE, Confiner, limits_for
from supplier.machines.host.isolation import Entered, Isolation
from supplier.machines.oci.boxes import DEFAULT_DISK_MB, ContainerError, Containers
from supplier.machines.oci.bundle import BundleError, runtime_spec
from supplier.machines.oci.runtime import Runtime
from supplier.machines.oci.users import UserError, image_files
from supplier.machines.process import IMAGE_STOP_GRACE_S
from supplier.machines.shim.contract import ContainerRun, Run

log = structlog.get_logger("bourse.driver.oci")


class ContainerKind:
    """The containers of one worker (see the module doc)."""

    name = "oci"

    def __init__(
        self,
        runtime: Runtime,
        containers: Containers,
        confiner: Confiner,
        isolation: Isolation | None = None,
    ) -> None:
        self.runtime = runtime
        self.containers = containers
        self.confiner = confiner
        # each container's users mapped into a block of its own, its network its own
        self.isolation = isolation or Isolation()

    @classmethod
    def make(
        cls,
        runtime: Runtime,
        data_dir: Path,
        owner: str,
        confiner: Confiner,
        cgroup_parent: str,
        isolation: Isolation | None = None,
    ) -> ContainerKind:
        """The containers of ``confiner``'s worker of the supplier ``owner`` (its data
        dir's, supplier/machines/host/confine.py ``owner_of``): below
        ``<data_dir>/containers/<worker_id>/``, their cgroups in the confiner's tree."""
        containers = Containers(
            runtime,
            data_dir / "containers",
            confiner.worker_id,
            cgroup_parent,
            subtree=f"{SUBTREE}/{owner}",
        )
        return cls(runtime, containers, confiner, isolation)

    @property
    def runtime_version(self) -> str:
        """What runs the containers ("runc 1.1.5")."""
        return self.runtime.describe()

    def can_run(self, image: str) -> bool:
        return False  # only content images: a catalog image has no root to run

    async def plan(
        self, m: Machine, image: ImageRun | None, env: Mapping[str, str]
    ) -> tuple[ContainerRun, float]:
        """The container's spec (a bad image fails the start with its reason) and its box:
        once per start, a new writable layer each time."""
        if image is None:
            raise DriverError(
                f"image {m.image!r} has no content: an oci worker runs only images pushed to "
                "the market's image store"
            )
        own = await self.isolation.enter(m)
        try:
            return await self._plan(m, image, env, own)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.isolation.leave(m.machine_id)
            raise

    async def _plan(
        self, m: Machine, image: ImageRun, env: Mapping[str, str], own: Entered
    ) -> tuple[ContainerRun, float]:
        boxes = self.containers
        base = own.ids
        if own.address:
            env = {**env, "BOURSE_PRIVATE_ADDRESS": own.address}
        try:
            passwd, group = await anyio.to_thread.run_sync(image_files, image.root)
            spec = runtime_spec(
                image.config,
                limits_for(m.resources, self.confiner.pids_max),
                cgroups_path=boxes.cgroups_path(m.machine_id),
                hostname=hostname(m.machine_id),
                bourse_env={"BOURSE_MACHINE_ID": m.machine_id, "BOURSE_ORDER_ID": m.order_id},
                order_env=env,
                passwd=passwd,
                group=group,
                host=boxes.host(own.resolv),
                ids=base,
                netns=own.netns,
            )
        except (BundleError, UserError) as exc:
            raise DriverError(f"image {m.image!r}: {exc}") from None
        disk_mb = m.resources.disk_mb or DEFAULT_DISK_MB
        try:
            run = await anyio.to_thread.run_sync(
                boxes.prepare, m.machine_id, spec, image.root, disk_mb, base
            )
        except (BundleError, ContainerError) as exc:
            raise DriverError(str(exc)) from None  # the caller names the machine
        return run, IMAGE_STOP_GRACE_S

    async def undo(self, machine_id: str) -> None:
        try:
            await anyio.to_thread.run_sync(self.containers.remove, machine_id)
        except ContainerError as exc:
            log.error("container_teardown_failed", machine_id=machine_id, error=str(exc))
        await self.isolation.leave(machine_id)

    async def forget(self, machine_id: str) -> None:
        await self.undo(machine_id)
        await self.isolation.forget(machine_id)  # nothing of its users left: its ids go back

    async def sweep(self, keep: Mapping[str, Run]) -> list[str]:
        nets = {mid: _netns_of(run) for mid, run in keep.items() if isinstance(run, ContainerRun)}
        await self.isolation.keep(nets)
        try:
            swept = await anyio.to_thread.run_sync(self.containers.sweep, keep)
        except ContainerError as exc:
            log.error("containers_sweep_failed", worker_id=self.confiner.worker_id, error=str(exc))
            swept = []
        cgroups = await anyio.to_thread.run_sync(lambda: self.confiner.sweep(keep=keep))
        return sorted({*swept, *cgroups})

    async def end(self) -> None:
        await anyio.to_thread.run_sync(self.containers.remove_empty_parents)
        await anyio.to_thread.run_sync(lambda: self.confiner.sweep(remove_base=True))

    async def background(self) -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.isolation.background)
            await self.containers.pool.keep_filled()


def _netns_of(run: ContainerRun) -> str:
    """The network namespace a container's spec joins ("" : none)."""
    try:
        spec = msgspec.json.decode(Path(run.bundle, "config.json").read_bytes())
        for ns in spec["linux"]["namespaces"]:
            if ns.get("type") == "network":
                return str(ns.get("path", ""))
    except (OSError, msgspec.DecodeError, KeyError, TypeError):
        pass
    return ""


def hostname(machine_id: str) -> str:
    """A container's host name: its machine id's characters that a host name label may
    hold, at most 63 (the id's tail: its unique part)."""
    label = "".join(c if c.isascii() and c.isalnum() else "-" for c in machine_id)
    return label[-63:].strip("-") or "machine"
