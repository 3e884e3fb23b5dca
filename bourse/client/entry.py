"""An order's image resolved where the order enters, as the exchange resolves it (§4.3a):
in direct mode from a watched copy of the image store's tags (started at the first order,
in a task the client owns), else with one read of the tag.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import anyio
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.client.errors import refusal
from bourse.runtime.tasks import TaskSet
from bourse.wire.subjects import Subjects

if TYPE_CHECKING:
    from bourse.auction.broker import Refused
    from bourse.auction.content import ImageContent, Resolver

log = structlog.get_logger("bourse.client")

# Direct mode: a market with no image store yet (nothing pushed) is asked again after this.
STORE_RETRY_S = 5.0
# Direct mode: how long the first order waits for the watched copy of the tags.
WATCH_START_S = 5.0


class Images:
    """A client's images: the watch of the store's tags (direct mode) and one image's
    content."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self._tasks = TaskSet("client.images")
        self._watching = False
        self._opening = asyncio.Lock()  # one opening of the store at a time
        self._store_at = 0.0  # monotonic: when the image store may be opened (again)

    async def close(self) -> None:
        await self._tasks.finish(0.0)

    async def watch(self, resolver: Resolver) -> None:
        """Direct mode: watch the image store's tags from now on for ``resolver`` (once the
        copy is replayed, or ``WATCH_START_S``); a no-op once watching. A market with no
        image store yet is asked again ``STORE_RETRY_S`` later; meanwhile every image is a
        catalog name and a digest is refused."""
        if self._watching:
            return
        from bourse.images.errors import ImageError
        from bourse.images.store import ImageStore

        async with self._opening:
            if self._watching or time.monotonic() < self._store_at:
                return
            try:
                store = await ImageStore.open(self.nc, self.subjects.prefix, create=False)
            except (ImageError, nats.errors.Error, TimeoutError) as exc:
                log.info("image_store_not_open", error=str(exc) or repr(exc))
                self._store_at = time.monotonic() + STORE_RETRY_S
                return
            self._watching = True
            ready = anyio.Event()

            async def watch() -> None:
                async with anyio.create_task_group() as tg:
                    await tg.start(resolver.watch, store)
                    ready.set()

            self._tasks.spawn(watch())
            with anyio.move_on_after(WATCH_START_S):
                await ready.wait()

    async def content(self, watched: Resolver | None, image: str) -> ImageContent:
        """What ``image`` names now: from ``watched`` (direct mode's copy, watched from the
        first call) or with one read of its tag. ClientError as the exchange refuses."""
        from bourse.auction.broker import Refused, resolve_image

        if watched is not None:
            await self.watch(watched)
            found = await resolve_image(watched, image)
        else:
            found = await self._in_store(image)
        if isinstance(found, Refused):
            raise refusal(found.error())
        return found

    async def _in_store(self, image: str) -> ImageContent | Refused:
        """``image`` resolved with one read of its tag in the store (no watched copy here);
        every name is a catalog name where there is no image store yet."""
        from bourse.auction.broker import RESOLVE_ERRORS, image_refusal, resolve_image
        from bourse.auction.content import CATALOG, Resolver
        from bourse.images.errors import ImageNotFound
        from bourse.images.store import ImageStore

        try:
            store = await ImageStore.open(self.nc, self.subjects.prefix, create=False)
        except ImageNotFound:
            return CATALOG
        except RESOLVE_ERRORS as exc:
            return image_refusal(image, exc)
        return await resolve_image(Resolver(blobs=store, lookup=store), image)
