"""What an image's root holds, file by file, and whether it still holds just that.

A root (bourse/images/cache.py) is made once from layers whose bytes matched their digests
(I7) and is never written again: process machines read it through a read-only bind,
containers use it as their overlay's lower layer. Whatever changes it afterwards (a
machine that escaped, a hand on the host, a disk that rots) changes what every later
machine of the image runs, so a worker checks each root against what its layers made:

- **The inventory.** When a root is unpacked, every entry of it is listed: its path, kind
  (directory, file, link, FIFO), mode, owner, a file's size and the SHA-256 of its bytes, a
  link's target, and the entry's inode number and change time (``ctime``). The file digests
  are taken by the unpacker as it writes each file from the checked layer stream
  (bourse/images/unpack.py), not read back, and the walk that lists the root refuses any
  file the unpacker did not write or whose size differs from what it wrote: the inventory
  is what the digests vouch for, and the root matches it when it goes into the cache. The
  inventory (``roots/<hex>.files``: msgpack, about 100 bytes an entry) sits beside the
  root in the cache, which only the supplier's user writes and no machine sees; its own
  SHA-256 is in the root's record (``RootRecord.files``), so an inventory that changed is
  a root that changed.
- **Adoption** (a supplier starting on a cache it finds on disk): each root's inventory
  is read and checked against its record, and the root walked once with ``lstat``,
  reading no file: anything added, removed, renamed, chmod'ed, chown'ed or written
  through the filesystem shows, because every such change moves the entry's change time
  (which no user, root included, can set back through the filesystem) or its inode. A
  walk costs about 20 µs an entry here (a root of 2,052 entries: 44 ms of the supplier's
  start, measured on a loaded 2-core machine), where reading it whole would cost its bytes
  at 700 to 900 MB/s (64 MiB: 0.1 s of a core). What a walk cannot see (bytes changed
  below the filesystem: a rotting disk, a raw write to the device) is the scrub's.
- **The scrub** (the supplier's background task, supplier/scrub.py) reads every file of
  every root and compares its SHA-256 with the inventory's, after the same walk, a root at
  a time, paced to a few MiB a second (:class:`Hasher` works in bounded steps, so the pace
  holds for a large file too); an adopted root is first in its line.

A root that fails any check is removed from the cache at once and made again from its
layers at its next use; its owner is told (an ``image_tampered`` event, a log line).
Nothing is hashed when a machine starts from a root already in the cache.

Paths are kept as bytes (a layer's names need not be UTF-8), relative to the root (``b""``
is the root itself); entries are in the walk's order, each directory's names sorted.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bourse.images.errors import BadImage

VERSION = 1
DIRECTORY, FILE, LINK, FIFO = "d", "f", "l", "p"
# Differences named in one finding (the rest are counted).
SHOWN = 3
# What a step of the hasher reads at most, unless told (a worker thread's share of work).
STEP_BYTES = 1 << 20


class Entry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One entry of a root: ``sha256`` (hex) and ``size`` for a file, ``target`` for a
    link; ``ino`` and ``ctime_ns`` as they were when the inventory was taken."""

    path: bytes
    kind: str
    mode: int
    uid: int
    gid: int
    ino: int
    ctime_ns: int
    size: int = 0
    sha256: str = ""
    target: bytes = b""


class Inventory(msgspec.Struct, frozen=True, gc=False):
    """A root's entries (see the module doc)."""

    entries: list[Entry]
    version: int = VERSION

    def files(self) -> list[Entry]:
        """Its regular files."""
        return [e for e in self.entries if e.kind == FILE]


# Written by the unpacker as it writes each file: inode -> (sha256 hex, bytes written).
Written = Mapping[int, tuple[str, int]]

_decoder = msgspec.msgpack.Decoder(Inventory)


def encode(inventory: Inventory) -> bytes:
    """The inventory's bytes (``roots/<hex>.files``)."""
    return msgspec.msgpack.encode(inventory)


def decode(data: bytes, what: str) -> Inventory:
    """An inventory from its bytes; BadImage naming ``what`` if they are not one."""
    try:
        inventory = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BadImage(f"{what}: not an inventory of a root: {exc}") from None
    if inventory.version != VERSION:
        raise BadImage(f"{what}: an inventory of version {inventory.version}, not {VERSION}")
    return inventory


