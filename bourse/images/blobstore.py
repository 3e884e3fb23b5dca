"""The blobs and tags of the image store on NATS: a JetStream Object Store of blobs, each
named by its digest, and a KV bucket of tags beside it. ``BlobStore`` works on the two
buckets once open; ``bourse.images.store.ImageStore`` (which opens them) adds the images.

- A blob's object name is its digest, ``sha256:<hex>``. Writing checks the digest the
  object store computed over the bytes it sent against the descriptor's; a mismatch
  deletes the object and raises. A blob already stored under its digest is not sent again.
- Reading streams the object's chunks from an ordered consumer (nats-py's ``get()`` is
  quadratic into memory, nats.py#703, and slower even into a file; it has no bound and
  checks no size): into memory for a manifest or config (at most 4 MiB), into a temporary
  file for a layer, each bounded in time, counted against the descriptor's size and hashed;
  only a file that matched is renamed into place (I7).
- A layer's uncompressed size, once a push checked it (bourse/images/bounds.py), is
  recorded beside the blob: the object's header ``Bourse-Unpacked-Size`` (its meta, written
  with the object, so a blob never exists without the record a push gave it; neither its
  digest nor its manifest's changes). A blob stored before without one gets it from the
  next push that checks the same bytes.
- A tag's key is ``name:tag`` escaped (``reference.tag_key``); its value is the manifest's
  digest (``TagRecord``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, cast

import anyio
import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bourse.images.bounds import UNPACKED_HEADER
from bourse.images.errors import BadImage, DigestMismatch, ImageNotFound, PullTimeout
from bourse.images.importer import Blob
from bourse.images.oci import MAX_DOCUMENT_BYTES, Descriptor, check_blob, digest_of_object
from bourse.images.reference import Reference, check_digest, tag_key
from bourse.images.tags import TagIndex, TagRecord, decode_record

log = structlog.get_logger("bourse.images")

# Object chunks: fewer, larger messages cost fewer acks (100 MB: 0.6 s at 128 KiB, 0.4 s at
# 512 KiB on one machine); at most half the server's max_payload.
CHUNK_BYTES = 512 * 1024
# A blob's fetch is bounded by a floor plus its size at a slow rate: a stalled stream ends.
FETCH_FLOOR_S = 30.0
FETCH_MIN_BYTES_PER_S = 4 * 1024 * 1024
# Bounds an unsubscribe run shielded from cancellation.
CLEANUP_TIMEOUT_S = 2.0


def fetch_timeout(size: int) -> float:
    """How long a blob of ``size`` bytes may take to fetch."""
    return FETCH_FLOOR_S + size / FETCH_MIN_BYTES_PER_S


@dataclass(frozen=True, slots=True)
class StoredBlob:
    """A blob in the store: digest, size and when it was written (the writer's clock)."""

    digest: str
    size: int
    mtime: float


class BlobStore:
    """The blobs and tags of one subject prefix, on one connection (its buckets open)."""

    def __init__(self, js: JetStreamContext, objects: ObjectStore, tags: KeyValue, bucket: str):
        self.js = js
        self.objects = objects
        self.tags = tags
        self.bucket = bucket
        self.chunk_bytes = CHUNK_BYTES

    # -- blobs -------------------------------------------------------------------------

    async def stat_blob(self, digest: str) -> int | None:
        """The size of the blob stored under ``digest`` (None when absent, or stored with
        other bytes than its name says)."""
        info = await self._info(digest)
        if info is None or digest_of_object(info.digest or "") != digest:
            return None
        return info.size or 0

    async def unpacked_size(self, digest: str) -> int | None:
        """A layer's uncompressed size as its push recorded it (None: no record, or no
        such blob)."""
        info = await self._info(digest)
        return _recorded(info) if info is not None else None

    async def put_blob(self, blob: Blob, what: str = "") -> bool:
        """Store ``blob`` unless it is there already (False then; its uncompressed size,
        if given, recorded where the stored one has none); the bytes sent are checked
        against its descriptor (``DigestMismatch`` names it, nothing is kept)."""
        want = blob.descriptor
        info = await self._info(want.digest)
        stored = info is not None and digest_of_object(info.digest or "") == want.digest
        if info is not None and stored and info.size == want.size:
            if blob.unpacked is not None and _recorded(info) is None:
                info.headers = {**(info.headers or {}), **_record(blob.unpacked)}
                await self.objects.update_meta(want.digest, info.meta)
            return False
        meta = ObjectMeta(
            name=want.digest,
            headers=_record(blob.unpacked) if blob.unpacked is not None else None,
            options=ObjectMetaOptions(max_chunk_size=self.chunk_bytes),
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
        ref = tag_only(ref)
        record = TagRecord(digest=check_digest(digest), tagged_ms=int(time.time() * 1000))
        await self.tags.put(tag_key(ref), msgspec.json.encode(record))
        log.info("image_tagged", reference=ref.tagged, digest=digest)

    async def remove_tag(self, ref: Reference | str) -> str:
        """Remove a tag (its blobs stay until ``gc``); the digest it named."""
        ref = tag_only(ref)
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


def _record(unpacked: int) -> dict[str, list[str]]:
    """An object's header recording a layer's uncompressed size (as NATS headers are in
    an object's meta: a name, its values)."""
    return {UNPACKED_HEADER: [str(unpacked)]}


def _recorded(info: ObjectInfo) -> int | None:
    """The uncompressed size an object's header records, None without one (or unreadable)."""
    value = (info.headers or {}).get(UNPACKED_HEADER)
    if isinstance(value, list):
        value = value[0] if value else None
    try:
        size = int(value) if isinstance(value, str | int) else -1
    except ValueError:
        return None
    return size if size >= 0 else None


def tag_only(ref: Reference | str) -> Reference:
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
