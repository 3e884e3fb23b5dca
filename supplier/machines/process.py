"""What a process machine runs, and the files it sees, without a root of its own
(docs/protocol.md §6.8c): its image's files, or its catalog image's command.

The ``process`` driver runs a machine on the host's filesystem; its image is an unpacked,
shared root in the worker's content cache. The machine sees it this way:

- **working directory**: ``<work_dir>/<machine_id>/``, its own (destroy removes it; a stop
  keeps it), holding a symbolic link to each top-level entry of the image's working
  directory (its config's ``WorkingDir`` inside the root, default ``/``): the image's files
  are read from the shared root, new files are written in the machine's own directory. A
  name the machine wrote itself is never replaced by a link.
- **argv**: the image's ``Entrypoint`` followed by its ``Cmd`` (Docker's rules:
  supplier/machines/oci/bundle.py ``argv``). An absolute ``argv[0]`` names the file at that path
  inside the root when there is one (symbolic links followed inside the root, as a
  container would), else the host's; a bare name is searched on ``PATH``; a relative path
  is the working directory's (so the image's). Other arguments go as they are.
- **PATH**: each directory of the image's ``PATH`` (its ``Env``, else Docker's default)
  inside the root, then the host's ``/usr/local/bin:/usr/bin:/bin``.
- **environment**: ``HOME`` (the working directory) and ``PATH`` as above, then the
  image's ``Env``, then the run's (the order's env, its ports: above the image's; a
  ``PATH`` of either is the one above), then Bourse's own:
  ``BOURSE_MACHINE_ID``, ``BOURSE_ORDER_ID``, ``BOURSE_IMAGE_ROOT`` (the root),
  ``BOURSE_IMAGE_DIGEST``. Nothing of the supplier's own environment.
- **user**: the supplier's; the image's ``User`` is not applied (no container).

The root is read-only by convention only: a machine that writes through a link changes
what other machines of the image see (the ``oci`` driver gives each a writable layer).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated

import anyio
import msgspec

from bourse.images.oci import RunConfig
from bourse.runtime.supervise import unwrap
from bourse.wire.messages import Machine
from bourse.wire.metadata import RestartPolicy
from supplier.machines.api import NO_ENV, DriverError, ImageRun
from supplier.machines.host.confine import Confiner
from supplier.machines.host.isolation import RUN_DIR, Entered, Isolation
from supplier.machines.host.network import NETNS_DIR
from supplier.machines.oci.bundle import DEFAULT_PATH, BundleError, argv, check_env, image_env
from supplier.machines.runner import confine, python_runtime
from supplier.machines.shim import teardown
from supplier.machines.shim.contract import ProcessRun, Run

# The host's part of a machine's PATH, after the image's directories.
HOST_PATH = ("/usr/local/bin", "/usr/bin", "/bin")
# Symbolic links followed while resolving one path inside a root (Linux's own limit).
MAX_LINK_HOPS = 40
# Where a machine of its own user sees its image (read-only) and its working directory:
# bound there in its own mount namespace, so that it needs no way into the supplier's data
# dir (which only root may enter) and sees no other machine's files.
SEEN_IMAGE = RUN_DIR / "mnt" / "image"
SEEN_WORK = RUN_DIR / "mnt" / "work"


@dataclass(frozen=True, slots=True)
class Launch:
    """What a machine's process is: its arguments, environment and working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path | None  # None: the supplier's


