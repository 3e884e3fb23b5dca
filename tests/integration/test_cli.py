"""The ``buyer`` CLI as a real subprocess against a market on a real nats-server: every
command, exit codes (0 placed / 2 unfilled / 1 error) and --json shapes."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from bourse.wire.messages import Placed
from tests.market import Market, order, wait_until, worker


async def buyer(
    market: Market, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "buyer_cli",
        *args,
        "--prefix",
        market.subjects.prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BOURSE_NATS_URL": market.url, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


PLACE = ("place", "--region", "mad", "--cpus", "2", "--memory-mb", "1024", "--image", "web")


async def test_place_json_start_and_exit_codes(market: Market) -> None:
    await market.host(worker("mad-1", images=["web"]))
    await market.exchange()
    code, out, err = await buyer(market, *PLACE, "--order-id", "cli-1", "--start", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["result"]["type"] == "Placed" and doc["result"]["order_id"] == "cli-1"
    assert doc["result"]["image_cached"] is True and set(doc["result"]["subscores"]) >= {"cpus"}
    assert doc["machine"]["state"] == "started"

    code, out, _ = await buyer(
        market,
        "place",
        "--region",
        "mad",
        "--cpus",
        "64",
        "--memory-mb",
        "1",
        "--image",
        "web",
        "--deadline-ms",
        "200",
        "--json",
    )
    result = json.loads(out)["result"]
    assert code == 2 and (result["type"], result["reason"]) == ("Unfilled", "no_offers")

    code, out, err = await buyer(market, *PLACE)  # human output
    assert code == 0 and "placed" in out and "score" in out


async def test_place_direct_needs_no_exchange(market: Market) -> None:
    await market.host(worker("mad-1"))
    code, out, err = await buyer(market, *PLACE, "--direct", "--json")
    assert code == 0, err
    assert json.loads(out)["result"]["worker_id"] == "mad-1"
    code, _, err = await buyer(market, *PLACE)  # no exchange instance runs
    assert code == 1 and err.startswith("error: no exchange is listening")
    assert len(err.strip().splitlines()) == 1


async def test_bad_arguments_are_one_line_and_exit_1(market: Market) -> None:
    for args, text in [
        (
            ("place", "--region", "mad", "--cpus", "0", "--memory-mb", "1", "--image", "x"),
            "(--cpus)",
        ),
        ((*PLACE, "--label", "nokey"), "must look like key=value"),
        (
            ("place", "--region", "MAD", "--cpus", "1", "--memory-mb", "1", "--image", "x"),
            "(--region)",
        ),
        (("place", "--cpus", "1"), "Missing option"),
    ]:
        code, _, err = await buyer(market, *args)
        assert code == 1, (args, err)
        assert text in err and len(err.strip().splitlines()) == 1, err
    code, _, err = await buyer(market, *PLACE, env={"BOURSE_NATS_URL": "nats://127.0.0.1:1"})
    assert code == 1 and "cannot connect to NATS" in err and len(err.strip().splitlines()) == 1


async def test_machines_commands_and_fleet(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    r = await (await market.client()).place(order(cpus=2, memory_mb=512))
    assert isinstance(r, Placed)
    mid = r.machine_id
    code, out, _ = await buyer(market, "machines", "list", "--worker", "mad-1", "--json")
    assert code == 0 and [m["machine_id"] for m in json.loads(out)["machines"]] == [mid]
    for verb, state in [("show", "reserved"), ("start", "started"), ("stop", "stopped")]:
        code, out, err = await buyer(market, "machines", verb, mid, "--json")
        assert code == 0, err
        assert json.loads(out)["state"] == state
    code, out, _ = await buyer(market, "machines", "logs", mid, "--json")
    assert code == 0 and json.loads(out) == {
        "type": "MachineLogs",
        "machine_id": mid,
        "lines": [],
        "truncated": False,
        "end": 0,  # the byte offset to follow from (a sim machine has no log)
    }
    code, out, _ = await buyer(market, "fleet", "--region", "mad", "--json")
    [status] = json.loads(out)
    assert status["committed"]["cpus"] == 2 and status["machines"] == 1
    code, out, _ = await buyer(market, "machines", "destroy", mid, "--json")
    assert json.loads(out)["state"] == "destroyed"
    code, _, err = await buyer(market, "machines", "start", mid)
    assert code == 1 and f"cannot start machine {mid}: it is destroyed" in err


async def test_deploy_spreads_over_distinct_workers_with_spares_and_is_idempotent(
    market: Market,
) -> None:
    await market.host(
        worker("a1", region="ams"),
        worker("a2", region="ams"),
        worker("b1", region="bcn"),
        worker("b2", region="bcn"),
    )
    await market.exchange()
    args = (
        "deploy",
        "--app",
        "shop",
        "--region",
        "ams",
        "--region",
        "bcn",
        "--count",
        "3",
        "--spares",
        "1",
        "--cpus",
        "1",
        "--memory-mb",
        "256",
        "--image",
        "web",
        "--json",
    )
    code, out, err = await buyer(market, *args)
    assert code == 0, err
    doc = json.loads(out)
    slots = {s["slot"]: s["machine"] for s in doc["slots"]}
    assert doc["complete"] is True
    workers = [m["worker_id"] for m in slots.values()]
    assert len(set(workers)) == 4  # anti-affinity: every machine on its own worker
    assert {slots["primary-0"]["region"], slots["primary-1"]["region"]} == {"ams"}  # order
    assert [slots[f"primary-{i}"]["state"] for i in range(3)] == ["started"] * 3
    assert slots["spare-0"]["state"] == "reserved"  # spares are placed, not started

    code, out, _ = await buyer(market, *args)  # again: nothing new
    again = json.loads(out)
    assert all(s["existed"] for s in again["slots"])
    assert {s["machine"]["machine_id"] for s in again["slots"]} == {
        m["machine_id"] for m in slots.values()
    }

    code, out, _ = await buyer(market, *args[:-1], "--count", "5")  # more than workers
    assert code == 2


async def test_failover_starts_a_spare_when_the_worker_is_gone(market: Market) -> None:
    # One worker per supplier process, so the primary's worker can go away alone. Which
    # worker wins is the auction's business (offers race across processes): the test
    # follows the deployment, not a guess.
    hosts = {w: await market.host(worker(w, region="ams")) for w in ("g1", "k1", "k2")}
    await market.exchange()
    code, out, err = await buyer(
        market,
        "deploy",
        "--app",
        "api",
        "--region",
        "ams",
        "--count",
        "1",
        "--spares",
        "1",
        "--cpus",
        "1",
        "--memory-mb",
        "64",
        "--image",
        "x",
        "--json",
    )
    assert code == 0, err
    slots = {s["slot"]: s["machine"] for s in json.loads(out)["slots"]}
    primary = slots["primary-0"]

    ff = ("failover", "--app", "api", "--machine", primary["machine_id"], "--region", "ams")
    code, _, err = await buyer(market, *ff)
    assert code == 1 and "still answers" in err

    assert primary["worker_id"] != slots["spare-0"]["worker_id"]
    gone = hosts[primary["worker_id"]]
    await market.stop(gone)  # the primary's worker goes away
    await gone.nc.close()
    code, out, err = await buyer(market, *ff, "--json")
    assert code == 0, err
    assert json.loads(out)["machine_id"] == slots["spare-0"]["machine_id"]
    assert json.loads(out)["state"] == "started"
    code, _, err = await buyer(market, *ff)
    assert code == 2 and "no spare left" in err


async def test_watch_prints_events_as_json_lines(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "buyer_cli",
        "watch",
        "--count",
        "2",
        "--json",
        "--prefix",
        market.subjects.prefix,
        "--nats",
        market.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    client = await market.client()
    seen: list[dict[str, str]] = []

    async def place_until_seen() -> None:
        # The watcher subscribes a moment after it starts: keep acting until it reports.
        while proc.returncode is None:
            r = await client.place(order())
            assert isinstance(r, Placed)
            await client.machine("start", r.machine_id)
            # give the capacity back, so a slow-starting watcher never finds it used up
            await client.machine("destroy", r.machine_id)
            await asyncio.sleep(0.05)  # the pace of the actions, not a synchronisation

    actor = asyncio.create_task(place_until_seen())
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        actor.cancel()
        if proc.returncode is None:  # a failed wait leaves no watcher behind
            proc.kill()
            await proc.wait()
    seen = [json.loads(line) for line in out.decode().splitlines()]
    assert proc.returncode == 0 and len(seen) == 2
    assert all(e["type"] == "Event" and e["worker_id"] == "mad-1" for e in seen)
    emitted = {"placed", "pulled", "started", "stopped", "destroyed"}  # what the actions emit
    assert {e["kind"] for e in seen} <= emitted
    await wait_until(lambda: actor.done())


async def test_fleet_says_which_region_has_no_worker_and_exits_2(market: Market) -> None:
    await market.host(worker("mad-1"))
    code, out, err = await buyer(market, "fleet", "--region", "mad", "--region", "nowhere")
    assert code == 2 and "mad-1" in out
    assert err == "no worker answers in region 'nowhere'\n"
    code, out, err = await buyer(market, "fleet", "--region", "mad", "--json")
    assert (code, err) == (0, "") and "mad-1" in out
