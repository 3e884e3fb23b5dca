"""A worker's cached images: an LRU bounded in MiB.

Pulling an image is the dominant cost of a start, so the cache feeds the price (a cached
image earns the image bonus). Adding an image evicts the least recently used ones until it
fits, never one that a live machine uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

DEFAULT_IMAGE_MB = 200
# Told (image, cached) whenever an image comes or goes: the host's image index.
ImageListener = Callable[[str, bool], None]


class ImageCache:
    """The images cached on one worker, least recently used first, within ``budget_mb``;
    ``size_of(image)`` gives an image's size, ``listener`` hears every image come and go."""

    def __init__(
        self,
        budget_mb: int,
        initial: Iterable[str] = (),
        size_of: Callable[[str], int] = lambda _: DEFAULT_IMAGE_MB,
        listener: ImageListener | None = None,
    ) -> None:
        self.budget_mb = budget_mb
        self.size_of = size_of
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.listener = listener  # not told about the initial images: the host reads them
        for image in initial:  # configured images are cached whatever the budget says
            self._lru[image] = size_of(image)

    def __contains__(self, image: object) -> bool:
        return image in self._lru

    def __iter__(self) -> Iterator[str]:
        return iter(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def used_mb(self) -> int:
        return sum(self._lru.values())

    def touch(self, image: str) -> None:
        if image in self._lru:
            self._lru.move_to_end(image)

    def add(self, image: str, in_use: Callable[[str], bool] = lambda _: False) -> list[str]:
        """Cache ``image``; returns the images evicted to make room (LRU first)."""
        if image in self._lru:
            self._lru.move_to_end(image)
            return []
        size = self.size_of(image)
        evicted = []
        for old in list(self._lru):
            if self.used_mb + size <= self.budget_mb:
                break
            if not in_use(old):
                del self._lru[old]
                evicted.append(old)
        self._lru[image] = size
        if self.listener is not None:
            for old in evicted:
                self.listener(old, False)
            self.listener(image, True)
        return evicted
