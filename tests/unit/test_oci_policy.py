"""The image cache's eviction policy and pull throughput, pure: entries, limits and the time
in, what to evict out. Budget 1000 bytes: high watermark 850, low 800, delay 180 s."""

from __future__ import annotations

import pytest

from bourse.images.policy import (
    DEFAULT_PULL_BYTES_PER_S,
    MIN_SAMPLE_BYTES,
    BadCacheLimits,
    Entry,
    Limits,
    PullRate,
    plan,
)

LIMITS = Limits(budget_bytes=1000)
NOW = 10_000.0
OLD = NOW - 3600  # past the delay
RECENT = NOW - 60  # within it


def e(key: str, size: int, last_used: float = OLD, pinned: bool = False) -> Entry:
    return Entry(key, size, last_used, pinned)


@pytest.mark.parametrize(
    ("entries", "incoming", "evict", "used_after", "fits"),
    [
        # at or under the high watermark: nothing to do
        pytest.param([e("a", 850)], 0, (), 850, True, id="at-high-watermark"),
        pytest.param([e("a", 400)], 450, (), 400, True, id="pull-within-high"),
        # past it: least recently used first, down to the low watermark
        pytest.param(
            [e("a", 300, OLD - 10), e("b", 300, OLD), e("c", 300, OLD - 20)],
            0,
            ("c",),
            600,
            True,
            id="lru-first-until-low",
        ),
        pytest.param(
            [e("a", 300, OLD), e("b", 300, OLD), e("c", 300, OLD)],
            0,
            ("a",),
            600,
            True,
            id="equal-times-by-key",
        ),
        # a pull counts as held: room is made down to low - incoming
        pytest.param(
            [e("a", 300, OLD - 2), e("b", 300, OLD - 1), e("c", 300, OLD)],
            300,
            ("a", "b"),
            300,
            True,
            id="pull-makes-room",
        ),
        # pinned entries never go, whatever their age
        pytest.param(
            [e("a", 300, OLD - 9, pinned=True), e("b", 300, OLD), e("c", 300, OLD)],
            0,
            ("b",),
            600,
            True,
            id="pinned-skipped",
        ),
        # nor entries used within the delay
        pytest.param(
            [e("a", 300, RECENT), e("b", 300, OLD), e("c", 300, RECENT)],
            0,
            ("b",),
            600,
            True,
            id="recent-skipped",
        ),
        # exactly the delay ago: may go
        pytest.param([e("a", 900, NOW - 180)], 0, ("a",), 0, True, id="delay-boundary"),
        # over the high watermark with nothing evictable: stays over, still within budget
        pytest.param([e("a", 900, RECENT)], 0, (), 900, True, id="nothing-evictable"),
        # a pull that cannot fit even with every evictable entry gone: evict nothing
        pytest.param(
            [e("a", 600, pinned=True), e("b", 300)],
            500,
            (),
            900,
            False,
            id="cannot-fit-evicts-nothing",
        ),
        pytest.param([], 1001, (), 0, False, id="bigger-than-budget"),
        # it fits the budget though not down to the low watermark: evict what may go
        pytest.param(
            [e("a", 600, pinned=True), e("b", 300)],
            100,
            ("b",),
            600,
            True,
            id="fits-above-low",
        ),
    ],
)
def test_the_plan_evicts_lru_unpinned_entries_past_their_delay(
    entries: list[Entry], incoming: int, evict: tuple[str, ...], used_after: int, fits: bool
) -> None:
    decided = plan(entries, LIMITS, NOW, incoming)
    assert (decided.evict, decided.used_after, decided.fits) == (evict, used_after, fits)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"budget_bytes": 0}, "must be positive"),
        ({"budget_bytes": 10, "low": 0.9, "high": 0.8}, "need 0 < low <= high <= 1"),
        ({"budget_bytes": 10, "high": 1.5}, "need 0 < low <= high <= 1"),
        ({"budget_bytes": 10, "delay_s": -1}, "must not be negative"),
    ],
)
def test_limits_that_cannot_bound_a_cache_are_refused(kwargs: dict[str, float], says: str) -> None:
    with pytest.raises(BadCacheLimits, match=says):
        Limits(**kwargs)  # type: ignore[arg-type]


def test_the_pull_rate_is_a_moving_average_of_real_pulls() -> None:
    rate = PullRate()
    assert rate.bytes_per_s == DEFAULT_PULL_BYTES_PER_S  # before any pull: the default
    rate.observe(MIN_SAMPLE_BYTES - 1, 0.001)  # too small to say anything
    rate.observe(10 * MIN_SAMPLE_BYTES, 0.0)  # no time measured
    assert (rate.bytes_per_s, rate.samples) == (DEFAULT_PULL_BYTES_PER_S, 0)
    rate.observe(100_000_000, 1.0)  # the first real pull replaces the default
    assert rate.bytes_per_s == 100_000_000
    rate.observe(200_000_000, 4.0)  # 50 MB/s, weighted 0.3
    assert rate.bytes_per_s == pytest.approx(0.3 * 50e6 + 0.7 * 100e6)
    assert rate.seconds_for(85_000_000) == pytest.approx(1.0)
