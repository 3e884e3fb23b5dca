"""The harness's pulls scenario, small: real suppliers pulling real images from the store,
both arms in one run, the report filled in. Whether cache-aware pricing pulls less than the
blind baseline is the scenario's measurement (docs/performance.md), not asserted here: ten
orders of 2-3 MB images are too few to tell it from chance on a busy host; pricing by the
bytes lacking is checked where it is decided (tests/unit/test_feasible.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.pulls import PullsProfile, run_pulls, table

pytestmark = pytest.mark.slow


async def test_both_arms_start_every_order_and_the_report_says_their_pulls(tmp_path: Path) -> None:
    # two small images, orders 250 ms apart, living 3 s
    profile = PullsProfile(
        images=2, image_mb=(2, 3), base_mb=1, orders=10, rate=4, lifetime_s=3, image_half_s=0.05
    )
    rep = await run_pulls(profile, tmp_path, lambda _: None)
    assert (tmp_path / "report.json").exists()
    aware, blind = rep["arms"]["aware"], rep["arms"]["blind"]
    for arm in (aware, blind):
        assert (arm["starts"], arm["unfilled"], arm["failed"]) == (10, {}, {})
        assert arm["unreported"] == 0 and arm["pulls"] >= 2  # each image pulled at least once
        assert 0 < arm["start_p50_ms"] <= arm["start_p99_ms"]
        assert 0 <= arm["hit_rate"] < 1 and arm["pull_mb_per_s"] > 0
    assert table(rep).row_count == 2
