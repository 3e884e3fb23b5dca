"""How much the order claims take (docs/operations.md, "Sizing the order claims"), and
whether the claims bucket takes a new order now. Pure: the bucket's shell
(``bourse.auction.claim_store.ClaimBucket``) feeds ``Room`` what it reads of the bucket and what
JetStream refused.

The bucket is bounded twice: by age (the idempotency window, docs/protocol.md §5.3c: a
claim lives as long as a retry or a worker's reclaim check may need it) and by bytes (the
sizing rule: ``CLAIM_BYTES`` per order * orders a second * the window, plus the room kept
for outcomes). A full bucket refuses a write (on a cluster even one that replaces a key by
something smaller), and a claim grows when its auction's outcome is written (a placed
claim carries its ``Placed``): so a new order is refused once one more claim would eat
into the last ``ROOM_SHARE`` of the limit, and the outcomes of the orders under way fit.
An order refused so gets ``Error{reason: "store_full"}``: nothing was placed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import nats.js.errors

# The idempotency window (docs/protocol.md §5.3c): how long a claim lives, so how long a
# retry anywhere is answered from it and a worker asking about its reserved machine finds
# it. It outlives every retry the protocol asks for (at once after a timeout, `unrecorded`
# or `shutting_down`; later after `overloaded`, `store_full` or an internal error) and a
# worker cut off from the exchanges for less than that. Past it, a retry is
# deduplicated by the workers alone.
DEFAULT_WINDOW_S = 3600.0
# What one order's claim takes in the bucket: a placed claim of a typical order is about
# 390 bytes of JSON and 510 with its subject and the stream's per-message overhead
# (tests/integration/test_claims_full.py measures it); rounded up for long ids.
CLAIM_BYTES = 800
# The bucket's byte limit unless the operator sizes it: an hour of about 350 orders a second.
DEFAULT_MAX_BYTES = 1024**3
# The share of the limit kept for the outcomes of the orders under way: past the rest, the
# bucket takes no new order.
ROOM_SHARE = 0.05
# How often the bucket's fill is read (one stream info request), and how long new orders are
# refused after JetStream refused a claim's write for room before one tries again.
ROOM_LOOK_S = 1.0

# JetStream's answers that mean "no room": the account's or the server's storage is used
# up (10002, 10023, 10028, 10047: a bucket whose byte limit cannot be reserved among them),
# or the stream refused to store the message (10077: "maximum bytes exceeded").
_NO_ROOM = frozenset({10002, 10023, 10028, 10047, 10077})


def no_room(exc: BaseException) -> bool:
    """Whether a failed KV request was refused for room (not a timeout or an outage)."""
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in _NO_ROOM


@dataclass(frozen=True, slots=True)
class ClaimLimits:
    """The claims bucket's limits: its age limit ``window_s`` and its byte limit."""

    window_s: float = DEFAULT_WINDOW_S
    max_bytes: int = DEFAULT_MAX_BYTES

    def covers(self) -> float:
        """The orders a second these limits hold for the whole window: the sizing rule,
        ``max_bytes * (1 - ROOM_SHARE) = CLAIM_BYTES * orders a second * window_s``, read
        back (3,000 orders a second for an hour need 9.1 GB)."""
        return self.max_bytes * (1 - ROOM_SHARE) / (CLAIM_BYTES * self.window_s)


FULL = "order_claims_full"  # Room's log events: new orders are refused from now on...
ROOM = "order_claims_room"  # ...or taken again


@dataclass(slots=True)
class Room:
    """Whether the claims bucket takes new orders: ``full`` says why not ("" while it
    does). ``stored`` and ``max_bytes``: the bucket's bytes and limit at the last look (-1:
    not looked at yet, or no limit); ``taken``: the claims counted on top of ``stored``,
    ``CLAIM_BYTES`` each: those of the orders let in here since, and of those still under
    way at the look (their claims grow when their outcome is written); ``open``: orders
    let in here and not ended. Other processes' claims are seen at the next look, within
    the room kept. Methods return the log event when ``full`` changes (``FULL`` or
    ``ROOM``), else None."""

    full: str = ""
    stored: int = -1
    max_bytes: int = -1
    taken: int = 0
    open: int = 0
    next_look: float = 0.0  # monotonic: when to read the bucket's fill again
    refused_until: float = field(default=0.0, repr=False)  # a refused write stands until

    def due(self, now: float) -> bool:
        """Whether it is time to read the bucket's fill."""
        return now >= self.next_look

    def looked(self, stored: int, max_bytes: int, now: float) -> str | None:
        """The bucket holds ``stored`` bytes of ``max_bytes`` (<= 0: no limit)."""
        self.stored, self.max_bytes, self.taken = stored, max_bytes, self.open
        self.next_look = now + ROOM_LOOK_S
        return self._set(self.full if now < self.refused_until else self._past_room(1))

    def admit(self, now: float) -> str | None:
        """A new order asks to create its claim: counted (until ``ended``), unless
        ``full`` (then it is refused) or one more claim would eat into the room kept."""
        if not self.full:
            event = self._set(self._past_room(self.taken + 1))
            if not self.full:
                self.taken += 1
                self.open += 1
            return event
        return None

    def ended(self) -> None:
        """An order let in by ``admit`` ended: its claim's outcome is written (or never
        will be)."""
        self.open -= 1

    def refused(self, why: str, now: float) -> str | None:
        """JetStream refused a claim's write (or the bucket) for room: ``why``."""
        self.refused_until = now + ROOM_LOOK_S
        return self._set(why)

    def _past_room(self, more: int) -> str:
        """Why ``more`` claims would not fit beside the room kept, or ""."""
        if self.max_bytes <= 0 or self.stored < 0:
            return ""
        held = self.stored + (more - 1) * CLAIM_BYTES
        if held + CLAIM_BYTES <= self.max_bytes * (1 - ROOM_SHARE):
            return ""
        kept = math.floor(ROOM_SHARE * 100)
        return (
            f"the order claims' bucket holds about {held} of its {self.max_bytes} bytes (the "
            f"last {kept}% are kept for the outcomes of the orders under way)"
        )

    def _set(self, why: str) -> str | None:
        changed = bool(why) != bool(self.full)
        self.full = why
        if not changed:
            return None
        return FULL if why else ROOM


def store_full_detail(why: str) -> str:
    """The refusal's text for people (an ``Error`` with reason ``store_full``)."""
    return (
        f"order claims store full ({why}): nothing was placed; send the order again later "
        "with the same order id (docs/protocol.md §5.3c)"
    )
