"""Machine lifecycle: which verb moves a machine from which state to which.

    reserved -> starting -> started -> stopping -> stopped -> destroyed
                            started -> failed (killed: at its memory limit, or by a signal)

``start``, ``stop`` and ``destroy`` are idempotent (start on a started machine returns it
unchanged; stop on a failed one too: it runs no more); anything else not in the table is an
InvalidTransition with a clear message. ``failed`` is not reached by a verb: the worker
records it when the driver reports a process killed and not restarted (supplier/machines.py).
"""

from __future__ import annotations

from bourse.errors import BourseError

LIVE_STATES = ("reserved", "starting", "started", "stopping", "stopped", "failed")

# verb -> {from_state: to_state}
TRANSITIONS: dict[str, dict[str, str]] = {
    "start": {
        "reserved": "started",
        "stopped": "started",
        "starting": "started",
        "failed": "started",
    },
    "stop": {"started": "stopped", "starting": "stopped", "stopping": "stopped"},
    "destroy": {s: "destroyed" for s in LIVE_STATES},
}
# verb -> the states in which it has nothing to do
SETTLED = {"start": ("started",), "stop": ("stopped", "failed"), "destroy": ("destroyed",)}
# verb -> the event published when it changes a machine
EVENT_OF = {"start": "started", "stop": "stopped", "destroy": "destroyed"}
# verb -> the state recorded while the driver works (so a crash mid-way is visible)
INTERMEDIATE = {"start": "starting", "stop": "stopping"}
# states in which a machine should be running (resumed after a supplier restart)
SHOULD_RUN = ("starting", "started")


class InvalidTransition(BourseError, ValueError):
    pass


def next_state(verb: str, machine_id: str, state: str) -> str:
    """The state after ``verb``; ``state`` itself when there is nothing to do."""
    if state in SETTLED.get(verb, ()):
        return state
    to = TRANSITIONS.get(verb, {}).get(state)
    if to is None:
        raise InvalidTransition(f"cannot {verb} machine {machine_id}: it is {state}")
    return to
