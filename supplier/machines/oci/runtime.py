"""Containers through an OCI runtime: the shell around ``runc`` (the spec itself is
supplier/drivers/bundle.py, pure).

Use::

    runtime = detect()              # runc's path and version, or RuntimeUnavailable (one line
                                    # naming what to install)
    boxes = Containers(runtime, data_dir / "containers", owner=worker_id)
    await boxes.sweep()             # at start: what a supplier that died left of this owner
    passwd, group = image_files(image_root)
    spec = runtime_spec(image, limits, cgroups_path=boxes.cgroups_path(machine_id),
                        passwd=passwd, group=group, host=boxes.host(), ...)
    c = await boxes.start(machine_id, spec, image_root, disk_mb, output=fd)
    how = await c.wait()            # Exit(code, signal, oom), once it ended by itself
    how = await c.stop(grace_s)     # or: SIGTERM, then SIGKILL after the grace period
    await c.cleanup()               # nothing left: idempotent, also after a failed start

Everything of an owner (a worker) lives below ``<directory>/<owner>/``, so owners never
touch each other's containers:

- ``state/``: the runtime's state (``runc --root``);
- ``machines/<runtime id>/``: ``record.json`` (the machine and its cgroups path, for a
  sweep), ``disk.ext4`` (the writable layer: a sparse file of ``disk_mb``, ext4 without a
  journal nor reserved blocks, loop-mounted at ``layer/``, holding the overlay's ``upper/``
  and ``work/``) and ``bundle/`` (``config.json``; ``rootfs/``: the overlay of the image
  root, read-only below, and the layer). A machine that writes past its disk gets ENOSPC
  and nothing else on the worker notices. The layer lives as long as the container: a new
  start begins from the image again.

The runtime runs in the foreground (``runc run --keep``) as a child of the caller, so its
exit status is the container's (a signal N reads as 128 + N; a command the runtime cannot
start, one not in the image say, ends with status 1 and the runtime's message in the
output); ``--keep`` leaves the container's cgroups after it ended, so that its OOM kills
can be read before ``runc delete``. Its cgroups are ``bourse/<owner>/<machine id>`` below
the caller's own cgroup in every hierarchy (the tree the process driver uses), or below
``cgroup_parent``; a cleanup removes the machine's, a sweep also the owner's (empty)
``bourse/<owner>``. Inside, the container sees its image, its layer and the mounts of the
spec: not the caller's data dir nor its credentials. Runtime ids: see
:func:`supplier.drivers.bundle.runtime_id`.

Rootful only (runc as root: the loop device and the mounts need it too). On a hybrid
cgroup layout (v1 controllers beside a cgroup2 mount), runc only: crun does not support it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import msgspec
import structlog

from bourse.errors import BourseError
from bourse.wire.limits import ID_PATTERN
from supplier.drivers.bundle import (
    DEFAULT_PATH,
    HOST_FILES,
    NOFILE,
    Host,
    Spec,
    cgroup_dirs,
    encode,
    exit_of_status,
    machine_id_of,
    runtime_id,
)
from supplier.drivers.confine import SUBTREE, Exit, Mounts, oom_kill_count, parse_mountinfo

log = structlog.get_logger("bourse.driver.oci")

RUNTIMES = ("runc", "crun")
INSTALL = "apt-get install runc"
# Where the tools live on Debian: /usr/sbin is not on every user's PATH.
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/local/sbin:/usr/sbin:/sbin"
TOOLS = {"mkfs.ext4": "e2fsprogs", "mount": "mount", "umount": "mount", "losetup": "mount"}
# The runtime's own environment (it passes none of it to the container: the spec's env is
# the container's).
RUNTIME_ENV = {"PATH": DEFAULT_PATH}
# How long a container may take to die of SIGKILL before the runtime itself is killed.
KILL_WAIT_S = 5.0
COMMAND_TIMEOUT_S = 60.0
# The image's /etc/passwd and /etc/group are read whole: more is no account file.
MAX_ETC_BYTES = 1 << 20
# Characters that overlayfs's option string cannot carry in a path.
OVERLAY_UNSAFE = ",:\\\n"
_ID = re.compile(ID_PATTERN)
_OCTAL = re.compile(r"\\([0-7]{3})")


class RuntimeUnavailable(BourseError, RuntimeError):
    """No OCI runtime that can work here."""


class ContainerError(BourseError, RuntimeError):
    """A container could not be prepared, run or removed."""


# -- the runtime ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Runtime:
    """An OCI runtime found on this host."""

    name: str
    path: str
    version: str

    def describe(self) -> str:
        return f"{self.name} {self.version}"


def hybrid(mounts: Mounts) -> bool:
    """cgroup v1 controllers beside a cgroup2 mount."""
    return mounts.v2 is not None and bool(mounts.v1)


def verdict(name: str, euid: int, mounts: Mounts, missing: dict[str, str]) -> str:
    """Why runtime ``name`` cannot run this driver's containers here, or "" (pure).
    ``missing``: the tools not found, each with the package that has it."""
    if euid != 0:
        return f"{name} needs root here: this driver runs rootful containers (mounts, loop devices)"
    if name == "crun" and hybrid(mounts):
        return (
            "crun does not support this host's hybrid cgroup layout (v1 controllers beside a "
            f"cgroup2 mount): install runc ({INSTALL})"
        )
    if missing:
        tools = ", ".join(sorted(missing))
        packages = " ".join(sorted(set(missing.values())))
        return f"{tools} not found: install them (apt-get install {packages})"
    return ""


def _version(path: str) -> str:
    """``runc version 1.1.5`` -> ``1.1.5``."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeUnavailable(f"{path} --version failed: {exc}") from None
    words = (out.splitlines() or [""])[0].split()
    return words[words.index("version") + 1] if "version" in words[:-1] else (out.strip() or "?")


