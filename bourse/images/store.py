"""The image store on NATS: blobs in a JetStream Object Store, tags in a KV bucket beside it.

Two buckets per subject prefix (``bourse`` -> ``BOURSE_IMAGES`` and ``BOURSE_IMAGE_TAGS``),
file storage, the replicas the caller asks for (1 on a single server, 3 in a cluster), no
age limit: a blob goes only by ``gc``, a tag only by ``remove_tag``. ``ImageStore.open``
makes or finds them; how blobs and tags are written and read, checked, is
``bourse.images.blobstore.BlobStore``; this module holds the images made of them:

- Pushing (a directory as a one-layer image, an imported image, any set of blobs) first
  bounds every layer (``bound``: read once, each entry checked, its uncompressed size
  counted within the store's ``bounds``, bourse/images/bounds.py; a layer built here was
  checked as it was written, one stored with a record is not read again), then writes every
  blob, each layer with its uncompressed size recorded beside it, and the tag last, so a
  tag never names a manifest with missing blobs, and nothing of a refused image is stored.
- ``inspect`` and ``ls`` read an image's manifest and config (checked like any blob).
- ``gc`` removes the blobs that no manifest reachable from a tag or from the digests the
  caller says are in use references, and never a digest in use. A blob younger than
  ``grace_s`` (one hour by default) stays too: it may belong to a push still writing
  its blobs before its tag.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.api import ObjectStoreConfig as _ObjectStoreConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bourse.images.blobstore import CHUNK_BYTES, BlobStore, StoredBlob, tag_only
from bourse.images.bounds import Bounds, Cap, Tally
from bourse.images.build import DEFAULT_COMPRESSLEVEL, Layer, RunSpec, documents, write_layer
from bourse.images.errors import BadImage, ImageNotFound, StoreUnavailable
from bourse.images.importer import Blob, reading
from bourse.images.oci import (
    MAX_DOCUMENT_BYTES,
    Descriptor,
    decode_config,
    decode_manifest,
    kind_of,
    references,
)
from bourse.images.reference import Reference, check_digest
from bourse.images.unpack import scan
from bourse.nats.jetstream import prefix_token, says_none

log = structlog.get_logger("bourse.images")

DEFAULT_PREFIX = "bourse"
# Every JetStream API request (bucket info, object info, a tag's read or write).
API_TIMEOUT_S = 10.0
# Blobs younger than this are spared by gc: a push writes its blobs before its tag.
GC_GRACE_S = 3600.0


def bucket_names(prefix: str) -> tuple[str, str]:
    """The blob (Object Store) and tag (KV) buckets of a subject prefix."""
    token = prefix_token(prefix)
    return f"{token}_IMAGES", f"{token}_IMAGE_TAGS"


@dataclass(frozen=True, slots=True)
class PushResult:
    """An image stored and tagged."""

    reference: str
    digest: str  # the manifest's
    size: int  # manifest, config and layers
    layers: int
    uploaded_bytes: int
    reused_bytes: int  # blobs the store already held
    note: str  # what was read, and which manifest of it


@dataclass(frozen=True, slots=True)
class LayerInfo:
    digest: str
    size: int
    media_type: str


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """An image's manifest and config, as ``inspect`` shows them."""

    digest: str
    media_type: str
    size: int
    created: str | None
    platform: str
    cmd: tuple[str, ...]
    entrypoint: tuple[str, ...]
    env: tuple[str, ...]
    workdir: str
    user: str
    config_digest: str
    layers: tuple[LayerInfo, ...]


@dataclass(frozen=True, slots=True)
class TagInfo:
    """A line of ``ls``: a tag, its manifest, the image's size and creation time (None when
    the image does not say, size None when its manifest is not in the store)."""

    reference: str
    digest: str
    size: int | None
    created: str | None


@dataclass(frozen=True, slots=True)
class GcResult:
    """What a ``gc`` removed (or would, dry run), and what it kept."""

    removed: tuple[StoredBlob, ...]
    kept: int  # blobs referenced or in use
    young: int  # unreferenced but within the grace period

    @property
    def removed_bytes(self) -> int:
        return sum(b.size for b in self.removed)


def sweep(
    stored: Iterable[StoredBlob], keep: set[str], now: float, grace_s: float
) -> list[StoredBlob]:
    """The blobs ``gc`` removes: not in ``keep`` and older than ``grace_s``."""
    return [b for b in stored if b.digest not in keep and now - b.mtime >= grace_s]


