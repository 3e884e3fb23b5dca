"""What the desk reads (and, through the ledger and queue, changes) of one worker: its
``Seat``, and the queue of bids waiting for its held capacity (``WaitingBids``, §6.3).
Pure: no NATS, no clock of its own."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol, TypeVar

from bourse.wire.messages import Bid, Machine
from supplier.feasible import OrderLike, WorkerView
from supplier.pricing import ImageCost, Pricer

# At most this many bids wait for held capacity on one worker; more are not answered.
MAX_WAITING = 1024


class WaitingBid:
    """A bid kept by a worker until ``until`` (monotonic s), blocked only by holds."""

    __slots__ = ("bid", "inbox", "until")

    def __init__(self, bid: Bid, inbox: str, until: float) -> None:
        self.bid = bid
        self.inbox = inbox
        self.until = until


class WaitingBids:
    """One worker's waiting bids, oldest first (first come, first served)."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[WaitingBid] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[WaitingBid]:
        return iter(self._q)

    def append(self, w: WaitingBid) -> None:
        self._q.append(w)

    def take_all(self) -> deque[WaitingBid]:
        """Empty the queue; returns what it held (the caller puts back what still waits)."""
        q, self._q = self._q, deque()
        return q

    def drop(self, order_id: str, auction_id: str = "") -> None:
        """A release: forget the order's waiting bids (of that auction, if given)."""
        if self._q:
            self._q = deque(
                w
                for w in self._q
                if w.bid.order_id != order_id or (auction_id and w.bid.auction_id != auction_id)
            )

    def prune(self, now: float) -> None:
        """Forget bids past their ``wait_ms`` (their auctions have moved on)."""
        if any(w.until <= now for w in self._q):
            self._q = deque(w for w in self._q if w.until > now)


class Seat(WorkerView, Protocol):
    """What the desk reads (and, through the ledger and queue, changes) of one worker:
    beside what the checks read, its price, images, waiting bids and hold cap."""

    @property
    def region(self) -> str: ...
    @property
    def pricer(self) -> Pricer: ...
    @property
    def waiting(self) -> WaitingBids: ...
    @property
    def max_hold_ms(self) -> int:
        """The longest this worker holds capacity for one bid, whatever it asks."""
        ...

    def machine_for(self, order_id: str) -> Machine | None:
        """The machine this worker placed for the order (not aborted), if any."""
        ...

    def image_cost(self, order: OrderLike) -> ImageCost:
        """What starting the order's image costs this worker (supplier/images.py)."""
        ...

    def has_image(self, m: Machine) -> bool:
        """Whether ``m``'s image is here (an offer's and a Placed's ``image_cached``)."""
        ...

    def hand_out(self, order_id: str) -> None:
        """The order's machine goes to an auction that may not be the one that committed it:
        from now on no abort undoes it (docs/protocol.md §6.6)."""
        ...

    def release(self, order_id: str, auction_id: str = "") -> None:
        """Drop the order's waiting bids and its hold (of ``auction_id`` when given)."""
        ...


S = TypeVar("S", bound=Seat)
