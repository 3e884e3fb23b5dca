"""At most one run of a job per key at a time (a layer's fetch, an image's unpack): who
comes while it runs waits for it and shares its outcome."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio


@dataclass(slots=True)
class _Flight:
    """One run under way: set ``done`` when it ends, with its error or ``finished``."""

    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None
    finished: bool = False


class Flights:
    """At most one run of a job per key: who comes while it runs waits for it and shares its
    error; if the run was cancelled, the next waiter runs it."""

    def __init__(self) -> None:
        self._running: dict[str, _Flight] = {}

    def __contains__(self, key: str) -> bool:
        """Whether a run of ``key``'s job is under way."""
        return key in self._running

    async def run(self, key: str, job: Callable[[], Awaitable[None]]) -> None:
        while (flight := self._running.get(key)) is not None:
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            if flight.finished:
                return
        flight = _Flight()
        self._running[key] = flight
        try:
            await job()
            flight.finished = True
        except Exception as exc:
            flight.error = exc
            raise
        finally:
            del self._running[key]
            flight.done.set()