class ImageStore(BlobStore):
    """The image store of one subject prefix, on one connection: its blobs and tags
    (``BlobStore``), and the images made of them."""

    bounds = Bounds()  # what a push lets in (open's ``bounds``)

    @classmethod
    async def open(
        cls,
        nc: NATS,
        prefix: str = DEFAULT_PREFIX,
        *,
        replicas: int = 1,
        create: bool = True,
        bounds: Bounds | None = None,
    ) -> ImageStore:
        """The store of ``prefix``, its buckets made if missing (with ``replicas``; an
        existing bucket keeps its own settings). ``StoreUnavailable`` without JetStream.
        ``create=False`` (a reader: a supplier) makes nothing: ``ImageNotFound`` while the
        buckets are missing (nothing was pushed yet). ``bounds``: what its pushes let in
        (the defaults unless given)."""
        blobs, tags = bucket_names(prefix)
        js = nc.jetstream(timeout=API_TIMEOUT_S)
        try:
            if create:
                objects = await _object_store(js, blobs, replicas)
                kv = await _tag_bucket(js, tags, replicas)
            else:
                objects, kv = await js.object_store(blobs), await js.key_value(tags)
        except nats.js.errors.BucketNotFoundError:
            raise ImageNotFound(
                f"no image store yet (buckets {blobs}, {tags}): push an image"
            ) from None
        except nats.errors.NoRespondersError:
            raise StoreUnavailable(_NO_JETSTREAM) from None
        except nats.js.errors.APIError as exc:
            if says_none(exc):
                raise StoreUnavailable(_NO_JETSTREAM) from None
            raise StoreUnavailable(f"image buckets {blobs}, {tags}: {exc}") from None
        store = cls(js, objects, kv, blobs)
        store.chunk_bytes = min(CHUNK_BYTES, nc.max_payload // 2)
        store.bounds = bounds or Bounds()
        return store

    # -- images ------------------------------------------------------------------------

    async def push_directory(
        self,
        directory: Path,
        ref: Reference | str,
        run: RunSpec,
        *,
        keep_mtime: bool = False,
        compresslevel: int = DEFAULT_COMPRESSLEVEL,
        created: str | None = None,
        tmp_dir: Path | None = None,
    ) -> PushResult:
        """Store ``directory`` as a one-layer image running ``run`` and tag it ``ref``
        (``build``: the same tree and options give the same digest)."""
        ref = tag_only(ref)
        built = directory_image(
            directory, run, keep_mtime, compresslevel, created, tmp_dir, self.bounds
        )
        async with built as (blobs, manifest):
            return await self.push_blobs(blobs, ref, manifest, f"directory {directory}")

    async def import_image(self, path: Path, ref: Reference | str, *, pick: str = "") -> PushResult:
        """Store the image at ``path`` (an OCI layout or oci-archive, a docker save tarball
        or directory: ``importer``) and tag it ``ref``; ``pick`` names one image of
        several."""
        ref = tag_only(ref)
        with contextlib.ExitStack() as stack:
            plan = await anyio.to_thread.run_sync(stack.enter_context, reading(path, pick))
            note = f"{path}: {plan.note}"
            return await self.push_blobs(list(plan.blobs()), ref, plan.descriptor, note)

    async def bound(self, blobs: Sequence[Blob], manifest: Descriptor) -> list[Blob]:
        """``blobs`` with each layer of ``manifest`` (its blob among them) bounded: its
        uncompressed size known (given, recorded in the store for the same bytes, or read
        once here: ``scan``) and within ``bounds`` in order (``ImageTooBig`` names the
        layer; ``UnsafeEntry`` an entry, ``DigestMismatch`` bytes not the layer's)."""
        layers = _layer_digests(blobs, manifest)
        tally = Tally(self.bounds)
        out = []
        for blob in blobs:
            d = blob.descriptor
            if d.digest not in layers:
                out.append(blob)
                continue
            known = blob.unpacked
            if known is None and await self.stat_blob(d.digest) == d.size:
                known = await self.unpacked_size(d.digest)
            if known is None:
                known = await anyio.to_thread.run_sync(_scan_blob, blob, tally.cap(d.size))
                tally.add(d.digest, d.size, known)
            else:
                tally.add(d.digest, d.size, known, known if blob.unpacked is None else None)
            out.append(dataclasses.replace(blob, unpacked=known))
        return out

    async def push_blobs(
        self,
        blobs: Sequence[Blob],
        ref: Reference,
        manifest: Descriptor,
        note: str,
        *,
        bounded: bool = False,
    ) -> PushResult:
        """Store ``blobs`` (the manifest's last, so no manifest names a missing blob),
        each layer bounded first (``bound``, unless the caller did: ``bounded``; nothing
        stored of a refused image), then tag ``ref`` with ``manifest``; ``note`` says what
        they were read from."""
        started = time.perf_counter()
        uploaded = reused = 0
        if not bounded:
            blobs = await self.bound(blobs, manifest)
        for blob in blobs:
            if await self.put_blob(blob, f"{note}: {blob.descriptor.digest}"):
                uploaded += blob.descriptor.size
            else:
                reused += blob.descriptor.size
        await self.set_tag(ref, manifest.digest)
        result = PushResult(
            reference=ref.tagged,
            digest=manifest.digest,
            size=uploaded + reused,
            layers=len(blobs) - 2,
            uploaded_bytes=uploaded,
            reused_bytes=reused,
            note=note,
        )
        log.info(
            "image_pushed",
            reference=result.reference,
            digest=result.digest,
            uploaded_bytes=uploaded,
            reused_bytes=reused,
            seconds=round(time.perf_counter() - started, 3),
            note=note,
        )
        return result

    async def tag(self, source: Reference | str, ref: Reference | str) -> str:
        """Give the image ``source`` names (a tag or a digest) the tag ``ref``; its digest."""
        digest = await self.lookup(source)
        if await self.stat_blob(digest) is None:
            raise ImageNotFound(f"manifest {digest} is not in the image store")
        await self.set_tag(ref, digest)
        return digest

    async def inspect(self, ref: Reference | str) -> ImageInfo:
        """The manifest and config of the image ``ref`` names."""
        digest = await self.lookup(ref)
        data = await self.read_blob(digest)
        if kind_of(data, f"blob {digest}") != "manifest":
            raise BadImage(f"{digest} is an index, not an image manifest")
        manifest = decode_manifest(data, f"manifest {digest}")
        config = decode_config(
            await self.read_blob(manifest.config.digest), f"config {manifest.config.digest}"
        )
        run = config.config
        return ImageInfo(
            digest=digest,
            media_type=manifest.media_type,
            size=len(data) + manifest.config.size + sum(x.size for x in manifest.layers),
            created=config.created,
            platform=f"{config.os}/{config.architecture}",
            cmd=tuple(run.cmd or ()),
            entrypoint=tuple(run.entrypoint or ()),
            env=tuple(run.env or ()),
            workdir=run.working_dir,
            user=run.user,
            config_digest=manifest.config.digest,
            layers=tuple(LayerInfo(x.digest, x.size, x.media_type) for x in manifest.layers),
        )

    async def ls(self) -> list[TagInfo]:
        """Every tag with its image's digest, size and creation time."""
        async with self.watch_tags() as index:
            entries = index.entries()
        images: dict[str, ImageInfo | None] = {}
        for entry in entries:
            if entry.digest not in images:
                try:
                    images[entry.digest] = await self.inspect(Reference("x", "", entry.digest))
                except (ImageNotFound, BadImage):
                    images[entry.digest] = None
        return [
            TagInfo(
                reference=e.reference.tagged,
                digest=e.digest,
                size=info.size if (info := images[e.digest]) else None,
                created=info.created if info else None,
            )
            for e in entries
        ]

    async def gc(
        self, in_use: Iterable[str] = (), *, grace_s: float = GC_GRACE_S, dry_run: bool = False
    ) -> GcResult:
        """Remove the blobs no tagged or in-use image references (``sweep``); digests in
        ``in_use`` (manifests, or any blob) are never removed."""
        async with self.watch_tags() as index:
            roots = {e.digest for e in index.entries()}
        used = {check_digest(d, "in-use digest") for d in in_use}
        keep = await self._reachable(roots | used) | used
        stored = await self.blobs()
        doomed = sweep(stored, keep, time.time(), grace_s)
        for blob in doomed if not dry_run else ():
            await self.delete_blob(blob.digest)
        kept = sum(1 for b in stored if b.digest in keep)
        result = GcResult(tuple(doomed), kept, len(stored) - kept - len(doomed))
        log.info(
            "image_gc",
            removed=len(doomed),
            removed_bytes=result.removed_bytes,
            kept=kept,
            young=result.young,
            dry_run=dry_run,
        )
        return result

    async def _reachable(self, roots: set[str]) -> set[str]:
        """``roots`` and every blob their manifests and indexes name, transitively."""
        seen: set[str] = set()
        pending = list(roots)
        while pending:
            digest = pending.pop()
            if digest in seen:
                continue
            seen.add(digest)
            size = await self.stat_blob(digest)
            if size is None or size > MAX_DOCUMENT_BYTES:
                continue  # absent, or a layer
            try:
                named = references(await self.read_blob(digest), f"blob {digest}")
            except BadImage:
                continue  # not a manifest or an index: a leaf
            pending += [d.digest for d in named]
        return seen


_NO_JETSTREAM = "the NATS server has no JetStream: the image store needs it (nats-server -js)"


async def _object_store(js: JetStreamContext, bucket: str, replicas: int) -> ObjectStore:
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    config = _ObjectStoreConfig(
        bucket=bucket,
        description="Bourse image blobs, named by digest",
        storage=StorageType.FILE,
        replicas=replicas,
    )
    try:
        objects = await js.create_object_store(bucket, config=config)
    except nats.js.errors.BadRequestError:
        return await js.object_store(bucket)  # made meanwhile by another process
    log.info("image_bucket_created", bucket=bucket, replicas=replicas)
    return objects


async def _tag_bucket(js: JetStreamContext, bucket: str, replicas: int) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    config = KeyValueConfig(
        bucket=bucket,
        description="Bourse image tags: name:tag -> manifest digest",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
    )
    try:
        kv = await js.create_key_value(config)
    except nats.js.errors.BadRequestError:
        return await js.key_value(bucket)
    log.info("image_tag_bucket_created", bucket=bucket, replicas=replicas)
    return kv


@contextlib.asynccontextmanager
async def directory_image(
    directory: Path,
    run: RunSpec,
    keep_mtime: bool = False,
    compresslevel: int = DEFAULT_COMPRESSLEVEL,
    created: str | None = None,
    tmp_dir: Path | None = None,
    bounds: Bounds | None = None,
) -> AsyncIterator[tuple[list[Blob], Descriptor]]:
    """``directory`` as a one-layer image running ``run`` (``build``): its blobs (the layer
    in a temporary file while the block runs, with its uncompressed size; the manifest
    last) and the manifest's descriptor. The layer's entries are checked as it is written,
    and the writing stops past ``bounds``' max_image_mb."""
    cap = (bounds or Bounds()).left(0)
    with tempfile.TemporaryDirectory(prefix="bourse-push-", dir=tmp_dir) as tmp:
        path = Path(tmp) / "layer"
        layer = await anyio.to_thread.run_sync(
            _write_layer_file, directory, path, keep_mtime, compresslevel, cap
        )
        docs = documents([layer], run, created)
        manifest = decode_manifest(docs.manifest, "manifest")
        yield (
            [
                Blob(layer.descriptor, open=lambda: path.open("rb"), unpacked=layer.unpacked),
                Blob(manifest.config, docs.config),
                Blob(docs.descriptor, docs.manifest),
            ],
            docs.descriptor,
        )


def _write_layer_file(directory: Path, path: Path, keep_mtime: bool, level: int, cap: Cap) -> Layer:
    with path.open("wb") as out:
        return write_layer(
            directory, out, keep_mtime=keep_mtime, compresslevel=level, max_bytes=cap
        )


def _layer_digests(blobs: Sequence[Blob], manifest: Descriptor) -> set[str]:
    """The layers ``manifest`` names, read from its blob among ``blobs``."""
    for blob in blobs:
        if blob.descriptor.digest == manifest.digest and blob.data is not None:
            image = decode_manifest(blob.data, f"manifest {manifest.digest}")
            return {x.digest for x in image.layers}
    raise BadImage(f"manifest {manifest.digest} is not among the blobs to push")


def _scan_blob(blob: Blob, cap: Cap) -> int:
    """A layer blob read once within ``cap`` (a worker thread): its uncompressed size."""
    d = blob.descriptor
    if blob.data is not None:
        return scan(io.BytesIO(blob.data), d.digest, cap)
    assert blob.open is not None  # a Blob has bytes or an opener
    with blob.open() as f:
        return scan(cast(BinaryIO, f), d.digest, cap)
