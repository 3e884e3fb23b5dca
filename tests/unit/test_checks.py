"""The health core (supplier/checks.py HealthCore): a machine's health from its checks'
results, table-driven with an injected clock."""

from __future__ import annotations

import pytest

from supplier.checks import HealthCore

# (check index, passed, detail, now_ms) -> (status, since_ms, failures, changed, restart)
Step = tuple[int, bool, str, int]
Want = tuple[str, int, int, bool, bool]


@pytest.mark.parametrize(
    ("checks", "steps"),
    [
        pytest.param(
            1,
            [
                ((0, True, "", 10), ("passing", 10, 0, True, False)),
                ((0, True, "", 20), ("passing", 10, 0, False, False)),
                ((0, False, "refused", 30), ("critical", 30, 1, True, False)),
                ((0, False, "refused", 40), ("critical", 30, 2, False, False)),
                ((0, False, "timeout", 50), ("critical", 30, 3, False, True)),
                ((0, False, "timeout", 60), ("critical", 30, 4, False, False)),  # once a run
                ((0, True, "", 70), ("passing", 70, 0, True, False)),
            ],
            id="one check: passing, critical, restart at the 3rd failure, passing again",
        ),
        pytest.param(
            2,
            [
                ((0, True, "", 10), ("", 0, 0, False, False)),  # the other has not run yet
                ((1, True, "", 11), ("passing", 11, 0, True, False)),
                ((1, False, "status 500", 20), ("critical", 20, 1, True, False)),
                ((0, True, "", 21), ("critical", 20, 1, False, False)),  # one failing is enough
                ((1, True, "", 30), ("passing", 30, 0, True, False)),
            ],
            id="two checks: passing only when both passed their last run",
        ),
        pytest.param(
            1,
            [((0, False, "refused", 5), ("critical", 5, 1, True, False))],
            id="a first failure is critical at once",
        ),
    ],
)
def test_health_follows_the_results(checks: int, steps: list[tuple[Step, Want]]) -> None:
    core = HealthCore(checks)
    for (i, ok, detail, now), (status, since, failures, changed, restart) in steps:
        v = core.observe(i, ok, detail, now)
        assert (v.health.status, v.health.since_ms, v.health.failures) == (status, since, failures)
        assert (v.changed, v.restart) == (changed, restart)
        if status != "critical":
            assert v.health.detail == ""


def test_the_detail_is_the_worst_failing_checks() -> None:
    core = HealthCore(2)
    core.observe(0, False, "a refused", 1)
    core.observe(0, False, "a refused again", 2)
    v = core.observe(1, False, "b timeout", 3)
    assert (v.health.failures, v.health.detail) == (2, "a refused again")
