"""A worker's image cache: each layer fetched once, each image unpacked once, bounded in bytes.

On disk, under the cache directory::

    blobs/sha256/<hex>   a layer, renamed into place once its size and digest matched
    roots/<hex>/         an image's root (<hex> of its manifest digest), never written after
                         its rename: a driver uses it read-only (an overlay's lower layer)
    roots/<hex>.files    that root's inventory: every entry, a file's SHA-256 included, as
                         unpacked (bourse/images/inventory.py)
    roots/<hex>.json     its record (cachetypes.RootRecord: layers, bytes on disk, what the
                         image runs, its inventory's digest); written last: a root with one
                         is whole
    tmp/                 fetches and unpacks under way, and entries being deleted

``open`` rebuilds the cache from that: ``tmp/`` is emptied (half-written files, half-made
roots), a root without its record or a record without its root is removed, and a root is
adopted only if a walk finds it matching its inventory (``checks``: verify.py, the scrub's
too). Each entry's last use is its file's time, so the LRU order survives a restart.

``prepare(manifest)`` returns the image's root (``pull(manifest)`` the same with what it
took: the bytes the image lacked when it was made, the seconds, what it runs): the
manifest and config read from the store (checked), every missing layer fetched (one fetch
per layer at a time: concurrent callers share it, and its error), the layers unpacked into
``tmp/`` and renamed into ``roots/`` (one unpack per image at a time). Every layer's digest
is checked again as it is unpacked (``unpack``), so bytes changed on disk since their fetch
never reach a root (I7), and the root's inventory is taken from what the checked stream
wrote. A root already here is returned as it is: nothing is read or hashed on that path.

The bytes held are bounded by ``policy.plan``: before a pull, room is made for the layers
it lacks and the root (estimated at the layers' uncompressed sizes the store recorded,
else at their compressed size; counted exactly once made); a pull that cannot fit raises
``CacheFull``. The unpack stops the moment a layer passes its recorded size, the image
``bounds``' max_image_mb, or the root what is left of the budget (less what other unpacks
under way expect): ``ImageTooBig`` naming the layer (bounds.py), nothing of it kept.

``pin``/``unpin`` mark the images live or reserved machines use: never evicted, nor their
layers (after a restart, none until the owner pins again: the eviction delay covers it)."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from bourse.images.bounds import Bounds, Cap, Tally
from bourse.images.cachetypes import BlobSource, CacheStats, Held, Pulled, RootRecord, Sized
from bourse.images.disk import hex_of, is_hex_name, remove_all, set_mtime

# supplier/drivers/process.py removes a machine's trees with it, from here
from bourse.images.disk import remove_tree as remove_tree
from bourse.images.errors import BadImage, CacheFull, DigestMismatch
from bourse.images.flights import Flights
from bourse.images.inventory import digest_of, encode, take
from bourse.images.oci import (
    Descriptor,
    RunConfig,
    decode_config,
    decode_manifest,
    kind_of,
)
from bourse.images.policy import Entry, Limits, PullRate, plan
from bourse.images.reference import check_digest
from bourse.images.unpack import LayerFile, unpack
from bourse.images.verify import RootChecks

_log = structlog.get_logger("bourse.images")


class ImageCache:
    """The image cache in ``directory``, fed by ``source``, bounded by ``limits``, each
    image unpacked within ``bounds``; ``clock`` gives wall-clock seconds (last uses are kept
    as file times)."""

    def __init__(
        self,
        directory: Path,
        source: BlobSource,
        limits: Limits,
        *,
        bounds: Bounds | None = None,
        clock: Callable[[], float] = time.time,
        logger: Any = None,
    ) -> None:
        self.directory = directory
        self.source = source
        self.limits = limits
        self.bounds = bounds or Bounds()
        self.clock = clock
        self.log = logger if logger is not None else _log
        self.blob_dir = directory / "blobs" / "sha256"
        self.root_dir = directory / "roots"
        self.tmp = directory / "tmp"
        self.rate = PullRate()
        self._layers: dict[str, Held] = {}
        self._roots: dict[str, Held] = {}
        self._layers_of: dict[str, tuple[str, ...]] = {}  # manifest -> its layers, once known
        self._pins: Counter[str] = Counter()
        self._fetches = Flights()
        self._unpacks = Flights()
        self._counts: Counter[str] = Counter()
        self._lacked: dict[str, int] = {}  # manifest -> bytes its last making had to fetch
        self._expected: dict[str, int] = {}  # manifest -> its root's bytes, while unpacked
        self._records = msgspec.json.Decoder(RootRecord)
        # the roots checked against their inventories (at open, by the owner's scrub)
        self.checks = RootChecks(
            self.root_dir,
            self._roots,
            self._counts,
            self._move_root_out,
            self._paths_of,
            clock,
            self.log,
        )

    @classmethod
    def open(
        cls,
        directory: Path,
        source: BlobSource,
        limits: Limits,
        *,
        bounds: Bounds | None = None,
        clock: Callable[[], float] = time.time,
        logger: Any = None,
    ) -> ImageCache:
        """The cache rebuilt from what ``directory`` holds (made if missing). Start-up work:
        it reads the directory, so call it before serving (or in a worker thread)."""
        cache = cls(directory, source, limits, bounds=bounds, clock=clock, logger=logger)
        cache._rebuild()
        return cache

    # -- what the owner asks -------------------------------------------------------------

    def root(self, manifest: str) -> Path | None:
        """The image's root if it is unpacked here."""
        return self.root_dir / hex_of(manifest) if manifest in self._roots else None

    def lacking(self, layers: Sequence[Sized], manifest: str = "") -> int:
        """The bytes a pull of an image with ``layers`` would fetch: the layers neither
        here nor being fetched already (a start shares a fetch under way), each counted
        once; 0 when ``manifest``'s root is here or being made."""
        if manifest and (manifest in self._roots or manifest in self._unpacks):
            return 0
        sizes = {layer.digest: layer.size for layer in layers}
        return sum(
            size
            for digest, size in sizes.items()
            if digest not in self._layers and digest not in self._fetches
        )

    def pin(self, manifest: str) -> None:
        """Keep ``manifest``'s image and its layers (a machine uses it); pins count up."""
        self._pins[check_digest(manifest)] += 1

    def unpin(self, manifest: str) -> None:
        """Undo one ``pin``; the image's delay before eviction starts now."""
        if self._pins[manifest] <= 1:
            self._pins.pop(manifest, None)
        else:
            self._pins[manifest] -= 1
        if manifest in self._roots:
            self._touch_root(manifest)

    def images(self) -> list[str]:
        """The manifest digests of the images unpacked here."""
        return sorted(list(self._roots))  # a snapshot: see stats()

    def stats(self) -> CacheStats:
        """What the cache holds and has done (safe to read from another thread, a metrics
        scrape: it reads snapshots of what the event loop changes)."""
        return CacheStats(
            used_bytes=self._used(),
            budget_bytes=self.limits.budget_bytes,
            images=len(self._roots),
            layers=len(self._layers),
            hits=self._counts["hits"],
            misses=self._counts["misses"],
            pulls=self._counts["pulls"],
            pulled_bytes=self._counts["pulled_bytes"],
            evictions=self._counts["evictions"],
            pull_bytes_per_s=self.rate.bytes_per_s,
            tampered=self._counts["tampered"],
            scrubbed_bytes=self._counts["scrubbed_bytes"],
        )

    async def prepare(self, manifest: str) -> Path:
        """The root of the image ``manifest`` names, fetched and unpacked if it is not here."""
        return (await self.pull(manifest)).root

    async def pull(self, manifest: str) -> Pulled:
        """``prepare``, with what it took and what the image runs. Callers that share one
        making of the root (concurrent pulls) each see the bytes that making fetched."""
        check_digest(manifest, "image manifest")
        started = time.perf_counter()
        self.pin(manifest)  # its layers stay while it is made
        try:
            lacked = 0
            if manifest in self._roots:
                self._counts["hits"] += 1
                self._touch_root(manifest)
            else:
                self._counts["misses"] += 1
                await self._unpacks.run(manifest, lambda: self._make(manifest))
                lacked = self._lacked.get(manifest, 0)
            root = self.root(manifest)
            if root is None:  # a bug: it was pinned throughout
                raise BadImage(f"image {manifest} was made but is not in the cache")
            run = await anyio.to_thread.run_sync(self._run_config, manifest)
            return Pulled(root, run, lacked, time.perf_counter() - started)
        finally:
            self.unpin(manifest)

    def _run_config(self, manifest: str) -> RunConfig:
        path = self.root_dir / f"{hex_of(manifest)}.json"
        try:
            return self._records.decode(path.read_bytes()).run
        except (OSError, msgspec.DecodeError) as exc:
            raise BadImage(
                f"image {manifest}: its record in the cache is unreadable: {exc}"
            ) from None

    async def collect(self) -> tuple[str, ...]:
        """Evict what the policy says now (past the high watermark); the keys evicted."""
        decided = plan(self._entries(), self.limits, self.clock())
        await self._evict(decided.evict)
        return decided.evict

    # -- making a root -------------------------------------------------------------------

    async def _make(self, manifest: str) -> None:
        log = self.log.bind(manifest=manifest)
        data = await self.source.read_blob(manifest)
        if kind_of(data, f"manifest {manifest}") != "manifest":
            raise BadImage(f"{manifest} is an index: name one platform's manifest")
        image = decode_manifest(data, f"manifest {manifest}")
        config = await self.source.read_blob(image.config.digest)
        decoded = decode_config(config, f"config {image.config.digest}")
        diff_ids = decoded.rootfs.diff_ids
        if len(diff_ids) != len(image.layers):
            raise BadImage(
                f"manifest {manifest}: {len(image.layers)} layers, its config has "
                f"{len(diff_ids)} diff_ids"
            )
        self._layers_of[manifest] = tuple(layer.digest for layer in image.layers)
        started = time.perf_counter()
        lacking = self.lacking(image.layers)
        self._lacked[manifest] = lacking
        records = [await self.source.unpacked_size(x.digest) for x in image.layers]
        expected = sum(
            r if r is not None else x.size for r, x in zip(records, image.layers, strict=True)
        )
        await self._make_room(lacking + expected)
        for layer in image.layers:
            await self._fetches.run(layer.digest, functools.partial(self._fetch, layer))
        files = [
            LayerFile(self.blob_dir / layer.hex, layer.digest, diff_id, record)
            for layer, diff_id, record in zip(image.layers, diff_ids, records, strict=True)
        ]
        tally = Tally(self.bounds, self._room(manifest, expected))
        try:
            record = await anyio.to_thread.run_sync(
                self._unpack, manifest, files, decoded.config, tally
            )
        except DigestMismatch as exc:
            self._forget_layer(exc.digest)  # changed on disk since its fetch: fetch it again
            raise
        finally:
            self._expected.pop(manifest, None)
        size = record.size
        self._roots[manifest] = Held(size, self.clock(), record.files, checked=self.clock())
        self._touch_root(manifest)
        log.info(
            "image_unpacked",
            layers=len(files),
            root_bytes=size,
            seconds=round(time.perf_counter() - started, 3),
        )
        await self.collect()

    async def _fetch(self, layer: Descriptor) -> None:
        if layer.digest in self._layers:
            self._touch_layer(layer.digest)
            return
        started = time.perf_counter()
        await self.source.fetch_blob(layer, self.blob_dir / layer.hex, tmp_dir=self.tmp)
        seconds = time.perf_counter() - started
        self.rate.observe(layer.size, seconds)
        self._layers[layer.digest] = Held(layer.size, self.clock())
        self._touch_layer(layer.digest)
        self._counts["pulls"] += 1
        self._counts["pulled_bytes"] += layer.size
        self.log.info(
            "image_layer_pulled", digest=layer.digest, bytes=layer.size, seconds=round(seconds, 3)
        )

    def _room(self, manifest: str, expected: int) -> Cap:
        """What the root of ``manifest`` may take of the budget: what is left of it, less
        what the other unpacks under way expect; it expects ``expected`` from now on."""
        others = sum(self._expected.values())
        self._expected[manifest] = expected
        left = self.limits.budget_bytes - self._used() - others
        why = f"the {max(left, 0)} bytes left of the image cache's budget"
        return Cap(left, why, permanent=False)

    def _unpack(
        self, manifest: str, files: list[LayerFile], run: RunConfig, tally: Tally
    ) -> RootRecord:
        """Unpack into ``tmp/`` within ``tally`` and rename into ``roots/``, then take its
        inventory (after the rename: the root's own change time is final then) and write
        it and the record (a worker thread)."""
        work = self.tmp / f"root-{hex_of(manifest)}-{secrets.token_hex(4)}"
        root = self.root_dir / hex_of(manifest)
        work.mkdir()
        try:
            written = unpack(work, files, tally)
            work.rename(root)
        finally:
            remove_tree(work)
        try:
            taken = take(root, written)
            data = encode(taken.inventory)
            layers = [f.digest for f in files]
            record = RootRecord(
                manifest=manifest,
                layers=layers,
                size=taken.disk_bytes,
                run=run,
                files=digest_of(data),
            )
            self._write(self.root_dir / f"{hex_of(manifest)}.files", data)
            self._write(self.root_dir / f"{hex_of(manifest)}.json", msgspec.json.encode(record))
        except BaseException:
            remove_all(self._paths_of(manifest))
            raise
        return record

    def _write(self, path: Path, data: bytes) -> None:
        """``data`` into ``path`` whole or not at all, readable by the owner only."""
        staged = self.tmp / f"{path.name}-{secrets.token_hex(4)}"
        try:
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            staged.rename(path)
        finally:
            staged.unlink(missing_ok=True)

    def _paths_of(self, manifest: str) -> list[Path]:
        """A root's files in ``roots/``: its record first (without it the rest is no
        root), its inventory, the root."""
        name = hex_of(manifest)
        return [
            self.root_dir / f"{name}.json",
            self.root_dir / f"{name}.files",
            self.root_dir / name,
        ]

    def _move_root_out(self, manifest: str) -> list[Path]:
        """A root, its inventory and record out of ``roots/`` and of the cache (into
        ``tmp/``: gone at once, and after a restart); the paths to delete."""
        doomed = [self._move_out(path) for path in self._paths_of(manifest)]
        self._roots.pop(manifest, None)
        self._lacked.pop(manifest, None)
        return doomed

    # -- room ----------------------------------------------------------------------------

    async def _make_room(self, incoming: int) -> None:
        decided = plan(self._entries(), self.limits, self.clock(), incoming)
        if not decided.fits:
            raise CacheFull(
                f"an image needing {incoming} bytes does not fit: the cache holds "
                f"{self._used()} of its {self.limits.budget_bytes} bytes, and what may be "
                f"evicted (not pinned, unused for {self.limits.delay_s:.0f} s) is not enough"
            )
        await self._evict(decided.evict)

    def _entries(self) -> list[Entry]:
        pinned_layers = {
            d for m in self._pins for d in self._layers_of.get(m, ()) if self._pins[m] > 0
        }
        layers = [
            Entry(f"layer {d}", h.size, h.last_used, d in pinned_layers)
            for d, h in self._layers.items()
        ]
        roots = [
            Entry(f"image {m}", h.size, h.last_used, self._pins[m] > 0)
            for m, h in self._roots.items()
        ]
        return layers + roots

    async def _evict(self, keys: Iterable[str]) -> None:
        """Move each entry into ``tmp/`` (gone from the cache at once, and on a restart),
        then delete it in a worker thread."""
        doomed = []
        for key in keys:
            kind, digest = key.split(" ", 1)
            if kind == "layer":
                doomed.append(self._move_out(self.blob_dir / hex_of(digest)))
                self._forget_layer(digest)
            else:
                doomed += self._move_root_out(digest)
            self._counts["evictions"] += 1
            self.log.info("image_cache_evicted", kind=kind, digest=digest)
        if doomed:
            await anyio.to_thread.run_sync(remove_all, doomed)

    def _move_out(self, path: Path) -> Path:
        target = self.tmp / f"gone-{path.name}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            path.rename(target)
        return target

    def _forget_layer(self, digest: str) -> None:
        if self._layers.pop(digest, None) is not None:
            (self.blob_dir / hex_of(digest)).unlink(missing_ok=True)

    def _used(self) -> int:
        # list(): copied at once (a scrape thread must not see the dicts change under it)
        layers, roots = list(self._layers.values()), list(self._roots.values())
        return sum(h.size for h in layers) + sum(h.size for h in roots)

    def _touch_layer(self, digest: str) -> None:
        held = self._layers[digest]
        held.last_used = self.clock()
        set_mtime(self.blob_dir / hex_of(digest), held.last_used)

    def _touch_root(self, manifest: str) -> None:
        held = self._roots[manifest]
        held.last_used = self.clock()
        set_mtime(self.root_dir / f"{hex_of(manifest)}.json", held.last_used)

    # -- rebuilding from disk ------------------------------------------------------------

    def _rebuild(self) -> None:
        for directory in (self.blob_dir, self.root_dir, self.tmp):
            directory.mkdir(parents=True, exist_ok=True)
        discarded = 0
        for path in list(self.tmp.iterdir()):
            remove_tree(path)
            discarded += 1
        for path in list(self.blob_dir.iterdir()):
            st = path.lstat()
            if is_hex_name(path.name) and stat.S_ISREG(st.st_mode):
                self._layers[f"sha256:{path.name}"] = Held(st.st_size, st.st_mtime)
            else:
                remove_tree(path)
                discarded += 1
        discarded += self._rebuild_roots()
        self.log.info(
            "image_cache_opened",
            directory=str(self.directory),
            layers=len(self._layers),
            images=len(self._roots),
            used_bytes=self._used(),
            budget_bytes=self.limits.budget_bytes,
            discarded=discarded,
        )

    def _rebuild_roots(self) -> int:
        """Pair each root with its record and adopt it if it matches its inventory;
        remove whatever has no pair or does not match. The count removed."""
        decoder = self._records
        discarded = 0
        for path in list(self.root_dir.iterdir()):
            if path.suffix in (".json", ".files"):
                continue
            record_path = self.root_dir / f"{path.name}.json"
            try:
                record = decoder.decode(record_path.read_bytes())
            except (OSError, msgspec.DecodeError):
                record = None
            if record is None or not path.is_dir() or hex_of(record.manifest) != path.name:
                remove_all([path, record_path, path.with_name(f"{path.name}.files")])
                discarded += 1
                continue
            if not self.checks.adopted(record):
                discarded += 1
                continue
            self._roots[record.manifest] = Held(
                record.size, record_path.stat().st_mtime, record.files
            )
            self._layers_of[record.manifest] = tuple(record.layers)
        for other in list(self.root_dir.glob("*.*")):
            if other.suffix in (".json", ".files") and not (self.root_dir / other.stem).is_dir():
                other.unlink()
                discarded += 1
        return discarded
