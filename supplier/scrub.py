"""The scrub: a supplier's background check of its workers' image roots, paced so that it
costs little.

Every root a worker's content cache holds is read whole against its inventory
(bourse/images/inventory.py, ``ImageCache.check``) once every ``every_s`` (an hour by
default): first the roots adopted at the supplier's start (only walked then), then the one
read longest ago. One root at a time over the whole process, its reading paced to
``bytes_per_s`` (8 MiB/s by default): a root of 64 MiB and 2,052 entries was read in 8.5 s
taking 0.13 s of CPU, 1.6% of one core (SHA-256 runs at 700 to 900 MB/s on a core of this
machine), so a cache of 1 GiB is read whole in a little over two minutes of each hour.
Nothing of it is on the start path of a machine: a start uses a root as the cache holds
it.

A root that differs is removed by its cache (made again from its layers at its next use)
and announced: an ``image_tampered`` event of its worker (at-most-once, like
``hold_expired``: no machine's state changes), its detail saying when it was found
(``adopted``: at the supplier's start, ``scrub``) and what differed, beside the cache's
``image_root_tampered`` log line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

from bourse.images.cache import ImageCache
from supplier.worker import Worker

log = structlog.get_logger("bourse.supplier")

MIB = 1024 * 1024
TAMPERED = "image_tampered"
# An event's detail says at most this much of what differed (the cache's log line says it
# all).
MAX_DETAIL = 1024


@dataclass(frozen=True, slots=True)
class Scrubbing:
    """How the scrub runs: the bytes it reads a second at most, and how often each root is
    read whole."""

    bytes_per_s: float = 8 * MIB
    every_s: float = 3600.0


class Scrub:
    """The scrub of the content caches of ``workers`` (see the module doc)."""

    def __init__(self, workers: Mapping[str, Worker], scrubbing: Scrubbing = Scrubbing()) -> None:
        self.workers = workers
        self.scrubbing = scrubbing

    def _caches(self) -> list[tuple[Worker, ImageCache]]:
        return [(w, w.images.content) for w in self.workers.values() if w.images.content]

    def __bool__(self) -> bool:
        """Whether there is anything to scrub here (a worker with a content cache)."""
        return bool(self._caches())

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Announce what the caches' opening removed, then scrub until cancelled."""
        self.announce()
        task_status.started()
        while True:
            await self.round()
            await anyio.sleep(self._rest())

    async def round(self) -> int:
        """Read every root that is due, each worker's in turn; what was found is announced
        as it is found. The roots read."""
        read = 0
        for w, cache in self._caches():
            for manifest in cache.checks.due(self.scrubbing.every_s):
                try:
                    await cache.checks.check(manifest, self._pace)
                except Exception as exc:  # the scrub never takes its supplier down
                    log.error(
                        "image_scrub_failed",
                        worker_id=w.worker_id,
                        manifest=manifest,
                        error=repr(exc),
                    )
                self.announce()
                read += 1
        return read

    def announce(self) -> int:
        """Each root the caches removed as tampered since the last call, as its worker's
        ``image_tampered`` event. How many."""
        count = 0
        for w, cache in self._caches():
            for found in cache.checks.take_found():
                detail = f"{found.found}: {found.why}"[:MAX_DETAIL]
                w.emit(w.event(TAMPERED, image_digest=found.manifest, detail=detail))
                count += 1
        return count

    async def _pace(self, read: int) -> None:
        await anyio.sleep(read / self.scrubbing.bytes_per_s)

    def _rest(self) -> float:
        """Until the next root falls due: at least a second (or ``every_s`` if less), at
        most ``every_s``."""
        every = self.scrubbing.every_s
        waits = [
            due - cache.clock()
            for _, cache in self._caches()
            if (due := cache.checks.next_due(every)) is not None
        ]
        return min(max(min(waits, default=every), min(every, 1.0)), every)
