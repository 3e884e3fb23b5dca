"""The broker: the order's image resolved, admission control, the auction: one home for
placing an order.

The exchange (``exchange/service.py``) and a direct-mode buyer (``BourseClient(direct=True)``)
both place orders through a ``Broker``: where an order enters, its image reference is
resolved to content once (``bourse/auction/content.py``, §4.3a). ``place`` never raises for
an order it could not place: it returns ``Placed``, ``Unfilled`` or a typed ``Refused``
(an unknown image, overloaded, a conflicting order id, or the auction could not run), and
``Refused.error()`` is the wire ``Error`` for it (docs/protocol.md §5.5, §7).

``resolve_image`` is the one way an image reference becomes content or a refusal, for the
broker and for a buyer's own dry run (``BourseClient.content``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import anyio
import nats.errors

from bourse.auction.admission import ConcurrencyLimit, overloaded_detail
from bourse.auction.auctioneer import Auctioneer
from bourse.auction.content import ImageContent, Resolver
from bourse.auction.errors import AuctionError, ConflictingOrder, StoreFull, UnrecordedPlacement
from bourse.images.errors import BadImage, BadReference, ImageError, ImageNotFound
from bourse.wire.messages import (
    IMAGE_UNKNOWN_REASON,
    OVERLOADED_REASON,
    SHUTTING_DOWN_REASON,
    STORE_FULL_REASON,
    UNRECORDED_REASON,
    Error,
    ErrorCode,
    Placed,
    PlaceOrder,
    Unfilled,
)

RefusalKind = Literal[
    "image_unknown",
    "bad_image",
    "overloaded",
    "conflicting_order",
    "cannot_run",
    "store_full",
    "unrecorded",
    "shutting_down",
]

# How each refusal travels as an Error: the code (v1's fixed set) and, for overload, the
# Error.reason that tells it apart from other internal errors without reading the detail.
_WIRE: dict[RefusalKind, tuple[ErrorCode, str]] = {
    "image_unknown": ("bad_request", IMAGE_UNKNOWN_REASON),
    "bad_image": ("bad_request", ""),
    "overloaded": ("internal", OVERLOADED_REASON),
    "conflicting_order": ("bad_request", ""),
    "cannot_run": ("internal", ""),
    "store_full": ("internal", STORE_FULL_REASON),
    "shutting_down": ("internal", SHUTTING_DOWN_REASON),
    "unrecorded": ("internal", UNRECORDED_REASON),
}


@dataclass(frozen=True, slots=True)
class Refused:
    """The order was not answered with an outcome.

    Nothing was bid, nothing is held: ``image_unknown``, its image names a digest the image
    store does not hold; ``bad_image``, its image is a malformed digest reference or names
    something that is not an image manifest; ``overloaded``, no admission slot in time (or the
    exchange's order backlog is full); ``conflicting_order``, its id is being placed for a
    different order; ``cannot_run``, the auction could not start (not connected to NATS,
    or its claim could not be written); ``store_full``, the order claims' bucket takes no
    new order (JetStream's storage for it is used up).
    ``unrecorded``: a machine was placed but the order's claim could not be made to name it;
    the order is to be sent again under the same id, which is answered with its one machine
    (docs/protocol.md §5.3c). ``shutting_down``: the broker stopped before the order had an
    outcome; sent again under the same id, it is answered with its machine if one was
    placed."""

    kind: RefusalKind
    detail: str

    def error(self) -> Error:
        """The wire ``Error`` that answers the order."""
        code, reason = _WIRE[self.kind]
        return Error(code=code, detail=self.detail, reason=reason)


Outcome = Placed | Unfilled | Refused

SHUTTING_DOWN = (
    "the exchange is stopping and gave this order no outcome: send it again with the same "
    "order id (as a retry), which is answered with its machine if one was placed "
    "(docs/protocol.md §5.5)"
)


class Broker:
    """Places orders: resolves the order's image (``images``; without it every image is a
    catalog name), waits for an admission slot (when ``admission`` is set), runs the
    auction with what is left of the deadline, and lets the outcome adapt the limit."""

    def __init__(
        self,
        auctioneer: Auctioneer,
        admission: ConcurrencyLimit | None = None,
        images: Resolver | None = None,
    ) -> None:
        self.auctioneer = auctioneer
        self.admission = admission
        self.images = images or Resolver()
        self.stopping = False

    async def place(self, order: PlaceOrder) -> Outcome:
        """Run one immediate-or-cancel order."""
        if self.stopping:
            return self.shutting_down()
        t0 = time.monotonic()
        content = self.images.known(order.image)  # every order of a known image: a lookup
        if content is None:
            found = await self.content(order)
            if isinstance(found, Refused):
                return found
            content = found
        try:
            if self.admission is None:
                return await self.auctioneer.run(order, _ms_since(t0), content)
            return await self._admitted(self.admission, order, t0, content)
        except UnrecordedPlacement as exc:
            return Refused("unrecorded", str(exc))
        except ConflictingOrder as exc:
            return Refused("conflicting_order", str(exc))
        except StoreFull as exc:
            return Refused("store_full", str(exc))
        except AuctionError as exc:
            return Refused("cannot_run", str(exc))

    def stop(self) -> None:
        """Take no order from now on: new ones and those waiting for a slot are refused
        ``shutting_down`` at once (the auctions under way are the caller's to let finish)."""
        self.stopping = True
        if self.admission is not None:
            self.admission.close()

    @staticmethod
    def shutting_down() -> Refused:
        """The refusal for an order the stop left without an outcome."""
        return Refused("shutting_down", SHUTTING_DOWN)

    def overloaded(self, backlog: int = 0) -> Refused:
        """The refusal for an order that finds no slot, or ``backlog`` orders queued ahead."""
        if self.admission is None:
            return Refused("overloaded", f"overloaded: {backlog} queued; try again")
        return Refused("overloaded", overloaded_detail(self.admission, backlog))

    async def close(self) -> None:
        await self.auctioneer.close()

    async def content(self, order: PlaceOrder) -> ImageContent | Refused:
        """What the order's image names (§4.3a), within the order's deadline; the refusal
        when it names no image the store holds, or the store cannot be read in time."""
        return await resolve_image(self.images, order.image, order.deadline_ms / 1000.0)

    async def _admitted(
        self, limit: ConcurrencyLimit, order: PlaceOrder, t0: float, content: ImageContent
    ) -> Outcome:
        """Past the limit an order waits its turn while its deadline leaves time for an
        auction (one started now would slow every one under way); the auction gets what is
        left, and what it says about load adapts the limit (bourse/auction/admission.py)."""
        if not await limit.acquire(limit.patience_s(order.deadline_ms)):
            return self.shutting_down() if self.stopping else self.overloaded()
        started = time.monotonic()
        load_ms: float | None = None
        try:
            result = await self.auctioneer.run(order, (started - t0) * 1000.0, content)
            if not order.retry and (isinstance(result, Placed) or result.reason == "deadline"):
                load_ms = (time.monotonic() - started) * 1000.0
            return result
        finally:
            limit.release(load_ms)


# What resolving an image reference may raise: its own errors (ImageNotFound, BadReference,
# BadImage) and the store's (unreachable, refused, not in time).
RESOLVE_ERRORS = (ImageError, nats.errors.Error, TimeoutError)


async def resolve_image(
    images: Resolver, image: str, within_s: float | None = None
) -> ImageContent | Refused:
    """What ``image`` names now (§4.3a), resolved by ``images`` within ``within_s`` (None:
    unbounded), or the refusal of an order of it (``image_refusal``)."""
    try:
        with anyio.fail_after(within_s):
            return await images.resolve(image)
    except RESOLVE_ERRORS as exc:
        return image_refusal(image, exc)


def image_refusal(image: str, exc: Exception) -> Refused:
    """The refusal of an order whose image reference ``image`` did not resolve (``exc``,
    one of RESOLVE_ERRORS): ``image_unknown`` for a digest the store does not hold,
    ``bad_image`` for a malformed digest reference or one naming no image manifest,
    ``cannot_run`` when the store could not be read."""
    if isinstance(exc, ImageNotFound):
        return Refused("image_unknown", str(exc))
    if isinstance(exc, BadReference | BadImage):
        return Refused("bad_image", str(exc))
    why = str(exc) or type(exc).__name__
    return Refused("cannot_run", f"image {image!r}: the image store: {why}")


def _ms_since(t0: float) -> float:
    return (time.monotonic() - t0) * 1000.0