def launch(
    m: Machine,
    root: Path,
    config: RunConfig,
    cwd: Path,
    env: Mapping[str, str] = NO_ENV,
    seen: Path | None = None,
) -> Launch:
    """The process a machine of the image at ``root`` runs, in ``cwd`` (see the module doc),
    with the image's env, then the run's ``env``, then Bourse's own variables. ``seen``:
    where the machine sees the root (a machine of its own user sees its image and its
    working directory bound at fixed paths: :data:`SEEN_IMAGE`, ``cwd`` being then
    :data:`SEEN_WORK`); files are looked for at ``root`` all the same. ``BundleError``
    names what the image lacks (no command) or carries badly (its env, or the run's)."""
    args = argv(config)
    check_env(env, "the order's")
    own = {**image_env(config.env or ()), **env}
    shown = seen or root
    path = search_path(shown, own.pop("PATH", DEFAULT_PATH))
    environment = {
        "HOME": str(cwd),
        "PATH": path,
        **own,
        "BOURSE_MACHINE_ID": m.machine_id,
        "BOURSE_ORDER_ID": m.order_id,
        "BOURSE_IMAGE_ROOT": str(shown),
        "BOURSE_IMAGE_DIGEST": m.image_digest,
    }
    if args[0].startswith("/"):
        inside = resolve(root, args[0])
        if inside is not None:
            args[0] = str(shown / inside.relative_to(root))
    return Launch(args, environment, cwd)


def search_path(root: Path, image_path: str) -> str:
    """``PATH``: the image's directories inside ``root``, then the host's."""
    inside = [f"{root}{d}" for d in image_path.split(":") if d.startswith("/")]
    return ":".join([*inside, *HOST_PATH])


def resolve(root: Path, path: str) -> Path | None:
    """The file ``path`` names in the image at ``root`` as a container sees it: absolute
    symbolic links start at the root, ``..`` stops there. None when there is no such file
    (or a loop of links)."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    at: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if at:
                at.pop()
            continue
        here = root.joinpath(*at, part)
        try:
            mode = here.lstat().st_mode
        except OSError:
            return None
        if stat.S_ISLNK(mode):
            hops += 1
            if hops > MAX_LINK_HOPS:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                at = []
            pending[:0] = [p for p in target.split("/") if p not in ("", ".")]
            continue
        at.append(part)
    return root.joinpath(*at)


def working_dir(
    root: Path, config: RunConfig, cwd: Path, seen: Path | None = None, owner: int = -1
) -> None:
    """Make the machine's working directory ``cwd`` (if missing; owned by ``owner`` when
    >= 0) and link each top-level entry of the image's working directory there, but for
    names it holds already; a link names the entry where the machine sees the root
    (``seen``, default ``root``)."""
    cwd.mkdir(parents=True, exist_ok=True)
    if owner >= 0:
        os.chown(cwd, owner, owner)
        cwd.chmod(0o700)
    source = resolve(root, config.working_dir or "/")
    if source is None or not source.is_dir():
        return  # an image without its working directory: the machine starts in an empty one
    shown = seen or root.absolute()
    for entry in os.scandir(source):
        link = cwd / entry.name
        if not os.path.lexists(link):
            # absolute: a link is read from where it is, not from a data dir named relative
            target = shown / Path(os.path.abspath(entry.path)).relative_to(root.absolute())
            link.symlink_to(target)


# -- a catalog image --------------------------------------------------------------------------
# A command word "{python}" is replaced by the supplier's own interpreter (portable specs).
PYTHON = "{python}"
# A content image's machine: how long a stop waits after SIGTERM (as a catalog spec's default).
IMAGE_STOP_GRACE_S = 10.0


class ImageSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a catalog image means on this worker (its config's ``catalog``): ``command`` is
    what a process worker runs, ``restart`` its default restart policy, ``stop_grace_s`` how
    long a stop waits after SIGTERM; ``size_mb`` is what the image costs in the cache (and,
    for sim, its pull time)."""

    command: list[str] = []
    env: dict[str, str] = {}
    size_mb: Annotated[int, msgspec.Meta(ge=0)] = 200
    restart: RestartPolicy = "no"
    stop_grace_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 10.0


def catalog_launch(
    m: Machine, spec: ImageSpec, env: Mapping[str, str] = NO_ENV, own_user: bool = False
) -> Launch:
    """A catalog image's process: its spec's command (``{python}`` the supplier's own
    interpreter, or for a machine of its own user one it can run: :func:`machine_python`)
    with a default ``PATH``, the spec's env, the run's and Bourse's ids (never the
    supplier's environment), in the supplier's working directory."""
    python = machine_python() if own_user else sys.executable
    env = {
        "PATH": DEFAULT_PATH,
        **spec.env,
        **env,
        "BOURSE_MACHINE_ID": m.machine_id,
        "BOURSE_ORDER_ID": m.order_id,
    }
    command = [python if word == PYTHON else word for word in spec.command]
    return Launch(command, env, None)


