"""A byte stream carried in messages over NATS core, as an exec session carries a command's
input and output (docs/protocol.md §4.24): its sender's window (how much it may send that
the other side has not acknowledged) and its receiver's check that no chunk was lost (each
chunk's offset is the bytes before it). Pure: both the worker and the client use it.

NATS core delivers at most once, in order per publisher: a chunk lost shows as an offset
past what was received, and the session ends rather than run on with a hole in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bourse.errors import BourseError


class StreamError(BourseError, ValueError):
    """A chunk or an acknowledgement that does not follow the stream (lost, or forged)."""


@dataclass(slots=True)
class Window:
    """A sender's side: ``size`` bytes may be unacknowledged at once."""

    size: int
    sent: int = 0
    acked: int = 0

    @property
    def room(self) -> int:
        """How many bytes may be sent now."""
        return max(0, self.size - (self.sent - self.acked))

    def sending(self, n: int) -> int:
        """``n`` bytes go now: the offset they go at (StreamError past the window)."""
        if n > self.room:
            raise StreamError(f"{n} bytes do not fit the window ({self.room} left)")
        offset = self.sent
        self.sent += n
        return offset

    def ack(self, received: int) -> bool:
        """The other side took ``received`` bytes in all; whether the window grew. An
        acknowledgement of bytes never sent is a StreamError; an older one changes nothing."""
        if received > self.sent:
            raise StreamError(f"{received} bytes acknowledged, {self.sent} sent")
        grew = received > self.acked
        self.acked = max(self.acked, received)
        return grew


@dataclass(slots=True)
class Inflow:
    """A receiver's side: the bytes taken so far, and how many it may hold unwritten."""

    size: int
    received: int = 0
    written: int = 0

    def take(self, offset: int, n: int) -> None:
        """A chunk of ``n`` bytes at ``offset`` arrived (StreamError: one was lost before
        it, or it overflows the window the sender was given)."""
        if offset != self.received:
            raise StreamError(f"a chunk at byte {offset}, {self.received} received: some lost")
        if self.received + n - self.written > self.size:
            raise StreamError(f"{n} bytes over the window of {self.size}")
        self.received += n

    def wrote(self, n: int) -> None:
        self.written += n
