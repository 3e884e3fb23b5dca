"""The ``oci`` driver: a machine of a content image runs as a container through an OCI
runtime (runc, or crun where cgroup2 is unified), with a root of its own.

What it shares with the process driver (supplier/drivers/process.py, which it extends):
the restart policy and its backoff, the stop (SIGTERM, then SIGKILL after the grace
period), exits reported through ``on_exit``/``on_restart`` (OOM is ``failed``/``oom``),
the capped, rotated log files and ``logs --follow``, and the cgroup tree keyed by the
supplier's owner (``bourse/<owner>/<worker>/<machine>``), where usage is read.

What a container is (supplier/drivers/bundle.py makes its spec, supplier/drivers/oci_runtime.py
runs it):

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
The runtime runs in the foreground, so its exit status is the machine's. When a run ends
(by itself, a stop, a destroy, the supplier's end), nothing of it is left: no mount, loop
device, cgroup in any hierarchy, runtime state. The driver's start sweeps what a supplier
that died left of this worker's containers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import anyio
import structlog

from bourse.wire.messages import Machine
from supplier.drivers import NO_ENV, DriverError, ImageRun
from supplier.drivers.bundle import BundleError, Spec, runtime_spec
from supplier.drivers.confine import SUBTREE, Confiner, Exit, limits_for
from supplier.drivers.image_files import Launch
from supplier.drivers.oci_runtime import (
    ContainerError,
    Containers,
    RunningContainer,
    Runtime,
    image_files,
)
from supplier.drivers.output import LogCaps
from supplier.drivers.process import (
    ExitFn,
    ProcessDriver,
    RestartFn,
    Running,
    Supervisor,
    no_restart_listener,
)
from supplier.drivers.shims import ContainerRun, ProcessRun

log = structlog.get_logger("bourse.driver.oci")

# A container's writable layer when its order buys no disk (MiB).
DEFAULT_DISK_MB = 1024


class _Container:
    """One run of a container, as the supervisor sees a run (process.py ``Running``)."""

    def __init__(self, c: RunningContainer) -> None:
        self.c = c

    @property
    def pid(self) -> int:
        return self.c.pid

    @property
    def running(self) -> bool:
        return self.c.running

    async def wait(self) -> Exit:
        return await self.c.wait()

    async def stop(self, grace_s: float) -> None:
        await self.c.stop(grace_s)  # cut short: the release that follows kills it

    async def release(self) -> None:
        try:
            await self.c.cleanup()
        except ContainerError as exc:
            log.error("container_cleanup_failed", machine_id=self.c.machine_id, error=str(exc))


class OciDriver(ProcessDriver):
    """Content images' machines as containers (see the module doc)."""

    name = "oci"

    def __init__(
        self,
        runtime: Runtime,
        containers: Containers,
        log_dir: Path,
        on_exit: ExitFn,
        *,
        confiner: Confiner,
        on_restart: RestartFn = no_restart_listener,
        log_caps: LogCaps | None = None,
        shims_dir: Path | None = None,
    ) -> None:
        super().__init__(
            {},
            log_dir,
            on_exit,
            confiner=confiner,
            on_restart=on_restart,
            log_caps=log_caps,
            shims_dir=shims_dir,
        )
        self.runtime = runtime
        self.containers = containers
        self._runs: dict[str, tuple[ImageRun, Spec]] = {}  # machine id -> what it runs

    @classmethod
    def make(
        cls,
        runtime: Runtime,
        data_dir: Path,
        owner: str,
        worker_id: str,
        log_dir: Path,
        on_exit: ExitFn,
        *,
        confiner: Confiner,
        cgroup_parent: str = "",
        on_restart: RestartFn = no_restart_listener,
        log_caps: LogCaps | None = None,
        shims_dir: Path | None = None,
    ) -> OciDriver:
        """The driver of ``worker_id`` of the supplier ``owner`` (its data dir's,
        supplier/drivers/confine.py ``owner_of``): its containers below
        ``<data_dir>/containers/<worker_id>/``, their cgroups in the process driver's tree."""
        containers = Containers(
            runtime,
            data_dir / "containers",
            worker_id,
            cgroup_parent,
            subtree=f"{SUBTREE}/{owner}",
        )
        return cls(
            runtime,
            containers,
            log_dir,
            on_exit,
            confiner=confiner,
            on_restart=on_restart,
            log_caps=log_caps,
            shims_dir=shims_dir,
        )

    @property
    def runtime_version(self) -> str:
        """What runs the containers ("runc 1.1.5")."""
        return self.runtime.describe()

    def can_run(self, image: str) -> bool:
        return False  # only content images: a catalog image has no root to run

    async def _sweep(self, at_end: bool = False, keep: Collection[str] = ()) -> None:
        try:
            swept = await self.containers.sweep(keep)
        except ContainerError as exc:
            log.error("containers_sweep_failed", worker_id=self.confiner.worker_id, error=str(exc))
        else:
            if swept and not at_end:
                log.warning("containers_swept", worker_id=self.confiner.worker_id, machines=swept)
        await super()._sweep(at_end, keep)

    async def start(
        self, m: Machine, image: ImageRun | None = None, env: Mapping[str, str] = NO_ENV
    ) -> None:
        if image is None:
            raise DriverError(
                f"image {m.image!r} has no content: an oci worker runs only images pushed to "
                "the market's image store"
            )
        try:
            await super().start(m, image, env)
        except BaseException:
            if not self.is_running(m.machine_id):
                self._runs.pop(m.machine_id, None)
            raise

    async def _image_launch(self, m: Machine, image: ImageRun, env: Mapping[str, str]) -> Launch:
        """The container's spec, made (and checked: a bad image fails the start with its
        reason) once per start; every run of it uses it. The supervisor's Launch is unused
        (a container's process is in its spec)."""
        try:
            passwd, group = await anyio.to_thread.run_sync(image_files, image.root)
            spec = runtime_spec(
                image.config,
                limits_for(m.resources, self.confiner.pids_max),
                cgroups_path=self.containers.cgroups_path(m.machine_id),
                hostname=hostname(m.machine_id),
                bourse_env={"BOURSE_MACHINE_ID": m.machine_id, "BOURSE_ORDER_ID": m.order_id},
                order_env=env,
                passwd=passwd,
                group=group,
                host=self.containers.host(),
            )
        except (BundleError, ContainerError) as exc:
            raise DriverError(f"image {m.image!r}: {exc}") from None
        self._runs[m.machine_id] = (image, spec)
        return Launch(spec.process.args, {}, None)

    async def _shim_run(self, sup: Supervisor) -> ProcessRun | ContainerRun:
        """What the shim runs: the container, through the same runtime and directories."""
        m = sup.m
        image, spec = self._runs[m.machine_id]
        boxes, runtime = self.containers, self.runtime
        return ContainerRun(
            runtime=runtime.name,
            runtime_path=runtime.path,
            runtime_version=runtime.version,
            directory=str(boxes.directory),
            owner=boxes.owner,
            subtree=boxes.subtree,
            cgroup_parent=boxes.cgroup_parent,
            spec=spec,
            image_root=str(image.root),
            disk_mb=m.resources.disk_mb or DEFAULT_DISK_MB,
        )

    async def _launch(self, sup: Supervisor, out: int) -> Running:
        """One run: a new layer, the container in the runtime's foreground."""
        m = sup.m
        image, spec = self._runs[m.machine_id]
        disk_mb = m.resources.disk_mb or DEFAULT_DISK_MB
        try:
            c = await self.containers.start(m.machine_id, spec, image.root, disk_mb, out)
        except (BundleError, ContainerError) as exc:
            raise DriverError(str(exc)) from None  # the caller names the machine
        return _Container(c)

    async def _forget(self, machine_id: str) -> None:
        self._runs.pop(machine_id, None)
        await super()._forget(machine_id)


def hostname(machine_id: str) -> str:
    """A container's host name: its machine id's characters that a host name label may
    hold, at most 63 (the id's tail: its unique part)."""
    label = "".join(c if c.isascii() and c.isalnum() else "-" for c in machine_id)
    return label[-63:].strip("-") or "machine"
