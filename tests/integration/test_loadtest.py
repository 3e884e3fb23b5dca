"""A small smoke run of the load-test harness: the report's shape and zero violations
(speed is the harness's business, not the test suite's)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from bourse.nats.embedded import EmbeddedNats
from loadtest import report
from loadtest.harness import run_loadtest
from loadtest.workload import SCENARIOS, Profile, Shape, trace
from tests.market import ROOMY_DEADLINE_MS, ROOMY_QUIET_MS


def _roomy(profile: Profile, **changes: Any) -> Profile:
    """``profile`` with ``changes``, and the test market's deadline and quiet window
    (tests/market.py): every order of a run that asks for all to be placed is, however
    busy the machine."""
    return msgspec.structs.replace(
        profile, deadline_ms=ROOMY_DEADLINE_MS, exchange_quiet_ms=ROOMY_QUIET_MS, **changes
    )


@pytest.mark.slow
async def test_smoke_run_reports_every_figure_and_no_violations(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    profile = msgspec.structs.replace(SCENARIOS["smoke"], duration_s=1.0, lifetime_s=0.5)
    rep = await run_loadtest(
        profile, tmp_path, [nats_server.url], ceiling_s=0.3, monitor_url=nats_server.monitor_url
    )

    assert rep["violations"] == []
    assert rep["orders"] == len(trace(profile))
    accounted = (
        rep["placed"]
        + sum(rep["unfilled"].values())
        + sum(n for k, n in rep["errors"].items() if not k.startswith("lifecycle"))
    )
    assert accounted == rep["orders"]
    assert rep["placed"] > 0 and rep["placements_per_s"] > 0
    lat = rep["latency_ms_placed"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"]
    assert rep["nats_ceiling_rps"] > 0 and 0 < rep["vs_ceiling"] < 1
    rtt = rep["nats_rtt_ms"]
    assert 0 < rtt["p50"] <= rtt["p99"]
    # a placement is at least two request-replies in a row, whatever the machine
    assert rep["latency_in_round_trips"]["p50"] > 1
    assert rep["latency_in_round_trips_from_send"]["p50"] > 1
    # timed from the send, a placement cannot take longer than from its due time
    sent = rep["latency_ms_placed_from_send"]
    assert 0 < sent["p50"] <= lat["p50"] and sent["p99"] <= lat["p99"]
    assert rep["oracle"]["fill_rate"] == 1.0 and rep["oracle"]["fill_vs_oracle"] > 0
    assert rep["machines_checked"] >= rep["placed"]
    assert {p["name"] for p in rep["processes"]} == {"supplier", "exchange", "loadgen"}
    assert all(p["max_rss_mb"] > 0 for p in rep["processes"])
    # CPU per placement: every process watched, the generator's own included
    cpu = rep["cpu_ms_per_placement"]
    assert set(cpu) == {"all", "supplier", "exchange", "loadgen"}
    assert all(v > 0 for v in cpu.values())
    assert cpu["all"] == pytest.approx(sum(v for k, v in cpu.items() if k != "all"), abs=0.01)
    # a placement is at least order, bid, offer, commit, Placed and the reply through the
    # server (each published once, delivered at least once); nothing near a hundred
    msgs = rep["messages_per_placement"]
    assert 5 <= msgs["published"] < 100 and 4 <= msgs["delivered"] < 100
    assert rep["nats_msgs"]["published"] >= 5 * rep["placed"]
    # by program: the generator publishes the orders (one each, and a machine verb or two),
    # the exchange bids, commits and answers, the suppliers offer, place and tell events;
    # together they are every client's publishes (JetStream's answers are the server's;
    # the two counters are read one after the other, so a stray heartbeat may fall
    # between them)
    by = rep["messages_per_placement_by_program"]
    assert set(by) == {"supplier", "exchange", "loadgen"}
    assert all(v["published"] >= 1 for v in by.values())
    total = sum(v["published"] for v in by.values())
    assert total == pytest.approx(msgs["published"], rel=0.05)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["placed"] == rep["placed"]
    assert on_disk["messages_per_placement"] == msgs and on_disk["cpu_ms_per_placement"] == cpu
    assert sorted(Path(p).name for p in rep["plots"]) == [
        "latency-cdf.png",
        "throughput.png",
        "utilization.png",
    ]
    assert all(Path(p).stat().st_size > 1000 for p in rep["plots"])


async def test_a_direct_run_places_without_any_exchange(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    profile = _roomy(SCENARIOS["smoke"], duration_s=0.5, lifetime_s=0.3, direct=True, bid_shards=4)
    rep = await run_loadtest(profile, tmp_path, [nats_server.url], ceiling=False, oracle=False)
    assert rep["violations"] == []
    assert rep["placed"] == rep["orders"] == len(trace(profile))
    assert {p["name"] for p in rep["processes"]} == {"supplier", "loadgen"}  # no exchange


async def test_a_tapped_run_counts_every_message_by_kind(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """--tap: one order, one bid and one claim create per order; one commit Placed and one
    order Placed per placement; and the kinds add up to what the server counted."""
    profile = _roomy(SCENARIOS["smoke"], duration_s=0.5, lifetime_s=0.3)
    rep = await run_loadtest(
        profile,
        tmp_path,
        [nats_server.url],
        ceiling=False,
        oracle=False,
        monitor_url=nats_server.monitor_url,
        tap=True,
    )
    assert rep["violations"] == [] and rep["placed"] == rep["orders"]
    kinds = rep["messages_per_placement_by_kind"]
    assert kinds["order"] == kinds["order -> Placed"] == kinds["commit -> Placed"] == 1
    assert kinds["claim write"] == kinds["claim write -> ack"] == 2  # create, then placed
    # a placed event is sent after the commit's answer: the last ones may miss the window
    assert (1 - kinds["event placed"]) * rep["placed"] <= 2
    assert kinds["event placed -> ack"] <= kinds["event placed"]
    assert kinds["bid"] + kinds.get("bid batch", 0) > 0 and kinds["bid -> Offers"] > 0
    # JetStream's acknowledgements, API answers and advisories are the server's: the rest is
    # what clients published
    server = ("jetstream advisory", "jetstream api -> ")
    published = sum(
        v for k, v in kinds.items() if not k.endswith("-> ack") and not k.startswith(server)
    )
    assert published == pytest.approx(rep["messages_per_placement"]["published"], rel=0.1)
    assert "NATS messages by kind" in _table_text(rep)


async def test_a_run_without_jetstream_places_with_no_claim_and_no_durable_event(
    tmp_path: Path,
) -> None:
    """--no-jetstream: the embedded server is core NATS only, so the exchange writes no
    claim and the suppliers publish their events at most once (nothing acknowledges)."""
    profile = _roomy(SCENARIOS["smoke"], duration_s=0.5, lifetime_s=0.3, jetstream=False)
    rep = await run_loadtest(profile, tmp_path, ceiling=False, oracle=False, tap=True)
    assert rep["violations"] == [] and rep["placed"] == rep["orders"]
    kinds = rep["messages_per_placement_by_kind"]
    assert "claim write" not in kinds
    assert not [k for k in kinds if k.endswith("-> ack")]
    assert (1 - kinds["event placed"]) * rep["placed"] <= 2  # told, at most once


async def test_a_tap_that_cannot_start_says_why(tmp_path: Path) -> None:
    """No server where the tap is pointed: the run fails at once, with the tap's log."""
    from bourse.wire.subjects import Subjects
    from loadtest.tap import tapped

    with pytest.raises(RuntimeError, match=r"loadtest\.tap exited"):
        async with tapped("nats://127.0.0.1:1", Subjects("lt1"), tmp_path):
            pass


def _table_text(rep: dict[str, Any]) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(report.table(rep))
    return console.export_text()


@pytest.mark.slow
async def test_a_run_of_fractional_cpus_keeps_every_invariant(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # Small workers (1.5 CPUs) and orders of 0.25, 0.5 and 1 CPU: the fleet fills up, so the
    # suppliers' I1 in millicores, the audit and the oracle all see fractions.
    profile = msgspec.structs.replace(
        SCENARIOS["smoke"],
        duration_s=1.0,
        lifetime_s=2.0,
        worker_cpus=1.5,
        shapes=[Shape(0.25, 256, 2), Shape(0.5, 512, 2), Shape(1, 1024, 1)],
    )
    rep = await run_loadtest(profile, tmp_path, [nats_server.url], ceiling_s=0.3)
    assert rep["violations"] == []
    assert rep["placed"] > 0 and rep["oracle"]["fill_rate"] > 0
    assert rep["machines_checked"] >= rep["placed"]
    print(
        f"fractional run: {rep['orders']} orders, placed {rep['placed']}, "
        f"unfilled {rep['unfilled']}, oracle fill {rep['oracle']['fill_rate']}"
    )
