"""The edge scenario (loadtest/edge.py): an upstream, the edge and nginx's reverse proxy in
front of it, wrk against each; the figures are the benchmark's (docs/performance.md), here
only that a short run wires every arm, completes and reports. Its parser of wrk's output
is checked on a fixed text."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.edge import EdgeProfile, parse_wrk, run_edge, table

WRK = """Running 1s test @ http://127.0.0.1:28001/
  1 threads and 1 connections
  Latency Distribution
     50%  132.00us
     75%  150.00us
     90%  1.20ms
     99%    2.50s
  5000 requests in 1.00s, 1.00MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 4
Requests/sec:   4999.50
"""


def test_wrk_output_is_read() -> None:
    assert parse_wrk(WRK) == {
        "rps": 4999.5,
        "requests": 5000.0,
        "p50_ms": 0.132,
        "p99_ms": 2500.0,
        "errors": 7.0,
    }


@pytest.mark.slow
async def test_a_short_edge_run_reports_every_arm(tmp_path: Path) -> None:
    said: list[str] = []
    profile = EdgeProfile(connections=4, duration_s=1, latency_s=1, rounds=1)
    rep = await run_edge(profile, tmp_path / "run", said.append)
    assert set(rep["arms"]) == {"direct", "edge", "nginx"}
    for arm in rep["arms"].values():
        assert arm["rps"] > 0 and arm["p50_ms"] > 0 and arm["errors"] == []
        assert arm["cpu_us_per_request"] > 0
    assert rep["edge_over_nginx_rps"] > 0
    assert (tmp_path / "run" / "report.json").exists()
    assert table(rep).row_count == 3 and len(said) == 4


@pytest.mark.slow
async def test_a_short_cold_start_run_measures_each_arm(tmp_path: Path) -> None:
    """The edge-cold scenario (loadtest/edgecold.py): a real market, a process machine,
    the edge; two rounds of each arm (own start, through the edge, placed by the edge),
    none failed."""
    from loadtest.edgecold import ColdProfile, run_cold
    from loadtest.edgecold import table as cold_table

    said: list[str] = []
    rep = await run_cold(ColdProfile(starts=2), tmp_path / "run", said.append)
    assert rep["failed"] == [] and rep["samples"] == {"own": 2, "edge": 2, "placed": 2}
    assert rep["own_start_p50_ms"] > 0 and rep["edge_first_byte_p50_ms"] > 0
    assert rep["placed_first_byte_p50_ms"] > 0
    assert (tmp_path / "run" / "report.json").exists() and cold_table(rep).row_count == 3


@pytest.mark.slow
async def test_a_short_faults_run_counts_each_phase_and_the_spare(tmp_path: Path) -> None:
    """The edge-faults scenario (loadtest/edgefail.py) at 50 GET/s and 2 s between faults:
    three suppliers, the edge and its controller, the deploy, the restart, the kill; every
    phase counted, the spare (another machine than the killed primary) serving after the
    kill, the killed worker's processes found, nothing of the run left running."""
    from loadtest.edgefail import FaultsProfile, kill_machines, run_faults
    from loadtest.edgefail import table as faults_table

    rep = await run_faults(FaultsProfile(rate=50, settle_s=2.0), tmp_path / "run", print)
    assert list(rep["phases"]) == ["steady", "deploy", "restart", "kill"]
    assert all(p["requests"] > 0 for p in rep["phases"].values()), rep
    assert rep["spare_serving_s"] is not None and rep["killed_pids"] >= 1, rep
    assert faults_table(rep).row_count == 4
    assert (tmp_path / "run" / "report.json").exists()
    workers = [p.name for p in (tmp_path / "run" / "data").iterdir()]
    assert len(workers) == 3 and all(kill_machines(w) == [] for w in workers)
