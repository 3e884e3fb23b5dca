"""The starts scenario (loadtest/starts.py) on a real market: it measures a machine's start
through the market against its program started by hand, and the shims' memory; the figures
are the benchmark's (docs/performance.md), here only that a run completes and reports,
its steps' times included."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.starts import StartsProfile, run_starts, table


@pytest.mark.slow
async def test_a_small_starts_run_reports_both_ways_and_the_shims(tmp_path: Path) -> None:
    said: list[str] = []
    profile = StartsProfile(starts=2, machines=3, containers=False)
    rep = await run_starts(profile, tmp_path / "run", said.append)
    k = rep["kinds"]["process"]
    assert (k["starts"], k["failed"]) == (2, [])
    assert k["market_p50_ms"] > 0 and k["hand_p50_ms"] > 0
    assert (rep["shims"]["machines"], rep["shims"]["shims"]) == (3, 3)
    assert rep["shims"]["pss_kib_max"] > 0
    assert (tmp_path / "run" / "report.json").exists()
    shared = rep["kinds"]["process-shared"]  # the same starts with isolation off, same run
    assert (shared["starts"], shared["failed"]) == (2, [])
    assert table(rep).row_count == 2 and said  # a row per kind
    steps = rep["steps"]["process"]  # each step of a start timed: the supplier's, the harness's
    assert {"launch_ms", "plan_ms", "shim_ms", "start_verb_ms", "ready_ms"} <= set(steps)
    assert all(ms is not None and ms >= 0 for ms in steps.values()), steps
