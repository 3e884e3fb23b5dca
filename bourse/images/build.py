"""A directory as a one-layer OCI image, byte for byte the same every time (pure but for the
files it reads and the layer it writes).

The layer is a tar of the directory's contents, depth first with each directory's entries
sorted by name, numeric owners kept (no user or group names), modification times 0 (or the
files' own, whole seconds, with ``keep_mtime``), hard links kept as links to the first path
in that order; then gzip with no name and time 0. The config carries the layer's
``rootfs.diff_ids`` and what to run; the manifest names both. Same tree, same options:
same digest.

Each entry is checked as it is written, as a push checks an imported layer
(bourse/images/unpack.py ``check_entry``: a symlink that climbs out of the root is refused
here, not first on a worker), and the tar's bytes are counted: the layer's uncompressed
size, recorded with it in the store, and the writing stops once it passes ``max_bytes``.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import platform
import re
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

from bourse.images.bounds import Cap, ImageTooBig
from bourse.images.errors import BadImage
from bourse.images.oci import (
    OCI_LAYER_GZIP,
    Descriptor,
    ImageConfig,
    RootFS,
    RunConfig,
    encode,
    image_manifest,
)
from bourse.images.unpack import check_entry

# zlib's default trade of time for size; 9 costs about twice the time for a few percent.
DEFAULT_COMPRESSLEVEL = 6
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}


def host_architecture() -> str:
    """This machine's architecture in OCI's words (``amd64``, ``arm64``, …)."""
    machine = platform.machine().lower()
    return _ARCH.get(machine, machine)


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What an image runs: its command, entrypoint, environment (``KEY=VALUE``), working
    directory and user, as the OCI config's ``Cmd``, ``Entrypoint``, ``Env``,
    ``WorkingDir`` and ``User``."""

    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    architecture: str = field(default_factory=host_architecture)
    os: str = "linux"

    def __post_init__(self) -> None:
        for entry in self.env:
            key, eq, _ = entry.partition("=")
            if not eq or not _ENV_KEY.fullmatch(key):
                raise BadImage(f"env {entry!r} is not KEY=VALUE (KEY of [A-Za-z0-9_])")
        if self.workdir and not self.workdir.startswith("/"):
            raise BadImage(f"workdir {self.workdir!r} is not an absolute path")

    def run_config(self) -> RunConfig:
        return RunConfig(
            user=self.user,
            env=list(self.env) or None,
            entrypoint=list(self.entrypoint) or None,
            cmd=list(self.cmd) or None,
            working_dir=self.workdir,
        )


@dataclass(frozen=True, slots=True)
class Layer:
    """A layer written: its descriptor, the digest of its uncompressed tar and that tar's
    size (0: not counted, a layer made elsewhere)."""

    descriptor: Descriptor
    diff_id: str
    unpacked: int = 0


@dataclass(frozen=True, slots=True)
class Documents:
    """An image's config and manifest as stored bytes, with the manifest's descriptor."""

    config: bytes
    manifest: bytes
    descriptor: Descriptor


class _Hashing:
    """A write-only stream that hashes and counts what it passes on (past ``cap``,
    ``ImageTooBig`` naming ``what``)."""

    def __init__(
        self, out: BinaryIO | gzip.GzipFile, cap: Cap | None = None, what: str = ""
    ) -> None:
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0
        self.cap = cap
        self.what = what

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.cap is not None and self.size > self.cap.bytes:
            raise ImageTooBig(self.what, self.cap)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def write_layer(
    source: Path,
    out: BinaryIO,
    *,
    keep_mtime: bool = False,
    compresslevel: int = DEFAULT_COMPRESSLEVEL,
    max_bytes: Cap | None = None,
) -> Layer:
    """Write ``source``'s contents to ``out`` as a gzip-compressed tar layer (its tar at
    most ``max_bytes``: ``ImageTooBig`` past it)."""
    if not source.is_dir():
        raise BadImage(f"{source} is not a directory")
    compressed = _Hashing(out)
    with gzip.GzipFile(
        filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=compresslevel
    ) as gz:
        plain = _Hashing(gz, max_bytes, f"of directory {source}")
        # a stream ("w|") only writes: the file protocol tarfile declares is more than it uses
        stream = cast(BinaryIO, plain)
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            links: dict[tuple[int, int], str] = {}
            for path, name in _walk(source):
                _add(tar, path, name, links, keep_mtime)
    layer = Descriptor(media_type=OCI_LAYER_GZIP, digest=compressed.digest, size=compressed.size)
    return Layer(layer, plain.digest, plain.size)


def _walk(top: Path, prefix: str = "") -> Iterator[tuple[Path, str]]:
    """Every path under ``top`` with its name in the layer, depth first, sorted by name."""
    for entry in sorted(os.scandir(top), key=lambda e: e.name):
        path = Path(entry.path)
        name = f"{prefix}{entry.name}"
        yield path, name
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(path, f"{name}/")


def _add(
    tar: tarfile.TarFile, path: Path, name: str, links: dict[tuple[int, int], str], keep: bool
) -> None:
    st = path.lstat()
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.uname = info.gname = ""
    info.mtime = int(st.st_mtime) if keep else 0
    regular = stat.S_ISREG(st.st_mode)
    if regular and st.st_nlink > 1 and (st.st_dev, st.st_ino) in links:
        info.type, info.linkname = tarfile.LNKTYPE, links[(st.st_dev, st.st_ino)]
        regular = False
    elif regular:
        links.setdefault((st.st_dev, st.st_ino), name)
        info.size = st.st_size
    elif stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
    elif stat.S_ISFIFO(st.st_mode):
        info.type = tarfile.FIFOTYPE
    else:  # a device node or a socket: nothing an image may carry
        raise BadImage(f"{path}: a device or socket cannot go into an image layer")
    check_entry(info)  # as a worker would refuse it (a symlink climbing out of the root)
    if regular:
        with path.open("rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)


def documents(layers: list[Layer], run: RunSpec, created: str | None = None) -> Documents:
    """The config (``rootfs.diff_ids`` of ``layers``, ``run``'s command and platform) and the
    manifest naming it and the layers. ``created`` (RFC 3339) is left out unless given, so
    the same tree gives the same digest."""
    config = encode(
        ImageConfig(
            created=created,
            architecture=run.architecture,
            os=run.os,
            config=run.run_config(),
            rootfs=RootFS(diff_ids=[layer.diff_id for layer in layers]),
        )
    )
    manifest, descriptor = image_manifest(config, [layer.descriptor for layer in layers])
    return Documents(config, manifest, descriptor)