def digest_of(data: bytes) -> str:
    """The OCI-style digest of an inventory's bytes (what a root's record keeps)."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def shown(path: bytes) -> str:
    """A path as a finding says it ("/" for the root)."""
    return "/" + path.decode("utf-8", "backslashreplace")


# -- taking and comparing -------------------------------------------------------------------
def _walk(root: Path) -> Iterator[tuple[bytes, os.stat_result]]:
    """Every entry under ``root`` (itself first, then depth first, each directory's names
    sorted), never through a link: its relative path and its ``lstat``."""
    top = os.fsencode(root)
    stack: list[tuple[bytes, os.stat_result]] = [(b"", os.lstat(top))]
    while stack:
        path, st = stack.pop()
        yield path, st
        if not stat.S_ISDIR(st.st_mode):
            continue
        with os.scandir(os.path.join(top, path) if path else top) as it:
            names = sorted(entry.name for entry in it)
        below = [path + b"/" + name if path else name for name in names]
        stack.extend((p, os.lstat(os.path.join(top, p))) for p in reversed(below))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return DIRECTORY
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISLNK(mode):
        return LINK
    if stat.S_ISFIFO(mode):
        return FIFO
    return "?"


def _entry(root: Path, path: bytes, st: os.stat_result, sha256: str = "") -> Entry:
    kind = _kind(st.st_mode)
    target = os.readlink(os.path.join(os.fsencode(root), path)) if kind == LINK else b""
    return Entry(
        path=path,
        kind=kind,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        ino=st.st_ino,
        ctime_ns=st.st_ctime_ns,
        size=st.st_size if kind == FILE else 0,
        sha256=sha256,
        target=target,
    )


@dataclass(frozen=True, slots=True)
class Taken:
    """A root's inventory and the bytes the root takes on disk (allocated blocks; a
    hard-linked file once)."""

    inventory: Inventory
    disk_bytes: int


def take(root: Path, written: Written) -> Taken:
    """The inventory of the root the unpacker just made, its files' digests from
    ``written``; BadImage for an entry the unpacker cannot have made: a file it did not
    write (or of another size), a device or a socket."""
    entries: list[Entry] = []
    seen: set[int] = set()
    disk = 0
    for path, st in _walk(root):
        if path and st.st_ino not in seen:
            seen.add(st.st_ino)
            disk += st.st_blocks * 512
        sha256 = ""
        kind = _kind(st.st_mode)
        if kind == "?":
            raise BadImage(f"the root made holds {shown(path)}, which no layer entry makes")
        if kind == FILE:
            wrote = written.get(st.st_ino)
            if wrote is None or wrote[1] != st.st_size:
                raise BadImage(
                    f"the root made holds {shown(path)} ({st.st_size} bytes), which its "
                    "layers did not write so"
                )
            sha256 = wrote[0]
        entries.append(_entry(root, path, st, sha256))
    return Taken(Inventory(entries), disk)


def _difference(was: Entry, now: Entry) -> str:
    """How ``now`` differs from ``was`` in what a walk sees ("" for nothing)."""
    if now.kind != was.kind:
        return f"was of kind {was.kind}, is of kind {now.kind}"
    if now.mode != was.mode:
        return f"mode {was.mode:04o} is now {now.mode:04o}"
    if (now.uid, now.gid) != (was.uid, was.gid):
        return f"owner {was.uid}:{was.gid} is now {now.uid}:{now.gid}"
    if now.size != was.size:
        return f"{was.size} bytes are now {now.size}"
    if now.target != was.target:
        return "its link target changed"
    if now.ino != was.ino:
        return "replaced (another inode)"
    if now.ctime_ns != was.ctime_ns:
        return "changed since it was unpacked (its change time moved)"
    return ""


def _said(differences: Sequence[str]) -> list[str]:
    """At most :data:`SHOWN` differences, and how many more."""
    if len(differences) <= SHOWN:
        return list(differences)
    return [*differences[:SHOWN], f"and {len(differences) - SHOWN} more"]


def changed(root: Path, inventory: Inventory) -> list[str]:
    """How the tree at ``root`` differs from ``inventory`` as a walk sees it, reading no
    file (see the module doc): each difference in a few words (at most :data:`SHOWN`, and
    a count of the rest); empty when none."""
    expected = {e.path: e for e in inventory.entries}
    differences = []
    try:
        for path, st in _walk(root):
            was = expected.pop(path, None)
            if was is None:
                differences.append(f"{shown(path)}: not in the image")
                continue
            why = _difference(was, _entry(root, path, st, was.sha256))
            if why:
                differences.append(f"{shown(path)}: {why}")
    except OSError as exc:  # a directory gone or replaced while it was walked
        return [f"{shown(b'')}: gone"] if not root.exists() else [f"cannot be walked ({exc})"]
    differences += [f"{shown(path)}: removed" for path in expected]
    return _said(differences)


def walk_check(root: Path, stored: Path, digest: str) -> tuple[Inventory | None, list[str]]:
    """The inventory in the file ``stored``, if its bytes have ``digest`` (what the root's
    record names), and how ``root`` differs from it as a walk sees it (``changed``); an
    inventory missing, unreadable or not the recorded one is a difference of its own."""
    try:
        data = stored.read_bytes()
    except OSError as exc:
        return None, [f"its inventory cannot be read ({exc.strerror})"]
    if digest_of(data) != digest:
        return None, ["its inventory is not the one its record names"]
    try:
        inventory = decode(data, str(stored))
    except BadImage as exc:
        return None, [str(exc)]
    return inventory, changed(root, inventory)


# -- reading the files' bytes ---------------------------------------------------------------
@dataclass(slots=True)
class Hasher:
    """Reads the files of ``entries`` under ``root`` and compares their SHA-256 with the
    inventory's, in steps of bounded size (each in a worker thread, with the owner's pace
    between them). A file that is not what the walk found (a link now, another inode) is
    a difference too; a file hard-linked under several paths is read once; a file its
    owner may not read (mode 0000: Fedora's /etc/shadow) is left to the walk when the
    supplier is not root."""

    root: Path
    entries: Sequence[Entry]
    differences: list[str] = field(default_factory=list)
    read: int = 0  # bytes read so far
    _next: int = 0
    _fd: int = -1
    _sha: hashlib._Hash | None = None
    _digests: dict[int, str] = field(default_factory=dict)  # inode -> its digest, once read

    @property
    def done(self) -> bool:
        return self._next >= len(self.entries) and self._fd < 0

    def findings(self) -> list[str]:
        return _said(self.differences)

    def step(self, limit: int = STEP_BYTES) -> int:
        """Read at most about ``limit`` bytes (a whole small file more); the bytes read."""
        spent = 0
        while spent < limit and not self.done:
            if self._fd < 0:
                self._open(self.entries[self._next])
                continue
            entry = self.entries[self._next - 1]
            try:
                chunk = os.read(self._fd, min(limit - spent, STEP_BYTES) or 1)
            except OSError as exc:  # EIO: a disk that fails is a root that cannot be trusted
                self.close()
                self.differences.append(f"{shown(entry.path)}: cannot be read ({exc.strerror})")
                continue
            spent += len(chunk)
            if chunk:
                assert self._sha is not None
                self._sha.update(chunk)
            else:
                self._finish(entry, self._sha)
        self.read += spent
        return spent

    def _open(self, entry: Entry) -> None:
        self._next += 1
        known = self._digests.get(entry.ino)
        if known is not None:
            self._compare(entry, known)
            return
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(os.path.join(os.fsencode(self.root), entry.path), flags)
        except PermissionError:
            if not entry.mode & stat.S_IRUSR and os.geteuid() != 0:
                return  # a supplier not root cannot read a file of mode 0000: the walk's
            self.differences.append(f"{shown(entry.path)}: cannot be read (permission denied)")
            return
        except OSError as exc:
            self.differences.append(f"{shown(entry.path)}: cannot be read ({exc.strerror})")
            return
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != entry.ino:
            os.close(fd)
            self.differences.append(f"{shown(entry.path)}: replaced (another inode)")
            return
        self._fd, self._sha = fd, hashlib.sha256()

    def _finish(self, entry: Entry, sha: hashlib._Hash | None) -> None:
        self.close()
        assert sha is not None
        self._digests[entry.ino] = sha.hexdigest()
        self._compare(entry, self._digests[entry.ino])

    def _compare(self, entry: Entry, got: str) -> None:
        if got != entry.sha256:
            self.differences.append(f"{shown(entry.path)}: its bytes are not the image's")

    def close(self) -> None:
        """Close the file being read, if any (a check cut short)."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._sha = -1, None
