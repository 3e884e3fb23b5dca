"""Whether a machine that was just started stays up: ``buyer place --start`` watches it
until its checks first pass or it has run ``up_s`` seconds without ending, and says how it
ended if it did (a machine that exits at once is not "started" for its buyer).

:func:`judge` is the pure core: the machine as its start answered, as read now, and the
seconds since -> watching, passing, up or ended. A restart counts as an end (its run ended;
its restart policy started another). :func:`watch_start` is the shell: it reads the machine
through the client at a pace (:data:`PACE_S`) until the core has judged."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import anyio

from bourse.runtime.defaults import DEFAULT_START_UP_S
from bourse.wire.messages import Machine

if TYPE_CHECKING:
    from bourse.client.client import BourseClient

# The pace of the reads while watching: a machine's state is read at most this often.
PACE_S = 0.1

Outcome = Literal["watching", "passing", "up", "ended"]
RUNNING = ("starting", "started")


def judge(first: Machine, now: Machine, elapsed_s: float, up_s: float) -> Outcome:
    """``ended``: it no longer runs, or it was restarted since ``first``; ``passing``: its
    checks passed; ``up``: it ran ``up_s`` seconds; else ``watching``."""
    if now.state not in RUNNING or now.restarts > first.restarts:
        return "ended"
    if now.state == "started" and now.health is not None and now.health.status == "passing":
        return "passing"
    return "up" if elapsed_s >= up_s else "watching"


@dataclass(frozen=True, slots=True)
class Watched:
    """What watching a start found, and the machine as last read."""

    outcome: Outcome
    machine: Machine

    def ended(self) -> str:
        """How it ended, in words (``outcome`` is "ended")."""
        m = self.machine
        if m.state in RUNNING:
            return f"ended and was restarted by its restart policy (restart {m.restarts})"
        return "failed" if m.state == "failed" else f"is {m.state}"


async def watch_start(
    client: BourseClient,
    started: Machine,
    up_s: float = DEFAULT_START_UP_S,
    pace_s: float = PACE_S,
    clock: Callable[[], float] = time.monotonic,
) -> Watched:
    """Read ``started`` (the start's answer) until :func:`judge` says something else than
    watching."""
    t0, now = clock(), started
    while (outcome := judge(started, now, clock() - t0, up_s)) == "watching":
        await anyio.sleep(pace_s)  # the pace of the reads, not a synchronisation
        now = await client.machine("get", started.machine_id)
    return Watched(outcome, now)
