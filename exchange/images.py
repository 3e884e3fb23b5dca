"""The exchange's images: the store its orders' references resolve against, and the
tenants' way into it (docs/protocol.md §4.3a, §4.18; docs/security.md).

``ExchangeImages.run`` (a task of the exchange's task group) opens the image store, making
its buckets if they are missing, makes the staging stream tenants push through, and keeps a
watched copy of the tags for the ``Resolver`` the exchange's broker resolves orders with.
A store it cannot open (JetStream refuses: no room, no permission) is logged and tried
again, the exchange serving meanwhile: catalog images are placed, a digest is refused.

A tenant's push, tag and untag (``ImagePush``, ``ImageTag``, ``ImageUntag`` on
``<root>.tenant.<name>.image.<verb>``) are carried out here: the tenant is the subject's
(the server attests it), the tag must be under ``<name>/``, and a blob the store lacks is
copied from that tenant's upload only once its size and sha256 match
(bourse/images/staging.py) and, a layer, once it was read within the exchange's bounds
(``--max-image-mb``: each entry checked, its uncompressed size counted and recorded,
bourse/images/bounds.py). A blob the store holds is never written again; its recorded
size counts toward the image's (a layer stored before records were kept counts nothing:
the worker's own caps bound it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

import anyio
import nats.errors
import structlog
from anyio.abc import TaskStatus
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.auction.content import Resolver, layers_of
from bourse.images.bounds import Bounds, Cap, ImageTooBig, Tally
from bourse.images.errors import (
    BadImage,
    BadReference,
    DigestMismatch,
    ImageError,
    ImageNotFound,
    UnsafeEntry,
)
from bourse.images.oci import OCI_MANIFEST, Descriptor, decode_manifest
from bourse.images.reference import Reference
from bourse.images.staging import Staging, make_staging
from bourse.images.store import ImageStore
from bourse.images.unpack import scan
from bourse.nats.jetstream import replicas_for
from bourse.nats.responder import Responder
from bourse.wire.codec import decode
from bourse.wire.messages import (
    SHUTTING_DOWN_REASON,
    ImagePush,
    ImageTag,
    ImageTagged,
    ImageUntag,
)
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.exchange")

# A store that could not be opened is tried again after this, doubling up to the most.
RETRY_S = 2.0
RETRY_MAX_S = 60.0
# Pushes copied at once (each reads a tenant's upload and writes the store): more wait.
PUSHES_AT_ONCE = 2
# A tenant's image requests, by verb (the subject's last token).
IMAGE_VERBS: dict[str, type[ImagePush | ImageTag | ImageUntag]] = {
    "push": ImagePush,
    "tag": ImageTag,
    "untag": ImageUntag,
}


class NotYours(ImageError, ValueError):
    """A tenant's request naming an image outside its own prefix."""


# Failures that are the request's own (answered bad_request); other image errors (the
# store unreachable, not open yet) are the market's (internal).
REQUEST_ERRORS = (
    BadImage,
    BadReference,
    ImageNotFound,
    DigestMismatch,
    NotYours,
    UnsafeEntry,
    ImageTooBig,
)


