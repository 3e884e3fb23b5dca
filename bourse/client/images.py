"""The client side of ``bourse image``: push, import, ls, inspect, tag, rm and gc over the
market's image store (``bourse.images.ImageStore``), as the key in hand may.

- Without credentials, or with the operator's key, the store is written directly (its
  buckets made if missing).
- A tenant's key (``auth init --buyer NAME``) pushes through the exchange
  (docs/security.md): the blobs the store lacks are staged on the tenant's own subjects
  (``bourse.images.staging``), then ``ImagePush`` asks the exchange to check and publish
  them; tag and rm are asked of the exchange too. Only names under ``NAME/`` are its own.
- ``ls`` says which workers hold each image (their status, ``WorkerStatus.image_digests``);
  ``gc`` keeps whatever a worker holds or a live machine names (every worker's status and
  machine listing), and removes nothing unless every worker the status found answered
  the listing.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, cast

import anyio
import nats.errors
from nats.aio.client import Client as NATS
from ulid import ULID

from bourse.client.client import BourseClient, ask
from bourse.client.errors import ClientError, expect
from bourse.images import ImageInfo, ImageStore, Reference, RunSpec
from bourse.images.blobstore import fetch_timeout
from bourse.images.bounds import Bounds
from bourse.images.errors import ImageNotFound
from bourse.images.importer import Blob, reading
from bourse.images.oci import Descriptor
from bourse.images.staging import Staging
from bourse.images.store import GC_GRACE_S, directory_image
from bourse.wire.codec import encode
from bourse.wire.messages import (
    ImagePush,
    ImageReply,
    ImageTag,
    ImageTagged,
    ImageUntag,
)
from bourse.wire.subjects import Subjects

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


class Progress(Protocol):
    """Where a push says how far it got (a progress bar on a terminal)."""

    def total(self, size: int) -> None:
        """The bytes the push will go through (its blobs', once known)."""

    def advance(self, size: int) -> None:
        """``size`` more bytes sent, or found stored already."""


# How long a tenant's tag or untag may take the exchange.
REQUEST_S = 10.0
# What a worker's status gather waits (ls, gc): every supplier answers at once.
STATUS_S = 2.0


@dataclass(frozen=True, slots=True)
class Pushed:
    """An image stored and tagged: ``push`` and ``import``."""

    reference: str
    digest: str
    size: int
    layers: int
    uploaded_bytes: int
    reused_bytes: int


@dataclass(frozen=True, slots=True)
class Listed:
    """A line of ``ls``: a tag, its image, and the workers holding it."""

    reference: str
    digest: str
    size: int | None
    created: str | None
    cached_by: list[str]


@dataclass(frozen=True, slots=True)
class Collected:
    """What ``gc`` removed (or would, ``dry_run``), what it kept and why."""

    removed: list[str]
    removed_bytes: int
    kept: int
    young: int  # unreferenced, but within the grace period
    in_use: int  # digests workers hold or live machines name
    dry_run: bool


class ImageClient:
    """The image commands on one connection; ``tenant``: the tenant the key is for ("" for
    the operator's, or none)."""

    def __init__(
        self, nc: NATS, subjects: Subjects, tenant: str = "", bounds: Bounds | None = None
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.tenant = tenant
        # what a push of the operator's lets in (a tenant's: the exchange's own bounds)
        self.bounds = bounds or Bounds()
        self._store: ImageStore | None = None

    async def store(self) -> ImageStore:
        """The market's image store; a tenant's key (which may make nothing) finds it or
        is told that nothing was pushed yet."""
        if self._store is None:
            self._store = await ImageStore.open(
                self.nc, self.subjects.prefix, create=not self.tenant, bounds=self.bounds
            )
        return self._store

    async def push(
        self, directory: Path, ref: str, run: RunSpec, progress: Progress | None = None
    ) -> Pushed:
        """``directory`` as a one-layer image running ``run``, tagged ``ref``."""
        tag = Reference.parse(ref)
        if not await anyio.Path(directory).is_dir():
            raise ClientError(f"{directory}: not a directory", "bad_request")
        bounds = None if self.tenant else self.bounds
        async with directory_image(directory, run, bounds=bounds) as (blobs, manifest):
            return await self._push(blobs, tag, manifest, f"directory {directory}", progress)

    async def import_image(
        self, path: Path, ref: str, pick: str = "", progress: Progress | None = None
    ) -> Pushed:
        """What docker, podman, skopeo or buildah wrote at ``path`` (an OCI layout or
        oci-archive, a docker-save tarball), tagged ``ref``; ``pick``: one image of several."""
        tag = Reference.parse(ref)
        if not await anyio.Path(path).exists():
            raise ClientError(f"{path}: no such file or directory", "bad_request")
        with contextlib.ExitStack() as stack:
            plan = await anyio.to_thread.run_sync(stack.enter_context, reading(path, pick))
            blobs = list(plan.blobs())
            return await self._push(blobs, tag, plan.descriptor, f"{path}: {plan.note}", progress)

    async def _push(
        self,
        blobs: Sequence[Blob],
        ref: Reference,
        manifest: Descriptor,
        note: str,
        progress: Progress | None,
    ) -> Pushed:
        if progress is not None:
            progress.total(sum(b.descriptor.size for b in blobs))
        if self.tenant:
            return await self._push_as_tenant(blobs, ref, manifest, progress)
        with writing(f"push {ref.tagged}"):
            store = await self.store()
            blobs = await store.bound(blobs, manifest)  # read once, checked, nothing sent yet
            counted = [counting(b, progress.advance) for b in blobs] if progress else blobs
            done = await store.push_blobs(counted, ref, manifest, note, bounded=True)
        return Pushed(
            done.reference,
            done.digest,
            done.size,
            done.layers,
            done.uploaded_bytes,
            done.reused_bytes,
        )

    async def _push_as_tenant(
        self,
        blobs: Sequence[Blob],
        ref: Reference,
        manifest: Descriptor,
        progress: Progress | None,
    ) -> Pushed:
        """Stage what the store lacks on the tenant's subjects, then ask the exchange
        (which checks the name again: this check only spares an upload it would refuse)."""
        if not ref.name.startswith(f"{self.tenant}/"):
            raise ClientError(
                f"image {ref.tagged!r} is not under tenant {self.tenant!r}'s own names "
                f"({self.tenant}/…): a tenant pushes only those",
                "bad_request",
            )
        store = await self._readable_store()
        staging = Staging(self.nc, self.subjects)
        upload = str(ULID())
        for blob in blobs:
            d = blob.descriptor
            if store is not None and await store.stat_blob(d.digest) == d.size:
                if progress is not None:
                    progress.advance(d.size)
                continue
            await staging.upload(self.tenant, upload, blob, progress.advance if progress else None)
        req = ImagePush(
            reference=ref.tagged,
            upload=upload,
            manifest=manifest.digest,
            manifest_size=manifest.size,
        )
        size = sum(b.descriptor.size for b in blobs)
        done = await self._ask("push", encode(req), fetch_timeout(size) + REQUEST_S)
        return Pushed(
            done.reference,
            done.digest,
            done.size,
            len(blobs) - 2,
            done.uploaded_bytes,
            done.reused_bytes,
        )

    async def _readable_store(self) -> ImageStore | None:
        """The store to read from, None when nothing was pushed yet."""
        try:
            return await self.store()
        except ImageNotFound:
            return None

    async def _ask(self, verb: str, body: bytes, timeout_s: float) -> ImageTagged:
        """A tenant's image request to the exchange, and its answer (ClientError: its
        Error, or none in time)."""
        subject = self.subjects.tenant_image(self.tenant, verb)
        reply = await ask(self.nc, subject, body, ImageReply, timeout_s, "exchange")
        return expect(reply, ImageTagged)

    async def ls(self) -> list[Listed]:
        """Every tag with its image's digest, size, creation time, and the workers that
        hold the image (empty when none answered holding it)."""
        store = await self._readable_store()
        if store is None:
            return []
        tags = await store.ls()
        holders = await self._holders()
        return [
            Listed(t.reference, t.digest, t.size, t.created, holders.get(t.digest, []))
            for t in tags
        ]

    async def _holders(self) -> dict[str, list[str]]:
        """Manifest digest -> the workers whose image cache holds it."""
        statuses = await BourseClient(self.nc, self.subjects).status(None, within_s=STATUS_S)
        out: dict[str, list[str]] = {}
        for st in statuses:
            for digest in st.image_digests:
                out.setdefault(digest, []).append(st.worker_id)
        return out

    async def inspect(self, ref: str) -> ImageInfo:
        """The manifest and config of the image ``ref`` names."""
        store = await self.store()
        return await store.inspect(ref)

    async def tag(self, source: str, ref: str) -> ImageTagged:
        """Give the image ``source`` names (a tag or a digest) the tag ``ref``."""
        tag = Reference.parse(ref)
        if self.tenant:
            body = encode(ImageTag(source=source, reference=tag.tagged))
            return await self._ask("tag", body, REQUEST_S)
        with writing(f"tag {tag.tagged}"):
            digest = await (await self.store()).tag(source, tag)
        return ImageTagged(reference=tag.tagged, digest=digest)

    async def remove(self, ref: str) -> ImageTagged:
        """Remove the tag ``ref`` (its blobs stay until gc): the digest it named."""
        tag = Reference.parse(ref)
        if self.tenant:
            return await self._ask("untag", encode(ImageUntag(reference=tag.tagged)), REQUEST_S)
        with writing(f"rm {tag.tagged}"):
            digest = await (await self.store()).remove_tag(tag)
        return ImageTagged(reference=tag.tagged, digest=digest)

    async def gc(self, *, dry_run: bool = False, grace_s: float = GC_GRACE_S) -> Collected:
        """Remove the blobs no tag and nothing in use reaches (``ImageStore.gc``): in use
        is what any worker's cache holds and what any machine not destroyed names."""
        if self.tenant:
            raise ClientError("image gc is the operator's: a tenant's key removes nothing")
        in_use = await self.in_use()
        with writing("gc"):
            result = await (await self.store()).gc(in_use, grace_s=grace_s, dry_run=dry_run)
        return Collected(
            removed=[b.digest for b in result.removed],
            removed_bytes=result.removed_bytes,
            kept=result.kept,
            young=result.young,
            in_use=len(in_use),
            dry_run=dry_run,
        )

    async def in_use(self) -> set[str]:
        """Every digest a worker holds or a machine not destroyed names, from every
        region's status and machine listing; ClientError when the listing is not complete
        (a worker that did not answer could be running any image)."""
        client = BourseClient(self.nc, self.subjects)
        holders = await self._holders()
        listing = await client.list_machines(None)
        if not listing.complete:
            missing = ", ".join(listing.missing) or "some workers"
            raise ClientError(
                f"not every worker listed its machines ({missing}): gc removes nothing while "
                "it cannot know what they run"
            )
        named = {m.image_digest for m in listing.machines if m.image_digest}
        return set(holders) | named


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """A write of the store, directly: a write that gets no answer is most often one the
    server refused this key (it answers a denied publish with nothing), so say so."""
    try:
        yield
    except (TimeoutError, nats.errors.TimeoutError):
        raise ClientError(
            f"{what}: the image store did not answer a write: this key may not write it (the "
            "shared buyer key and a supplier's only read; push with the operator's key, or a "
            "tenant's under its own names), or its JetStream is unavailable"
        ) from None


def counting(blob: Blob, progress: Callable[[int], None]) -> Blob:
    """``blob`` whose bytes, as they are read, are told to ``progress``."""
    data, opener = blob.data, blob.open

    @contextlib.contextmanager
    def opened() -> Iterator[IO[bytes]]:
        if data is not None:
            yield cast(IO[bytes], _Counted(io.BytesIO(data), progress))
            return
        assert opener is not None  # a Blob has bytes or an opener
        with opener() as raw:
            yield cast(IO[bytes], _Counted(cast(io.BufferedIOBase, raw), progress))

    return Blob(blob.descriptor, open=opened, unpacked=blob.unpacked)


class _Counted(io.RawIOBase):
    """A readable file that tells ``progress`` how many bytes each read returned."""

    def __init__(self, raw: io.BufferedIOBase, progress: Callable[[int], None]) -> None:
        self.raw = raw
        self.progress = progress

    def readable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:
        n = self.raw.readinto(b)
        self.progress(n)
        return n
