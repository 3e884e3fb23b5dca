"""Which of a host's workers price a bid: every one in a small group, else a sample.

A host with many virtual workers in one region would price every bid on each of them,
O(workers) per bid. Past ``sample`` workers in a bid group (a region, or a shard of one
under sampled bidding) it prices only:

1. the worker that already has a machine for the order: a retry must find it (I3);
2. up to ``sample`` workers that cache the bid's image: the image bonus is where the
   best offers are, so sampling keeps image locality;
3. ``sample`` workers at random (power of d choices: near-best balance at O(d) cost).

The host falls back to the whole group when none of these can take the bid at once, so
sampling never turns an order that fits somewhere into an Unfilled. Both draws are a
window at a position taken from the order id (crc32): cheap, and a post-mortem replays
the same choice.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Generic, TypeVar

W = TypeVar("W")

# Workers priced per source (cached image, random) when a group is larger than twice this.
DEFAULT_QUOTE_SAMPLE = 8


def window(items: Sequence[W], start: int, k: int) -> list[W]:
    """``k`` consecutive items from ``start`` (mod len), wrapping around; all if fewer."""
    n = len(items)
    if n <= k:
        return list(items)
    start %= n
    end = start + k
    if end <= n:
        return list(items[start:end])
    return [*items[start:], *items[: end - n]]


class BidGroup(Generic[W]):
    """The workers one bid subject reaches in this process, and which of them cache which
    image (kept current by :meth:`image_changed`)."""

    __slots__ = ("by_image", "members", "workers")

    def __init__(self, workers: list[W]) -> None:
        self.workers = workers
        self.members = set(workers)
        self.by_image: dict[str, list[W]] = {}

    def image_changed(self, worker: W, image: str, cached: bool) -> None:
        holders = self.by_image.setdefault(image, [])
        if cached:
            if worker not in holders:
                holders.append(worker)
        elif worker in holders:
            holders.remove(worker)
            if not holders:
                del self.by_image[image]

    def candidates(self, order_id: str, image: str, owner: W | None, sample: int) -> list[W]:
        """The workers to price for one bid (see the module doc); the whole group when it
        is small or ``sample`` is 0."""
        if not sample or len(self.workers) <= 2 * sample:
            return self.workers
        pos = zlib.crc32(order_id.encode())
        picked = [owner] if owner is not None and owner in self.members else []
        picked += window(self.by_image.get(image, ()), pos, sample)
        picked += window(self.workers, pos >> 8, sample)
        return list(dict.fromkeys(picked))  # each once, in that order
