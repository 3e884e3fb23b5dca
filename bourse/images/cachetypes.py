"""What the image cache (bourse/images/cache.py) takes and tells: the source of its blobs,
a root's record on disk, a pull's result, its stats, a root found tampered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from bourse.images.oci import MAX_DOCUMENT_BYTES, Descriptor, Digest, RunConfig


class BlobSource(Protocol):
    """Where the cache gets blobs: an ``ImageStore`` (or anything that checks as it does)."""

    async def read_blob(self, digest: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes: ...

    async def unpacked_size(self, digest: str) -> int | None: ...

    async def fetch_blob(
        self,
        descriptor: Descriptor,
        dest: Path,
        *,
        tmp_dir: Path | None = None,
        timeout_s: float | None = None,
    ) -> None: ...


class Sized(Protocol):
    """A layer as a price sees it: a descriptor, or a bid's layer (its digest and size)."""

    @property
    def digest(self) -> str: ...
    @property
    def size(self) -> int: ...


class RootRecord(msgspec.Struct, frozen=True, kw_only=True):
    """``roots/<hex>.json``: an image root's manifest, layers, bytes on disk and what the
    image runs (its config's ``config``)."""

    manifest: Digest
    layers: list[Digest]
    size: int
    run: RunConfig = RunConfig()
    files: str = ""  # the digest of roots/<hex>.files ("": made before inventories)


@dataclass(frozen=True, slots=True)
class Pulled:
    """An image made ready by :meth:`ImageCache.pull`: its root, what it runs, the bytes its
    layers lacked when its root began to be made (0: the root was here) and the seconds
    this call took."""

    root: Path
    run: RunConfig
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What the cache holds and has done since it was opened."""

    used_bytes: int
    budget_bytes: int
    images: int
    layers: int
    hits: int  # prepare() of an image whose root was there
    misses: int  # prepare() that had to make it (or wait for it being made)
    pulls: int  # layers fetched
    pulled_bytes: int
    evictions: int
    pull_bytes_per_s: float  # measured (moving average), or the default before any pull
    tampered: int = 0  # roots removed because they no longer matched their inventory
    scrubbed_bytes: int = 0  # bytes of roots read by check()


@dataclass(frozen=True, slots=True)
class Tampered:
    """A root that did not match its inventory, and was removed: found when the cache was
    opened (``adopted``) or by ``check`` (``scrub``); ``why`` names what differed."""

    manifest: str
    why: str
    found: str


# ``check``'s pace: told the bytes just read, it waits as long as the owner's rate says.
Pace = Callable[[int], Awaitable[None]]


@dataclass(slots=True)
class Held:
    size: int
    last_used: float
    files: str = ""  # a root's: its inventory's digest
    checked: float = 0.0  # a root's: when check() last began to read it (clock), 0 if never
