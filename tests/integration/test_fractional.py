"""Fractional CPUs end to end (docs/protocol.md §4.1): half-CPU orders through a real
exchange and in direct mode, on a real nats-server; two fit a 1-CPU worker, a third does
not; the buyer CLI places ``--cpus 250m`` and ``buyer fleet`` shows the fraction."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest

from bourse.wire.messages import Amount, Placed, PlaceOrder, Resources, Unfilled
from supplier.machines.runner import Runner
from tests.cli import buyer
from tests.integration.test_confinement import _cgroups_or_skip, _driver, _worker
from tests.market import ROOMY_DEADLINE_MS, Market, wait_until, worker

HALF = Resources(cpus=1, cpu_millis=500, memory_mb=256)


def order(resources: Resources = HALF, **kw: Any) -> PlaceOrder:
    return PlaceOrder(region="mad", resources=resources, image="web", **kw)


@pytest.mark.parametrize("direct", [False, True], ids=["exchange", "direct"])
async def test_two_half_cpu_orders_fill_a_one_cpu_worker_and_a_third_is_unfilled(
    market: Market, direct: bool
) -> None:
    host = await market.host(worker("mad-1", cpus=1, memory_mb=4096, images=["web"]))
    if not direct:
        await market.exchange()
    client = await market.client(direct=direct)
    placed = []
    for i in range(2):
        r = await client.place(order(order_id=f"half-{i}", deadline_ms=300))
        assert isinstance(r, Placed), r
        placed.append(r)
    # spread: u_cpus 0.5 -> 0.5, u_mem 256/4096 -> 0.9375: utility 0.71875; 0.7 * u + 0.3
    assert placed[0].score == pytest.approx(0.803125)
    third = await client.place(order(order_id="half-2", deadline_ms=300))
    assert isinstance(third, Unfilled) and third.reason == "no_offers"
    assert "0.5 cpus + 256 MiB" in third.detail
    assert host.workers["mad-1"].ledger.committed == (1000, 512, 0, 0, 0)  # I1: exactly full
    [status] = await client.status("mad")
    assert status.committed == Amount(cpus=1, memory_mb=512)
    assert status.held == Amount()
    m = await client.machine("get", placed[0].machine_id)
    assert m.resources == HALF  # stored and listed with its millicores
    assert market.violations() == []


async def test_a_v1_order_of_whole_cpus_still_takes_whole_cpus(market: Market) -> None:
    host = await market.host(worker("mad-1", cpus=2, memory_mb=4096))
    await market.exchange()
    client = await market.client()
    assert isinstance(await client.place(order(Resources(cpus=1, memory_mb=256))), Placed)
    assert isinstance(await client.place(order()), Placed)
    assert host.workers["mad-1"].ledger.committed == (1500, 512, 0, 0, 0)
    [status] = await client.status("mad")
    assert status.committed == Amount(cpus=2, cpu_millis=1500, memory_mb=512)


async def test_the_cli_places_millicores_and_the_fleet_shows_fractions(market: Market) -> None:
    await market.host(worker("mad-1", cpus=1, memory_mb=4096, images=["web"]))
    await market.exchange()
    args = ("place", "--region", "mad", "--memory-mb", "64", "--image", "web", "--json")
    args += ("--deadline-ms", str(ROOMY_DEADLINE_MS))
    code, out, err = await buyer(market, *args, "--cpus", "250m")
    assert code == 0, err
    mid = json.loads(out)["result"]["machine_id"]
    code, out, err = await buyer(market, *args, "--cpus", "0.5")
    assert code == 0, err
    code, out, err = await buyer(market, "machines", "show", mid, "--json")
    assert code == 0, err
    assert json.loads(out)["machine"]["resources"] == {
        "cpus": 1,
        "memory_mb": 64,
        "disk_mb": 0,
        "gpus": 0,
        "cpu_millis": 250,
    }
    code, out, err = await buyer(market, "fleet", "--region", "mad", "--fresh")  # the worker's
    assert code == 0, err
    [row] = [line for line in out.splitlines() if "mad-1" in line]
    assert "0.75/1" in row.split()


@pytest.mark.slow
async def test_a_half_cpu_burner_is_held_to_half_a_core(market: Market) -> None:
    d, mid, share = await _burner_share(market, 500, used_ns=20_000_000)
    print(f"0.5-CPU burner used {share:.3f} cores (cgroup usage counter)")
    assert 0.05 < share <= 0.6
    assert _cpu_files(d, mid) == ("50000", "100000")


@pytest.mark.slow
async def test_a_one_millicore_burner_gets_one_millicore_not_ten(market: Market) -> None:
    """``--cpus 1m`` is 1 ms of CPU per second: a CFS quota of 1 ms per 100 ms (the
    kernel's smallest quota at the usual period) would give it ten times what was sold."""
    d, mid, share = await _burner_share(market, 1, used_ns=1)
    print(f"1-millicore burner used {share * 1000:.2f} millicores (cgroup usage counter)")
    assert share < 0.005  # 1 ms a second (and the kernel's slack), not 10 ms
    assert _cpu_files(d, mid) == ("1000", "1000000")


async def _burner_share(market: Market, millicores: int, used_ns: int) -> tuple[Runner, str, float]:
    """Run a two-core burner sold ``millicores`` on a confining worker; once it has used
    ``used_ns``, the cores it uses over 3 s (its cgroup's usage counter)."""
    _cgroups_or_skip()
    await market.host(_worker())
    await market.exchange()
    d = _driver(market)
    client = await market.client()
    r = await client.place(
        PlaceOrder(
            region="mad",
            resources=Resources(cpus=1, cpu_millis=millicores, memory_mb=256),
            image="burn",
        )
    )
    assert isinstance(r, Placed), r
    m = await client.machine("start", r.machine_id)
    await wait_until(lambda: (d.usage_ns(m.machine_id) or 0) >= used_ns)
    used0, t0 = d.usage_ns(m.machine_id), time.monotonic()
    await anyio.sleep(3.0)  # a pace: the measuring window (3 CFS periods even of 1 s)
    used1, t1 = d.usage_ns(m.machine_id), time.monotonic()
    assert used0 is not None and used1 is not None
    return d, m.machine_id, (used1 - used0) / 1e9 / (t1 - t0)


def _cpu_files(d: Runner, machine_id: str) -> tuple[str, str]:
    """The machine's CFS (quota, period) as its cgroup holds them."""
    dirs = d.confiner.dirs(machine_id)
    if d.confiner.mechanism == "cgroup2":  # cpu.max is "quota period"
        quota, period = (dirs[""] / "cpu.max").read_text().split()
        return quota, period
    cpu = dirs["cpu"]
    return (cpu / "cpu.cfs_quota_us").read_text().strip(), (
        cpu / "cpu.cfs_period_us"
    ).read_text().strip()


async def test_deploy_runs_half_cpu_machines(market: Market) -> None:
    await market.host(*(worker(f"mad-{i}", cpus=1, images=["web"]) for i in (1, 2)))
    await market.exchange()
    code, _, err = await buyer(
        market,
        *("deploy", "--app", "half", "--region", "mad", "--cpus", "0.5", "--memory-mb", "64"),
        *("--image", "web", "--count", "2", "--json"),
    )
    assert code == 0, err
    client = await market.client()
    statuses = await client.status("mad")
    assert sorted(s.committed.cpu_millis for s in statuses) == [500, 500]
