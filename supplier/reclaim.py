"""Reclaiming orphans: a worker's machines that no buyer holds (docs/protocol.md §5.3d).

A commit can land on a worker and still not be its order's machine: the auction's
``abort_commit`` was lost (the buyer was told ``Unfilled``), or the auction died and the one
that took its claim over did not hear this worker (a stall) and placed elsewhere. Such a
machine stays ``reserved``. So a worker asks, for each of its machines still ``reserved`` a
while (``after_ms``) after its commit, what the order's claim says (a ``ReclaimCheck`` to
the exchanges, which hold the claims): keep it, destroy it as an orphan, or ask again later.

This is one worker's bookkeeping, pure: which machines are due, which are being asked
about (their orders' bids and commits are not answered with the machine meanwhile, so a
machine is never handed out while its verdict may be "orphan"), what the verdicts mean.
The host (supplier/host.py) sends the checks and destroys the orphans.
"""

from __future__ import annotations

from collections.abc import Iterable

from bourse.wire.messages import RECLAIM_BATCH, Machine, ReclaimVerdict

# A machine still reserved this long after its commit is asked about: longer than any
# auction that may still hand it out (a 30 s deadline at most, plus the commit grace, is
# answered "wait" by its live claim, and asked again).
DEFAULT_AFTER_S = 10.0
# How often a host looks for machines that are due, at most.
MAX_EVERY_S = 5.0


def check_every(after_s: float) -> float:
    """How often to look for due machines: half the age that makes one due, at most
    ``MAX_EVERY_S``, so an orphan is destroyed within 1.5 x ``after_s`` (and at most
    ``after_s + MAX_EVERY_S``) of its verdict being known."""
    return min(MAX_EVERY_S, max(0.01, after_s / 2))


class Reclaims:
    """One worker's reclaim state: machines known to be their order's (``confirmed``, not
    asked again until a restart) and the ones asked about now (``orders``: their order ids,
    which the worker must not hand out meanwhile)."""

    def __init__(self, after_ms: int) -> None:
        self.after_ms = after_ms
        self.confirmed: set[str] = set()
        self.asking: dict[str, str] = {}  # machine id -> order id, while asked about
        self.orders: set[str] = set()

    def due(self, machines: Iterable[Machine], now_ms: int) -> list[Machine]:
        """The machines to ask about now (at most one ReclaimCheck's worth), marked as
        asked: ``reserved`` since at least ``after_ms``, neither confirmed nor asked."""
        if self.after_ms <= 0:
            return []
        cutoff = now_ms - self.after_ms
        batch = []
        for m in machines:
            if (
                m.state == "reserved"
                and not m.aborted
                and m.created_at_ms <= cutoff
                and m.machine_id not in self.confirmed
                and m.machine_id not in self.asking
            ):
                batch.append(m)
                if len(batch) == RECLAIM_BATCH:
                    break
        for m in batch:
            self.asking[m.machine_id] = m.order_id
            self.orders.add(m.order_id)
        return batch

    def settle(
        self, asked: Iterable[Machine], verdicts: Iterable[ReclaimVerdict]
    ) -> list[ReclaimVerdict]:
        """Take the verdicts on the machines ``asked`` about; returns the orphans to destroy
        (still marked as asked about until :meth:`done`). ``keep`` confirms; ``wait``, or
        no verdict, asks again later."""
        by_id = {v.machine_id: v for v in verdicts}
        orphans = []
        for m in asked:
            v = by_id.get(m.machine_id)
            if v is not None and v.verdict == "orphan":
                orphans.append(v)
                continue
            if v is not None and v.verdict == "keep":
                self.confirmed.add(m.machine_id)
            self.done(m.machine_id)
        return orphans

    def done(self, machine_id: str) -> None:
        """The machine is no longer asked about (settled, destroyed, or the check failed)."""
        order_id = self.asking.pop(machine_id, None)
        if order_id is not None:
            self.orders.discard(order_id)
