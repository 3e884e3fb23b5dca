"""What a worker's machines tell: the events a change writes with its record, and the facts
kept while the store refuses writes (supplier/machines/keeper.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bourse.wire.messages import Event, Health, LastExit, now_ms
from supplier.machines.api import Exit

# A start that ended before its command ran (its image could not be pulled): the exit code
# runtimes give to their own failures.
START_FAILED_CODE = 125
PULL_FAILED = "pull_failed"
MAX_EXIT_DETAIL = 1024  # LastExit.detail's bound on the wire


class EventFn(Protocol):
    """Builds an event (kind, order id, machine id, detail, the image's digest, a pull's
    bytes and seconds, a placed or started machine's addresses and private address, a
    check's health); it is
    written with the change it reports (the store's outbox: exactly-once publishing), then
    announced."""

    def __call__(
        self,
        kind: str,
        order_id: str = "",
        machine_id: str = "",
        detail: str = "",
        *,
        image_digest: str = "",
        pulled: tuple[int, float] = (0, 0.0),
        addresses: dict[str, str] | None = None,
        health: Health | None = None,
        private_address: str = "",
    ) -> Event: ...


# Told about an event once its change is durable.
AnnounceFn = Callable[[Event], None]


@dataclass(frozen=True, slots=True)
class Fact:
    """A change that happened to a machine in state ``was`` (its run ended, or a stop or
    destroy took it) while the store refused its record: the record's arguments, kept to
    be written later (the events keep their time)."""

    was: str
    state: str
    op: str
    detail: str = ""
    events: tuple[Event, ...] = ()
    changes: dict[str, Any] = field(default_factory=dict)


def last_exit(how: Exit, detail: str = "") -> LastExit:
    """The wire form of how a run ended."""
    return LastExit(
        reason=how.reason,
        code=how.code,
        signal=how.signal,
        at_ms=how.at_ms or now_ms(),
        detail=detail[:MAX_EXIT_DETAIL],
    )


def pull_failed(why: str) -> str:
    """A failed pull as a machine's event and last exit say it, within the wire's bound."""
    return f"{PULL_FAILED}: {why}"[:MAX_EXIT_DETAIL]
