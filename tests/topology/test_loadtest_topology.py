"""The load-test harness across a supercluster: suppliers on one cluster (--supplier-nats),
the generator and the exchanges on another (--nats)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import structlog
from typer.testing import CliRunner

import loadtest.harness
from bourse.nats.supercluster import Supercluster
from bourse.wire.subjects import Subjects
from loadtest.harness import run_loadtest
from loadtest.runner import start_fleet
from loadtest.workload import SCENARIOS
from ops import cli as bourse
from tests.cli import run_cli

TINY = msgspec.structs.replace(SCENARIOS["smoke"], duration_s=1.0, lifetime_s=0.5, rate=20)


async def test_fleet_suppliers_join_their_cluster_and_exchanges_theirs(
    three_clusters: Supercluster, tmp_path: Path
) -> None:
    sc = three_clusters
    programs = await start_fleet(TINY, sc.urls("a"), Subjects("ltf"), tmp_path, sc.urls("b"))
    try:
        fleet_file = msgspec.json.decode((tmp_path / "config" / "fleet-0.json").read_bytes())
        first_worker = fleet_file["worker"][0]["worker_id"]
        assert sc.server_of(f"bourse-supplier:{first_worker}") == "b-1"
        assert sc.server_of("bourse-exchange").startswith("a-")
    finally:
        for p in programs:
            assert await p.stop() == 0


async def test_a_run_across_the_gateway_places_and_checks_the_invariants(
    three_clusters: Supercluster, tmp_path: Path
) -> None:
    rep = await run_loadtest(
        TINY,
        tmp_path,
        three_clusters.urls("a"),
        ceiling=False,
        oracle=False,
        supplier_urls=three_clusters.urls("c"),
    )
    assert rep["violations"] == []
    assert rep["placed"] > 0 and rep["placed"] == rep["orders"] - sum(rep["unfilled"].values())
    assert rep["machines_checked"] >= rep["placed"]  # every worker answered across the gateway


def test_supplier_nats_without_nats_is_refused() -> None:
    code, _, err = run_cli(
        bourse.app, "loadtest", "--supplier-nats", "nats://127.0.0.1:4222",
        env={"BOURSE_NATS_URL": None},
    )  # fmt: skip
    assert code == 1
    assert err == "error: --supplier-nats needs --nats: the generator and exchanges' cluster\n"


def test_supplier_nats_reaches_the_run_as_the_suppliers_urls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    got: dict[str, object] = {}

    async def fake_run(profile: object, out: Path, urls: list[str], **kw: object) -> dict:
        got.update(urls=urls, **kw)
        return {"violations": [], "plots": []}

    # `bourse loadtest` imports the harness when it runs (its extra may be missing)
    monkeypatch.setattr(loadtest.harness, "run_loadtest", fake_run)
    result = CliRunner().invoke(
        bourse.app,
        ["loadtest", "--nats", "nats://a:1", "--supplier-nats", "nats://b:1,nats://b:2",
         "--json", "--out", str(tmp_path)],
    )  # fmt: skip
    structlog.reset_defaults()
    assert result.exit_code == 0, result.output
    assert got["urls"] == ["nats://a:1"]
    assert got["supplier_urls"] == ["nats://b:1", "nats://b:2"]
