"""Admission control for the exchange: how many auctions one instance runs at once.

Past the fleet's capacity every process queues, each auction waits behind the others, and
they all end late (``no_offers`` after the quiet window, or the deadline): the market
collapses instead of placing as many orders as fit. An exchange therefore runs at most
``limit`` auctions at once. An order that finds them all busy waits for a slot, first come
first served, while its deadline still leaves time for an auction (``patience_s``: a
burst of a deploy's orders is served, not refused); if none frees in that time it is
refused (``Refused("overloaded")`` from ``bourse/auction/broker.py``, an ``Error`` with
reason ``overloaded`` on the wire: the client may try again later or elsewhere), and the
auction that does run gets only what is left of the deadline. When no order has found a
free slot at once, nor one in line within ``standing_ms`` of joining it, for ``standing_ms``,
the line is not a burst but overload (as in CoDel, by how long orders wait): orders
arriving then wait at most ``congested_wait_ms``, so under sustained overload refusals
come fast and the orders that are placed do not queue for long either.

The limit adapts, AIMD as in TCP congestion control, on a moving average (EWMA, weight
``smoothing``) of how long auctions take: while it is within ``target_ms`` every placement
adds ``1 / limit`` (one more slot per round of auctions); above it the limit is cut by
``decrease``, once per round: after a cut, only an auction admitted since may cut again
(the ones under way were admitted under the old limit: one cut per congestion event, not
one per slow auction of the same burst). The average, not each auction, decides: a tail of
slow auctions is normal at any load and would otherwise hold the limit far below capacity.
Placements and auctions that ran into their deadline feed the average.
Other outcomes say nothing about load (``no_offers`` waits out a quiet window by design,
a retry gathers offers on purpose) and only give their slot back. An idle market never
reaches the limit, so it costs nothing there, and what a past burst taught it is stale: a
limit below its start value starts again there once no order has waited for
``restart_s`` (as TCP restarts its window after an idle period). A saturated market
settles where auctions take about ``target_ms``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

# An order that finds every slot busy waits at least this share of its deadline for one
# (with a fixed cap: exactly this share).
WAIT_SHARE = 0.25
OVERLOADED = "exchange overloaded"  # the start of an admission refusal's detail
DEFAULT_TARGET_MS = 25.0  # auctions should end within this under load
FLOOR = 16
INITIAL = 64


@dataclass(slots=True)
class ConcurrencyLimit:
    """An adaptive cap on auctions in flight (``target_ms=0``: a fixed cap of ``ceiling``)."""

    # settings
    ceiling: int = 10_000
    target_ms: float = DEFAULT_TARGET_MS
    floor: int = FLOOR
    initial: int = INITIAL
    decrease: float = 0.8
    smoothing: float = 0.05
    standing_ms: float = 100.0
    congested_wait_ms: float = 25.0
    restart_s: float = 1.0
    # state
    limit: float = field(init=False)
    inflight: int = field(default=0, init=False)
    refused: int = field(default=0, init=False)
    cuts: int = field(default=0, init=False)
    avg_ms: float | None = field(default=None, init=False)  # the auctions' moving average
    _cut_at: float = field(default=-math.inf, init=False)  # when the limit was last cut
    _calm_at: float = field(default=0.0, init=False)  # last time a slot was free at once
    _waited_at: float = field(default=0.0, init=False)  # last time an order waited
    _refused_at: float = field(default=-math.inf, init=False)  # last time one was refused
    closed: bool = field(default=False, init=False)
    _waiters: deque[asyncio.Future[bool]] = field(default_factory=deque, init=False)

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < self.floor:
            raise ValueError(f"need 1 <= floor <= ceiling, got {self.floor} and {self.ceiling}")
        if not 0 < self.decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {self.decrease}")
        self.limit = float(self.ceiling if not self.target_ms else self._clamp(self.initial))

    def _clamp(self, value: float) -> float:
        return min(float(self.ceiling), max(float(self.floor), value))

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def patience_s(self, deadline_ms: float) -> float:
        """How long an order with ``deadline_ms`` may wait in line for a slot: what its
        deadline leaves once an auction of the expected length is set aside (the
        auctions' average, at least ``target_ms``), so a burst is served while its orders
        can still be placed in time. Only ``WAIT_SHARE`` of it with a fixed cap, or while
        this limit has refused an order in the last ``restart_s``: that is overload, not a
        burst, and waits stay short (the standing line shortens newcomers' further,
        ``acquire``)."""
        if not self.target_ms or time.monotonic() - self._refused_at < self.restart_s:
            return deadline_ms * WAIT_SHARE / 1000.0
        avg = self.target_ms / 2 if self.avg_ms is None else self.avg_ms
        kept_ms = max(self.target_ms, avg)
        return max(deadline_ms * WAIT_SHARE, deadline_ms - kept_ms) / 1000.0

    def try_acquire(self) -> bool:
        """Take a free slot at once (none is free while others wait for one, nor once
        ``close``d)."""
        if self.closed:
            return False
        now = time.monotonic()
        if self.limit < self.initial and now - self._waited_at >= self.restart_s:
            self._restart()
        if self.inflight >= int(self.limit) or self._waiters:
            self._waited_at = now
            return False
        self.inflight += 1
        self._calm_at = now
        return True

    def _restart(self) -> None:
        """No order has waited for ``restart_s``: what the limit learnt is stale."""
        self.limit = self._clamp(self.initial)
        self.avg_ms = None

    async def acquire(self, within_s: float) -> bool:
        """Take a slot, waiting up to ``within_s`` in line for one; False if none came
        (counted in ``refused``) or the limit was closed meanwhile (not counted)."""
        if self.try_acquire():
            return True
        if self.closed:
            return False
        if time.monotonic() - self._calm_at > self.standing_ms / 1000.0:
            within_s = min(within_s, self.congested_wait_ms / 1000.0)
        if within_s > 0:
            # its result: True, handed a slot (the releaser counted us in); False, closed
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            lined_up = time.monotonic()
            try:
                return self._served(await asyncio.wait_for(fut, within_s), lined_up)
            except TimeoutError:
                if fut.done() and not fut.cancelled():
                    return self._served(fut.result(), lined_up)  # just as the wait ran out
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.result():  # handed a slot,
                    self.inflight -= 1  # then cancelled: give it back, or it is lost
                    self._hand_over()
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        self.refused += 1
        self._refused_at = time.monotonic()
        return False

    def _served(self, got: bool, lined_up: float) -> bool:
        """An order handed a slot after waiting less than ``standing_ms`` says the line
        moves (a burst being served, as CoDel reads a short sojourn): calm, as a slot free
        at once is. Else a burst whose orders arrive over more than ``standing_ms`` (a busy
        exchange reads them slowly) would be taken for overload while its line drains."""
        now = time.monotonic()
        if got and now - lined_up <= self.standing_ms / 1000.0:
            self._calm_at = now
        return got

    def _hand_over(self) -> None:
        """Give free slots to the orders waiting longest."""
        while self._waiters and self.inflight < int(self.limit):
            fut = self._waiters.popleft()
            if not fut.done():
                self.inflight += 1
                fut.set_result(True)

    def close(self) -> None:
        """Give no slot from now on (the exchange is stopping): the orders in line are let
        go at once (``acquire`` returns False) and new ones find none."""
        self.closed = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(False)

    def release(self, elapsed_ms: float | None, now: float | None = None) -> None:
        """An auction ended (at monotonic ``now``): give its slot back and adapt the limit.
        ``elapsed_ms``: how long a placement (or an auction that hit its deadline: pass the
        deadline) took; None for an outcome that says nothing about load."""
        self.inflight -= 1
        self._adapt(elapsed_ms, now)
        self._hand_over()

    def _adapt(self, elapsed_ms: float | None, now: float | None) -> None:
        if not self.target_ms or elapsed_ms is None:
            return
        avg = self.target_ms / 2 if self.avg_ms is None else self.avg_ms  # a neutral start
        self.avg_ms = avg = avg + self.smoothing * (elapsed_ms - avg)
        if avg <= self.target_ms:
            self.limit = self._clamp(self.limit + 1.0 / self.limit)
            return
        now = time.monotonic() if now is None else now
        if now - elapsed_ms / 1000.0 >= self._cut_at:  # admitted since the last cut
            self.limit = self._clamp(self.limit * self.decrease)
            self.cuts += 1
            self._cut_at = now


def adaptive_limit(max_inflight: int, target_ms: float) -> ConcurrencyLimit:
    """The exchange's limit: starts at 64, adapts within [16, ``max_inflight``] toward
    auctions of ``target_ms`` (0: a fixed cap of ``max_inflight``)."""
    return ConcurrencyLimit(
        ceiling=max_inflight,
        target_ms=target_ms,
        floor=min(max_inflight, FLOOR),
        initial=min(max_inflight, INITIAL),
    )


def overloaded_detail(limit: ConcurrencyLimit, backlog: int = 0) -> str:
    """The refusal's text for people (an ``Error internal`` with reason ``overloaded``:
    programs read the reason, not this text)."""
    return (
        f"{OVERLOADED}: {limit.inflight} auctions in flight (limit {int(limit.limit)}), "
        f"{limit.waiting} orders waiting, {backlog} queued; try again"
    )
