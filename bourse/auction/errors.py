"""What running an order can raise: the auction could not run, the order id names another
order, the order claims' store is full, or a machine was placed that the order's claim does
not name. ``Broker.place`` turns each into a typed refusal (bourse/auction/broker.py)."""

from __future__ import annotations

from bourse.errors import BourseError
from bourse.wire.messages import Placed

__all__ = ["AuctionError", "ConflictingOrder", "StoreFull", "UnrecordedPlacement"]


class AuctionError(BourseError, RuntimeError):
    """The auction could not run at all: not connected to NATS, or the order's claim could
    not be written in its time (nothing was placed)."""


class UnrecordedPlacement(BourseError, RuntimeError):
    """A machine was placed but the order's claim could not be made to name it: the buyer
    is not told ``Placed`` (a claim that does not name the machine may yet give the order
    id another one, I3), but to send the order again under the same id, which is answered
    with this machine or, if it was reclaimed meanwhile, the one the claim names
    (docs/protocol.md §5.3c)."""

    def __init__(self, placed: Placed, why: str) -> None:
        super().__init__(
            f"a machine was placed on worker {placed.worker_id!r} but the order's claim could "
            f"not be recorded ({why}): send the order again with the same order id (retry), "
            "which is answered with the order's one machine (docs/protocol.md §5.3c)"
        )


class ConflictingOrder(BourseError, ValueError):
    """The order id is the idempotency key: reusing it for a different order is an error."""


class StoreFull(BourseError, RuntimeError):
    """The order claims' bucket takes no new order (its bytes, or JetStream's store, are used
    up): nothing was placed; the order may be sent again later (bourse/auction/room.py)."""
