"""What ``bourse.auction.claiming.Claiming`` decides: the steps the auctioneer performs for
an order's claim, in order, feeding back what came of each.

A KV request or a pause, then the event it answers: ``OpenClaims`` (``opened``),
``ReadClaim`` (``read``), ``WriteClaim`` (``written``), ``RemoveClaim`` (``removed``),
``WaitForChange`` (``changed``), ``BackOff`` (``woke``); any of the requests may end in
``failed`` instead. ``RunAuction`` (fresh, or as a retry), then ``ended`` or ``refused``.
The order's end: ``RunUnclaimed`` (no claims on this server: the auction's outcome is the
order's), the core's ``Finish`` and ``Refuse``, ``Unavailable`` (AuctionError: the claim
could not be written, nothing was placed), ``NoRoom`` (StoreFull: the claims bucket takes
no new order, nothing was placed) and ``Unrecorded`` (UnrecordedPlacement: a machine was
placed that the claim could not be made to name). The core's ``Log`` may come before any
of them.

msgspec Structs, where the auction core's are dataclasses: several are made for every
order, and a frozen dataclass costs five times as much to make.
"""

from __future__ import annotations

import msgspec

from bourse.auction.claims import KV_TIMEOUT_S, Claim
from bourse.auction.core import Finish, Log, Refuse
from bourse.wire.messages import Placed, PlaceOrder


class OpenClaims(msgspec.Struct, frozen=True):
    """Open the claims bucket; feed ``opened`` (or ``failed``)."""


class ReadClaim(msgspec.Struct, frozen=True):
    """Read the order's claim; feed ``read`` (or ``failed``)."""


class WriteClaim(msgspec.Struct, frozen=True):
    """Write ``claim`` if the key is still at ``revision`` (0: absent), waiting at most
    ``timeout_s``; feed ``written`` (or ``failed``)."""

    claim: Claim
    revision: int
    timeout_s: float = KV_TIMEOUT_S


class RemoveClaim(msgspec.Struct, frozen=True):
    """Delete the claim if it is still at ``revision``; feed ``removed`` (or ``failed``)."""

    revision: int


class WaitForChange(msgspec.Struct, frozen=True):
    """Wait until monotonic ``until`` at most for the claim to move past ``revision``;
    feed ``changed`` (or ``failed``)."""

    revision: int
    until: float


class BackOff(msgspec.Struct, frozen=True):
    """Pause until monotonic ``until`` (a failed request's back-off); feed ``woke``."""

    until: float


class RunAuction(msgspec.Struct, frozen=True):
    """Run the auction for ``order`` (``order.retry``: it gathers as a retry), ``spent_ms``
    of its deadline gone; feed ``ended``, or ``refused`` if it refuses the order."""

    order: PlaceOrder
    spent_ms: float


class RunUnclaimed(msgspec.Struct, frozen=True):
    """The server has no claims: run the auction without one; its outcome is the order's."""

    spent_ms: float


class Unavailable(msgspec.Struct, frozen=True):
    """The claim could not be written in the order's time: refuse it (AuctionError)."""

    detail: str


class NoRoom(msgspec.Struct, frozen=True):
    """The claims bucket takes no new order (``why``): refuse it, nothing was placed
    (StoreFull). ``refused``: JetStream refused this order's write for room (then the
    bucket takes no new order for a while, bourse/auction/room.py)."""

    why: str
    refused: bool = False


class Unrecorded(msgspec.Struct, frozen=True):
    """``placed`` was placed but the claim could not be made to name it (``why``): the
    buyer is not told Placed (UnrecordedPlacement)."""

    placed: Placed
    why: str


# What the auctioneer asks of the claims bucket.
ClaimRequest = WriteClaim | ReadClaim | RemoveClaim | WaitForChange | OpenClaims

ClaimStep = (
    OpenClaims
    | ReadClaim
    | WriteClaim
    | RemoveClaim
    | WaitForChange
    | BackOff
    | RunAuction
    | RunUnclaimed
    | Finish
    | Refuse
    | Unavailable
    | NoRoom
    | Unrecorded
    | Log
)
