"""The image store on NATS: blobs in a JetStream Object Store, tags in a KV bucket beside it.

Two buckets per subject prefix (``bourse`` -> ``BOURSE_IMAGES`` and ``BOURSE_IMAGE_TAGS``),
file storage, the replicas the caller asks for (1 on a single server, 3 in a cluster), no
age limit: a blob goes only by ``gc``, a tag only by ``remove_tag``.

- A blob's object name is its digest, ``sha256:<hex>``. Writing checks the digest the
  object store computed over the bytes it sent against the descriptor's; a mismatch
  deletes the object and raises. A blob already stored under its digest is not sent again.
- Reading streams the object's chunks from an ordered consumer (nats-py's ``get()`` is
  quadratic into memory, nats.py#703, and slower even into a file; it has no bound and
  checks no size): into memory for a manifest or config (at most 4 MiB), into a temporary
  file for a layer, each bounded in time, counted against the descriptor's size and hashed;
  only a file that matched is renamed into place.
- A tag's key is ``name:tag`` escaped (``reference.tag_key``); its value is the manifest's
  digest (``TagRecord``). Pushing writes every blob first and the tag last, so a tag never
  names a manifest with missing blobs.
- ``gc`` removes the blobs that no manifest reachable from a tag or from the digests the
  caller says are in use references, and never a digest in use. A blob younger than
  ``grace_s`` (one hour by default) stays too: it may belong to a push still writing
  its blobs before its tag.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, cast

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectInfo, ObjectMeta, ObjectMetaOptions, StorageType
from nats.js.api import ObjectStoreConfig as _ObjectStoreConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bourse.images.build import DEFAULT_COMPRESSLEVEL, Layer, RunSpec, documents, write_layer
from bourse.images.errors import (
    BadImage,
    DigestMismatch,
    ImageNotFound,
    PullTimeout,
    StoreUnavailable,
)
from bourse.images.importer import Blob, reading
from bourse.images.oci import (
    MAX_DOCUMENT_BYTES,
    Descriptor,
    check_blob,
    decode_config,
    decode_manifest,
    digest_of_object,
    kind_of,
    references,
)
from bourse.images.reference import Reference, check_digest, tag_key
from bourse.images.tags import TagIndex, TagRecord, decode_record
from bourse.nats.jetstream import prefix_token, says_none

log = structlog.get_logger("bourse.images")

DEFAULT_PREFIX = "bourse"
# Object chunks: fewer, larger messages cost fewer acks (100 MB: 0.6 s at 128 KiB, 0.4 s at
# 512 KiB on one machine); at most half the server's max_payload.
CHUNK_BYTES = 512 * 1024
# Every JetStream API request (bucket info, object info, a tag's read or write).
API_TIMEOUT_S = 10.0
# A blob's fetch is bounded by a floor plus its size at a slow rate: a stalled stream ends.
FETCH_FLOOR_S = 30.0
FETCH_MIN_BYTES_PER_S = 4 * 1024 * 1024
# Blobs younger than this are spared by gc: a push writes its blobs before its tag.
GC_GRACE_S = 3600.0
# Bounds an unsubscribe run shielded from cancellation.
CLEANUP_TIMEOUT_S = 2.0


def bucket_names(prefix: str) -> tuple[str, str]:
    """The blob (Object Store) and tag (KV) buckets of a subject prefix."""
    token = prefix_token(prefix)
    return f"{token}_IMAGES", f"{token}_IMAGE_TAGS"


def fetch_timeout(size: int) -> float:
    """How long a blob of ``size`` bytes may take to fetch."""
    return FETCH_FLOOR_S + size / FETCH_MIN_BYTES_PER_S


@dataclass(frozen=True, slots=True)
class StoredBlob:
    """A blob in the store: digest, size and when it was written (the writer's clock)."""

    digest: str
    size: int
    mtime: float


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


class ImageStore:
    """The blobs and tags of one subject prefix, on one connection."""

    def __init__(self, js: JetStreamContext, objects: ObjectStore, tags: KeyValue, bucket: str):
        self.js = js
        self.objects = objects
        self.tags = tags
        self.bucket = bucket
        self.chunk_bytes = CHUNK_BYTES

    @classmethod
    async def open(
        cls, nc: NATS, prefix: str = DEFAULT_PREFIX, *, replicas: int = 1, create: bool = True
    ) -> ImageStore:
        """The store of ``prefix``, its buckets made if missing (with ``replicas``; an
        existing bucket keeps its own settings). ``StoreUnavailable`` without JetStream.
        ``create=False`` (a reader: a supplier) makes nothing: ``ImageNotFound`` while the
        buckets are missing (nothing was pushed yet)."""
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
        return store

    # -- blobs -------------------------------------------------------------------------

    async def stat_blob(self, digest: str) -> int | None:
        """The size of the blob stored under ``digest`` (None when absent, or stored with
        other bytes than its name says)."""
        info = await self._info(digest)
        if info is None or digest_of_object(info.digest or "") != digest:
            return None
        return info.size or 0

    async def put_blob(self, blob: Blob, what: str = "") -> bool:
        """Store ``blob`` unless it is there already (False then); the bytes sent are
        checked against its descriptor (``DigestMismatch`` names it, nothing is kept)."""
        want = blob.descriptor
        if await self.stat_blob(want.digest) == want.size:
            return False
        meta = ObjectMeta(
            name=want.digest, options=ObjectMetaOptions(max_chunk_size=self.chunk_bytes)
        )
        async with _opened(blob) as data:
            # nats-py's put reads any object with readinto (files, tar members, BytesIO)
            info = await self.objects.put(want.digest, cast(io.BufferedIOBase, data), meta=meta)
        got = digest_of_object(info.digest or "")
        if got != want.digest or info.size != want.size:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.objects.delete(want.digest)
            raise DigestMismatch(
                want.digest,
                f"{what or 'blob'}: the bytes read ({info.size} bytes) have digest {got}; "
                f"the descriptor says {want.size} bytes: not stored",
            )
        return True

    async def read_blob(self, digest: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes:
        """A small blob (a manifest, a config, an index) into memory, checked."""
        info = await self._present(digest)
        size = info.size or 0
        if size > max_bytes:
            raise BadImage(f"blob {digest} is {size} bytes: more than {max_bytes} for a document")
        data = bytearray()

        async def keep(chunk: bytes) -> None:
            data.extend(chunk)

        with _bounded(digest, fetch_timeout(size)):
            await self._receive(info, keep, size)
        return check_blob(bytes(data), digest, f"blob {digest}")

    async def fetch_blob(
        self,
        descriptor: Descriptor,
        dest: Path,
        *,
        tmp_dir: Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Stream the blob into a temporary file (in ``tmp_dir``, else beside ``dest``),
        check its size and digest, then rename it to ``dest``. A mismatch or a timeout
        raises naming the digest, and the temporary file is gone."""
        check_digest(descriptor.digest)  # it names the temporary file
        tmp = (tmp_dir or dest.parent) / f"{descriptor.hex}.{secrets.token_hex(4)}.part"
        sink = _FileSink(tmp)
        try:
            with _bounded(descriptor.digest, timeout_s or fetch_timeout(descriptor.size)):
                info = await self._present(descriptor.digest)
                if info.size != descriptor.size:
                    raise DigestMismatch(
                        descriptor.digest,
                        f"the store holds {info.size} bytes, the descriptor says "
                        f"{descriptor.size}: not fetched",
                    )
                await sink.open()
                await self._receive(info, sink.write, descriptor.size)
            await sink.commit(descriptor, dest)
        finally:
            await sink.discard()

    async def _receive(
        self, info: ObjectInfo, write: Callable[[bytes], Awaitable[None]], size: int
    ) -> None:
        """Hand every chunk of the object to ``write``; at most ``size`` bytes in all."""
        if size == 0:
            return  # no chunks to wait for
        subject = f"$O.{self.bucket}.C.{info.nuid}"
        sub = await self.js.subscribe(subject, stream=f"OBJ_{self.bucket}", ordered_consumer=True)
        try:
            received = 0
            while True:
                msg = await sub.next_msg(timeout=None)  # bounded by the caller's scope
                received += len(msg.data)
                if received > size:
                    raise DigestMismatch(info.name, f"the store sends more than {size} bytes")
                await write(msg.data)
                if msg.metadata.num_pending == 0:
                    return
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
                await sub.unsubscribe()

    async def _info(self, digest: str) -> ObjectInfo | None:
        check_digest(digest)
        try:
            info = await self.objects.get_info(digest)
        except nats.js.errors.ObjectNotFoundError:
            return None
        if info.is_link():
            raise BadImage(f"blob {digest} is a link in the object store, not a blob")
        return info

    async def _present(self, digest: str) -> ObjectInfo:
        info = await self._info(digest)
        if info is None:
            raise ImageNotFound(f"blob {digest} is not in the image store")
        return info

    async def delete_blob(self, digest: str) -> None:
        """Remove one blob (gone already is fine)."""
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.objects.delete(digest)

    async def blobs(self) -> list[StoredBlob]:
        """Every blob in the store (objects not named by a digest are not listed)."""
        try:
            infos = await self.objects.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []  # an empty bucket
        return [
            StoredBlob(info.name, info.size or 0, _mtime(info.mtime))
            for info in infos
            if _is_digest(info.name)
        ]

    # -- tags --------------------------------------------------------------------------

    async def set_tag(self, ref: Reference | str, digest: str) -> None:
        """Point ``ref``'s tag at the manifest ``digest``."""
        ref = _tag_only(ref)
        record = TagRecord(digest=check_digest(digest), tagged_ms=int(time.time() * 1000))
        await self.tags.put(tag_key(ref), msgspec.json.encode(record))
        log.info("image_tagged", reference=ref.tagged, digest=digest)

    async def remove_tag(self, ref: Reference | str) -> str:
        """Remove a tag (its blobs stay until ``gc``); the digest it named."""
        ref = _tag_only(ref)
        digest = await self.lookup(ref)
        await self.tags.delete(tag_key(ref))
        log.info("image_untagged", reference=ref.tagged, digest=digest)
        return digest

    async def lookup(self, ref: Reference | str) -> str:
        """The manifest digest ``ref`` names, by one KV read (a service resolves from a
        ``TagIndex`` instead: no request per lookup)."""
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        if ref.digest:
            return ref.digest
        try:
            entry = await self.tags.get(tag_key(ref))
        except nats.js.errors.KeyNotFoundError:
            raise ImageNotFound(f"no image tagged {ref.tagged} in the store") from None
        return decode_record(entry.value, ref.tagged).digest

    def watch_tags(self) -> contextlib.AbstractAsyncContextManager[TagIndex]:
        """A ``TagIndex`` of this store, replayed, followed until the block ends."""
        return TagIndex.watching(self.tags)

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
        ref = _tag_only(ref)
        built = directory_image(directory, run, keep_mtime, compresslevel, created, tmp_dir)
        async with built as (blobs, manifest):
            return await self.push_blobs(blobs, ref, manifest, f"directory {directory}")

    async def import_image(self, path: Path, ref: Reference | str, *, pick: str = "") -> PushResult:
        """Store the image at ``path`` (an OCI layout or oci-archive, a docker save tarball
        or directory: ``importer``) and tag it ``ref``; ``pick`` names one image of
        several."""
        ref = _tag_only(ref)
        with contextlib.ExitStack() as stack:
            plan = await anyio.to_thread.run_sync(stack.enter_context, reading(path, pick))
            note = f"{path}: {plan.note}"
            return await self.push_blobs(list(plan.blobs()), ref, plan.descriptor, note)

    async def push_blobs(
        self, blobs: Sequence[Blob], ref: Reference, manifest: Descriptor, note: str
    ) -> PushResult:
        """Store ``blobs`` (the manifest's last, so no manifest names a missing blob), then
        tag ``ref`` with ``manifest``; ``note`` says what they were read from."""
        started = time.perf_counter()
        uploaded = reused = 0
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


def _tag_only(ref: Reference | str) -> Reference:
    ref = Reference.parse(ref) if isinstance(ref, str) else ref
    if ref.digest:
        raise BadImage(f"{ref} names a digest: a tag is name[:tag]")
    return ref


def _is_digest(name: str) -> bool:
    try:
        check_digest(name)
    except ValueError:
        return False
    return True


def _mtime(text: str | None) -> float:
    """An object's mtime (RFC 3339, maybe with nanoseconds) as epoch seconds; an
    unreadable one reads as now, so gc's grace spares the blob."""
    if text:
        trimmed = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("Z", "+00:00")
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(trimmed).timestamp()
    return time.time()


@contextlib.asynccontextmanager
async def directory_image(
    directory: Path,
    run: RunSpec,
    keep_mtime: bool = False,
    compresslevel: int = DEFAULT_COMPRESSLEVEL,
    created: str | None = None,
    tmp_dir: Path | None = None,
) -> AsyncIterator[tuple[list[Blob], Descriptor]]:
    """``directory`` as a one-layer image running ``run`` (``build``): its blobs (the layer
    in a temporary file while the block runs, the manifest last) and the manifest's
    descriptor."""
    with tempfile.TemporaryDirectory(prefix="bourse-push-", dir=tmp_dir) as tmp:
        path = Path(tmp) / "layer"
        layer = await anyio.to_thread.run_sync(
            _write_layer_file, directory, path, keep_mtime, compresslevel
        )
        docs = documents([layer], run, created)
        manifest = decode_manifest(docs.manifest, "manifest")
        yield (
            [
                Blob(layer.descriptor, open=lambda: path.open("rb")),
                Blob(manifest.config, docs.config),
                Blob(docs.descriptor, docs.manifest),
            ],
            docs.descriptor,
        )


def _write_layer_file(directory: Path, path: Path, keep_mtime: bool, level: int) -> Layer:
    with path.open("wb") as out:
        return write_layer(directory, out, keep_mtime=keep_mtime, compresslevel=level)


@contextlib.asynccontextmanager
async def _opened(blob: Blob) -> AsyncIterator[IO[bytes]]:
    if blob.data is not None:
        yield io.BytesIO(blob.data)
        return
    assert blob.open is not None  # a Blob has bytes or an opener
    with contextlib.ExitStack() as stack:
        yield await anyio.to_thread.run_sync(stack.enter_context, blob.open())


@contextlib.contextmanager
def _bounded(digest: str, timeout_s: float) -> Iterator[None]:
    """A scope that ends a fetch after ``timeout_s``, as ``PullTimeout`` naming the blob."""
    try:
        with anyio.fail_after(timeout_s):
            yield
    except TimeoutError:
        raise PullTimeout(f"blob {digest}: not fetched within {timeout_s:g} s") from None


class _FileSink:
    """A temporary file that chunks are written to (in a worker thread) and hashed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: IO[bytes] | None = None
        self.sha = hashlib.sha256()
        self.size = 0

    async def open(self) -> None:
        self.file = await anyio.to_thread.run_sync(self.path.open, "xb")

    async def write(self, data: bytes) -> None:
        await anyio.to_thread.run_sync(self._write, data)

    def _write(self, data: bytes) -> None:
        assert self.file is not None  # opened before the first chunk
        self.file.write(data)
        self.sha.update(data)
        self.size += len(data)

    async def commit(self, descriptor: Descriptor, dest: Path) -> None:
        """Check size and digest; then flush to disk and rename into place."""
        got = "sha256:" + self.sha.hexdigest()
        if self.size != descriptor.size or got != descriptor.digest:
            raise DigestMismatch(
                descriptor.digest,
                f"fetched {self.size} bytes with digest {got} (want {descriptor.size}): discarded",
            )
        await anyio.to_thread.run_sync(self._commit, dest)

    def _commit(self, dest: Path) -> None:
        assert self.file is not None
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        self.path.rename(dest)

    async def discard(self) -> None:
        """Close and remove the temporary file, if it is still there."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._discard)

    def _discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self.path.unlink(missing_ok=True)
