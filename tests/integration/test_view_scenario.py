"""The view scenario (loadtest/views.py) runs end to end on a small profile: a change's
delay to a view measured for every row the view applied, a view built from scratch in a
process of its own, the CLI's listing timed (its view's keeper stopped at the end), the
stream one row per subject."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.views import ViewProfile, run_views, table
from tests.market import wait_until


@pytest.mark.slow
async def test_the_view_scenario_measures_what_it_says(tmp_path: Path) -> None:
    p = ViewProfile(
        workers=4, machines=40, changes_per_s=100, duration_s=1.0, build_machines=600,
        build_workers=20, regions=3, cli_runs=1,
    )  # fmt: skip
    rep = await run_views(p, tmp_path / "run", lambda _: None)
    d = rep["delay"]
    assert d["failed"] == 0 and d["changes"] == 2 * d["verbs"]
    # a row per change, or fewer (two changes of a machine in one 10 ms round: one row);
    # a few more are the last run's rows of the same changes
    assert 0 < d["rows_applied"] <= d["changes"] + 20
    assert 0 < d["to_stream_ms"]["p50"] <= d["delay_ms"]["p50"] + 1  # the stream is on the way
    assert (rep["build"]["machines"], rep["build"]["workers"]) == (600, 20)
    assert rep["build"]["peak_rss_mb"] > 0
    assert rep["cli"]["machines_listed"] == 210  # region r0: 7 of the 20 workers, 30 each
    # caught up before each answer (by the view's keeper, then by itself); then as it
    # stands (caught up a moment before)
    assert rep["cli"]["runs"] == 1 and rep["cli"]["view_age_ms_max"] < 1000
    itself = rep["cli"]["by_itself"]
    assert itself["machines_listed"] == 210 and itself["view_age_ms_max"] < 1000
    stands = rep["cli"]["as_it_stands"]
    assert stands["machines_listed"] == 210 and stands["view_age_ms_max"] > 0
    keeper_log = next((tmp_path / "run").rglob("*.keeper.log"))
    await wait_until(lambda: "view_keeper_stopped" in keeper_log.read_text())
    s, again = rep["stream"], rep["stream_after_republish"]
    assert s["messages"] >= 620  # every row, and the heartbeats
    assert again["republished"] == 210 and again["messages"] <= s["messages"] + 3  # + beats
    assert (tmp_path / "run" / "report.json").exists() and table(rep).row_count == 7
