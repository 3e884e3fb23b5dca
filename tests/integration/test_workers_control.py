"""The operator's verbs on one worker of a supplier that hosts several (docs/protocol.md
§4.22: ``buyer workers drain | stop | start``): a drained worker offers nothing, a stopped
one leaves the market as if its supplier had stopped (its machines stop with it, a failover
finds it gone, a stop is kept for it; the view calls it gone) and, started, applies what was
kept for it before its machines resume (I9), then serves again."""

from __future__ import annotations

import json

import anyio
import pytest

from bourse.view import open_view
from supplier.config import WorkerConfig
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.runner import Runner
from tests.cli import buyer
from tests.isolation import own_worker_id
from tests.market import Market, wait_until, worker
from tests.views import published

W1, W2 = own_worker_id("wc-1"), own_worker_id("wc-2")  # their cgroups: the host's
HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "0.2"]


def _worker(wid: str) -> WorkerConfig:
    return worker(
        wid, driver="process", catalog={"web": {"command": HEARTBEAT}}, keep_machines=False
    )


async def _json(market: Market, *args: str) -> dict[str, object]:
    code, out, err = await buyer(market, *args, "--json")
    assert code == 0, out + err
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


async def test_a_worker_drained_stopped_and_started_again(market: Market) -> None:
    host = await market.host(_worker(W1), _worker(W2))  # one supplier, two workers
    await market.exchange()
    deploy = ("deploy", "--app", "web", "--region", "mad", "--count", "1", "--spares", "1")
    deployed = await _json(market, *deploy, "--cpus", "1", "--memory-mb", "64", "--image", "web")
    slots = {s["role"]: s for s in deployed["slots"]}  # type: ignore[attr-defined]
    primary, spare = slots["primary"], slots["spare"]
    gone = primary["worker_id"]
    driver = host.workers[gone].driver
    assert isinstance(driver, Runner) and driver.is_running(primary["machine_id"])

    # drain: it offers nothing more, its machine runs on
    [state] = (await _json(market, "workers", "drain", gone))["workers"]  # type: ignore[misc]
    assert (state["serving"], state["draining"], state["drain_reason"]) == (True, True, "operator")
    order = ("place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web")
    code, out, _ = await buyer(market, *order, "--exclude", spare["worker_id"])
    assert code == 2 and f"draining: {gone}" in out
    assert driver.is_running(primary["machine_id"])

    # stop: it leaves the market; its machine stops with it (as with its supplier's stop)
    [state] = (await _json(market, "workers", "stop", gone))["workers"]  # type: ignore[misc]
    assert (state["serving"], state["machines"]) == (False, 1)
    assert not driver.is_running(primary["machine_id"])
    fleet = await _json(market, "fleet", "--fresh")  # the workers that answer now
    assert [w["worker_id"] for w in fleet["workers"]] == [spare["worker_id"]]  # type: ignore[attr-defined]
    code, _, err = await buyer(market, "machines", "show", primary["machine_id"], "--fresh")
    assert code == 1 and "is not reachable: no supplier serves it" in err  # gone, as if dead

    # the README's failover: the primary's worker is gone, so no --force is needed; the
    # stop of the old primary is kept for its worker
    failover = ("failover", "--app", "web", "--machine", primary["machine_id"], "--region", "mad")
    code, out, err = await buyer(market, *failover)
    assert code == 0, out + err
    assert out.splitlines()[0].startswith(f"started spare {spare['machine_id']} on "), out

    # start: the kept stop applied before its machines resume (I9): two primaries never run
    [state] = (await _json(market, "workers", "start", gone))["workers"]  # type: ignore[misc]
    assert (state["serving"], state["draining"]) == (True, False)  # the operator's drain lifted
    shown = await _json(market, "machines", "show", primary["machine_id"], "--fresh")
    assert shown["machine"]["state"] == "stopped", out  # type: ignore[index]
    assert not driver.is_running(primary["machine_id"])
    fleet = await _json(market, "fleet", "--fresh")
    assert sorted(w["worker_id"] for w in fleet["workers"]) == sorted([W1, W2])  # type: ignore[attr-defined]
    assert market.violations() == []


