"""Layers unpacked into a root that no entry can escape (the standard library only).

``tarfile``'s own filters do not fit a root filesystem (``tar_filter`` clears the sticky
bit of ``/tmp``, ``data_filter`` refuses absolute symlinks), so every entry is checked
here:

- a name that is absolute or has a ``..`` component is refused (a layer has no use for
  either);
- every parent directory is resolved inside the root the way a container sees it: a
  symlink on the way is followed with ``/`` meaning the root and ``..`` stopping at it, so
  no symlink of any layer leads a later entry out of the root;
- a symlink whose relative target climbs above the root is refused (an absolute target
  means the root's path, as in a container); a hard link must name an existing
  non-directory inside the root;
- character and block devices are refused; FIFOs are kept (they are harmless pipes);
- setuid and setgid bits are dropped (the sticky bit stays); owners are kept as numbers
  when running as root; extended attributes (file capabilities included) are not kept;
- whiteouts apply in layer order to what lower layers left: ``.wh.<name>`` removes
  ``<name>``, ``.wh..wh..opq`` empties its directory; what the same layer writes stays.

Each layer file's digest is checked before a byte of it is read into the root, and its
uncompressed tar's digest against the config's ``diff_id`` as it is read; a mismatch
raises ``DigestMismatch`` (I7). Each file's bytes are hashed as they are written (what
``unpack`` returns), so the root's inventory (bourse/images/inventory.py) holds what the
checked stream said. Its uncompressed bytes are counted as they are read, and the read
stops the moment they pass the layer's cap (bourse/images/bounds.py: the image's
``max_image_mb``, the layer's recorded size or ratio, a cache's budget left):
``ImageTooBig`` naming the layer; a sparse file entry (which unpacks to more than its tar
bytes) is refused. The caller unpacks into a fresh directory and renames it into place
only when every layer went in: a refused entry, a mismatch or a cap passed leaves nothing
behind but that directory, for the caller to remove.

``scan`` reads a layer the way ``unpack`` does and writes nothing: what a push checks
before a byte of the layer is stored (each entry as above, as far as an entry alone says:
names, link targets, devices; the cap), and the uncompressed size it records.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import stat
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from bourse.images.bounds import Bounds, Cap, ImageTooBig, Tally
from bourse.images.errors import BadImage, DigestMismatch, UnsafeEntry
from bourse.images.inventory import Written

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
# Symlinks followed while resolving one entry's parents, as Linux's own limit.
MAX_LINK_HOPS = 40
DROPPED_BITS = stat.S_ISUID | stat.S_ISGID
IMPLICIT_DIR_MODE = 0o755
_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LayerFile:
    """A layer on disk: its file, its digest (of the file's bytes), its ``diff_id`` (of
    the uncompressed tar, from the image config) and its uncompressed size as the store
    recorded it (None: no record, a blob stored before records were kept)."""

    path: Path
    digest: str
    diff_id: str
    recorded: int | None = None


def unpack(root: Path, layers: Sequence[LayerFile], tally: Tally | None = None) -> Written:
    """Unpack ``layers`` in order into ``root`` (an empty directory), each within its cap
    by ``tally`` (the default bounds unless given). What it wrote: each file's inode with
    the SHA-256 and size of the bytes written into it (bourse/images/inventory.py ``take``
    lists the root with them)."""
    unpacker = _Unpacker(root, owners=os.geteuid() == 0, tally=tally or Tally(Bounds()))
    for layer in layers:
        unpacker.layer(layer)
    unpacker.finish()
    return unpacker.written


def scan(raw: BinaryIO, digest: str, cap: Cap, *, verify: bool = True) -> int:
    """Read the layer ``digest`` from ``raw`` once, as ``unpack`` would, writing nothing:
    each entry checked in itself (``check_entry``), its uncompressed bytes counted within
    ``cap`` (``ImageTooBig``), and (``verify``) its bytes' digest checked (``DigestMismatch``).
    Its uncompressed size."""
    hashed = _Reader(raw, digest, hashing=verify)
    plain = _Reader(_decompressed(hashed, digest), digest, cap=cap, hashing=False)
    try:
        with tarfile.open(fileobj=cast(BinaryIO, plain), mode="r|") as tar:
            for info in _members(tar):
                check_entry(info)
        plain.drain()
        got = hashed.drain()
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise BadImage(f"layer {digest} is not a readable tar: {exc}") from None
    if verify and got != digest:
        raise DigestMismatch(digest, f"the layer's bytes have digest {got}: not stored")
    return plain.count


def file_digest(path: Path) -> str:
    """The OCI digest of a file's bytes."""
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


