"""Admission control for the exchange: how many auctions one instance runs at once.

Past the fleet's capacity every process queues, each auction waits behind the others, and
they all end late (``no_offers`` after the quiet window, or the deadline): the market
collapses instead of placing as many orders as fit. An exchange therefore refuses an order
at once (an ``Error`` saying it is overloaded; the client may try again or elsewhere) while
it runs ``limit`` auctions.

The limit adapts, AIMD as in TCP congestion control: every auction that finishes within
``target_ms`` adds ``1 / limit`` (one more slot per round of auctions); an auction slower
than that cuts the limit by ``decrease`` at most once per ``target_ms`` (one cut per
congestion event, not one per slow auction of the same burst). An idle market never
reaches the limit, so it costs nothing there; a saturated one settles where auctions take
about ``target_ms``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class ConcurrencyLimit:
    """An adaptive cap on auctions in flight (``target_ms=0``: a fixed cap of ``ceiling``)."""

    ceiling: int = 10_000
    target_ms: float = 25.0
    floor: int = 16
    initial: int = 64
    decrease: float = 0.8
    limit: float = field(init=False)
    inflight: int = field(default=0, init=False)
    refused: int = field(default=0, init=False)
    cuts: int = field(default=0, init=False)
    _next_cut: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < self.floor:
            raise ValueError(f"need 1 <= floor <= ceiling, got {self.floor} and {self.ceiling}")
        if not 0 < self.decrease < 1:
            raise ValueError(f"decrease must be in (0, 1), got {self.decrease}")
        self.limit = float(self.ceiling if not self.target_ms else self._clamp(self.initial))

    def _clamp(self, value: float) -> float:
        return min(float(self.ceiling), max(float(self.floor), value))

    def try_acquire(self) -> bool:
        """Take a slot for one auction; False (counted in ``refused``) when full."""
        if self.inflight >= int(self.limit):
            self.refused += 1
            return False
        self.inflight += 1
        return True

    def release(self, elapsed_ms: float, now: float | None = None) -> None:
        """An auction ended after ``elapsed_ms``: give its slot back and adapt the limit."""
        self.inflight -= 1
        if not self.target_ms:
            return
        if elapsed_ms <= self.target_ms:
            self.limit = self._clamp(self.limit + 1.0 / self.limit)
            return
        now = time.monotonic() if now is None else now
        if now >= self._next_cut:
            self.limit = self._clamp(self.limit * self.decrease)
            self.cuts += 1
            self._next_cut = now + self.target_ms / 1000.0
