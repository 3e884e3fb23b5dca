"""The errors of the image library: each says which image, blob or entry, and what to do."""

from __future__ import annotations

from bourse.errors import BourseError

__all__ = [
    "BadImage",
    "BadReference",
    "CacheFull",
    "DigestMismatch",
    "ImageError",
    "ImageNotFound",
    "PullTimeout",
    "StoreUnavailable",
    "UnsafeEntry",
]


class ImageError(BourseError):
    """Any failure of the image library."""


class BadReference(ImageError, ValueError):
    """An image reference that does not follow ``name[:tag]`` / ``name@sha256:<hex>``."""


class BadImage(ImageError, ValueError):
    """Input that is not an image this library takes: a malformed manifest, config, layout
    or archive, or a format it refuses (zstd layers, a digest other than sha256)."""


class DigestMismatch(ImageError):
    """Bytes that did not match their digest (or their descriptor's size): nothing is kept
    of them and nothing runs from them (I7)."""

    def __init__(self, digest: str, detail: str) -> None:
        super().__init__(f"{digest}: {detail}")
        self.digest = digest


class UnsafeEntry(ImageError):
    """A layer entry refused while unpacking (it would escape the root, or is a device)."""

    def __init__(self, entry: str, detail: str) -> None:
        super().__init__(f"layer entry {entry!r}: {detail}")
        self.entry = entry


class ImageNotFound(ImageError, LookupError):
    """A tag, digest or blob the store does not hold."""


class PullTimeout(ImageError, TimeoutError):
    """A blob not fetched within its bound."""


class CacheFull(ImageError):
    """An image that does not fit the cache's budget, even with everything evictable gone."""


class StoreUnavailable(ImageError):
    """The image store cannot be reached or made (no JetStream, a bucket refused)."""
