"""The README's main job: ``bourse demo`` as a real process, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


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
