"""A replaced machine's drain (bourse/client/apps/drain.py): when the edges' reports say
the requests under way have finished, by the deploy's own clock."""

from __future__ import annotations

import pytest

from bourse.client.apps.drain import Heard, drained, heard_of
from bourse.wire.messages import EdgeActivity

MARK = 100.0  # when the record named the machine draining (the deploy's clock, s)


@pytest.mark.parametrize(
    ("heard", "now", "want"),
    [
        ({}, MARK + 1.0, False),  # not heard long enough: an edge may not have reported yet
        ({}, MARK + 1.5, True),  # no edge in 1.5 intervals: nothing to wait for
        ({"e1": Heard(MARK + 1.2, 1.0, busy=False)}, MARK + 1.5, True),
        ({"e1": Heard(MARK + 0.5, 1.0, busy=False)}, MARK + 1.5, False),  # too soon after
        ({"e1": Heard(MARK + 1.2, 1.0, busy=True)}, MARK + 1.5, False),  # one in flight
        # two edges: each must say so
        ({"e1": Heard(MARK + 1.2, 1.0, False), "e2": Heard(MARK + 1.4, 1.0, True)}, MARK + 1.5,
         False),
        ({"e1": Heard(MARK + 2.2, 1.0, False), "e2": Heard(MARK + 2.4, 1.0, False)}, MARK + 2.5,
         True),
        # an edge silent for 3 intervals is gone: not waited for
        ({"e1": Heard(MARK + 0.5, 1.0, True), "e2": Heard(MARK + 3.8, 1.0, False)}, MARK + 3.9,
         True),
        # an edge of a longer interval is listened to longer
        ({"e1": Heard(MARK + 2.1, 2.0, False)}, MARK + 2.5, False),
    ],
)  # fmt: skip
def test_when_a_machine_is_drained(heard: dict[str, Heard], now: float, want: bool) -> None:
    assert drained(heard, MARK, now) is want


def test_a_report_says_busy_when_the_machine_has_a_request_in_flight() -> None:
    report = EdgeActivity(edge="e1", at_ms=5000, machines={"m1": 5000, "m2": 4000})
    assert heard_of(report, "m1", 7.0) == Heard(7.0, 1.0, busy=True)
    assert heard_of(report, "m2", 7.0).busy is False
    assert heard_of(report, "m3", 7.0).busy is False
