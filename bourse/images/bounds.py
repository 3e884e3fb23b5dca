"""How much an image may unpack to, layer by layer (pure: sizes in, caps and refusals out).

A layer is a compressed tar: a few megabytes of gzip can unpack to gigabytes (a
decompression bomb), so neither a push nor a pull trusts its size. Every layer is read
through a count of its uncompressed tar bytes that stops the moment it passes the layer's
cap, the tightest of:

- what is left of ``max_image_mb`` once the layers before it are counted (the whole
  image's uncompressed bytes, by default ``DEFAULT_MAX_IMAGE_MB``);
- ``MAX_RATIO`` times its compressed size (at least ``RATIO_FLOOR_BYTES``): gzip's own
  ceiling is about 1032:1 and real layers compress 2 to 10 times, so a layer past 100:1
  is refused whatever room there is; a worker applies it only to a layer without a record;
- its size recorded in the store (``UNPACKED_HEADER``, written by the push that checked it):
  a worker's unpack stops at it, a layer whose bytes say otherwise lied;
- on a worker, what is left of its image cache's budget (the only cap that may pass later:
  not ``permanent``).

A refusal is ``ImageTooBig``, naming the layer, the cap and why; nothing of what was read
past the cap is kept (the caller removes what it wrote).
"""

from __future__ import annotations

from dataclasses import dataclass

from bourse.images.errors import ImageError

MIB = 1024 * 1024
# The default max_image_mb (supplier run, exchange serve, bourse image push/import): the
# whole image unpacked, every layer's tar together.
DEFAULT_MAX_IMAGE_MB = 10 * 1024
# The most a layer may grow from its compressed bytes (gzip's own ceiling is ~1032:1).
MAX_RATIO = 100
# A small layer may unpack to this much whatever its ratio (a few KB of text or of zeros
# grows past 100:1 and harms nothing).
RATIO_FLOOR_BYTES = 64 * MIB
# The object header that records a layer's uncompressed size beside its blob in the store.
UNPACKED_HEADER = "Bourse-Unpacked-Size"


@dataclass(frozen=True, slots=True)
class Cap:
    """At most ``bytes`` unpacked, and why (what a refusal says); ``permanent`` unless
    trying again later could pass (a cache budget that evictions may free)."""

    bytes: int
    why: str
    permanent: bool = True


class ImageTooBig(ImageError):
    """A layer that passed its cap as it was read: refused, nothing of it kept."""

    def __init__(self, layer: str, cap: Cap) -> None:
        super().__init__(
            f"image_too_big: layer {layer} passed {max(cap.bytes, 0)} bytes unpacked ({cap.why})"
        )
        self.layer = layer
        self.cap = cap

    @property
    def permanent(self) -> bool:
        return self.cap.permanent


@dataclass(frozen=True, slots=True)
class Bounds:
    """An image's limits: ``max_image_bytes`` unpacked in all, each layer at most
    ``max_ratio`` times its compressed size (at least ``ratio_floor_bytes``)."""

    max_image_bytes: int = DEFAULT_MAX_IMAGE_MB * MIB
    max_ratio: int = MAX_RATIO
    ratio_floor_bytes: int = RATIO_FLOOR_BYTES

    @classmethod
    def of_mb(cls, max_image_mb: int | None) -> Bounds:
        """The default bounds with ``max_image_mb`` (None: the default's)."""
        return cls() if max_image_mb is None else cls(max_image_bytes=max_image_mb * MIB)

    @property
    def max_image_mb(self) -> float:
        return self.max_image_bytes / MIB

    def ratio(self, compressed: int) -> Cap:
        """What a layer of ``compressed`` bytes may unpack to by its ratio."""
        cap = max(self.ratio_floor_bytes, compressed * self.max_ratio)
        return Cap(cap, f"more than {self.max_ratio} times its {compressed} bytes")

    def left(self, used: int) -> Cap:
        """What the rest of an image may unpack to, ``used`` bytes unpacked before."""
        return Cap(
            self.max_image_bytes - used,
            f"max_image_mb {self.max_image_mb:g} for the whole image, {used} bytes before it",
        )


def recorded(size: int) -> Cap:
    """A layer's cap by its size recorded in the store."""
    return Cap(size, "its size recorded in the store")


def tightest(*caps: Cap | None) -> Cap:
    """The smallest of ``caps`` (the first of equals)."""
    return min((c for c in caps if c is not None), key=lambda c: c.bytes)


class Tally:
    """One image's layers as they are read, in order: each one's cap (:meth:`cap`) and the
    bytes counted so far (:meth:`add`). ``room``: a cap on the whole image besides
    ``bounds`` (a worker's cache budget left)."""

    def __init__(self, bounds: Bounds, room: Cap | None = None) -> None:
        self.bounds = bounds
        self.room = room
        self.used = 0

    def cap(self, compressed: int, size_recorded: int | None = None) -> Cap:
        """The cap of the next layer: ``compressed`` bytes, its recorded size if any (a
        recorded size was bounded by its push: the ratio is not applied again)."""
        own = recorded(size_recorded) if size_recorded is not None else None
        room = None
        if self.room is not None:
            room = Cap(self.room.bytes - self.used, self.room.why, self.room.permanent)
        return tightest(own or self.bounds.ratio(compressed), self.bounds.left(self.used), room)

    def add(
        self, layer: str, compressed: int, unpacked: int, size_recorded: int | None = None
    ) -> None:
        """Count a layer that unpacks to ``unpacked`` bytes (known without reading it: a
        record, a layer built here); ``ImageTooBig`` when that passes its cap."""
        cap = self.cap(compressed, size_recorded)
        if unpacked > cap.bytes:
            raise ImageTooBig(layer, cap)
        self.used += unpacked
