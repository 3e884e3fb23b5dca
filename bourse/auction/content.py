"""What an order's image is, as content: its reference resolved where the order enters
(docs/protocol.md §4.3a), the exchange's or a direct buyer's, once per order.

``ImageContent`` is what the auction's core is given with the order: the manifest digest
and the layers the bid carries (``CATALOG``, both empty, for a name no image store knows).
A ``Resolver`` makes it:

- a ``name@sha256:…`` reference is its digest; the store must hold the manifest, else
  ``ImageNotFound`` (the order is refused ``image_unknown``, never left to time out);
- a ``name[:tag]`` is looked up in a WATCHED local copy of the tags (``TagIndex``, kept
  current by a KV watch): the digest the tag names now, or ``CATALOG`` when the store has
  no such tag (a worker's catalog image, the simulated ones);
- a manifest's layers are read from the store once per digest and kept (a bounded LRU:
  a manifest never changes under its digest);
- what a reference resolved to is kept too, until a tag changes: an order whose image was
  seen before (every order of a catalog image) costs one dictionary lookup
  (``Resolver.known``); only a miss awaits ``resolve``.

The watch runs in its owner's task group (``Resolver.watch``: the exchange's; a direct
client's own task), started again after a failure, the last copy kept meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import structlog
from anyio.abc import TaskStatus

from bourse.images.errors import BadImage, BadReference, ImageNotFound
from bourse.images.oci import decode_manifest, kind_of
from bourse.images.reference import Reference
from bourse.images.store import ImageStore
from bourse.images.tags import TagIndex
from bourse.runtime.supervise import unwrap
from bourse.wire.limits import MAX_LAYERS
from bourse.wire.messages import Layer

log = structlog.get_logger("bourse.images")

# References resolved and kept (a plain dict, emptied when full: buyers choose the strings).
MEMO_MAX = 4096
# Manifests' layers kept, least recently used out first.
LAYERS_MAX = 1024
# A failed tag watch is started again after this pause (not synchronisation: a back-off).
WATCH_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class ImageContent:
    """An image as content: its manifest ``digest`` and its ``layers`` (the list every bid
    of it carries, shared, never changed), or both empty for a catalog name."""

    digest: str = ""
    layers: list[Layer] = field(default_factory=list)


CATALOG = ImageContent()


class Manifests(Protocol):
    """Where manifests are read from (``ImageStore``)."""

    async def read_blob(self, digest: str) -> bytes: ...


class Tags(Protocol):
    """Where a tag is read from when there is no watched copy (``ImageStore``)."""

    async def lookup(self, ref: Reference | str) -> str: ...


class Resolver:
    """Resolves order references to content; see the module's docstring. Without a store
    (no JetStream, or before ``attach``) every name is a catalog name and a digest is
    refused. ``lookup``: where a tag is read, one request each, while there is no
    ``index`` (a one-shot tool: a dry run through the exchange)."""

    def __init__(
        self,
        index: TagIndex | None = None,
        blobs: Manifests | None = None,
        lookup: Tags | None = None,
    ) -> None:
        self.index = index
        self.blobs = blobs
        self.lookup = lookup
        self._memo: dict[str, ImageContent] = {}
        self._version = -1  # the index's version the memo was made under
        self._layers: OrderedDict[str, ImageContent] = OrderedDict()

    def attach(self, index: TagIndex, blobs: Manifests) -> None:
        """Resolve from ``index`` and ``blobs`` from now on."""
        self.index, self.blobs = index, blobs
        self._memo.clear()

    def known(self, image: str) -> ImageContent | None:
        """What ``image`` resolved to, if it was resolved since the tags last changed (a
        dictionary lookup); None: ``resolve`` it."""
        index = self.index
        if index is not None and index.version != self._version:
            self._memo.clear()
            self._version = index.version
        return self._memo.get(image)

    async def resolve(self, image: str) -> ImageContent:
        """The content ``image`` names now. ``ImageNotFound``: a digest the store does not
        hold (or a tag naming one); ``BadReference``: a digest reference that is malformed;
        ``BadImage``: a digest naming something that is not an image manifest; the
        store's own errors when it cannot be read."""
        hit = self.known(image)
        if hit is not None:
            return hit
        version = self._version
        content = await self._resolve(image)
        if self.known(image) is None and self._version == version:  # no tag moved meanwhile
            if len(self._memo) >= MEMO_MAX:
                self._memo.clear()
            self._memo[image] = content
        return content

    async def _resolve(self, image: str) -> ImageContent:
        try:
            ref = Reference.parse(image)
        except BadReference:
            if "@sha256:" in image:
                raise  # a digest was meant: say what is wrong with it
            return CATALOG  # a string only a worker's catalog can know
        if ref.digest:
            return await self.content(ref.digest, f"image {image!r}")
        digest = await self._tagged(ref)
        if digest is None:
            return CATALOG
        return await self.content(digest, f"image {image!r} (tag {ref.tagged})")

    async def _tagged(self, ref: Reference) -> str | None:
        """The manifest digest ``ref``'s tag names, None when there is no such tag."""
        if self.index is not None:
            entry = self.index.get(ref)
            return entry.digest if entry is not None else None
        if self.lookup is not None:
            try:
                return await self.lookup.lookup(ref)
            except ImageNotFound:
                return None
        return None

    async def content(self, digest: str, what: str) -> ImageContent:
        """The content of the manifest ``digest`` (its layers read once, then kept)."""
        kept = self._layers.get(digest)
        if kept is not None:
            self._layers.move_to_end(digest)
            return kept
        if self.blobs is None:
            raise ImageNotFound(f"{what}: no image store here to find {digest} in")
        try:
            data = await self.blobs.read_blob(digest)
        except ImageNotFound:
            raise ImageNotFound(f"{what}: the image store holds no {digest}") from None
        content = ImageContent(digest, layers_of(data, f"{what}: {digest}"))
        self._layers[digest] = content
        if len(self._layers) > LAYERS_MAX:
            self._layers.popitem(last=False)
        return content

    async def watch(
        self, store: ImageStore, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep a watched copy of ``store``'s tags attached until cancelled. Says started
        once the first replay is done, or failed (logged: the resolver goes on without, or
        with the copy it had); a watch that fails is started again."""
        status: TaskStatus[None] | None = task_status
        while True:
            index = TagIndex(store.tags)
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(index.run)
                    self.attach(index, store)
                    if status is not None:
                        status.started()
                        status = None
            except Exception as exc:  # an ExceptionGroup of the watch's failure
                log.warning("image_tags_watch_failed", error=repr(unwrap(exc)))
            if status is not None:
                status.started()
                status = None
            await anyio.sleep(WATCH_RETRY_S)  # the pace of the retries, not a synchronisation


def layers_of(data: bytes, what: str) -> list[Layer]:
    """The layers (digest, size) of the image manifest ``data``, as a bid carries them;
    ``BadImage`` for an index or anything but an image manifest, or more layers than a bid
    may carry."""
    if kind_of(data, what) != "manifest":
        raise BadImage(f"{what} is an index, not an image manifest: name one of its images")
    manifest = decode_manifest(data, what)
    if len(manifest.layers) > MAX_LAYERS:
        raise BadImage(f"{what} has {len(manifest.layers)} layers: a bid carries {MAX_LAYERS}")
    return [Layer(digest=d.digest, size=d.size) for d in manifest.layers]
