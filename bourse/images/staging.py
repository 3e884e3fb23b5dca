"""A tenant's way into the image store: the staging stream (docs/protocol.md §4.18,
docs/security.md).

The image store is written only by the operator's key and the exchange. A tenant pushes
through the exchange: it publishes each blob the store lacks as JetStream messages on its
own subject ``<root>.stage.<tenant>.<upload>.<hex>`` (its chunks, in order), which only
its user may publish and one stream, ``<PREFIX>_IMAGE_STAGING``, stores; then it asks the
exchange (``ImagePush`` on ``<root>.tenant.<tenant>.image.push``) to publish the image.
The exchange takes the tenant's name from the subjects (the server attests both), reads
each blob the store lacks back from that tenant's upload, checks its size and sha256
before a byte of it reaches the store (``copy``), writes the tag and clears the upload
(``clear``). A blob the store holds already is never written again, so no tenant can
replace another's content; a tenant reads nothing of the stream.

Each layer is read once more before it is stored, as the operator's push reads it
(bourse/images/bounds.py: entries checked, its uncompressed size within the exchange's
``max_image_mb`` and ratio, recorded beside it); a layer the store holds is not.

The stream keeps what it is given for ``MAX_AGE_S`` at most (an abandoned upload goes by
itself) and refuses new chunks past ``DEFAULT_MAX_BYTES`` (never drops another upload's).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import anyio
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from bourse.images.blobstore import CHUNK_BYTES
from bourse.images.errors import BadImage, DigestMismatch, StoreUnavailable
from bourse.images.importer import Blob
from bourse.images.oci import Descriptor
from bourse.images.store import API_TIMEOUT_S, ImageStore
from bourse.nats.jetstream import NOT_ENABLED, prefix_token
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.images")

# An upload left behind (a push given up) is dropped by the stream after this.
MAX_AGE_S = 24 * 3600.0
# What the stream holds at most, every tenant's uploads together; past it new chunks are
# refused (the push fails; nothing staged before is dropped). `bourse jetstream init
# --staging-max-mib` sets another.
DEFAULT_MAX_BYTES = 1024**3
# Called with the bytes of each chunk sent or copied (a progress bar).
Progress = Callable[[int], None]


def staging_name(prefix: str) -> str:
    """The staging stream of a subject prefix: ``bourse`` -> ``BOURSE_IMAGE_STAGING``."""
    return prefix_token(prefix) + "_IMAGE_STAGING"


def staging_config(
    subjects: Subjects, replicas: int = 1, max_bytes: int = DEFAULT_MAX_BYTES
) -> StreamConfig:
    """The staging stream's settings (direct gets: the exchange reads a blob's chunks one
    request each, no consumer)."""
    return StreamConfig(
        name=staging_name(subjects.prefix),
        description="Bourse image staging: tenants' blobs on their way into the image store",
        subjects=[subjects.stage_all],
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_bytes=max_bytes,
        max_age=MAX_AGE_S,
        discard=DiscardPolicy.NEW,
        allow_direct=True,
    )


async def make_staging(
    nc: NATS, subjects: Subjects, replicas: int = 1, max_bytes: int = DEFAULT_MAX_BYTES
) -> bool:
    """Make the staging stream if it is missing (an existing one keeps its settings);
    whether it was made. ``StoreUnavailable`` when JetStream refuses."""
    js = nc.jetstream(timeout=API_TIMEOUT_S)
    name = staging_name(subjects.prefix)
    try:
        await js.stream_info(name)
        return False
    except nats.js.errors.NotFoundError:
        pass
    except nats.errors.NoRespondersError:
        raise StoreUnavailable(f"stream {name}: the NATS server has no JetStream") from None
    try:
        await js.add_stream(staging_config(subjects, replicas, max_bytes))
    except nats.js.errors.BadRequestError:
        return False  # made meanwhile by another process
    except nats.js.errors.APIError as exc:
        if exc.err_code in NOT_ENABLED:
            raise StoreUnavailable(f"stream {name}: the NATS server has no JetStream") from None
        raise StoreUnavailable(f"stream {name}: {exc}") from None
    log.info("image_staging_created", stream=name, replicas=replicas, max_bytes=max_bytes)
    return True


class Staging:
    """One market's staging stream, on one connection."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.js: JetStreamContext = nc.jetstream(timeout=API_TIMEOUT_S)
        self.subjects = subjects
        self.stream = staging_name(subjects.prefix)
        self.chunk_bytes = min(CHUNK_BYTES, nc.max_payload // 2)

    async def upload(
        self, tenant: str, upload: str, blob: Blob, progress: Progress | None = None
    ) -> None:
        """Publish ``blob``'s bytes as chunks on the tenant's subject for it, each stored
        (acknowledged) before the next goes. ``StoreUnavailable`` names why one was not."""
        subject = self.subjects.stage(tenant, upload, blob.descriptor.hex)
        if blob.data is not None:
            await self._send(subject, blob.data, progress)
            return
        assert blob.open is not None  # a Blob has bytes or an opener
        with blob.open() as f:
            while chunk := await anyio.to_thread.run_sync(f.read, self.chunk_bytes):
                await self._send(subject, chunk, progress)

    async def _send(self, subject: str, chunk: bytes, progress: Progress | None) -> None:
        for at in range(0, len(chunk), self.chunk_bytes):
            part = chunk[at : at + self.chunk_bytes]
            try:
                await self.js.publish(subject, part, stream=self.stream)
            except nats.js.errors.NoStreamResponseError:
                raise StoreUnavailable(
                    f"no image staging stream {self.stream} on this market (an exchange "
                    "makes it at its start, or `bourse jetstream init`)"
                ) from None
            except nats.js.errors.APIError as exc:
                raise StoreUnavailable(f"staging refused a chunk: {exc}") from None
            if progress is not None:
                progress(len(part))

    async def copy(
        self,
        tenant: str,
        upload: str,
        want: Descriptor,
        store: ImageStore,
        check: Callable[[Path], int] | None = None,
    ) -> int | None:
        """Read the staged chunks of ``want`` from the tenant's upload into a temporary
        file, check their size and digest, then ``check`` the file (a layer: read once
        within its bounds, bourse/images/bounds.py; in a worker thread), then store them
        with what it found, the layer's uncompressed size (returned; None: not a layer).
        Refused (nothing stored): ``BadImage`` when the upload lacks the blob or part of
        it, ``DigestMismatch`` when its bytes are not ``want``'s, whatever ``check``
        raises."""
        subject = self.subjects.stage(tenant, upload, want.hex)
        with tempfile.TemporaryDirectory(prefix="bourse-stage-") as tmp:
            path = Path(tmp) / want.hex
            sha = hashlib.sha256()
            size = seq = 0
            with path.open("wb") as out:
                while size < want.size:
                    msg = await self._next(subject, seq)
                    if msg is None:
                        what = f"{size} of its {want.size} bytes" if size else "none of it"
                        raise BadImage(
                            f"blob {want.digest} is not in the image store and the upload "
                            f"staged {what}"
                        )
                    seq, data = msg
                    size += len(data)
                    if size > want.size:
                        raise DigestMismatch(
                            want.digest, f"more than its {want.size} bytes staged: not stored"
                        )
                    await anyio.to_thread.run_sync(_write, out, sha, data)
            got = "sha256:" + sha.hexdigest()
            if got != want.digest:
                raise DigestMismatch(
                    want.digest, f"the {size} bytes staged have digest {got}: not stored"
                )
            unpacked = await anyio.to_thread.run_sync(check, path) if check else None
            blob = Blob(want, open=lambda: path.open("rb"), unpacked=unpacked)
            await store.put_blob(blob, "staged blob")
            return unpacked

    async def _next(self, subject: str, after: int) -> tuple[int, bytes] | None:
        """The first chunk on ``subject`` after sequence ``after`` (a direct get), or None."""
        try:
            raw = await self.js.get_msg(
                self.stream, seq=after + 1, subject=subject, next=True, direct=True
            )
        except nats.js.errors.NotFoundError:
            return None
        return raw.seq or 0, raw.data or b""

    async def clear(self, tenant: str, upload: str) -> None:
        """Remove what an upload staged (gone already is fine)."""
        await self.js.purge_stream(self.stream, subject=self.subjects.stage_upload(tenant, upload))


def _write(out: IO[bytes], sha: hashlib._Hash, data: bytes) -> None:
    out.write(data)
    sha.update(data)