def detect(names: tuple[str, ...] = RUNTIMES) -> Runtime:
    """The first runtime of ``names`` that is installed and can work here, with its
    version; RuntimeUnavailable says why none can, and what to install."""
    try:
        mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    except OSError:
        mounts = Mounts()
    missing = {t: p for t, p in TOOLS.items() if shutil.which(t, path=SEARCH_PATH) is None}
    refused = []
    for name in names:
        path = shutil.which(name, path=SEARCH_PATH)
        if path is None:
            continue
        why = verdict(name, os.geteuid(), mounts, missing)
        if not why:
            return Runtime(name, path, _version(path))
        refused.append(why)
    if refused:
        raise RuntimeUnavailable("; ".join(refused))
    raise RuntimeUnavailable(
        f"no OCI runtime found ({' or '.join(names)}): install runc ({INSTALL})"
    )


# -- files of an image root -----------------------------------------------------------------
def read_image_file(root: Path, relative: str) -> str:
    """A small text file of an image root, "" where it has none. No symbolic link is
    followed on the way (read from the host, one could lead out of the root): an image whose
    file is reached through one is an error naming it."""
    parts = [p for p in relative.split("/") if p]
    if not parts:
        raise ContainerError(f"{relative!r} names no file of the image")
    where = "/" + "/".join(parts)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            step = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = step
        leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)  # a FIFO must not block
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ContainerError(
                f"the image's {where} is reached through a symbolic link or a non-directory"
            ) from None
        raise ContainerError(f"cannot read the image's {where}: {exc.strerror}") from None
    finally:
        os.close(fd)
    with os.fdopen(leaf, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ContainerError(f"the image's {where} is not a regular file")
        data = f.read(MAX_ETC_BYTES + 1)
    if len(data) > MAX_ETC_BYTES:
        raise ContainerError(f"the image's {where} is larger than {MAX_ETC_BYTES} bytes")
    return data.decode(errors="replace")


def image_files(root: Path) -> tuple[str, str]:
    """The image's ``/etc/passwd`` and ``/etc/group`` (to resolve its user by name)."""
    return read_image_file(root, "etc/passwd"), read_image_file(root, "etc/group")


# -- a machine's place on disk --------------------------------------------------------------
class Record(msgspec.Struct, frozen=True, kw_only=True):
    """``record.json``: what a sweep needs to find of a machine, and which start made it
    (``run``: a later start of the same machine makes its own)."""

    machine_id: str
    cgroups_path: str
    run: str


@dataclass(frozen=True, slots=True)
class Box:
    """One machine's directory and the paths in it."""

    dir: Path

    @property
    def record(self) -> Path:
        return self.dir / "record.json"

    @property
    def disk(self) -> Path:
        return self.dir / "disk.ext4"

    @property
    def layer(self) -> Path:
        return self.dir / "layer"

    @property
    def bundle(self) -> Path:
        return self.dir / "bundle"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=RUNTIME_ENV
    )