class _Reader:
    """A read-only stream that counts (and hashes) what it hands on, at most
    ``_COPY_BYTES`` a read (a bomb's bytes come a bounded step at a time); past ``cap`` it
    raises ``ImageTooBig`` naming the layer."""

    def __init__(
        self,
        raw: BinaryIO | gzip.GzipFile | _Prepended,
        layer: str,
        cap: Cap | None = None,
        hashing: bool = True,
    ) -> None:
        self.raw = raw
        self.layer = layer
        self.cap = cap
        self.sha = hashlib.sha256() if hashing else None
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > _COPY_BYTES:
            size = _COPY_BYTES  # a short read: callers (tarfile, drain) read again
        data = self.raw.read(size)
        self.count += len(data)
        if self.cap is not None and self.count > self.cap.bytes:
            raise ImageTooBig(self.layer, self.cap)
        if self.sha is not None:
            self.sha.update(data)
        return data

    def drain(self) -> str:
        """Read to the end (a tar's trailing padding counts too); the digest of it all."""
        while self.read(_COPY_BYTES):
            pass
        return "sha256:" + (self.sha.hexdigest() if self.sha is not None else "")


class _Prepended:
    """``head`` (bytes read already), then the rest of ``rest``."""

    def __init__(self, head: bytes, rest: _Reader) -> None:
        self.head = head
        self.rest = rest

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.rest.read(size)
        out, self.head = (self.head, b"") if size < 0 else (self.head[:size], self.head[size:])
        return out


