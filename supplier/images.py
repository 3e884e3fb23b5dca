"""A worker's images: what starting an order's image costs it, and the caches behind that.

An order names its image two ways (docs/protocol.md §4.3a):

- **content**: a manifest digest (``Bid.image_digest``) with its layers and their sizes.
  A ``process`` worker keeps such images in its content cache
  (``bourse.images.ImageCache`` under ``<data_dir>/images/<worker_id>/``, bounded by the
  worker's ``image_cache_mb``, rebuilt from disk on a restart), fed by the market's image
  store (:class:`StoreSource`, read only). It prices the bytes of the layers it lacks over
  its measured pull throughput (supplier/pricing.py), declines an image that could never fit
  its budget, and runs a digest only with a store to pull from (or the image already here).
  A ``sim`` worker models the same: a digest is one entry of its catalog's LRU, sized by its
  layers, pulled in size / ``pull_mb_per_s``.
- **catalog**: a name the worker's config maps to a command (``catalog``) or, for ``sim``,
  any name. :class:`CatalogCache` is the catalog's view: an LRU of names bounded in MiB, the
  configured ``images`` cached from the start, an image a machine uses never evicted; its
  image term is 1 when cached, else 0.

Machines pin the digest they run for as long as they exist (destroy unpins): the content
cache never evicts it, nor its layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.errors import BourseError
from bourse.images import ImageCache, ImageError, ImageStore, Limits, StoreUnavailable
from bourse.images.bounds import Bounds, ImageTooBig
from bourse.images.cachetypes import Pulled
from bourse.images.errors import BadImage, DigestMismatch, UnsafeEntry
from bourse.images.oci import MAX_DOCUMENT_BYTES, Descriptor
from bourse.nats.jetstream import jetstream_available
from bourse.wire.messages import Layer, Machine
from supplier.feasible import OrderLike
from supplier.pricing import CACHED, NOT_CACHED, ImageCost

log = structlog.get_logger("bourse.images")

MIB = 1024 * 1024
DEFAULT_IMAGE_MB = 200
# Told (image, cached) whenever an image comes or goes: the host's image index.
ImageListener = Callable[[str, bool], None]
# Digest sizes a sim worker learned from bids (its pull model): at most this many.
MAX_LEARNED = 4096


class PullFailed(BourseError):
    """An image could not be made ready for a machine: the store unreachable, a blob that
    did not match its digest, an entry refused while unpacking, no room on disk. The
    message says which (an unsafe entry names it); ``permanent`` when trying again cannot
    mend it (the stored content itself is bad: it must be pushed again)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class CatalogCache:
    """The images cached on one worker, least recently used first, within ``budget_mb``;
    ``size_of(image)`` gives an image's size in MiB, ``listener`` hears every image come
    and go."""

    def __init__(
        self,
        budget_mb: int,
        initial: Iterable[str] = (),
        size_of: Callable[[str], int] = lambda _: DEFAULT_IMAGE_MB,
        listener: ImageListener | None = None,
    ) -> None:
        self.budget_mb = budget_mb
        self.size_of = size_of
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._used_mb = 0  # the sum of _lru's sizes, kept as they come and go
        self.listener = listener  # not told about the initial images: the host reads them
        for image in initial:  # configured images are cached whatever the budget says
            if image not in self._lru:
                self._lru[image] = size = size_of(image)
                self._used_mb += size

    def __contains__(self, image: object) -> bool:
        return image in self._lru

    def __iter__(self) -> Iterator[str]:
        return iter(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def used_mb(self) -> int:
        return self._used_mb

    def touch(self, image: str) -> None:
        if image in self._lru:
            self._lru.move_to_end(image)

    def add(self, image: str, in_use: Callable[[str], bool] = lambda _: False) -> list[str]:
        """Cache ``image``; returns the images evicted to make room (LRU first)."""
        if image in self._lru:
            self._lru.move_to_end(image)
            return []
        size = self.size_of(image)
        evicted = []
        for old in list(self._lru):
            if self.used_mb + size <= self.budget_mb:
                break
            if not in_use(old):
                self._used_mb -= self._lru.pop(old)
                evicted.append(old)
        self._lru[image] = size
        self._used_mb += size
        if self.listener is not None:
            for old in evicted:
                self.listener(old, False)
            self.listener(image, True)
        return evicted


class StoreSource:
    """The market's image store as a worker's content cache reads it: the buckets opened
    on first use, never made (a supplier only reads: an operator's push makes them).
    :meth:`start` says once whether the server has JetStream; without it (or without a
    connection: a worker driven alone) no content image can be pulled here (catalog images
    still run)."""

    def __init__(self, nc: NATS | None = None, prefix: str = "bourse") -> None:
        self.nc = nc
        self.prefix = prefix
        self.available = False  # until start() found JetStream
        self._store: ImageStore | None = None

    async def start(self) -> None:
        """Find out whether the server has JetStream (one request, at start-up)."""
        self.available = self.nc is not None and await jetstream_available(self.nc)
        if not self.available:
            log.warning(
                "image_store_unavailable",
                detail="the server has no JetStream: images named by digest cannot be pulled "
                "here; catalog images still run",
            )

    async def _opened(self) -> ImageStore:
        if self._store is None:
            if self.nc is None or not self.available:
                raise StoreUnavailable("the NATS server has no JetStream: no image store")
            self._store = await ImageStore.open(self.nc, self.prefix, create=False)
        return self._store

    async def read_blob(self, digest: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes:
        return await (await self._opened()).read_blob(digest, max_bytes)

    async def unpacked_size(self, digest: str) -> int | None:
        return await (await self._opened()).unpacked_size(digest)

    async def fetch_blob(
        self,
        descriptor: Descriptor,
        dest: Path,
        *,
        tmp_dir: Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        store = await self._opened()
        await store.fetch_blob(descriptor, dest, tmp_dir=tmp_dir, timeout_s=timeout_s)


@dataclass(frozen=True, slots=True)
class CacheState:
    """A worker's image cache as its status and metrics show it."""

    used_bytes: int
    budget_bytes: int
    digests: list[str]
    hits: int = 0
    misses: int = 0
    pulled_bytes: int = 0
    evictions: int = 0


class WorkerImages:
    """One worker's images (see the module doc). ``content``: its content cache (a process
    worker), or None (a sim worker models content in its catalog's LRU, pulling at
    ``sim_bytes_per_s``)."""

    def __init__(
        self,
        budget_mb: int,
        initial: Iterable[str],
        catalog_mb: dict[str, int],
        *,
        content: ImageCache | None = None,
        source: StoreSource | None = None,
        sim_bytes_per_s: float = 0.0,
        listener: ImageListener | None = None,
    ) -> None:
        self.budget_bytes = budget_mb * MIB
        self.content = content
        self.source = source or StoreSource()
        self.sim_bytes_per_s = sim_bytes_per_s
        # image name (or, for a sim worker, a digest it learned from a bid) -> MiB
        self._sizes: OrderedDict[str, int] = OrderedDict(catalog_mb)
        self._catalog_names = len(catalog_mb)
        self.catalog = CatalogCache(budget_mb, initial, self.size_mb, listener)

    def __iter__(self) -> Iterator[str]:
        """The catalog LRU's keys: image names, and a sim worker's digests (the host's image
        index: quote sampling prefers workers that hold a bid's image)."""
        return iter(self.catalog)

    def size_mb(self, key: str) -> int:
        """A catalog image's size (its spec's ``size_mb``), or a digest's learned from a
        bid's layers (sim), in MiB."""
        return self._sizes.get(key, DEFAULT_IMAGE_MB)

    # -- an order's image --------------------------------------------------------------
    def cost(self, order: OrderLike) -> ImageCost:
        """What starting the order's image costs here (supplier/pricing.py prices it)."""
        digest = order.image_digest
        if not digest:
            return CACHED if order.image in self.catalog else NOT_CACHED
        if self.content is None:
            return self._sim_cost(digest, order.layers)
        if not order.layers and self.content.root(digest) is None:
            return NOT_CACHED  # no sizes to price: the bytes are unknown
        lacking = self.content.lacking(order.layers, digest)
        seconds = lacking / self.content.rate.bytes_per_s
        return ImageCost(lacking == 0, True, lacking, seconds)

    def _sim_cost(self, digest: str, layers: Sequence[Layer]) -> ImageCost:
        if digest in self.catalog:
            return ImageCost(True, True)
        size = _total(layers)
        self._learn(digest, size)
        seconds = size / self.sim_bytes_per_s if self.sim_bytes_per_s > 0 else 0.0
        return ImageCost(size == 0, True, size, seconds)

    def _learn(self, digest: str, size: int) -> None:
        """Remember a digest's size for the sim's pull (bounded; catalog sizes stay)."""
        self._sizes[digest] = -(-size // MIB)
        self._sizes.move_to_end(digest)
        if len(self._sizes) > self._catalog_names + MAX_LEARNED:  # the least recent goes
            del self._sizes[next(islice(self._sizes, self._catalog_names, None))]

    def runnable(self, order: OrderLike) -> str:
        """Why a content image cannot run here ("" when it can, and for catalog images: the
        driver says for those): a process worker needs a store to pull from, or the image
        already here."""
        digest = order.image_digest
        if not digest or self.content is None:
            return ""
        if self.source.available or self.content.root(digest) is not None:
            return ""
        return f"no image store here to pull image {order.image!r} ({digest}) from (no JetStream)"

    def too_big(self, order: OrderLike) -> str:
        """Why the order's content image could never fit this worker's cache ("" when it
        could): what a pull would add (the layers lacking, and for a process worker the
        unpacked root, counted at its layers' size) exceeds the whole budget."""
        digest = order.image_digest
        if not digest:
            return ""
        if self.content is None:
            need = 0 if digest in self.catalog else _total(order.layers)
        elif self.content.root(digest) is not None:
            return ""
        else:
            need = self.content.lacking(order.layers) + _total(order.layers)
        if need <= self.budget_bytes:
            return ""
        return (
            f"image {order.image!r} needs {need} bytes in the image cache here, more than its "
            f"whole budget of {self.budget_bytes} bytes"
        )

    # -- machines ----------------------------------------------------------------------
    def key(self, m: Machine) -> str:
        """The catalog LRU's key of a machine's image: its digest (sim) or its name."""
        return m.image_digest if m.image_digest and self.content is None else m.image

    def has(self, m: Machine) -> bool:
        """Whether ``m``'s image is here (``Placed.image_cached``)."""
        if m.image_digest and self.content is not None:
            return self.content.root(m.image_digest) is not None
        return self.key(m) in self.catalog

    def pin(self, m: Machine) -> None:
        """``m`` uses its image from now until :meth:`unpin` (its destroy)."""
        if m.image_digest and self.content is not None:
            self.content.pin(m.image_digest)

    def unpin(self, m: Machine) -> None:
        if m.image_digest and self.content is not None:
            self.content.unpin(m.image_digest)

    async def pull(self, m: Machine) -> Pulled:
        """Make ``m``'s content image ready: its root, what it runs, what it took. Any
        failure is :class:`PullFailed` saying why (``image_too_big: layer …`` for a layer
        that passed its cap); the cache keeps nothing half made."""
        assert self.content is not None and m.image_digest, "a content image on a process worker"
        try:
            return await self.content.pull(m.image_digest)
        except (ImageError, nats.errors.Error, OSError) as exc:
            bad = isinstance(exc, DigestMismatch | UnsafeEntry | BadImage)
            if isinstance(exc, ImageTooBig):
                bad = exc.permanent  # the cache's budget left may grow: tried again then
            raise PullFailed(_why(exc), permanent=bad) from None

    # -- what it shows -----------------------------------------------------------------
    def names(self) -> list[str]:
        """The catalog images cached here (``WorkerStatus.images``)."""
        return sorted(k for k in self.catalog if not k.startswith("sha256:"))

    def used_bytes(self) -> int:
        """Bytes the cache holds (cheap: a worker's row compares it every heartbeat)."""
        if self.content is None:
            return int(self.catalog.used_mb * MIB)
        return self.content.stats().used_bytes

    def state(self) -> CacheState:
        """Bytes used and budget, the images held by digest, the cache's counts (a metrics
        scrape reads it from its own thread: snapshots only)."""
        if self.content is None:
            digests = sorted(k for k in list(self.catalog) if k.startswith("sha256:"))
            return CacheState(self.catalog.used_mb * MIB, self.budget_bytes, digests)
        s = self.content.stats()
        return CacheState(
            s.used_bytes,
            s.budget_bytes,
            self.content.images(),
            s.hits,
            s.misses,
            s.pulled_bytes,
            s.evictions,
        )


def open_content(
    directory: Path,
    budget_mb: int,
    source: StoreSource,
    worker_id: str,
    max_image_mb: int | None = None,
) -> ImageCache:
    """A process worker's content cache in ``directory`` (rebuilt from what it holds), each
    image unpacked to at most ``max_image_mb`` (the default's unless given)."""
    return ImageCache.open(
        directory,
        source,
        Limits(budget_bytes=max(1, budget_mb) * MIB),
        bounds=Bounds.of_mb(max_image_mb),
        logger=log.bind(worker_id=worker_id),
    )


def _total(layers: Sequence[Layer]) -> int:
    """The bytes of an image's layers, a layer listed twice counted once."""
    return sum({x.digest: x.size for x in layers}.values())


def _why(exc: BaseException) -> str:
    """A pull failure in one line: the library's message, or the NATS error's kind."""
    text = str(exc)
    if isinstance(exc, nats.errors.Error):
        return f"the image store is unreachable: {type(exc).__name__} {text}".strip()
    if isinstance(exc, OSError):
        return f"cannot write the image cache: {exc.strerror or text}"
    return text
