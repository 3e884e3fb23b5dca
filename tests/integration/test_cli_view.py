"""The buyer answers from its view of the market (issue 37's "done when"): a worker's
supplier is stopped, and `buyer apps status` shows its machine as `unknown (worker gone
since …)`, `machines list`, `machines show` and `fleet` say it, `buyer query` answers SQL at
once (read-only), and `query --watch` prints rows as they change; the view is a cache in
the user's cache directory, resumed after a kill -9."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import anyio

from bourse.view import open_view
from tests.cli import buyer
from tests.market import Market, order, worker
from tests.views import published, worker_published

APP = ("deploy", "--app", "web", "--region", "mad", "--count", "1", "--spares", "1")
APP += ("--cpus", "1", "--memory-mb", "64", "--image", "web", "--json")
COUNT = "SELECT region, count(*) AS n FROM machines WHERE state = 'started' GROUP BY region"


async def test_a_gone_workers_machines_are_shown_unknown(market: Market) -> None:
    hosts = {w: await market.host(worker(w)) for w in ("mad-1", "mad-2")}
    await market.exchange()
    code, out, err = await buyer(market, *APP)
    assert code == 0, err
    slots = {s["role"]: s for s in json.loads(out)["slots"]}
    primary, spare = slots["primary"], slots["spare"]
    nc = await market.connect("test")
    await published(nc, market.subjects, primary["machine_id"], "started")

    await market.stop(hosts[primary["worker_id"]])  # its supplier stops; its machine runs on
    async with open_view(nc, market.subjects) as view:  # until a view calls it gone (3 s)
        with anyio.fail_after(10):
            async for batch in view.follow():
                if primary["worker_id"] in batch.changed:
                    break

    code, out, err = await buyer(market, "apps", "status", "web")
    assert code == 0, err
    row = next(line for line in out.splitlines() if primary["machine_id"] in line)
    assert "unknown (worker gone since " in row
    code, out, err = await buyer(market, "apps", "status", "web", "--json")
    got = {m["role"]: m for m in json.loads(out)["machines"]}
    assert got["primary"]["state"] == "started" and got["primary"]["worker_gone_since_ms"] > 0
    assert got["spare"]["worker_gone_since_ms"] is None
    assert json.loads(out)["view"]["seq"] > 0

    code, out, err = await buyer(market, "query", COUNT)  # answers at once, from the view
    assert (code, out.split()) == (0, ["region", "n", "mad", "1"]), err
    assert err.startswith("view: as of seq ") and err.endswith(" ms ago\n")
    code, out, err = await buyer(market, "query", COUNT, "--json")
    assert json.loads(out)["rows"] == [{"region": "mad", "n": 1}]

    code, out, err = await buyer(market, "machines", "list", "--json")
    doc = json.loads(out)
    assert doc["gone"] == {primary["worker_id"]: got["primary"]["worker_gone_since_ms"]}
    assert sorted(m["machine_id"] for m in doc["machines"]) == sorted(
        [primary["machine_id"], spare["machine_id"]]
    )
    assert doc["regions"] == ["mad"]  # the other worker still beats there
    code, out, err = await buyer(market, "machines", "list")
    assert code == 0 and f"worker(s) gone: {primary['worker_id']} (since " in err
    code, out, err = await buyer(market, "machines", "show", primary["machine_id"], "--json")
    assert json.loads(out)["worker_gone_since_ms"] == got["primary"]["worker_gone_since_ms"]
    code, out, err = await buyer(market, "fleet", "--json")
    doc = json.loads(out)
    assert {w["worker_id"]: w["type"] for w in doc["workers"]} == {
        "mad-1": "WorkerRow",
        "mad-2": "WorkerRow",
    }
    assert set(doc["gone"]) == {primary["worker_id"]}
    code, out, err = await buyer(market, "fleet")
    assert "gone since " in next(ln for ln in out.splitlines() if primary["worker_id"] in ln)


async def test_a_query_may_only_read(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    await worker_published(await market.connect(), market.subjects, "mad", "mad-1")
    for sql in ("DELETE FROM machines", "ATTACH DATABASE '/tmp/x' AS x", "PRAGMA user_version = 3"):
        code, out, err = await buyer(market, "query", sql)
        assert (code, out) == (1, "") and err.startswith("error: refused: "), err
        assert len(err.splitlines()) == 1
    code, out, err = await buyer(market, "query", "SELECT count(*) FROM workers", "--json")
    assert json.loads(out)["rows"] == [{"count(*)": 1}]


async def test_watch_prints_rows_as_they_change_and_a_kill_9_view_resumes(
    market: Market,
) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    sql = "SELECT machine_id, state FROM machines"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "buyer_cli", "query", "--watch", sql, "--json",
        "--prefix", market.subjects.prefix,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BOURSE_NATS_URL": market.url},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        c = await market.client()
        p = await c.place(order())
        with anyio.fail_after(30):
            first = json.loads(await proc.stdout.readline())
        assert first == {"op": "+", "row": {"machine_id": p.machine_id, "state": "reserved"},
                         "seq": first["seq"]}  # fmt: skip
        await c.machine("start", p.machine_id)
        seen = []  # reserved -> starting -> started, each change a - and a +
        with anyio.fail_after(10):
            while ("+", "started") not in seen:
                line = json.loads(await proc.stdout.readline())
                seen.append((line["op"], line["row"]["state"]))
        assert seen[0] == ("-", "reserved") and seen.count(("+", "started")) == 1
    finally:
        proc.send_signal(signal.SIGKILL)  # the view dies mid-follow
        await proc.wait()
    await c.machine("stop", p.machine_id)
    await published(await market.connect(), market.subjects, p.machine_id, "stopped")
    # the view it left, resumed: caught up first (within a second of the watch's last
    # catch-up the view is read as it stands, and the stop came from this test's client)
    code, out, err = await buyer(market, "query", sql, "--json", env={"BOURSE_VIEW_FRESH_MS": "0"})
    assert code == 0, err
    assert json.loads(out)["rows"] == [{"machine_id": p.machine_id, "state": "stopped"}]
