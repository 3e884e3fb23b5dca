"""Batches (docs/protocol.md §4.4.4): the bids and region releases an auctioneer queues for
a region in one loop turn, sent as one ``Batch`` message a loop turn later.

Under load many auctions bid in the same instant; each supplier process then gets one
message for all of them and answers them in one ``Answers`` to ``answers_to``. When idle a
lone bid or release goes as itself. The flusher is a task the ``BatchSender`` owns:
``start`` makes it, ``close`` cancels it and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from nats.aio.client import Client as NATS

from bourse.wire.codec import encode
from bourse.wire.limits import MAX_BATCH_ITEMS
from bourse.wire.messages import Batch, BatchBid, Release
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.auction")


class BatchSender:
    """Queues bids and region releases per region; sends them a loop turn later."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.sent = 0  # Batch messages published (for tests and the logs)
        self._answers_to = ""
        self._queued: dict[str, tuple[list[BatchBid], list[Release]]] = {}
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    def start(self, answers_to: str) -> None:
        """Start the flusher; the answers to the batches' bids go to ``answers_to``."""
        self._answers_to = answers_to
        self._flusher = asyncio.get_running_loop().create_task(self._flush())

    def queue(
        self, region: str, bid: BatchBid | None = None, release: Release | None = None
    ) -> None:
        """Send ``bid`` and ``release`` to ``region`` with the others of this loop turn."""
        bids, releases = self._queued.setdefault(region, ([], []))
        if bid is not None:
            bids.append(bid)
        if release is not None:
            releases.append(release)
        self._wake.set()

    async def close(self) -> None:
        """Stop the flusher (what is still queued is not sent: its holds expire)."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None

    async def _flush(self) -> None:
        """Send what was queued, a loop turn after it was: whatever the other auctions
        queued meanwhile goes in the same message."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            queued, self._queued = self._queued, {}
            for region, (bids, releases) in queued.items():
                try:
                    await self._publish(region, bids, releases)
                except Exception as exc:  # connection lost: bids unanswered, holds expire
                    log.warning("batch_failed", region=region, bids=len(bids), error=repr(exc))

    async def _publish(self, region: str, bids: list[BatchBid], releases: list[Release]) -> None:
        s = self.subjects
        if len(bids) == 1 and not releases:
            await self.nc.publish(s.bid(region), encode(bids[0].bid), reply=bids[0].reply)
            return
        if not bids and len(releases) == 1:
            await self.nc.publish(s.region_release(region), encode(releases[0]))
            return
        for i in range(0, max(len(bids), len(releases)), MAX_BATCH_ITEMS):
            batch = Batch(
                bids=bids[i : i + MAX_BATCH_ITEMS],
                releases=releases[i : i + MAX_BATCH_ITEMS],
                answers_to=self._answers_to,
            )
            await self.nc.publish(s.bid_batch(region), encode(batch))
            self.sent += 1
