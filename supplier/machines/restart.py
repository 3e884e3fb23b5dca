"""Restart policy: the one home of when a machine is started again by its worker, and after
how long. Pure: what happened and a clock in, a verdict out; the worker's keeper
(supplier/machines/keeper.py) applies it to all three causes:

- ``exit``: its run ended by itself (``always``: restart; ``on-failure``: restart unless
  it exited with code 0; ``no``: record the exit);
- ``check``: its checks failed 3 times in a row (``on-failure`` and ``always`` restart it;
  ``no`` leaves it running, critical);
- ``pull``: its image could not be made ready. A transient failure (the store unreachable,
  a timeout, no room yet) is tried again under ``on-failure`` and ``always``; bytes that did
  not match their digest, or an entry refused while unpacking, are not: the store's
  content must change first (push the image again, then start the machine).

One backoff for all of them: the first restart after :data:`BACKOFF_FIRST_S`, doubling up to
:data:`BACKOFF_MAX_S`; a run that lasted :data:`BACKOFF_RESET_AFTER_S` (or a start that
succeeded, for pulls) starts the count again.

The policy a machine has: the order's ``restart`` field, else the v1 ``metadata["restart"]``
(still honoured, and still sent by clients for workers that predate the field), else its
catalog image's default, else ``no`` (:func:`policy_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bourse.wire.messages import Machine
from bourse.wire.metadata import RESTART, RESTART_POLICIES, RestartPolicy
from supplier.machines.api import Exit

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 10.0
BACKOFF_RESET_AFTER_S = 30.0

Cause = Literal["exit", "check", "pull"]


class BadPolicy(ValueError):
    """A restart policy that is not one of RESTART_POLICIES."""


def policy_of(m: Machine, default: str = "no") -> RestartPolicy:
    """The machine's restart policy (see the module doc); BadPolicy naming the allowed
    ones for anything else."""
    value = m.restart or m.metadata.get(RESTART, "") or default or "no"
    for p in RESTART_POLICIES:
        if value == p:
            return p
    raise BadPolicy(f"restart policy {value!r}: use one of {', '.join(RESTART_POLICIES)}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Restart (after ``delay_s``) or not; ``why`` says so in words for an event."""

    restart: bool
    delay_s: float = 0.0
    why: str = ""


@dataclass(slots=True)
class Backoff:
    """One machine's failures in a row (its restarts' backoff)."""

    failures: int = 0

    def next_delay(self) -> float:
        delay = min(BACKOFF_FIRST_S * float(2**self.failures), BACKOFF_MAX_S)
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0


def decide(
    policy: RestartPolicy,
    cause: Cause,
    backoff: Backoff,
    *,
    how: Exit | None = None,
    ran_s: float = 0.0,
    permanent: bool = False,
) -> Verdict:
    """Whether the machine starts again, and when. ``how``: the run's end (``exit``);
    ``ran_s``: how long that run lasted; ``permanent``: a pull failure that trying again
    cannot mend."""
    if cause == "exit":
        assert how is not None
        if ran_s >= BACKOFF_RESET_AFTER_S:
            backoff.reset()
        if policy == "always" or (policy == "on-failure" and not how.clean):
            return Verdict(True, backoff.next_delay(), f"{how.describe()}; restart policy {policy}")
        return Verdict(False, why=f"{how.describe()}; restart policy {policy}")
    if policy == "no":
        return Verdict(False, why="restart policy no")
    if cause == "pull" and permanent:
        return Verdict(False, why="not tried again: push the image again, then start it")
    return Verdict(True, backoff.next_delay(), f"restart policy {policy}")
