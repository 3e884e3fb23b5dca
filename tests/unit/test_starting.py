"""Whether a started machine stays up (bourse/client/starting.py ``judge``): the machine as
its start answered, as read now, and the seconds since, to what ``place --start`` says."""

from __future__ import annotations

import msgspec
import pytest

from bourse.client.starting import Watched, judge
from bourse.wire.messages import Health, LastExit, Machine, Resources

STARTED = Machine(
    machine_id="w1~01ABC", order_id="o1", worker_id="w1", region="mad", state="started",
    resources=Resources(cpus=1, memory_mb=64), image="web", created_at_ms=1,
)  # fmt: skip
PASSING = Health(status="passing", since_ms=2)
CRITICAL = Health(status="critical", since_ms=2, failures=1, detail="http: status 500")
EXIT = LastExit(reason="exit", code=2, at_ms=3)


def now(**changes: object) -> Machine:
    return msgspec.structs.replace(STARTED, **changes)


@pytest.mark.parametrize(
    ("read", "elapsed_s", "outcome"),
    [
        (now(), 0.5, "watching"),  # up, not long enough yet
        (now(), 2.0, "up"),  # ran 2 s without ending
        (now(health=PASSING), 0.3, "passing"),  # its checks passed: no need to wait on
        (now(health=CRITICAL), 0.5, "watching"),  # a failing check ends nothing by itself
        (now(health=CRITICAL), 2.0, "up"),
        (now(state="stopped", last_exit=EXIT), 0.2, "ended"),  # exited (policy no)
        (now(state="failed", last_exit=EXIT), 0.2, "ended"),  # killed, or its pull failed
        (now(restarts=1, last_exit=EXIT), 0.2, "ended"),  # ended, and its policy restarted it
        (now(state="destroyed"), 0.2, "ended"),
        (now(state="starting"), 0.1, "watching"),  # started again after a restart's backoff
    ],
)
def test_a_start_is_judged_by_what_the_machine_does_after_it(
    read: Machine, elapsed_s: float, outcome: str
) -> None:
    assert judge(STARTED, read, elapsed_s, up_s=2.0) == outcome


def test_a_start_watched_for_no_time_is_up_unless_it_ended_already() -> None:
    assert judge(STARTED, STARTED, 0.0, up_s=0.0) == "up"
    assert judge(STARTED, now(state="stopped"), 0.0, up_s=0.0) == "ended"


def test_how_it_ended_in_words() -> None:
    assert Watched("ended", now(state="stopped")).ended() == "is stopped"
    assert Watched("ended", now(state="failed")).ended() == "failed"
    assert Watched("ended", now(restarts=3)).ended() == (
        "ended and was restarted by its restart policy (restart 3)"
    )
