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

A host's groups (:class:`BidGroups`) are one per bid subject its workers hear: their
region's, and with sampled bidding their shard's.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from bourse.wire.subjects import Subjects, shard_of

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


class Member(Protocol):
    """What grouping reads of a worker."""

    @property
    def worker_id(self) -> str: ...
    @property
    def region(self) -> str: ...
    @property
    def images(self) -> Iterable[str]: ...


M = TypeVar("M", bound=Member)


class BidGroups(Mapping[str, BidGroup[M]], Generic[M]):
    """Bid subject -> the workers of a host it reaches (their region's subject, and their
    shard's when bids may be sampled by shard: ``bid_shards`` > 0), each group with its
    image index, kept current by :meth:`image_changed`."""

    def __init__(self, subjects: Subjects, workers: Iterable[M], bid_shards: int = 0) -> None:
        by_key: dict[tuple[str, int], list[M]] = {}
        for w in workers:
            by_key.setdefault((w.region, -1), []).append(w)
            if bid_shards:
                by_key.setdefault((w.region, shard_of(w.worker_id, bid_shards)), []).append(w)
        self._groups = {
            subjects.bid(region) if shard < 0 else subjects.bid_shard(region, shard): BidGroup(ws)
            for (region, shard), ws in by_key.items()
        }
        self._of: dict[str, list[BidGroup[M]]] = {}  # worker id -> the groups it is in
        for group in self._groups.values():
            for w in group.workers:
                self._of.setdefault(w.worker_id, []).append(group)
                for image in w.images:
                    group.image_changed(w, image, True)

    def __getitem__(self, subject: str) -> BidGroup[M]:
        return self._groups[subject]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def image_changed(self, worker: M, image: str, cached: bool) -> None:
        """The worker's cache gained (or lost) the image: every group it is in says so."""
        for group in self._of.get(worker.worker_id, ()):
            group.image_changed(worker, image, cached)
