"""The harness's pulls scenario, small: real suppliers pulling real images from the store,
both arms in one run, the report filled in and cache-aware pricing pulling less per start
than the cache-blind baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.pulls import PullsProfile, run_pulls, table

pytestmark = pytest.mark.slow


async def test_cache_aware_pricing_pulls_fewer_bytes_per_start_than_blind(tmp_path: Path) -> None:
    # two small images, orders 250 ms apart (each image's pull done before its next order)
    # living 3 s (the fleet fills, so the blind arm spreads them over its workers)
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
    assert aware["pulled_bytes_per_start"] < blind["pulled_bytes_per_start"]
    assert aware["hit_rate"] > blind["hit_rate"]
    assert table(rep).row_count == 2