def _must(what: str, *args: str) -> None:
    done = _run(*args)
    if done.returncode != 0:
        raise ContainerError(f"cannot {what}: {done.stderr.strip() or done.returncode}")


def _unescape(field: str) -> str:
    """A mountinfo path (spaces and the like as octal escapes)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def _mounts_below(top: Path) -> list[Path]:
    """The mount points below ``top``, the deepest first (the root before its layer)."""
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = Path(_unescape(fields[4]))
            if point.is_relative_to(top) and point != top:
                points.add(point)
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# -- the containers of one owner ------------------------------------------------------------
class Containers:
    """The containers of one owner (a worker) through ``runtime``, below
    ``directory/<owner>``; their cgroups are ``<subtree>/<owner>/<machine id>`` (the
    process driver's tree passes ``bourse/<its supplier's owner>``), below
    ``cgroup_parent`` when given, else below the caller's own cgroup."""

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

    def host(self) -> Host:
        """What this host gives a container (for :func:`runtime_spec`)."""
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return Host(
            swap_accounted=self._swap_accounted(),
            nofile_max=NOFILE if hard == resource.RLIM_INFINITY else hard,
            files=tuple(f for f in HOST_FILES if Path(f).is_file()),
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

    def _runtime(self, *args: str) -> tuple[str, ...]:
        return (self.runtime.path, "--root", str(self.state), *args)

    # -- start ------------------------------------------------------------------------------
    async def start(
        self, machine_id: str, spec: Spec, image_root: Path, disk_mb: int, output: int
    ) -> RunningContainer:
        """Prepare the machine's layer and bundle and run ``spec`` in the foreground, its
        output to the file descriptor ``output``. ``image_root`` must stay while it runs
        (the caller pins it in its image cache). Leftovers of an earlier run of the machine
        are removed first. A failure leaves nothing behind and raises ContainerError."""
        rid = runtime_id(machine_id)
        box = Box(self.machines / rid)
        run = uuid.uuid4().hex
        try:
            await anyio.to_thread.run_sync(
                self._prepare,
                box,
                Record(machine_id=machine_id, cgroups_path=spec.linux.cgroups_path, run=run),
                spec,
                image_root,
                disk_mb,
            )
            proc = await anyio.open_process(
                self._runtime("run", "--keep", "--bundle", str(box.bundle), rid),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                start_new_session=True,  # the caller's terminal signals are not the machine's
                env=RUNTIME_ENV,
            )
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._teardown_quietly, box)
            if isinstance(exc, OSError):
                raise ContainerError(f"cannot run {self.runtime.path}: {exc}") from None
            raise
        self.log.info("container_started", machine_id=machine_id, runtime_id=rid, pid=proc.pid)
        cgroups = self.cgroups(spec.linux.cgroups_path)
        return RunningContainer(self, machine_id, box, run, proc, cgroups)

    def _prepare(
        self, box: Box, record: Record, spec: Spec, image_root: Path, disk_mb: int
    ) -> None:
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
        if box.dir.exists():
            self._teardown(box)  # an earlier run's leftovers
        try:
            self._make(box, record, spec, image_root, rootfs, disk_mb)
        except BaseException as exc:
            self._teardown_quietly(box)
            if isinstance(exc, OSError):
                raise ContainerError(f"cannot prepare {record.machine_id}: {exc}") from None
            raise

    @staticmethod
    def _make(
        box: Box, record: Record, spec: Spec, image_root: Path, rootfs: Path, disk_mb: int
    ) -> None:
        box.dir.mkdir(parents=True, mode=0o700)
        box.record.write_bytes(msgspec.json.encode(record))
        with box.disk.open("wb") as f:
            f.truncate(disk_mb << 20)  # sparse: blocks are used as the machine writes
        # No journal (the layer never outlives a crash: a sweep removes it), no blocks
        # reserved for root (the machine's root may use all it bought).
        mkfs = ("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", str(box.disk))
        _must("make the writable layer", *mkfs)
        box.layer.mkdir()
        loop = ("mount", "-o", "loop,nodev,nosuid", str(box.disk), str(box.layer))
        _must("mount the writable layer", *loop)
        upper, work = box.layer / "upper", box.layer / "work"
        upper.mkdir()
        work.mkdir()
        rootfs.mkdir(parents=True)
        options = f"lowerdir={image_root},upperdir={upper},workdir={work}"
        _must("mount the root", "mount", "-t", "overlay", "overlay", "-o", options, str(rootfs))
        (box.bundle / "config.json").write_bytes(encode(spec))

    # -- teardown ---------------------------------------------------------------------------
    def _teardown_quietly(self, box: Box) -> None:
        try:
            self._teardown(box)
        except ContainerError as exc:
            self.log.error("container_teardown_failed", box=str(box.dir), error=str(exc))

    def _teardown(self, box: Box, run: str = "") -> None:
        """Remove everything of one machine: its runtime state and cgroups, its mounts, its
        loop device, its directory; with ``run``, only if that start made them (a later
        start of the machine removed them, and what is there now is its own). Idempotent;
        raises ContainerError naming what is left."""
        rid = box.dir.name
        left: list[str] = []
        record = _record(box)
        if run and record is not None and record.run != run:
            return
        cgroups = self._state_cgroups(rid)
        if record is not None:
            cgroups |= set(self.cgroups(record.cgroups_path).values())
        if (self.state / rid).exists():
            done = _run(*self._runtime("delete", "--force", rid))
            if done.returncode != 0:
                left.append(f"runtime state ({done.stderr.strip()})")
        left += [f"cgroup {d}" for d in sorted(cgroups) if not _remove_cgroup(d)]
        for point in _mounts_below(box.dir):
            if _run("umount", str(point)).returncode != 0:
                self.log.warning("umount_lazy", path=str(point))
                _run("umount", "-l", str(point))
        left += [f"mount {p}" for p in _mounts_below(box.dir)]
        if box.disk.exists():
            left += [f"loop device {d}" for d in _detach_loops(box.disk)]
        if not left:
            shutil.rmtree(box.dir, ignore_errors=True)
            if box.dir.exists():
                left.append(f"directory {box.dir}")
        if left:
            raise ContainerError(f"container {rid} left {', '.join(left)}")

    def _state_cgroups(self, rid: str) -> set[Path]:
        """The cgroups the runtime's state says the container joined."""
        try:
            state = msgspec.json.decode((self.state / rid / "state.json").read_bytes())
            return {Path(p) for p in state.get("cgroup_paths", {}).values()}
        except (OSError, msgspec.DecodeError, AttributeError):
            return set()

    # -- sweep ------------------------------------------------------------------------------
    async def sweep(self, keep: Collection[str] = ()) -> list[str]:
        """Remove every container of this owner and all it held but those of the machines
        in ``keep`` (what a supplier that died left: running containers are killed; the
        ones their shims still hold stay); then the owner's empty cgroup parents. Never
        another owner's. Returns the machine ids swept."""
        return await anyio.to_thread.run_sync(self._sweep, keep)

    def _sweep(self, keep: Collection[str] = ()) -> list[str]:
        gone: list[str] = []
        errors: list[str] = []
        kept = {runtime_id(m) for m in keep}
        boxes = sorted(self.machines.iterdir()) if self.machines.is_dir() else []
        orphans = sorted(self.state.iterdir()) if self.state.is_dir() else []
        for d in [*boxes, *(o for o in orphans if not (self.machines / o.name).exists())]:
            if d.name in kept:
                continue
            try:
                self._teardown(Box(self.machines / d.name))
            except ContainerError as exc:
                errors.append(str(exc))
            with contextlib.suppress(BourseError):
                gone.append(machine_id_of(d.name))
        self._remove_empty_parents()
        if gone:
            self.log.warning("containers_swept", machines=gone)
        if errors:
            raise ContainerError("; ".join(errors))
        return gone

    def _remove_empty_parents(self) -> None:
        """The owner's cgroup directories and the subtree's above them, where empty."""
        owner_dirs = set(self.cgroups(self._below(f"{self.subtree}/{self.owner}")).values())
        levels = len(self.subtree.split("/"))  # bourse/<owner>: 2 above a machine's
        parents = {p.parents[i] for p in owner_dirs for i in range(levels)}
        for d in sorted({*owner_dirs, *parents}, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: another owner's subtree stays


def _record(box: Box) -> Record | None:
    try:
        return msgspec.json.decode(box.record.read_bytes(), type=Record)
    except (OSError, msgspec.DecodeError):
        return None


def _loops(disk: Path) -> list[str]:
    """The loop devices backed by ``disk``."""
    out = _run("losetup", "-j", str(disk)).stdout
    return [line.split(":", 1)[0] for line in out.splitlines() if ":" in line]


def _detach_loops(disk: Path) -> list[str]:
    """Detach the loop devices backed by ``disk``; those still attached after a while. An
    unmounted loop device clears itself in the kernel's own time (autoclear): it is waited
    for, so the disk is never removed under a device that still names it."""
    for _ in range(400):
        devices = _loops(disk)
        if not devices:
            return []
        for device in devices:
            _run("losetup", "-d", device)
        time.sleep(0.005)  # a pace: the kernel is releasing the devices
    return _loops(disk)


def _remove_cgroup(d: Path) -> bool:
    """Remove a cgroup directory (killing what is left in it); whether it is gone."""
    for _ in range(200):
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.warning("cgroup_not_removed", path=str(d), error=exc.strerror)
                return False
        for pid in _read(d / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.005)  # a pace: the killed processes are leaving
    return False


# -- one running container ------------------------------------------------------------------
class RunningContainer:
    """A container running in the foreground of its runtime process."""

    def __init__(
        self,
        owner: Containers,
        machine_id: str,
        box: Box,
        run: str,
        proc: anyio.abc.Process,
        cgroups: dict[str, Path],
    ) -> None:
        self.owner = owner
        self.machine_id = machine_id
        self.runtime_id = box.dir.name
        self.box = box
        self.run = run
        self.cgroups = cgroups  # where its limits are, by controller ("" for cgroup2)
        self._proc = proc
        self._exit: Exit | None = None
        self.log = owner.log.bind(machine_id=machine_id)

    @property
    def pid(self) -> int:
        """The runtime process's pid."""
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc.returncode is None

    async def wait(self) -> Exit:
        """Wait for the container to end; how it ended (its OOM kills read from its
        memory cgroup, which ``--keep`` leaves until cleanup)."""
        status = await self._proc.wait()
        if self._exit is None:
            self._exit = exit_of_status(status, self._oom_kills())
            self.log.info("container_exited", exit=self._exit.describe())
        return self._exit

    def _oom_kills(self) -> int:
        kills = 0
        for key, name in (("memory", "memory.oom_control"), ("", "memory.events")):
            d = self.cgroups.get(key)
            if d is not None:
                kills = max(kills, oom_kill_count(_read(d / name)))
        return kills

    async def kill(self, sig: Literal["TERM", "KILL"]) -> None:
        """Send ``sig`` to the container's first process (as PID 1 of its namespace, it
        gets SIGTERM only if it handles it; SIGKILL ends the whole namespace)."""
        if not self.running:
            return
        done = await anyio.run_process(
            self.owner._runtime("kill", self.runtime_id, sig), check=False, env=RUNTIME_ENV
        )
        if done.returncode != 0 and self.running:
            self.log.warning(
                "container_kill_failed", signal=sig, error=done.stderr.decode().strip()
            )

    async def stop(self, grace_s: float) -> Exit:
        """SIGTERM, then SIGKILL after ``grace_s``; how it ended."""
        if self.running:
            await self.kill("TERM")
            with anyio.move_on_after(grace_s):
                return await self.wait()
            self.log.warning("container_kill_after_grace", grace_s=grace_s)
        return await self._end()

    async def _end(self) -> Exit:
        """SIGKILL; if the container does not die in time, the runtime process itself is
        killed (cleanup's ``runc delete --force`` then ends the container)."""
        await self.kill("KILL")
        with anyio.move_on_after(KILL_WAIT_S):
            return await self.wait()
        self.log.error("container_not_dead", waited_s=KILL_WAIT_S)
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        return await self.wait()

    async def cleanup(self) -> None:
        """Kill it if it still runs, then remove everything it held: runtime state,
        cgroups (in every hierarchy), mounts, loop device, directory. Idempotent; runs to
        its end even when the caller is cancelled; ContainerError names what is left."""
        with anyio.CancelScope(shield=True):
            await self._end()
            await anyio.to_thread.run_sync(self.owner._teardown, self.box, self.run)
