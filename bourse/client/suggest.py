"""What a misspelt region or image most likely meant, asked of the market only once an order
or a deploy was refused for it (nothing is asked on the way of one that goes through): the
regions whose workers answer, and the images the store holds or a worker's catalog names.
The nearest name is bourse/runtime/words.py's. A hint that cannot be had is none: it never
takes the place of the error it is for."""

from __future__ import annotations

from typing import TYPE_CHECKING

import nats.errors

from bourse.errors import BourseError
from bourse.runtime.words import did_you_mean

if TYPE_CHECKING:
    from bourse.client.client import BourseClient


async def region_hint(client: BourseClient, region: str) -> str:
    """``" (did you mean 'mad'?)"`` from the regions whose workers answer, or ``""``."""
    try:
        regions = {s.region for s in await client.status(None)}
    except BourseError:
        return ""
    return did_you_mean(region, regions)


async def image_hint(client: BourseClient, image: str, regions: list[str]) -> str:
    """``" (did you mean 'hello:latest'?)"`` from the store's tags (and their names) and the
    images the workers of ``regions`` list (their catalogs), or ``""``."""
    names: set[str] = set()
    try:
        for region in regions:
            for s in await client.status(region):
                names.update(i for i in s.images if not i.startswith("sha256:"))
    except BourseError:
        pass
    names.update(await _tags(client))
    return did_you_mean(image, names)


async def _tags(client: BourseClient) -> set[str]:
    """The store's tags and their names (``hello:latest`` and ``hello``); none when there
    is no store to read."""
    from bourse.images import ImageError, ImageStore

    try:
        store = await ImageStore.open(client.nc, client.subjects.prefix, create=False)
        async with store.watch_tags() as index:
            refs = [e.reference for e in index.entries()]
    except (ImageError, nats.errors.Error, TimeoutError):  # no store, no read of it here
        return set()
    return {r.tagged for r in refs} | {r.name for r in refs}
