"""What a process machine of a content image runs, and the files it sees, without a root of
its own (docs/protocol.md §6.8c).

The ``process`` driver runs a machine on the host's filesystem; its image is an unpacked,
shared root in the worker's content cache. The machine sees it this way:

- **working directory**: ``<work_dir>/<machine_id>/``, its own (destroy removes it; a stop
  keeps it), holding a symbolic link to each top-level entry of the image's working
  directory (its config's ``WorkingDir`` inside the root, default ``/``): the image's files
  are read from the shared root, new files are written in the machine's own directory. A
  name the machine wrote itself is never replaced by a link.
- **argv**: the image's ``Entrypoint`` followed by its ``Cmd`` (Docker's rules:
  supplier/drivers/bundle.py ``argv``). An absolute ``argv[0]`` names the file at that path
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bourse.images.oci import RunConfig
from bourse.wire.messages import Machine
from supplier.drivers import NO_ENV
from supplier.drivers.bundle import DEFAULT_PATH, argv, check_env, image_env

# The host's part of a machine's PATH, after the image's directories.
HOST_PATH = ("/usr/local/bin", "/usr/bin", "/bin")
# Symbolic links followed while resolving one path inside a root (Linux's own limit).
MAX_LINK_HOPS = 40


@dataclass(frozen=True, slots=True)
class Launch:
    """What a machine's process is: its arguments, environment and working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path | None  # None: the supplier's


def launch(
    m: Machine, root: Path, config: RunConfig, cwd: Path, env: Mapping[str, str] = NO_ENV
) -> Launch:
    """The process a machine of the image at ``root`` runs, in ``cwd`` (see the module doc),
    with the image's env, then the run's ``env``, then Bourse's own variables. ``BundleError``
    names what the image lacks (no command) or carries badly (its env, or the run's)."""
    args = argv(config)
    check_env(env, "the order's")
    own = {**image_env(config.env or ()), **env}
    path = search_path(root, own.pop("PATH", DEFAULT_PATH))
    environment = {
        "HOME": str(cwd),
        "PATH": path,
        **own,
        "BOURSE_MACHINE_ID": m.machine_id,
        "BOURSE_ORDER_ID": m.order_id,
        "BOURSE_IMAGE_ROOT": str(root),
        "BOURSE_IMAGE_DIGEST": m.image_digest,
    }
    if args[0].startswith("/"):
        inside = resolve(root, args[0])
        if inside is not None:
            args[0] = str(inside)
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


def working_dir(root: Path, config: RunConfig, cwd: Path) -> None:
    """Make the machine's working directory ``cwd`` (if missing) and link each top-level
    entry of the image's working directory there, but for names it holds already."""
    cwd.mkdir(parents=True, exist_ok=True)
    source = resolve(root, config.working_dir or "/")
    if source is None or not source.is_dir():
        return  # an image without its working directory: the machine starts in an empty one
    for entry in os.scandir(source):
        link = cwd / entry.name
        if not os.path.lexists(link):
            # absolute: a link is read from where it is, not from a data dir named relative
            link.symlink_to(os.path.abspath(entry.path))