def _decompressed(raw: _Reader, digest: str) -> gzip.GzipFile | _Prepended:
    """The layer's tar from ``raw``: its bytes, or their gzip stream; zstd is refused."""
    head = raw.read(4)
    if head.startswith(ZSTD_MAGIC):
        raise BadImage(
            f"layer {digest} is zstd-compressed, which this library does not read (no zstd in "
            "Python 3.11's standard library)"
        )
    source = _Prepended(head, raw)
    if head[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=cast(BinaryIO, source), mode="rb")
    return source


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The tar's entries. A tar that ends right after its last entry's data, without the
    padding to a whole block or the end-of-archive blocks, ends there: umoci writes its
    layers so (what the bytes are is the diff_id's business, checked after)."""
    while True:
        try:
            info = tar.next()
        except tarfile.ReadError as exc:
            # tarfile's words for "no padding after the last entry's data": every entry's
            # data was read whole before (a short one fails as it is read)
            if str(exc) == "unexpected end of data":
                return
            raise
        if info is None:
            return
        yield info


def _parts(name: str, entry: str, what: str = "its name") -> list[str]:
    """The components of an archive path; absolute or ``..`` refused."""
    if name.startswith("/"):
        raise UnsafeEntry(entry, f"{what} {name!r} is an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeEntry(entry, f"{what} {name!r} has a '..' component")
    return parts


def _escapes(parts: Sequence[str], target: str) -> bool:
    """Whether a symlink ``target`` at ``parts`` climbs above the root (an absolute target
    starts at the root, where ``..`` stays)."""
    if target.startswith("/"):
        return False
    depth = len(parts) - 1
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def _remove(path: Path) -> None:
    """Remove whatever is at ``path`` (a directory with its contents), following no link."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


def check_entry(info: tarfile.TarInfo) -> list[str]:
    """What an entry alone says is unsafe, refused (``UnsafeEntry``): an absolute name or a
    ``..`` component, a root that is no directory, a whiteout of ``.`` or ``..``, a device
    node, a sparse file, a symlink whose target climbs out, a hard link whose target is
    absolute, climbs or is the root, an unknown type. Its name's components."""
    parts = _parts(info.name, info.name)
    if not parts:  # the root itself ("./")
        if not info.isdir():
            raise UnsafeEntry(info.name, "the root must be a directory")
        return parts
    if parts[-1].startswith(WHITEOUT):
        name = parts[-1].removeprefix(WHITEOUT)
        if name in ("", ".", ".."):  # would hide its own directory or the one above
            raise UnsafeEntry(info.name, f"a whiteout of {name!r}")
        return parts
    if info.ischr() or info.isblk():
        kind = "character" if info.ischr() else "block"
        raise UnsafeEntry(info.name, f"a {kind} device node is not allowed in a layer")
    if info.issparse():
        raise UnsafeEntry(info.name, "a sparse file is not allowed in a layer (it unpacks to more)")
    if info.issym() and (not info.linkname or _escapes(parts, info.linkname)):
        raise UnsafeEntry(info.name, f"symlink to {info.linkname!r} escapes the root")
    if info.islnk() and not _parts(info.linkname, info.name, "its hard link target"):
        raise UnsafeEntry(info.name, "a hard link to the root")
    if not (info.isreg() or info.isdir() or info.issym() or info.islnk() or info.isfifo()):
        raise UnsafeEntry(info.name, f"unknown tar entry type {info.type!r}")
    return parts


class _Unpacker:
    """One root being unpacked, layer after layer, each within its cap by ``tally``."""

    def __init__(self, root: Path, owners: bool, tally: Tally) -> None:
        self.root = root
        self.owners = owners  # chown to the entries' numeric owners (only root may)
        self.tally = tally
        self.dirs: dict[Path, tuple[int, int]] = {}  # mode and mtime, applied at the end
        self.created: set[Path] = set()  # written by the current layer: whiteouts spare them
        self.written: dict[int, tuple[str, int]] = {}  # inode -> sha256 hex, bytes written

    def layer(self, layer: LayerFile) -> None:
        got = file_digest(layer.path)
        if got != layer.digest:
            raise DigestMismatch(layer.digest, f"the layer file holds {got}: nothing unpacked")
        self.created = set()
        compressed = layer.path.stat().st_size
        cap = self.tally.cap(compressed, layer.recorded)
        with layer.path.open("rb") as raw:
            source = _decompressed(_Reader(raw, layer.digest, hashing=False), layer.digest)
            plain = _Reader(source, layer.digest, cap=cap)
            try:
                with tarfile.open(fileobj=cast(BinaryIO, plain), mode="r|") as tar:
                    for info in _members(tar):
                        self.entry(tar, info)
                diff_id = plain.drain()
            except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
                raise BadImage(f"layer {layer.digest} is not a readable tar: {exc}") from None
        if diff_id != layer.diff_id:
            raise DigestMismatch(
                layer.digest, f"its tar has digest {diff_id}, the config says {layer.diff_id}"
            )
        self.tally.add(layer.digest, compressed, plain.count, layer.recorded)

    def entry(self, tar: tarfile.TarFile, info: tarfile.TarInfo) -> None:
        parts = check_entry(info)
        if not parts:  # the root itself ("./")
            self._own(self.root, info)
            self.dirs[self.root] = (self._mode(info), int(info.mtime))
            return
        if parts[-1].startswith(WHITEOUT):
            self.whiteout(parts, info.name)
            return
        parent = self.resolve(parts[:-1], info.name, create=True)
        assert parent is not None  # created on the way
        path = parent / parts[-1]
        if info.isdir():
            self.directory(path, info)
        else:
            self.node(tar, info, path)
        self.created.add(path)

    def resolve(self, parts: Sequence[str], entry: str, create: bool) -> Path | None:
        """The directory ``parts`` names inside the root: symlinks followed with ``/`` as
        the root and ``..`` stopping at it; missing directories made (``create``) or None."""
        current: list[str] = []
        pending = list(parts)
        hops = 0
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if current:
                    current.pop()
                continue
            path = self.root.joinpath(*current, part)
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:
                if not create:
                    return None
                path.mkdir(mode=0o700)
                self.dirs[path] = (IMPLICIT_DIR_MODE, 0)
                self.created.add(path)
                mode = stat.S_IFDIR
            if stat.S_ISLNK(mode):
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise UnsafeEntry(entry, "too many levels of symbolic links")
                target = os.readlink(path)
                if target.startswith("/"):
                    current = []
                pending[:0] = target.split("/")
            elif stat.S_ISDIR(mode):
                current.append(part)
            else:
                raise UnsafeEntry(entry, f"{'/'.join([*current, part])} is not a directory")
        return self.root.joinpath(*current)

    def whiteout(self, parts: list[str], entry: str) -> None:
        name = parts[-1].removeprefix(WHITEOUT)
        parent = self.resolve(parts[:-1], entry, create=False)
        if parent is None:
            return  # nothing below to hide
        if parts[-1] == OPAQUE:
            self.opaque(parent)
        elif parent / name not in self.created:
            _remove(parent / name)

    def opaque(self, directory: Path) -> None:
        """Hide what lower layers put in ``directory`` (what this layer wrote stays)."""
        for child in list(directory.iterdir()):
            if child not in self.created:
                _remove(child)
            elif child.is_dir() and not child.is_symlink():
                self.opaque(child)

    def directory(self, path: Path, info: tarfile.TarInfo) -> None:
        try:
            existing = path.lstat().st_mode
        except FileNotFoundError:
            existing = 0
        if not stat.S_ISDIR(existing):
            _remove(path)
            path.mkdir(mode=0o700)  # writable while unpacking; its mode is set at the end
        self._own(path, info)
        self.dirs[path] = (self._mode(info), int(info.mtime))

    def node(self, tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path) -> None:
        if info.islnk():
            self.hardlink(info, path)
            return
        _remove(path)
        if info.isreg():
            self.file(tar, info, path)
        elif info.issym():
            os.symlink(info.linkname, path)
            self._own(path, info)
        else:  # a FIFO: check_entry let no other kind through
            os.mkfifo(path, 0o600)
            self._own(path, info)
            os.chmod(path, self._mode(info))
        os.utime(path, (info.mtime, info.mtime), follow_symlinks=False)

    def file(self, tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path) -> None:
        data = tar.extractfile(info)
        assert data is not None  # a regular file's entry
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path, flags, 0o600), "wb") as out:
            sha, size = hashlib.sha256(), 0
            while chunk := data.read(_COPY_BYTES):
                sha.update(chunk)
                out.write(chunk)
                size += len(chunk)
            self.written[os.fstat(out.fileno()).st_ino] = (sha.hexdigest(), size)
            if self.owners:
                os.fchown(out.fileno(), info.uid, info.gid)
            os.fchmod(out.fileno(), self._mode(info))

    def hardlink(self, info: tarfile.TarInfo, path: Path) -> None:
        link = _parts(info.linkname, info.name, "its hard link target")  # not the root
        parent = self.resolve(link[:-1], info.name, create=False)
        source = parent / link[-1] if parent is not None else None
        try:
            mode = source.lstat().st_mode if source is not None else 0
        except FileNotFoundError:
            mode = 0
        if source is None or not mode or stat.S_ISDIR(mode):
            raise UnsafeEntry(info.name, f"hard link to {info.linkname!r}: no such file before it")
        _remove(path)
        os.link(source, path, follow_symlinks=False)

    def _own(self, path: Path, info: tarfile.TarInfo) -> None:
        if self.owners:
            os.lchown(path, info.uid, info.gid)

    @staticmethod
    def _mode(info: tarfile.TarInfo) -> int:
        return stat.S_IMODE(info.mode) & ~DROPPED_BITS

    def finish(self) -> None:
        """Give each directory its own mode and time, deepest first (a read-only directory
        is finished only once nothing more goes into it)."""
        for path in sorted(self.dirs, key=lambda p: len(p.parts), reverse=True):
            mode, mtime = self.dirs[path]
            try:
                if not stat.S_ISDIR(path.lstat().st_mode):
                    continue  # replaced by a later layer's non-directory
            except FileNotFoundError:
                continue  # removed by a whiteout
            os.chmod(path, mode)
            os.utime(path, (mtime, mtime))
