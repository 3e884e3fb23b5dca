"""A worker's machines' images made ready: a content image pulled in the background right
after its commit (so a reserved machine, a deploy's spare, starts without waiting for a
pull), or by the start that needs it; a catalog image fetched into the catalog's LRU.

A start that comes while its machine's background pull is under way waits for that pull
and reports it; a background pull that no start waited for reports itself (a ``pulled``
event written with the machine as it is then). What a pull costs is counted (``on_pull``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc
import structlog

from bourse.images.cachetypes import Pulled
from bourse.wire.messages import Event, Machine
from supplier.images import PullFailed, WorkerImages
from supplier.machines.api import Driver

# (machine, what it pulled) -> its ``pulled`` event.
PulledEventFn = Callable[[Machine, Pulled], Event]


@dataclass(slots=True)
class _Prefetch:
    """A machine's background pull after its commit; a start that comes meanwhile takes it
    (waits for it and reports it)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    got: Pulled | None = None
    error: PullFailed | None = None
    taken: bool = False


def _unobserved(seconds: float) -> None:
    """No metrics (a worker driven alone, or a supplier without --metrics-addr)."""


class Pulls:
    """One worker's pulls (see the module doc)."""

    def __init__(
        self,
        worker_id: str,
        images: WorkerImages,
        driver: Driver,
        report: Callable[[str, Pulled], Awaitable[None]],
    ) -> None:
        self.images = images
        self.driver = driver
        self.report = report  # a background pull no start took: record it
        self._prefetches: dict[str, _Prefetch] = {}  # machine id -> its background pull
        self.on_pull: Callable[[float], None] = _unobserved  # a pull's seconds (metrics)
        self.log = structlog.get_logger("bourse.machines").bind(worker_id=worker_id)

    def prefetch(self, m: Machine, tasks: anyio.abc.TaskGroup | None) -> None:
        """Pull ``m``'s content image in ``tasks`` unless it is here (or being pulled for
        it, or there is nowhere to run the pull)."""
        if (
            tasks is None
            or not m.image_digest
            or self.images.content is None
            or self.images.has(m)
            or m.machine_id in self._prefetches
        ):
            return
        pending = self._prefetches[m.machine_id] = _Prefetch()
        tasks.start_soon(self._prefetched, m, pending)

    async def _prefetched(self, m: Machine, pending: _Prefetch) -> None:
        try:
            pending.got = await self.now(m)
        except PullFailed as exc:
            pending.error = exc
        finally:
            del self._prefetches[m.machine_id]
            pending.done.set()
        if pending.taken:
            return  # a start waited for it: the start reports it
        if pending.error is not None:
            self.log.warning(
                "image_prefetch_failed",
                machine_id=m.machine_id,
                image_digest=m.image_digest,
                error=str(pending.error),
            )
        elif pending.got is not None:
            await self.report(m.machine_id, pending.got)

    async def now(self, m: Machine) -> Pulled:
        got = await self.images.pull(m)
        if got.bytes:
            self.on_pull(got.seconds)
        return got

    async def for_start(self, m: Machine) -> Pulled:
        """``m``'s image made ready for its start: its background pull's, if one is under
        way (this start then reports it), else a pull now."""
        pending = self._prefetches.get(m.machine_id)
        if pending is None:
            return await self.now(m)
        pending.taken = True
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        if pending.got is None:  # the background pull was cut short: pull now
            return await self.now(m)
        return pending.got

    async def catalog(self, m: Machine, in_use: Callable[[str], bool]) -> tuple[int, float] | None:
        """A catalog image (or a sim worker's content image) into the catalog's LRU: the
        bytes and seconds it took when it was not there (None: it was)."""
        key, catalog = self.images.key(m), self.images.catalog
        if key in catalog:
            catalog.touch(key)
            return None
        size, seconds = await self.driver.pull(key)
        evicted = catalog.add(key, in_use)
        if evicted:
            self.log.info("images_evicted", images=evicted, for_image=key)
        return size, seconds