def reachable(path: Path) -> bool:
    """Whether any user may reach ``path`` (each directory on its way searchable by
    others, the file itself readable or searchable), links followed."""
    try:
        real = path.resolve(strict=True)
    except OSError:
        return False
    for d in real.parents:
        if not d.stat().st_mode & stat.S_IXOTH:
            return False
    return bool(real.stat().st_mode & (stat.S_IXOTH | stat.S_IROTH))


@cache
def machine_python() -> str:
    """``{python}`` for a machine of its own user: the supplier's interpreter when any user
    may run it (a Python installed below a home only its owner enters may not be), else the
    host's ``python3``."""
    if reachable(Path(sys.executable)):
        return sys.executable
    for d in HOST_PATH:
        candidate = Path(d) / "python3"
        if reachable(candidate):
            return str(candidate)
    return sys.executable


# -- the kind --------------------------------------------------------------------------------
class ProcessKind:
    """Process machines (supplier/machines/runner.py's kind): the image's files or the
    catalog's command, confined by the worker's confiner, each with a working directory of
    its own below ``work_dir``. With ``ids`` (a root supplier's: supplier/machines/host/
    ids.py) each machine runs as its own user in a mount namespace of its own: a /tmp of its
    own (and /var/tmp, /dev/shm, /run/lock: nothing it writes is the host's), its image
    read-only at :data:`SEEN_IMAGE` and its working directory at :data:`SEEN_WORK`, nothing
    of the supplier's data dir reachable."""

    name = "process"

    def __init__(
        self,
        confiner: Confiner,
        catalog: Mapping[str, ImageSpec],
        work_dir: Path,
        isolation: Isolation | None = None,
    ) -> None:
        self.confiner = confiner
        self.catalog = catalog
        self.work_dir = work_dir
        self.isolation = isolation or Isolation()
        if self.isolation.ids is not None:
            for seen in (SEEN_IMAGE, SEEN_WORK):
                seen.mkdir(parents=True, exist_ok=True)  # mount points, empty on the host

    @property
    def runtime_version(self) -> str:
        return python_runtime()

    def can_run(self, image: str) -> bool:
        spec = self.catalog.get(image)
        return spec is not None and bool(spec.command)

    async def plan(
        self, m: Machine, image: ImageRun | None, env: Mapping[str, str]
    ) -> tuple[ProcessRun, float]:
        mid = m.machine_id
        confined: list[tuple[list[str], list[str]]] = []

        async def make_cgroups() -> None:
            confined.append(await confine(self.confiner, mid, m.resources))

        try:
            try:  # its cgroups made while it enters its network: both on its start's path
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(make_cgroups)
                    own = await self.isolation.enter(m)
            except BaseExceptionGroup as group:
                raise start_error(group) from None
            return await self._plan(m, image, env, own, confined[0])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.isolation.leave(mid)
            raise

    async def _plan(
        self,
        m: Machine,
        image: ImageRun | None,
        env: Mapping[str, str],
        own: Entered,
        confined: tuple[list[str], list[str]],
    ) -> tuple[ProcessRun, float]:
        mid = m.machine_id
        user = own.ids
        work = self.work_dir / mid
        binds: list[list[str]] = []
        if image is not None:
            run, grace = await self._image_launch(m, image, env, user), IMAGE_STOP_GRACE_S
            if user >= 0:
                binds.append([str(image.root.absolute()), str(SEEN_IMAGE), "ro"])
        else:
            spec = self.catalog.get(m.image)
            if spec is None or not spec.command:
                raise DriverError(f"image {m.image!r} is not in this worker's catalog")
            run, grace = catalog_launch(m, spec, env, own_user=user >= 0), spec.stop_grace_s
            if user >= 0:
                await self._work_dir(mid, user)
        if user >= 0:
            binds.append([str(work.absolute()), str(SEEN_WORK), "rw"])
        if own.resolv:
            binds.append([own.resolv, "/etc/resolv.conf", "ro"])
        private = {"BOURSE_PRIVATE_ADDRESS": own.address} if own.address else {}
        cgroups, limits = confined
        return (
            ProcessRun(
                argv=run.argv,
                env=run.env | ({"HOME": str(SEEN_WORK)} if user >= 0 else {}) | private,
                cwd=str(SEEN_WORK if user >= 0 else run.cwd or Path.cwd()),
                cgroups=cgroups,
                rlimits=limits,
                cgroup_dirs=self.confiner.cgroup_dirs(mid),
                oom_files=self.confiner.oom_files(mid),
                uid=user,
                gid=user,
                tmp_mb=max(16, min(m.resources.memory_mb, 1024)) if user >= 0 else 0,
                binds=binds,
                netns=own.netns,
                hide=self._hidden() if user >= 0 else [],
            ),
            grace,
        )

    async def _work_dir(self, machine_id: str, user: int) -> None:
        """A catalog machine's working directory, its user's."""
        work = self.work_dir / machine_id

        def make() -> None:
            work.mkdir(parents=True, exist_ok=True)
            os.chown(work, user, user)
            work.chmod(0o700)

        try:
            await anyio.to_thread.run_sync(make)
        except OSError as exc:
            raise DriverError(f"cannot make {machine_id}'s working directory: {exc}") from None

    async def _image_launch(
        self, m: Machine, image: ImageRun, env: Mapping[str, str], user: int
    ) -> Launch:
        """A content image's process, its working directory made (linked to the image)."""
        cwd = self.work_dir / m.machine_id
        seen = SEEN_IMAGE if user >= 0 else None
        try:
            run = launch(m, image.root, image.config, SEEN_WORK if seen else cwd, env, seen)
            await anyio.to_thread.run_sync(working_dir, image.root, image.config, cwd, seen, user)
        except BundleError as exc:
            raise DriverError(f"image {m.image!r}: {exc}") from None
        except OSError as exc:
            raise DriverError(f"cannot make {m.machine_id}'s working directory: {exc}") from None
        return run

    def _hidden(self) -> list[str]:
        """What a machine of its own users sees empty: every container's root and layer and
        every machine's network namespace (the host's mounts there, detached from its copy:
        it holds none of them alive), and its supplier's data dir (its shims, logs, other
        machines' files and image roots: its own image and working directory are bound
        where it sees them)."""
        data_dir = self.work_dir.parents[1]  # <data dir>/work/<worker id>
        return [str(RUN_DIR), str(NETNS_DIR), str(data_dir)]

    async def undo(self, machine_id: str) -> None:
        await anyio.to_thread.run_sync(self.confiner.remove, machine_id)
        await self.isolation.leave(machine_id)

    async def forget(self, machine_id: str) -> None:
        await self.undo(machine_id)
        await anyio.to_thread.run_sync(teardown.remove_tree, str(self.work_dir / machine_id))
        await self.isolation.forget(machine_id)  # nothing of its user left: its ids go back

    async def sweep(self, keep: Mapping[str, Run]) -> list[str]:
        nets = {mid: run.netns for mid, run in keep.items() if isinstance(run, ProcessRun)}
        await self.isolation.keep(nets)
        return await anyio.to_thread.run_sync(lambda: self.confiner.sweep(keep=keep))

    async def end(self) -> None:
        await anyio.to_thread.run_sync(lambda: self.confiner.sweep(remove_base=True))

    async def background(self) -> None:
        await self.isolation.background()


def start_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """What a start's steps run at once raised: the first DriverError (the reason a start
    gives), else the one error inside."""
    found = [e for e in group.exceptions if isinstance(unwrap(e), DriverError)]
    return unwrap(found[0]) if found else unwrap(group)