class ExchangeImages:
    """The image store as one exchange instance uses it; see the module's docstring."""

    def __init__(
        self, nc: NATS, subjects: Subjects, responder: Responder, bounds: Bounds | None = None
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.responder = responder  # answers the tenants' requests
        self.bounds = bounds or Bounds()  # what a tenant's push lets in
        self.resolver = Resolver()
        self.store: ImageStore | None = None
        self.staging: Staging | None = None
        self._pushes = anyio.Semaphore(PUSHES_AT_ONCE)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the store and follow its tags until cancelled; say started after the first
        try, whether the store opened or not."""
        status: TaskStatus[None] | None = task_status
        delay = RETRY_S
        while True:
            try:
                self.store = await ImageStore.open(
                    self.nc, self.subjects.prefix, replicas=replicas_for(self.nc)
                )
                break
            except (ImageError, nats.errors.Error, TimeoutError) as exc:
                log.warning("image_store_unavailable", error=str(exc) or repr(exc), retry_s=delay)
            if status is not None:
                status.started()
                status = None
            await anyio.sleep(delay)  # the pace of the retries, not a synchronisation
            delay = min(delay * 2, RETRY_MAX_S)
        await self._open_staging()
        await self.resolver.watch(self.store, task_status=status or anyio.TASK_STATUS_IGNORED)

    async def _open_staging(self) -> None:
        """The staging stream, made if missing; without it tenants' pushes are refused."""
        try:
            await make_staging(self.nc, self.subjects, replicas_for(self.nc))
        except (ImageError, nats.errors.Error, TimeoutError) as exc:
            log.warning("image_staging_unavailable", error=str(exc) or repr(exc))
            return
        self.staging = Staging(self.nc, self.subjects)

    def _ready(self) -> tuple[ImageStore, Staging | None]:
        if self.store is None:
            raise ImageError("the image store is not open on this exchange (yet): try again")
        return self.store, self.staging

    async def on_tenant_image(self, msg: Msg) -> None:
        """A tenant's image push, tag or untag: its own names only."""
        tenant, _, verb = self.subjects.tail(msg.subject, 1)
        kind = IMAGE_VERBS.get(verb)
        if kind is None:
            await self.responder.error(
                msg,
                "unknown_subject",
                f"unknown image verb {verb!r}: use one of {', '.join(IMAGE_VERBS)}",
            )
            return
        self.responder.spawn(msg, self._request(msg, tenant, decode(msg.data, kind)))

    async def _request(self, msg: Msg, tenant: str, req: ImagePush | ImageTag | ImageUntag) -> None:
        try:
            if isinstance(req, ImagePush):
                done: ImageTagged = await self.push(tenant, req)
            elif isinstance(req, ImageTag):
                done = await self.tag(tenant, req)
            else:
                done = await self.untag(tenant, req)
        except asyncio.CancelledError:  # the stop cut it short: say so, then go
            with contextlib.suppress(Exception):
                detail = "the exchange is stopping: send the image request again"
                await self.responder.error(msg, "internal", detail, SHUTTING_DOWN_REASON)
            raise
        except REQUEST_ERRORS as exc:
            log.warning("image_request_refused", tenant=tenant, error=str(exc))
            await self.responder.error(msg, "bad_request", str(exc))
            return
        except (ImageError, nats.errors.Error, TimeoutError) as exc:
            await self.responder.error(msg, "internal", str(exc) or type(exc).__name__)
            return
        await self.responder.reply(msg, done)

    async def push(self, tenant: str, req: ImagePush) -> ImageTagged:
        """Publish the image a tenant staged: its manifest and every blob it names in the
        store (copied from the upload where missing, checked), then its tag; the upload is
        cleared whatever happened."""
        staging = self.staging
        try:
            ref = own(tenant, req.reference)
            store, _ = self._ready()
            if staging is None:
                raise ImageError("no image staging stream on this market: pushes are refused")
            async with self._pushes:
                return await self._publish(tenant, req, ref, store, staging)
        finally:
            if staging is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(RETRY_S):
                    await staging.clear(tenant, req.upload)

    async def _publish(
        self, tenant: str, req: ImagePush, ref: Reference, store: ImageStore, staging: Staging
    ) -> ImageTagged:
        want = Descriptor(media_type=OCI_MANIFEST, digest=req.manifest, size=req.manifest_size)
        uploaded = reused = 0
        # the manifest first: it says which blobs there are (and it is checked first)
        if await store.stat_blob(want.digest) == want.size:
            reused += want.size
        else:
            await staging.copy(tenant, req.upload, want, store)
            uploaded += want.size
        data = await store.read_blob(want.digest)
        layers_of(data, f"manifest {want.digest}")  # an image manifest, as orders need
        manifest = decode_manifest(data, f"manifest {want.digest}")
        tally = Tally(self.bounds)
        for blob in (manifest.config, *manifest.layers):
            layer = blob is not manifest.config
            if await store.stat_blob(blob.digest) == blob.size:
                reused += blob.size
                if layer and (known := await store.unpacked_size(blob.digest)) is not None:
                    tally.add(blob.digest, blob.size, known, known)
                continue
            check = functools.partial(_bounded, blob, tally.cap(blob.size)) if layer else None
            unpacked = await staging.copy(tenant, req.upload, blob, store, check)
            if unpacked is not None:
                tally.add(blob.digest, blob.size, unpacked)
            uploaded += blob.size
        await store.set_tag(ref, want.digest)
        log.info(
            "image_pushed_for_tenant",
            tenant=tenant,
            reference=ref.tagged,
            digest=want.digest,
            uploaded_bytes=uploaded,
            reused_bytes=reused,
        )
        return ImageTagged(
            reference=ref.tagged,
            digest=want.digest,
            size=uploaded + reused,
            uploaded_bytes=uploaded,
            reused_bytes=reused,
        )

    async def tag(self, tenant: str, req: ImageTag) -> ImageTagged:
        """Give the image ``req.source`` names the tenant's tag ``req.reference``."""
        ref = own(tenant, req.reference)
        store, _ = self._ready()
        digest = await store.tag(req.source, ref)
        return ImageTagged(reference=ref.tagged, digest=digest)

    async def untag(self, tenant: str, req: ImageUntag) -> ImageTagged:
        """Remove the tenant's tag ``req.reference``."""
        ref = own(tenant, req.reference)
        store, _ = self._ready()
        return ImageTagged(reference=ref.tagged, digest=await store.remove_tag(ref))


def own(tenant: str, reference: str) -> Reference:
    """``reference`` as a tag of ``tenant``'s: ``name[:tag]`` with a name under
    ``<tenant>/``; else refused, naming why."""
    ref = Reference.parse(reference)
    if ref.digest:
        raise BadImage(f"{reference!r} names a digest: a tag is name[:tag]")
    if not ref.name.startswith(f"{tenant}/"):
        raise NotYours(
            f"image {ref.tagged!r} is not under tenant {tenant!r}'s own names "
            f"({tenant}/…): a tenant pushes and tags only those"
        )
    return ref


def _bounded(layer: Descriptor, cap: Cap, path: Path) -> int:
    """A staged layer's file read once within ``cap`` (its digest was checked as it was
    staged): its uncompressed size."""
    with path.open("rb") as f:
        return scan(f, layer.digest, cap, verify=False)
