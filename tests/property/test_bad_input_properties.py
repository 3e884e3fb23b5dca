"""I6 as properties: thousands of generated malformed, truncated, oversized, wrongly typed and
adversarial messages on every subject of a real supplier process and a real exchange process.

For every case: a request gets exactly the Error it deserves (code, a detail naming the
problem and, for a field, its JSON path) within a bounded time; a publish gets nothing back.
After every batch the supplier's state is exactly what it was (no hold, no machine change),
and after each test both processes are still running, logged no unexpected exception, and a
valid order still places.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bourse.wire.codec import decode
from bourse.wire.messages import Error
from tests.property.harness import NO_REPLY, Harness, assert_same, assert_still_serving
from tests.property.strategies import Case, misplaced_cases, raw_cases, structured_cases

BATCH = 40  # cases sent at once; below the supplier's bid backlog (64), so no bid is shed
SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ],
)


def check(case: Case, reply: bytes | str) -> None:
    if not case.reply:
        assert reply == NO_REPLY, case
        return
    assert isinstance(reply, bytes), f"{reply} for {case!r}"
    try:
        err = decode(reply, Error)
    except Exception as exc:
        raise AssertionError(
            f"reply {reply[:300]!r} is not an Error ({exc}) for {case!r}"
        ) from None
    assert err.code == case.code, f"{err} for {case!r}"
    assert err.detail.strip(), f"empty detail for {case!r}"
    assert err.detail.startswith(case.prefixes), f"{err.detail!r} for {case!r}"
    for name in case.names:
        assert name in err.detail, f"{name!r} not in {err.detail!r} for {case!r}"


def run_property(harness: Harness, cases: st.SearchStrategy[Case]) -> int:
    """Send generated batches; check every reply and that the supplier's state never moves."""
    before = harness.snapshot()
    sent = harness.sent

    @SETTINGS
    @given(batch=st.lists(cases, min_size=BATCH // 2, max_size=BATCH))
    def batches(batch: Sequence[Case]) -> None:
        for case, reply in zip(batch, harness.send_batch(batch), strict=True):
            check(case, reply)
        assert_same(before, harness.snapshot())

    batches()
    assert_still_serving(harness)
    return harness.sent - sent


@pytest.mark.slow
def test_wrongly_typed_out_of_range_and_missing_fields(harness: Harness) -> None:
    assert run_property(harness, structured_cases) >= 1000


def test_truncated_random_garbled_oversized_and_nested_payloads(harness: Harness) -> None:
    assert run_property(harness, raw_cases) >= 1000


def test_valid_json_in_the_wrong_place_and_unknown_subjects(harness: Harness) -> None:
    assert run_property(harness, misplaced_cases) >= 500
