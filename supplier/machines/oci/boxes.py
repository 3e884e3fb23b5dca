"""A container machine's box: what the supplier makes on disk before its shim runs it, and
what a sweep removes when no shim did.

Everything of an owner (a worker) lives below ``<directory>/<owner>/``, so owners never
touch each other's containers:

- ``state/``: the runtime's state (``runc --root``);
- ``machines/<runtime id>/``: the box of one machine: ``record.json`` (the machine and its
  cgroups path, for a sweep), ``disk.ext4`` (the writable layer: a sparse file of
  ``disk_mb``, ext4 without a journal nor reserved blocks, loop-mounted at ``layer/``,
  holding the overlay's ``upper/`` and ``work/``) and ``bundle/`` (``config.json``;
  ``rootfs/``: the overlay of the image root, read-only below, and the layer). A machine
  that writes past its disk gets ENOSPC and nothing else on the worker notices. The layer
  lives as long as the container: a new start begins from the image again;
- ``pool/``: writable layers formatted ahead (:class:`LayerPool`), so that a start only
  mounts one: ``mkfs`` is off the start path.

The shim removes a box when its container ended (supplier/machines/shim/teardown.py
``remove_container``: runtime state, cgroups in every hierarchy, mounts, loop device,
directory); a start cut short before its shim took it, and a sweep of what a dead shim left,
call the same function. Runtime ids: see :func:`supplier.machines.oci.bundle.runtime_id`.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import structlog

from bourse.errors import BourseError
from bourse.wire.limits import ID_PATTERN
from supplier.machines.host.confine import SUBTREE
from supplier.machines.oci.bundle import (
    HOST_FILES,
    NOFILE,
    Host,
    cgroup_dirs,
    machine_id_of,
    runtime_id,
)
from supplier.machines.oci.runtime import Runtime
from supplier.machines.oci.spec import Spec, encode
from supplier.machines.shim import teardown
from supplier.machines.shim.contract import ContainerRun

log = structlog.get_logger("bourse.driver.oci")

# Characters that overlayfs's option string cannot carry in a path.
OVERLAY_UNSAFE = ",:\\\n"
# Where boxes' bundles are (a directory each, searchable by anyone, so that a container's
# root, mapped into a user namespace, can be entered; below it only the container's own).
BUNDLES = Path("/run/bourse/bundles")
# A container's writable layer when its order buys no disk (MiB).
DEFAULT_DISK_MB = 1024
# Layers formatted ahead, per size; the sizes kept ready (the default's, and the last few
# asked for).
POOL_DEPTH = 2
POOL_SIZES = 4
_ID = re.compile(ID_PATTERN)


class ContainerError(BourseError, RuntimeError):
    """A container could not be prepared or removed."""


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """``record.json``: what a sweep needs to find of a machine."""

    machine_id: str
    cgroups_path: str
    run: str = ""


@dataclass(frozen=True, slots=True)
class Box:
    """One machine's directory and the paths in it, and its bundle's directory (outside the
    data dir: runc enters a user-namespaced container's root as the container's root, which
    may not pass through the supplier's data dir)."""

    dir: Path
    bundle: Path

    @property
    def record(self) -> Path:
        return self.dir / teardown.RECORD

    @property
    def disk(self) -> Path:
        return self.dir / teardown.DISK

    @property
    def layer(self) -> Path:
        """Where its disk is mounted: beside its root, below /run/bourse, which a process
        machine's mount namespace drops whole (so no machine's copy of the host's mounts
        holds another's layer, nor its loop device, after its end)."""
        return self.bundle / "layer"


def _must(what: str, *args: str) -> None:
    code, out = teardown.run(list(args))
    if code != 0:
        raise ContainerError(f"cannot {what}: {out or code}")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def format_layer(path: Path, disk_mb: int) -> None:
    """A sparse file of ``disk_mb`` MiB holding an empty ext4 without a journal (the layer
    never outlives a crash: a sweep removes it) nor blocks reserved for root (the machine's
    root may use all it bought); written under a temporary name, renamed when whole."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.truncate(disk_mb << 20)  # sparse: blocks are used as the machine writes
    _must(
        "make the writable layer",
        "mkfs.ext4",
        "-q",
        "-F",
        "-m",
        "0",
        "-O",
        "^has_journal",
        str(tmp),
    )
    os.replace(tmp, path)


class LayerPool:
    """Writable layers formatted ahead, by size, in ``directory``: :meth:`take` hands one
    over (renamed into a box), :meth:`fill` formats what is missing (in a worker thread,
    off the start path)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sizes: OrderedDict[int, None] = OrderedDict({DEFAULT_DISK_MB: None})
        self.wanted = anyio.Event()  # a take left a size short

    def _ready(self, disk_mb: int) -> list[Path]:
        return sorted(self.directory.glob(f"{disk_mb}-*.ext4"))

    def take(self, disk_mb: int, into: Path) -> bool:
        """Move a formatted layer of ``disk_mb`` to ``into``; False when none is ready."""
        self.sizes[disk_mb] = None
        self.sizes.move_to_end(disk_mb)
        while len(self.sizes) > POOL_SIZES:
            self.sizes.popitem(last=False)
        self.wanted.set()
        for path in self._ready(disk_mb):
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, into)
                return True
        return False

    def fill(self) -> None:
        """Format what the kept sizes lack (a failure is logged: starts then format their
        own); drop layers of sizes no longer kept and half-made ones."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.directory.iterdir():
            size = path.name.split("-", 1)[0]
            if path.suffix == ".tmp" or not size.isdigit() or int(size) not in self.sizes:
                path.unlink(missing_ok=True)
        for disk_mb in list(self.sizes):
            for _ in range(POOL_DEPTH - len(self._ready(disk_mb))):
                try:
                    format_layer(self.directory / f"{disk_mb}-{uuid.uuid4().hex}.ext4", disk_mb)
                except (ContainerError, OSError) as exc:
                    log.warning("layer_pool_fill_failed", disk_mb=disk_mb, error=str(exc))
                    return

    async def keep_filled(self) -> None:
        """Fill now and after every take, until cancelled."""
        while True:
            self.wanted = anyio.Event()
            await anyio.to_thread.run_sync(self.fill, abandon_on_cancel=True)
            await self.wanted.wait()


class Containers:
    """The containers of one owner (a worker) through ``runtime``, below
    ``directory/<owner>``; their cgroups are ``<subtree>/<owner>/<machine id>`` (the
    confiner's tree passes ``bourse/<its supplier's owner>``), below ``cgroup_parent`` when
    given, else below the caller's own cgroup."""

    def __init__(
        self,
        runtime: Runtime,
        directory: Path,
        owner: str,
        cgroup_parent: str = "",
        subtree: str = SUBTREE,
    ) -> None:
        if not _ID.match(owner):
            raise ContainerError(f"owner {owner!r} is not a worker id")
        self.runtime = runtime
        self.directory = directory
        self.owner = owner
        self.home = directory.resolve() / owner  # as /proc/self/mountinfo names it
        self.state = self.home / "state"
        self.machines = self.home / "machines"
        self.pool = LayerPool(self.home / "pool")
        self.bundles = BUNDLES / f"{subtree.strip('/').rsplit('/', 1)[-1]}-{owner}"
        self.cgroup_parent = cgroup_parent.strip("/")
        self.subtree = subtree.strip("/")
        self.log = log.bind(worker_id=owner)

    def cgroups_path(self, machine_id: str) -> str:
        """The machine's cgroups path (the spec's ``cgroupsPath``)."""
        runtime_id(machine_id)  # a machine id, or BundleError
        return self._below(f"{self.subtree}/{self.owner}/{machine_id}")

    def _below(self, path: str) -> str:
        return f"/{self.cgroup_parent}/{path}" if self.cgroup_parent else path

    def cgroups(self, cgroups_path: str) -> dict[str, Path]:
        """Where ``cgroups_path`` is in each hierarchy (by controller; "" for cgroup2)."""
        return cgroup_dirs(
            _read(Path("/proc/self/mountinfo")), _read(Path("/proc/self/cgroup")), cgroups_path
        )

    def host(self, resolv: str = "") -> Host:
        """What this host gives a container (for ``runtime_spec``); ``resolv``: the
        resolv.conf it sees ("": the host's)."""
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return Host(
            swap_accounted=self._swap_accounted(),
            nofile_max=NOFILE if hard == resource.RLIM_INFINITY else hard,
            files=tuple(f for f in HOST_FILES if Path(f).is_file()),
            sources=(("/etc/resolv.conf", resolv),) if resolv else (),
        )

    def _swap_accounted(self) -> bool:
        """cgroup v1's memsw files (or, on cgroup2, the memory controller's swap files) are
        there where the caller's cgroups are."""
        dirs = self.cgroups(self._below("."))
        memory = dirs.get("memory")
        if memory is not None:
            return (memory / "memory.memsw.limit_in_bytes").exists()
        unified = dirs.get("")
        return unified is not None and (unified / "memory.swap.max").exists()

    # -- a box ------------------------------------------------------------------------------
    def box(self, machine_id: str) -> Box:
        rid = runtime_id(machine_id)
        return Box(self.machines / rid, self.bundles / rid)

    def prepare(
        self, machine_id: str, spec: Spec, image_root: Path, disk_mb: int, ids: int = -1
    ) -> ContainerRun:
        """Make the machine's box (blocking: run it in a worker thread): its record, its
        writable layer (from the pool, else formatted now) mounted, its root (the image
        root under the layer) mounted, its bundle; what its shim runs. Leftovers of an
        earlier run of the machine are removed first. A failure leaves nothing behind and
        raises ContainerError. ``image_root`` must stay while it runs (the caller pins it
        in its image cache)."""
        box = self.box(machine_id)
        if disk_mb < 1:
            raise ContainerError(f"disk_mb must be >= 1, not {disk_mb}")
        rootfs = box.bundle / spec.root.path
        if rootfs.parent != box.bundle or spec.root.path in ("", ".", ".."):
            raise ContainerError(f"the spec's root {spec.root.path!r} is not a bundle directory")
        for path in (image_root, box.dir):
            if any(c in str(path) for c in OVERLAY_UNSAFE):
                raise ContainerError(f"{path} holds a character overlayfs options cannot carry")
        if not image_root.is_dir():
            raise ContainerError(f"the image root {image_root} is not a directory")
        if box.dir.exists() or box.bundle.exists():
            self.remove(machine_id)  # an earlier run's leftovers
        run = uuid.uuid4().hex
        try:
            self._make(
                box,
                Record(machine_id=machine_id, cgroups_path=spec.linux.cgroups_path, run=run),
                spec,
                image_root,
                rootfs,
                disk_mb,
                ids,
            )
        except BaseException as exc:
            self._remove_quietly(machine_id)
            if isinstance(exc, OSError):
                raise ContainerError(f"cannot prepare {machine_id}: {exc}") from None
            raise
        cgroups = [str(d) for d in self.cgroups(spec.linux.cgroups_path).values()]
        return ContainerRun(
            runtime=self.runtime.path,
            state_root=str(self.state),
            runtime_id=box.dir.name,
            bundle=str(box.bundle),
            box=str(box.dir),
            cgroup_dirs=sorted(set(cgroups)),
            oom_files=[
                str(Path(d) / name)
                for d in sorted(set(cgroups))
                for name in ("memory.oom_control", "memory.events")
            ],
            run=run,
        )

    def _make(
        self,
        box: Box,
        record: Record,
        spec: Spec,
        image_root: Path,
        rootfs: Path,
        disk_mb: int,
        ids: int,
    ) -> None:
        t0 = time.monotonic()
        box.dir.mkdir(parents=True, mode=0o700)
        for d in reversed([box.bundle, *box.bundle.parents]):  # searchable on the way in
            if d == BUNDLES.parent or d in BUNDLES.parents:
                continue
            d.mkdir(mode=0o711, exist_ok=True)
            d.chmod(0o711)
        box.record.write_bytes(msgspec.json.encode(record))
        if not self.pool.take(disk_mb, box.disk):
            format_layer(box.disk, disk_mb)
        box.layer.mkdir(mode=0o700)
        loop = ("mount", "-o", "loop,nodev,nosuid", str(box.disk), str(box.layer))
        _must("mount the writable layer", *loop)
        upper, work = box.layer / "upper", box.layer / "work"
        upper.mkdir(mode=0o755)
        work.mkdir(mode=0o700)
        if ids >= 0:  # the container's root owns its writable layer (its ids are the block's)
            for d in (upper, work):
                os.chown(d, ids, ids)
            self._mount_points(upper, spec, ids)
        rootfs.mkdir(parents=True, exist_ok=True)
        options = f"lowerdir={image_root},upperdir={upper},workdir={work}"
        _must("mount the root", "mount", "-t", "overlay", "overlay", "-o", options, str(rootfs))
        # the spec holds the machine's env (its secrets): the runtime reads it as root
        config = os.open(box.bundle / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(config, "wb") as f:
            f.write(encode(spec))
        if ids >= 0:  # its root is entered as the container's root, and by no other user
            os.chown(box.bundle, ids, ids)
            box.bundle.chmod(0o700)
        ms = round((time.monotonic() - t0) * 1e3)
        self.log.debug("box_made", machine_id=record.machine_id, ms=ms)

    @staticmethod
    def _mount_points(upper: Path, spec: Spec, ids: int) -> None:
        """The files the spec binds into a directory of the image (its /etc/resolv.conf,
        /etc/hosts), made in the writable layer beforehand, the container's: the image's
        directories are the host's root's, which the container's root is not, so the
        runtime could not make them there itself."""
        for m in spec.mounts:
            if m.type != "bind" or not Path(m.source).is_file():
                continue
            target = upper / m.destination.lstrip("/")
            for d in reversed(target.parents):
                if d == upper or upper not in d.parents:
                    continue
                if not d.exists():
                    d.mkdir(mode=0o755)
                    os.chown(d, ids, ids)
            target.touch(mode=0o644, exist_ok=True)
            os.chown(target, ids, ids)

    # -- removal ----------------------------------------------------------------------------
    def remove(self, machine_id: str) -> None:
        """Everything of the machine's container, removed (blocking); ContainerError names
        what is left."""
        box = self.box(machine_id)
        record = _record(box)
        path = record.cgroups_path if record is not None else self.cgroups_path(machine_id)
        cgroups = [str(d) for d in self.cgroups(path).values()]
        left = teardown.remove_container(
            self.runtime.path,
            str(self.state),
            box.dir.name,
            str(box.dir),
            cgroups,
            bundle=str(box.bundle),
        )
        if left:
            raise ContainerError(f"container {box.dir.name} left {', '.join(left)}")

    def _remove_quietly(self, machine_id: str) -> None:
        try:
            self.remove(machine_id)
        except ContainerError as exc:
            self.log.error("container_teardown_failed", machine_id=machine_id, error=str(exc))

    def sweep(self, keep: Collection[str] = ()) -> list[str]:
        """Remove every container of this owner and all it held but those of the machines
        in ``keep`` (what a supplier's dead shims left; the ones live shims hold stay);
        then the owner's empty cgroup parents. Never another owner's. Blocking; returns the
        machine ids swept (ContainerError names what could not be removed)."""
        gone: list[str] = []
        errors: list[str] = []
        kept = {runtime_id(m) for m in keep}
        boxes = sorted(self.machines.iterdir()) if self.machines.is_dir() else []
        orphans = sorted(self.state.iterdir()) if self.state.is_dir() else []
        orphans += sorted(self.bundles.iterdir()) if self.bundles.is_dir() else []
        names = {b.name for b in boxes}
        for d in [*boxes, *{o.name: o for o in orphans if o.name not in names}.values()]:
            if d.name in kept:
                continue
            with contextlib.suppress(BourseError):
                mid = machine_id_of(d.name)
                try:
                    self.remove(mid)
                except ContainerError as exc:
                    errors.append(str(exc))
                gone.append(mid)
        self.remove_empty_parents()
        if gone:
            self.log.warning("containers_swept", machines=gone)
        if errors:
            raise ContainerError("; ".join(errors))
        return gone

    def remove_empty_parents(self) -> None:
        """The owner's bundles' directory, its cgroup directories and the supplier's above
        them, where empty. Bourse's own directory, above every supplier's, stays: another
        supplier may be making its directories below it."""
        with contextlib.suppress(OSError):
            self.bundles.rmdir()
        owner_dirs = set(self.cgroups(self._below(f"{self.subtree}/{self.owner}")).values())
        levels = len(self.subtree.split("/")) - 1  # bourse/<owner>: the supplier's only
        parents = {p.parents[i] for p in owner_dirs for i in range(levels)}
        for d in sorted({*owner_dirs, *parents}, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: another owner's subtree stays


def _record(box: Box) -> Record | None:
    try:
        return msgspec.json.decode(box.record.read_bytes(), type=Record)
    except (OSError, msgspec.DecodeError):
        return None
