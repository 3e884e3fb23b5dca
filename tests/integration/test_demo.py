"""The README's main job: ``bourse demo`` as a real process, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio

from bourse.client import BourseClient
from bourse.images import ImageInfo, ImageStore
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.messages import Machine, Placed
from ops.demo import DEMO_FLEET
from tests.isolation import ONE_DEMO_FLEET_AT_A_TIME
from tests.market import Market, order, worker

pytestmark = ONE_DEMO_FLEET_AT_A_TIME


def test_bourse_demo_places_real_orders_and_stops_cleanly(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.cli",
            "demo",
            "--json",
            "--burst",
            "30",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    outcomes = {o["scenario"]: o["result"] for o in report["orders"]}
    web = outcomes["web: the worker with the image cached wins"]
    assert (web["type"], web["image_cached"]) == ("Placed", True)
    assert outcomes["ml job: needs the gpu=a100 label"]["worker_id"] == "mad-3"
    assert outcomes["idempotent: demo-retry again"]["existing"] is True
    assert (
        outcomes["idempotent: demo-retry again"]["machine_id"]
        == outcomes["idempotent: order demo-retry"]["machine_id"]
    )
    assert outcomes["too big for any worker"]["reason"] == "no_offers"
    assert outcomes["a region nobody serves"]["reason"] == "no_workers"
    assert outcomes["picky buyer: min_score 0.99"]["reason"] == "below_min_score"
    assert report["burst"]["orders"] == 30
    assert report["burst"]["placed"] + sum(report["burst"]["unfilled"].values()) == 30
    for w in report["fleet"]:  # I1 from the workers' own status replies
        for r in ("cpus", "memory_mb", "disk_mb", "gpus"):
            assert w["committed"][r] + w["held"][r] <= w["capacity"][r]
    # Processes stopped cleanly and their logs and state were kept in --data-dir.
    assert "supplier_stopped" in (tmp_path / "logs" / "supplier-mad.log").read_text()
    assert (tmp_path / "data" / "mad" / "supplier.db").exists()
    # The example app was pushed into the market's store, and a machine of it placed by its
    # digest: the store, read again from the demo's server directory, says the same digest.
    hello = outcomes["hello: the example app, pushed and placed by its tag"]
    assert (hello["type"], hello["region"]) == ("Placed", "mad")
    pushed = anyio.run(_stored_hello, tmp_path / "nats")
    assert pushed.digest == hello["image_digest"]
    assert pushed.cmd == ("python3", "server.py") and "HELLO_VERSION=1" in pushed.env


async def _stored_hello(workdir: Path) -> ImageInfo:
    server = EmbeddedNats(workdir=workdir).start()
    try:
        nc = await connect([server.url], name="test-demo", service=False)
        try:
            store = await ImageStore.open(nc, create=False)
            return await store.inspect("hello:latest")
        finally:
            await shutdown(nc)
    finally:
        server.stop()


def _demo_on(url: str, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "demo", "--json", "--burst", "12", "--nats", url, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


async def _live(client: BourseClient, worker_ids: list[str]) -> list[Machine]:
    machines = []
    for worker_id in worker_ids:
        machines += (await client.machines(worker_id)).machines
    return [m for m in machines if m.state != "destroyed"]


async def test_demo_on_a_users_market_leaves_it_as_it_was(market: Market) -> None:
    """On a market given with --nats, the demo destroys what it placed (its app's machines),
    unless --keep; the user's own machines are untouched either way."""
    workers = [w["worker_id"] for ws in DEMO_FLEET.values() for w in ws]
    for region, ws in DEMO_FLEET.items():
        await market.host(*(worker(str(w["worker_id"]), region, 64, 262144) for w in ws))
    await market.exchange()
    client = await market.client()
    mine = await client.place(order(region="fra"))  # the user's own machine
    assert isinstance(mine, Placed)

    report = await anyio.to_thread.run_sync(
        _demo_on, market.url, "--prefix", market.subjects.prefix
    )
    # what it placed, however many a busy machine let it place (the burst's 12 on an idle
    # one): each scripted machine once (a retry shares its machine), and the burst's
    scripted = {
        o["result"]["machine_id"] for o in report["orders"] if o["result"]["type"] == "Placed"
    }
    cleanup = report["cleanup"]
    assert cleanup["placed"] == len(scripted) + report["burst"]["placed"] > 0
    assert cleanup["destroyed"] == cleanup["placed"]
    assert [m.machine_id for m in await _live(client, workers)] == [mine.machine_id]

    kept = await anyio.to_thread.run_sync(
        _demo_on, market.url, "--prefix", market.subjects.prefix, "--keep"
    )
    assert kept["cleanup"] is None
    live = await _live(client, workers)
    demo = [m for m in live if m.metadata.get("app") == "bourse-demo"]
    assert len(demo) >= 12 and len(live) == len(demo) + 1
