"""Answers in pages under a byte budget, and putting them back together (one home for both).

A scatter-gather answer that can be large (an explanation of every worker, §4.15; every
machine of a worker, §4.17) is sent as numbered pages, each at most a byte budget well under
the NATS ``max_payload``: :func:`cut` makes the pages (the sender), :class:`PageSet` collects
them, in order, and says when every page of every responder is in (the requester).

Pure: no NATS here (supplier/desk.py, supplier/host.py and bourse/client use it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import msgspec

from bourse.wire.codec import encode

T = TypeVar("T")

# The budget of one page: well under the server's max_payload (1 MiB by default), so a page
# never fails to publish, and small enough that a page is one quick message.
PAGE_BYTES = 60 * 1024
# The NATS server's default max_payload. One item larger than PAGE_BYTES still goes, alone
# on its page (an item is never split); every wire item is bounded well under this (a
# machine's metadata came in a PlaceOrder, which is at most 64 KiB).
NATS_MAX_PAYLOAD = 1024 * 1024
# Room for a page's own numbers (page and pages up to 10 digits each, ``last``) and the
# list's brackets, on top of the frame measured with the defaults.
FRAME_SLACK = 32


def encoded_size(item: msgspec.Struct) -> int:
    """An item's bytes in a page's JSON list (its encoding and the comma before it)."""
    return len(encode(item)) + 1


def cut(
    items: Sequence[T],
    frame_bytes: int,
    limit_bytes: int = PAGE_BYTES,
    size: Callable[[T], int] = encoded_size,  # type: ignore[assignment]  # encoded_size takes any Struct, T is one
    max_chunks: int | None = None,
) -> list[list[T]]:
    """``items`` in order, in chunks whose page (a frame of ``frame_bytes`` plus the items'
    ``size``) is at most ``limit_bytes``; an item that alone exceeds it gets a chunk of its
    own. At least one chunk, empty when there are no items (a responder with nothing to say
    still says that it is done). ``max_chunks``: stop after that many (the items after them
    are not sized)."""
    chunks: list[list[T]] = [[]]
    used = frame_bytes + FRAME_SLACK
    for item in items:
        n = size(item)
        if chunks[-1] and used + n > limit_bytes:
            if len(chunks) == max_chunks:
                break
            chunks.append([])
            used = frame_bytes + FRAME_SLACK
        chunks[-1].append(item)
        used += n
    return chunks


class PageSet(Generic[T]):
    """The pages of several responders (each numbered ``1..pages``) as they arrive, in any
    order; a responder is complete once it has every page; its items come out in page order.
    A page seen twice counts once."""

    def __init__(self) -> None:
        self._pages: dict[str, dict[int, list[T]]] = {}
        self._total: dict[str, int] = {}

    def add(self, responder: str, page: int, pages: int, items: list[T]) -> None:
        self._pages.setdefault(responder, {})[page] = items
        self._total[responder] = pages

    def __contains__(self, responder: object) -> bool:
        return responder in self._pages

    def responders(self) -> list[str]:
        return list(self._pages)

    def is_complete(self, responder: str) -> bool:
        got = self._pages.get(responder)
        return got is not None and all(p in got for p in range(1, self._total[responder] + 1))

    def all_complete(self) -> bool:
        return all(self.is_complete(r) for r in self._pages)

    def complete(self) -> list[str]:
        """The responders that sent every page."""
        return [r for r in self._pages if self.is_complete(r)]

    def items(self, responder: str) -> list[T]:
        """The responder's items so far, in page order."""
        got = self._pages.get(responder, {})
        return [item for p in sorted(got) for item in got[p]]
