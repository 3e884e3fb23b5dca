"""A worker's capacity accounting: capacity, committed, and holds with a TTL (I1).

Amounts are resource vectors (bourse/wire/resources.py). The ledger keeps
``committed + held <= capacity`` per resource at all times: a hold is only added when it
fits, a commit converts a hold into committed without ever adding on top of it, and a hold
that is being committed is pinned (it can neither expire nor be released underneath the
write). Holds live in memory and use the monotonic clock: a restart forgets them, which is
safe because a commit without a live hold is rejected.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict

from bourse.wire.resources import ZERO, Vec, add, leq, sub

# How long a worker remembers that a hold expired, to answer a late commit with
# "hold_expired" instead of "no_hold".
EXPIRED_MEMORY = 4096


class Hold:
    __slots__ = (
        "auction_id",
        "committing",
        "constraints",
        "expires_at",
        "image_cached",
        "order_id",
        "replaced",
        "score",
        "subscores",
        "want",
    )

    def __init__(
        self,
        order_id: str,
        want: Vec,
        expires_at: float,
        score: float,
        subscores: dict[str, float],
        image_cached: bool,
        auction_id: str,
        replaced: Hold | None = None,
        constraints: dict[str, str] | None = None,
    ) -> None:
        self.order_id = order_id
        self.want = want
        self.expires_at = expires_at
        self.score = score
        self.subscores = subscores
        self.image_cached = image_cached
        self.auction_id = auction_id
        self.committing = False
        # The live hold of another auction for the same order that this one's bid took
        # the place of (a concurrent duplicate's): it comes back if this auction releases
        # first, so one auction's release never drops what another still counts on.
        self.replaced = replaced
        # The bid's constraints: the machine a commit makes of this hold records them.
        self.constraints = constraints or {}


class Ledger:
    def __init__(self, capacity: Vec) -> None:
        self._capacity = capacity
        self._committed: Vec = ZERO
        self._held: Vec = ZERO
        self._sums()
        self.holds: dict[str, Hold] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, order_id)
        self.recently_expired: OrderedDict[str, None] = OrderedDict()

    # Every bid reads ``free`` (and pricing ``used``) of each worker it reaches, far more
    # often than a hold or a commit changes them: they are worked out on each change.
    @property
    def capacity(self) -> Vec:
        return self._capacity  # fixed for the ledger's life (free depends on it)

    @property
    def committed(self) -> Vec:
        return self._committed

    @committed.setter
    def committed(self, value: Vec) -> None:
        self._committed = value
        self._sums()

    @property
    def held(self) -> Vec:
        return self._held

    @held.setter
    def held(self, value: Vec) -> None:
        self._held = value
        self._sums()

    def _sums(self) -> None:
        self.used: Vec = add(self._committed, self._held)
        self.free: Vec = sub(self._capacity, self.used)
        # what would be free if every hold were released
        self.free_of_committed: Vec = sub(self._capacity, self._committed)

    def freer_than(self, before: Vec) -> bool:
        """Whether some resource is freer now than in ``before`` (an earlier ``free``). A
        release or an expiry that puts a replaced hold back returns nothing to announce,
        yet frees the difference when the replaced hold wants less (one order id reused
        with other resources): callers compare ``free`` to know that capacity came back.
        ``free`` is a new tuple only when something changed, so the common case is one
        identity test."""
        return self.free is not before and not leq(self.free, before)

    def free_for(self, order_id: str, now: float) -> Vec:
        """What a bid for ``order_id`` would find free at ``now``, changing nothing: the
        steps the desk takes before it prices (the order's earlier hold dropped, then the
        expired ones, a replaced hold they carry coming back in their place), on a copy.
        "Why not" asks it (supplier/explain.py ``verdict``)."""
        copy = Ledger(self._capacity)
        copy.holds = dict(self.holds)
        copy._expiry = list(self._expiry)  # a heap still: stale entries are skipped as here
        copy._committed = self._committed
        copy.held = self._held
        copy.drop(order_id)
        copy.expire(now)
        return copy.free

    def check(self) -> None:
        """Raise if I1 is broken (used by tests and the load-test harness)."""
        if not leq(self.used, self.capacity):
            raise AssertionError(
                f"overcommitted: committed {self.committed} + held {self.held} > {self.capacity}"
            )

    # -- holds -----------------------------------------------------------------------------
    def hold(self, hold: Hold) -> bool:
        """Add a hold if it fits (the caller priced it against ``free`` just before). A hold
        for an order that already has one replaces it, unless that one is being committed."""
        old = self.holds.get(hold.order_id)
        if old is not None:
            if old.committing:
                return False
            self._remove(old)
        if not leq(hold.want, self.free):
            return False
        self.holds[hold.order_id] = hold
        self.held = add(self.held, hold.want)
        self.recently_expired.pop(hold.order_id, None)
        heapq.heappush(self._expiry, (hold.expires_at, hold.order_id))
        return True

    def drop(self, order_id: str, auction_id: str = "", now: float | None = None) -> Hold | None:
        """Release a hold unless it is being committed (or belongs to another auction);
        returns it, or None when it stays or another takes its place. A release of
        ``auction_id`` whose hold took the place of another auction's still live hold
        (``Hold.replaced``) puts that one back instead (which frees the difference if it
        wants less: ``freer_than`` tells); a release of the replaced auction only forgets
        it."""
        h = self.holds.get(order_id)
        if h is None or h.committing:
            return None
        back = h.replaced
        if auction_id and h.auction_id != auction_id:
            if back is not None and back.auction_id == auction_id:
                h.replaced = None  # the auction it replaced let go: the hold is h's alone
            return None
        self._remove(h)
        if auction_id and back is not None:
            now = time.monotonic() if now is None else now
            if back.expires_at > now and self.hold(back):
                return None  # the same capacity, held again for the other auction
        return h

    def _remove(self, h: Hold) -> Hold:
        del self.holds[h.order_id]
        self.held = sub(self.held, h.want)
        return h

    def expire(self, now: float | None = None) -> list[Hold]:
        """Drop holds past their TTL; returns those whose order holds nothing here any more
        (for hold_expired events). A replacing hold whose replaced one outlives it gives way
        to it (the other auction's hold is back) and is not returned: the order still holds
        here, and an event saying its hold expired would be false."""
        now = time.monotonic() if now is None else now
        gone: list[Hold] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            expires_at, order_id = heapq.heappop(heap)
            h = self.holds.get(order_id)
            # Stale heap entries (hold dropped, or refreshed with a later expiry) are skipped.
            if h is None or h.expires_at != expires_at:
                continue
            if h.committing:
                continue  # pinned: the commit decides; it removes the hold itself
            self._remove(h)
            back = h.replaced
            if back is not None and back.expires_at > now and self.hold(back):
                continue  # the hold it replaced outlives it: back in its place
            gone.append(h)
            self.recently_expired[order_id] = None
            if len(self.recently_expired) > EXPIRED_MEMORY:
                self.recently_expired.popitem(last=False)
        return gone

    # -- commits ----------------------------------------------------------------------------
    def convert(self, h: Hold, want: Vec) -> None:
        """A durable commit: the hold becomes committed (``want`` <= the hold's amount)."""
        if self.holds.get(h.order_id) is h:
            self._remove(h)
        self.committed = add(self.committed, want)

    def unpin(self, h: Hold) -> None:
        """A commit failed: the hold goes away (the buyer's auction moves on)."""
        h.committing = False
        if self.holds.get(h.order_id) is h:
            self._remove(h)

    def load_committed(self, want: Vec) -> None:
        """Recovery: machines found in the store count as committed."""
        self.committed = add(self.committed, want)

    def free_committed(self, want: Vec) -> None:
        self.committed = sub(self.committed, want)
