"""The restart policy (supplier/machines/restart.py): one table for exits, failed checks and
failed pulls, one backoff, and where a machine's policy comes from."""

from __future__ import annotations

import pytest

from bourse.wire.messages import Machine, Resources
from supplier.machines.api import Exit
from supplier.machines.restart import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    BACKOFF_RESET_AFTER_S,
    Backoff,
    BadPolicy,
    Cause,
    decide,
    policy_of,
)

CLEAN, FAILED, KILLED = Exit(code=0), Exit(code=3), Exit(signal=9, oom=True)


@pytest.mark.parametrize(
    ("policy", "cause", "how", "permanent", "restart"),
    [
        ("no", "exit", FAILED, False, False),
        ("on-failure", "exit", CLEAN, False, False),
        ("on-failure", "exit", FAILED, False, True),
        ("on-failure", "exit", KILLED, False, True),
        ("always", "exit", CLEAN, False, True),
        ("no", "check", None, False, False),
        ("on-failure", "check", None, False, True),
        ("always", "check", None, False, True),
        ("no", "pull", None, False, False),
        ("on-failure", "pull", None, False, True),
        ("always", "pull", None, True, False),  # bad content: trying again cannot mend it
    ],
)
def test_who_is_started_again(
    policy: str, cause: Cause, how: Exit | None, permanent: bool, restart: bool
) -> None:
    verdict = decide(policy, cause, Backoff(), how=how, permanent=permanent)  # type: ignore[arg-type]
    assert verdict.restart is restart
    assert verdict.why


def test_one_backoff_doubles_to_its_most_and_a_long_run_resets_it() -> None:
    b = Backoff()
    delays = [decide("always", "exit", b, how=FAILED).delay_s for _ in range(10)]
    assert delays[:3] == [BACKOFF_FIRST_S, 2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S]
    assert delays[-1] == BACKOFF_MAX_S
    assert decide("always", "exit", b, how=FAILED, ran_s=BACKOFF_RESET_AFTER_S).delay_s == (
        BACKOFF_FIRST_S
    )
    assert decide("on-failure", "check", b).delay_s == 2 * BACKOFF_FIRST_S  # the same count


def _m(restart: str = "", meta: str | None = None) -> Machine:
    return Machine(
        machine_id="w~1",
        order_id="o",
        worker_id="w",
        region="r",
        state="started",
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        metadata={} if meta is None else {"restart": meta},
        restart=restart,
    )


@pytest.mark.parametrize(
    ("field", "meta", "default", "policy"),
    [
        ("", None, "no", "no"),
        ("", None, "always", "always"),  # the catalog image's own
        ("", "on-failure", "always", "on-failure"),  # v1's metadata, still honoured
        ("always", "no", "no", "always"),  # the field wins
    ],
)
def test_a_machines_policy(field: str, meta: str | None, default: str, policy: str) -> None:
    assert policy_of(_m(field, meta), default) == policy


def test_a_policy_that_is_none_is_named() -> None:
    with pytest.raises(BadPolicy, match="restart policy 'sometimes': use one of no, on-failure"):
        policy_of(_m(meta="sometimes"))
