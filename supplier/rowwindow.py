"""Which of a supplier's rows go to the state stream now (supplier/rows.py), pure: the rows
marked (each key's latest), the rows sent and not yet acknowledged (a bounded window, at
most one a key), and what an acknowledgement, a refusal or a timeout does to them.

A row goes as soon as it is marked, while the window has room and no row of its key is in
flight; a key changed while its row is in flight waits for that row's answer, and goes
then as its latest (changes of one machine within a round trip are one message). A row
that was not acknowledged is marked again, unless a newer one of its key is marked already.
The clock is given (``now``, seconds); nothing here sends, waits or sleeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Flight(Generic[V]):
    """A row sent: its ticket (the send's own number), what it was, when it went."""

    ticket: int
    value: V
    sent_at: float


class RowWindow(Generic[K, V]):
    """The rows of one publisher (see the module doc); ``limit`` rows in flight at most."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the window holds at least one row")
        self.limit = limit
        self.marked: dict[K, V] = {}
        self.flying: dict[K, Flight[V]] = {}  # in the order they went: the oldest first
        self._tickets = 0

    @property
    def backlog(self) -> int:
        """Rows marked or in flight: not yet known to be in the stream."""
        return len(self.marked) + len(self.flying)

    def mark(self, key: K, value: V) -> None:
        """``value`` is ``key``'s latest row: it replaces one marked and not yet sent."""
        self.marked[key] = value

    def again(self, key: K, value: V) -> None:
        """``value`` goes again (every row sent anew), unless a newer row of ``key`` is
        marked already."""
        self.marked.setdefault(key, value)

    def due(self, now: float) -> list[tuple[K, V, int]]:
        """The rows to send now, each with its ticket (they are in flight from now): the
        marked ones whose key has none in flight, as many as the window has room for, in
        the order they were first marked."""
        room = self.limit - len(self.flying)
        out: list[tuple[K, V, int]] = []
        if room <= 0 or not self.marked:
            return out
        for key in list(self.marked):
            if key in self.flying:
                continue  # its answer first; then this, its latest
            value = self.marked.pop(key)
            self._tickets += 1
            self.flying[key] = Flight(self._tickets, value, now)
            out.append((key, value, self._tickets))
            if len(out) == room:
                break
        return out

    def waiting(self) -> bool:
        """Whether a marked row could go now (:meth:`due` would give one)."""
        return len(self.flying) < self.limit and any(k not in self.flying for k in self.marked)

    def acked(self, key: K, ticket: int) -> bool:
        """The stream stored the row sent with ``ticket``; False when that send was
        already given up (timed out: its key moved on)."""
        flight = self.flying.get(key)
        if flight is None or flight.ticket != ticket:
            return False
        del self.flying[key]
        return True

    def failed(self, key: K, ticket: int) -> bool:
        """The row sent with ``ticket`` was not stored (refused, or no answer): marked again
        unless a newer row of its key is; False when that send was already given up."""
        flight = self.flying.get(key)
        if flight is None or flight.ticket != ticket:
            return False
        del self.flying[key]
        self.again(key, flight.value)
        return True

    def expired(self, now: float, timeout_s: float) -> list[tuple[K, int]]:
        """The sends older than ``timeout_s`` (key and ticket; the caller gives each up with
        :meth:`failed`), the oldest first."""
        out: list[tuple[K, int]] = []
        for key, flight in self.flying.items():
            if now - flight.sent_at < timeout_s:
                break  # the rest went later
            out.append((key, flight.ticket))
        return out