async def test_a_stopped_worker_resumes_its_machines_when_started(market: Market) -> None:
    """Nothing kept for it: what ran runs again, as after its supplier's restart; a verb is
    idempotent, and a worker no supplier hosts is one error line."""
    host = await market.host(_worker(W1))
    await market.exchange()
    placed = await _json(
        market, "place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web",
        "--start",
    )  # fmt: skip
    mid = placed["machine"]["machine_id"]  # type: ignore[index]
    driver = host.workers[W1].driver
    assert isinstance(driver, Runner)
    for _ in range(2):
        [state] = (await _json(market, "workers", "stop", W1))["workers"]  # type: ignore[misc]
        assert state["serving"] is False and not driver.is_running(mid)
    await _json(market, "workers", "start", W1)
    await wait_until(lambda: driver.is_running(mid))
    shown = await _json(market, "machines", "show", mid, "--fresh")
    assert shown["machine"]["state"] == "started"  # type: ignore[index]
    code, out, err = await buyer(market, "workers", "stop", "nobody-1")
    assert (code, out) == (1, "")
    assert err == "error: stop nobody-1: no supplier is listening on " + (
        f"{market.subjects.control('nobody-1')}\n"
    )


async def _view_changes(market: Market, worker_id: str, action: str) -> None:
    """``buyer workers <action> worker_id``, then wait until a view sees the worker's
    liveness change (gone after a stop, 3 s after its last row; back after a start)."""
    async with open_view(await market.connect("view"), market.subjects) as view:
        await _json(market, "workers", action, worker_id)
        with anyio.fail_after(15):
            async for batch in view.follow():
                if worker_id in batch.changed:
                    return


@pytest.mark.slow
async def test_a_stopped_worker_is_gone_from_the_view_and_back_once_started(
    market: Market,
) -> None:
    """The listings answer from the view by default: a stopped worker is shown as a stopped
    supplier's (its heartbeat leaves it out): gone since its stop, its machine's state
    unknown and its health -; started, it is back at once with its machine."""
    host = await market.host(_worker(W1), _worker(W2))
    await market.exchange()
    order = ("place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web")
    placed = await _json(market, *order, "--exclude", W2, "--start")
    mid = placed["machine"]["machine_id"]  # type: ignore[index]
    nc = await market.connect("rows")
    await published(nc, market.subjects, mid, "started")

    await _view_changes(market, W1, "stop")
    fleet = await _json(market, "fleet")
    assert sorted(w["worker_id"] for w in fleet["workers"]) == sorted([W1, W2])  # type: ignore[attr-defined]
    assert list(fleet["gone"]) == [W1]  # type: ignore[call-overload]
    listed = await _json(market, "machines", "list")
    [m] = listed["machines"]  # type: ignore[misc]
    # the row as its worker last published it: a supplier's stop stopped the machine and
    # kept it started, to run again with the worker; the view does not know more
    assert (m["machine_id"], m["state"]) == (mid, "started")
    assert listed["gone"] == fleet["gone"]
    code, out, err = await buyer(market, "machines", "list")
    [line] = [ln for ln in out.splitlines() if mid in ln]
    assert code == 0 and "unknown (worker gone since " in line, out + err
    assert line.split()[-4:-2] == ["0", "-"]  # restarts, health (the addresses, the app)
    code, out, err = await buyer(market, "fleet")
    assert "gone since " in next(ln for ln in out.splitlines() if W1 in ln), out + err

    await _view_changes(market, W1, "start")
    fleet = await _json(market, "fleet")
    assert fleet["gone"] == {}
    await wait_until(lambda: host.workers[W1].driver.is_running(mid))  # type: ignore[attr-defined]
    await published(nc, market.subjects, mid, "started")
    listed = await _json(market, "machines", "list")
    assert [(m["machine_id"], m["state"]) for m in listed["machines"]] == [(mid, "started")]  # type: ignore[attr-defined]
    assert listed["gone"] == {}
