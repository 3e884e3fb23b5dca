"""The soak mode end to end, through the real command: load, random faults, the audit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ops.cli import app as bourse
from tests.cli import run_cli


@pytest.mark.slow
def test_soak_mode_reports_faults_and_no_violation(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cmd = [
        sys.executable, "-m", "ops.cli", "loadtest",
        "--soak", "6", "--fault-every-s", "0.7", "--seed", "3", "--json", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report == json.loads((out / "soak-report.json").read_text()) | {
        "path": str(out / "soak-report.json")
    }
    orders, faults = report["orders"], report["faults"]
    assert orders["sent"] == 180  # 30/s for 6 s, the same seeded trace every time
    # a duplicate storm: each id twice more at once (a direct buyer, the exchanges); the
    # audit below holds every Placed of an id to one machine (I3)
    assert report["profile"]["duplicates"] == 3 and orders["duplicate_sends"] == 360
    assert (
        orders["placed"] + sum(orders["unfilled"].values()) + sum(orders["failed"].values())
        == orders["sent"]
    )
    # One fault at least: the next comes a random while after the last one ended, and on a
    # busy machine a restart can outlast the rest of the 6 s load (one fault in such a run)
    assert faults["total"] >= 1 and sum(faults["by_kind"].values()) == faults["total"]
    starts = [f["at_s"] for f in faults["log"]]
    assert len(starts) == faults["total"] and starts == sorted(starts)
    assert set(faults["by_kind"]) <= {
        "kill-supplier", "kill-exchange", "restart-nats", "stall-supplier", "fill-disk",
        "bad-input",
    }  # fmt: skip
    assert report["audit"]["files"] == 3 and report["audit"]["violations"] == []
    assert set(report["max_rss_mb"]) == {
        "supplier-0", "supplier-1", "supplier-2", "exchange-0", "exchange-1",
    }  # fmt: skip


def test_soak_refuses_an_external_nats() -> None:
    code, out, err = run_cli(bourse, "loadtest", "--soak", "5", "--nats", "x")
    assert code == 1
    assert "--soak starts (and restarts) its own nats-server" in err + out
