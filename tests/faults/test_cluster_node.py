"""A 3-node NATS cluster loses a node under load: every program was given all three URLs,
fails over to the survivors by itself, and nothing is lost or doubled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadtest.chaos import ChaosRun
from loadtest.workload import trace
from tests.faults.conftest import FLEET, ONE_SECOND_OF_LOAD, strike_during_load


@pytest.mark.slow
async def test_killing_a_cluster_node_under_load(tmp_path: Path) -> None:
    async with ChaosRun(FLEET, tmp_path / "run", nats_nodes=3) as run:
        cluster = run.cluster
        assert cluster is not None
        orders = trace(run.p, "kc")
        # the node most programs use (URLs are shuffled): the one with the most connections
        busiest = max(range(3), key=lambda i: len(cluster.connections(f"c-{i + 1}")))
        assert cluster.connections(f"c-{busiest + 1}")

        kill = strike_during_load(
            run, ONE_SECOND_OF_LOAD, lambda: run.kill_nats_node(busiest, down_s=1.0)
        )
        _, (killed_at, _) = await asyncio.gather(run.load(orders), kill)
        assert all(m.alive for m in run.suppliers + run.exchanges)
        assert sum(run.stats.failed.values()) == 0, run.stats.failed
        # answered a second or more after the kill: the programs had failed over
        late = [r for r in run.records.values() if r.answered_at_s > killed_at + 1.0]
        assert late and all(r.outcome == "placed" for r in late)  # placing after the kill
        result = await run.finish()
        assert result.violations == []
