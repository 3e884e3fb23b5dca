"""The ``buyer`` CLI against a market on a real nats-server: every command, exit codes
(0 placed / 2 unfilled / 1 error) and --json shapes. Commands run in this process
(tests/cli.py: the console script's ``cli_main``); the real program runs as a subprocess
where it is the point: its exit codes seen from outside, a terminal, and ``watch`` (signals,
its own event loop)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from bourse.wire.messages import Placed
from tests.cli import buyer
from tests.market import Market, collect, order, wait_until, worker


async def program(
    market: Market, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """The real ``buyer`` program (``python -m buyer_cli``) on the market."""
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


async def test_the_program_places_and_says_its_exit_codes(market: Market) -> None:
    """The real program: 0 placed, 2 unfilled, 1 an error (one line on stderr), whatever
    runs in this process."""
    await market.host(worker("mad-1", images=["web"]))
    await market.exchange()
    code, out, err = await program(market, *PLACE, "--order-id", "cli-1", "--start", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["outcome"] == "placed" and doc["explain"] is None
    assert doc["result"]["type"] == "Placed" and doc["result"]["order_id"] == "cli-1"
    assert doc["result"]["image_cached"] is True and set(doc["result"]["subscores"]) >= {"cpus"}
    assert doc["machine"]["state"] == "started"

    too_big = ("place", "--region", "mad", "--cpus", "64", "--memory-mb", "1", "--image", "web")
    code, out, _ = await program(market, *too_big, "--deadline-ms", "200", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["outcome"] == "unfilled"
    assert (doc["result"]["type"], doc["result"]["reason"]) == ("Unfilled", "no_offers")

    code, out, err = await program(market, *PLACE[:3], "--cpus", "0", *PLACE[5:])
    assert (code, out) == (1, "")
    assert err == (
        "error: Invalid value for '--cpus': '0' is not more than 0 CPUs: use a number of CPUs"
        " (2, 0.5) or of millicores (250m)\n"
    )
    code, out, err = await program(market, *PLACE, env={"BOURSE_NATS_URL": "nats://127.0.0.1:1"})
    assert (code, out) == (1, "") and err.startswith("error: cannot connect to NATS")
    assert len(err.splitlines()) == 1


async def test_place_json_start_and_human_output(market: Market) -> None:
    await market.host(worker("mad-1", images=["web"]))
    await market.exchange()
    code, out, err = await buyer(market, *PLACE, "--start")  # human output
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("placed mad-1~") and lines[1].startswith("  score ")
    assert lines[-1].endswith(" is started")
    assert "  simulated: its worker runs nothing (driver sim)" in lines  # a sim worker says so
    code, out, err = await buyer(market, *PLACE, "--order-id", "cli-1", "--json")
    assert code == 0, err
    assert json.loads(out)["machine"] is None  # not started: no machine asked for


async def test_place_direct_needs_no_exchange(market: Market) -> None:
    await market.host(worker("mad-1"))
    code, out, err = await buyer(market, *PLACE, "--direct", "--json")
    assert code == 0, err
    assert json.loads(out)["result"]["worker_id"] == "mad-1"
    code, out, err = await buyer(market, *PLACE, "--json")  # no exchange instance runs
    assert code == 1 and err.startswith("error: no exchange is listening")
    assert len(err.strip().splitlines()) == 1
    assert json.loads(out) == {"error": err.removeprefix("error: ").strip()}


async def test_machines_commands_and_fleet(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    r = await (await market.client()).place(order(cpus=2, memory_mb=512))
    assert isinstance(r, Placed)
    mid = r.machine_id
    # --fresh: the worker's answers now (the view's: tests/integration/test_cli_view.py)
    code, out, _ = await buyer(market, "machines", "list", "--worker", "mad-1", "--json", "--fresh")
    assert code == 0 and [m["machine_id"] for m in json.loads(out)["machines"]] == [mid]
    for verb, state in [("show", "reserved"), ("start", "started"), ("stop", "stopped")]:
        fresh = ("--fresh",) if verb == "show" else ()
        code, out, err = await buyer(market, "machines", verb, mid, "--json", *fresh)
        assert code == 0, err
        assert json.loads(out)["machine"]["state"] == state
    code, out, _ = await buyer(market, "machines", "logs", mid, "--json")
    assert code == 0 and json.loads(out) == {
        "type": "MachineLogs",
        "machine_id": mid,
        "lines": [],
        "truncated": False,
        "end": 0,  # the byte offset to follow from (a sim machine has no log)
    }
    code, out, _ = await buyer(market, "fleet", "--region", "mad", "--json", "--fresh")
    doc = json.loads(out)
    [status] = doc["workers"]
    assert doc["regions"] == ["mad"]
    assert status["committed"]["cpus"] == 2 and status["machines"] == 1
    code, out, _ = await buyer(market, "machines", "destroy", mid, "--json")
    [gone] = json.loads(out)["machines"]
    assert (gone["machine_id"], gone["state"]) == (mid, "destroyed")
    code, _, err = await buyer(market, "machines", "start", mid)
    assert code == 1 and f"cannot start machine {mid}: it is destroyed" in err


def by_role(doc: dict[str, Any]) -> dict[str, dict[str, str]]:
    """``deploy --json``'s slots as ``primary-0``, ``spare-0``… (in the order of the rows)."""
    out: dict[str, dict[str, str]] = {}
    for s in doc["slots"]:
        n = sum(k.startswith(s["role"] + "-") for k in out)
        out[f"{s['role']}-{n}"] = s
    return out


async def test_deploy_spreads_over_distinct_workers_with_spares_and_is_idempotent(
    market: Market,
) -> None:
    await market.host(
        worker("a1", region="ams"),
        worker("a2", region="ams"),
        worker("a3", region="ams"),
        worker("b1", region="bcn"),
        worker("b2", region="bcn"),
        worker("b3", region="bcn"),
    )
    await market.exchange()
    args = (
        "deploy", "--app", "shop", "--region", "ams", "--region", "bcn", "--count", "2",
        "--spares", "1", "--cpus", "1", "--memory-mb", "256", "--image", "web", "--json",
    )  # fmt: skip
    code, out, err = await buyer(market, *args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["complete"] is True and len(doc["slots"]) == 6  # count and spares per region
    workers = [s["worker_id"] for s in doc["slots"]]
    assert len(set(workers)) == 6  # anti-affinity: every machine on its own worker
    listed = {}
    for w in workers:
        _, got, _ = await buyer(market, "machines", "list", "--worker", w, "--json")
        [m] = json.loads(got)["machines"]
        listed[m["machine_id"]] = m["state"]
    roles = {s["machine_id"]: s["role"] for s in doc["slots"]}
    assert (
        sorted((roles[mid], st) for mid, st in listed.items())
        == [("primary", "started")] * 4 + [("spare", "reserved")] * 2
    )  # spares: placed, not started

    code, out, _ = await buyer(market, *args)  # again: nothing new
    again = json.loads(out)
    assert {(s["action"], s["result"]) for s in again["slots"]} == {("keep", "kept")}
    assert {s["machine_id"] for s in again["slots"]} == set(listed)

    code, out, _ = await buyer(market, *args[:-1], "--count", "3")  # more than workers
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
    slots = by_role(json.loads(out))
    primary = slots["primary-0"]

    ff = ("failover", "--app", "api", "--machine", primary["machine_id"], "--region", "ams")
    code, _, err = await buyer(market, *ff)
    assert code == 1 and "still answers" in err

    assert primary["worker_id"] != slots["spare-0"]["worker_id"]
    gone = hosts[primary["worker_id"]]
    await market.stop(gone)  # the primary's worker goes away
    await gone.nc.close()
    third = ({"g1", "k1", "k2"} - {primary["worker_id"], slots["spare-0"]["worker_id"]}).pop()
    code, out, err = await buyer(market, *ff, "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert (doc["app"], doc["replaced"], doc["error"]) == ("api", primary["machine_id"], None)
    assert doc["started"]["machine_id"] == slots["spare-0"]["machine_id"]
    assert doc["started"]["state"] == "started"
    assert doc["stopped"] is None  # its worker is gone: its stop is kept for it
    assert (doc["queued"]["machine_id"], doc["queued"]["verb"]) == (primary["machine_id"], "stop")
    assert (doc["queued"]["worker_id"], doc["queue_error"]) == (primary["worker_id"], "")
    # the spare is refilled as deploy would: on the one worker the app does not use
    assert (doc["spare"]["worker_id"], doc["spare"]["state"]) == (third, "reserved")
    assert doc["spare"]["metadata"] == {"app": "api", "role": "spare", "slot": "1"}
    # the started spare is the app's primary now (its metadata, written once, says spare)
    code, out, err = await buyer(market, "apps", "status", "api", "--json", "--fresh")
    roles = {m["machine_id"]: m["role"] for m in json.loads(out)["machines"]}
    assert roles == {slots["spare-0"]["machine_id"]: "primary", doc["spare"]["machine_id"]: "spare"}

    # the refilled spare is started by the next failover; then none is left: exit 2, and
    # --json still prints one object
    code, out, err = await buyer(market, *ff, "--json")
    assert json.loads(out)["started"]["machine_id"] == doc["spare"]["machine_id"]
    code, out, err = await buyer(market, *ff, "--json")
    assert code == 2
    assert json.loads(out) == {
        "app": "api",
        "replaced": primary["machine_id"],
        "started": None,
        "stopped": None,
        "queued": None,
        "queue_error": "",
        "spare": None,
        "spare_unfilled": [],
        "error": "no failover: app 'api' has no spare left in ams",
    }
    assert err == "error: no failover: app 'api' has no spare left in ams\n"


async def test_failover_force_stops_the_machine_and_refills_the_spare(market: Market) -> None:
    await market.host(*(worker(w, region="ams") for w in ("a1", "a2", "a3", "a4")))
    await market.exchange()
    deploy = (
        "deploy", "--app", "web", "--region", "ams", "--count", "2", "--spares", "1",
        "--cpus", "1", "--memory-mb", "64", "--image", "x", "--json",
    )  # fmt: skip
    code, out, err = await buyer(market, *deploy)
    assert code == 0, err
    slots = by_role(json.loads(out))
    primary, spare = slots["primary-0"], slots["spare-0"]
    ff = ("failover", "--app", "web", "--machine", primary["machine_id"], "--region", "ams")
    code, out, err = await buyer(market, *ff, "--force", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["started"]["machine_id"] == spare["machine_id"]
    assert (doc["stopped"]["machine_id"], doc["stopped"]["state"]) == (
        primary["machine_id"],
        "stopped",
    )
    used = {m["worker_id"] for m in slots.values()}
    assert doc["spare"]["state"] == "reserved" and doc["spare"]["worker_id"] not in used

    # two running, as asked: the replaced primary is stopped, the spare runs in its place;
    # a re-run of deploy places nothing (the started spare's slot is a primary's now) and
    # keeps the new spare, destroying the stopped machine (one spare, as asked)
    code, out, err = await buyer(market, *deploy)
    again = json.loads(out)
    assert sorted((s["action"], s["role"]) for s in again["slots"]) == [
        ("destroy", "spare"), ("keep", "primary"), ("keep", "primary"), ("keep", "spare")
    ], again  # fmt: skip
    states: list[str] = []
    for w in ("a1", "a2", "a3", "a4"):
        _, listed, _ = await buyer(market, "machines", "list", "--worker", w, "--json")
        states += [m["state"] for m in json.loads(listed)["machines"]]
    states.sort()
    assert states == ["reserved", "started", "started"]


async def test_failover_of_an_unknown_app_or_machine_is_a_clear_error(market: Market) -> None:
    await market.host(worker("a1", region="ams"))
    await market.exchange()
    r = await (await market.client()).place(
        order(region="ams", metadata={"app": "web", "role": "primary", "slot": "0"})
    )
    assert isinstance(r, Placed)
    for args, line in [
        (
            ("--app", "nope", "--machine", r.machine_id),
            "error: app 'nope' has no machines in ams\n",
        ),
        (
            ("--app", "web", "--machine", "a1~01JD5X7Q2M4N6P8R0T2V4X6Z8B"),
            "error: machine a1~01JD5X7Q2M4N6P8R0T2V4X6Z8B is not a live machine of app 'web' "
            "(its worker a1 answers without it)\n",
        ),
    ]:
        code, out, err = await buyer(market, "failover", *args, "--region", "ams")
        assert (code, out, err) == (1, "", line)
        code, out, err = await buyer(market, "failover", *args, "--region", "ams", "--json")
        doc = json.loads(out)
        assert code == 1 and doc["error"] == line.removeprefix("error: ").strip()
        assert (doc["app"], doc["replaced"], doc["started"]) == (args[1], args[3], None)
    code, out, err = await buyer(
        market, "failover", "--app", "web", "--machine", "bogus", "--region", "ams"
    )
    assert code == 1 and err.startswith("error: Invalid value for '--machine': 'bogus' is not")


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
    fresh = "--fresh"  # the workers answer (no exchange has made the state stream here)
    code, out, err = await buyer(market, "fleet", "--region", "mad", "--region", "nowhere", fresh)
    assert code == 2 and "mad-1" in out
    assert err == "no worker answers in region 'nowhere'\n"
    code, out, err = await buyer(
        market, "fleet", "--region", "mad", "--region", "x", "--json", fresh
    )
    assert (code, err) == (2, "no worker answers in region 'x'\n")
    assert json.loads(out)["regions"] == ["mad"]


async def test_an_unfilled_order_says_why_each_worker_declined(market: Market) -> None:
    await market.host(
        worker("mad-1", labels={"disk": "ssd"}, draining=True),
        worker("mad-2", labels={"disk": "hdd"}),
        worker("mad-3", labels={"disk": "ssd"}, cpus=1),
        worker("mad-4", labels={"disk": "ssd"}),
    )
    await market.exchange()
    args = (*PLACE[:5], "--memory-mb", "256", "--image", "web", "--label", "disk=ssd")
    line = (
        "unfilled (no_offers) in mad: no worker in 'mad' took 2 cpus + 256 MiB + constraints "
        "disk=ssd of image 'web': draining: mad-1; excluded by the order: mad-4; labels do not "
        "match on mad-2 (label disk: wants 'ssd', has 'hdd'); not enough free capacity on mad-3 "
        "(cpus: wants 2, free 1 (capacity 1, committed 0, held 0))"
    )
    for how in ((), ("--direct",)):  # through the exchange, and the auction run here
        code, out, err = await buyer(market, *args, "--exclude", "mad-4", *how)
        assert (code, err) == (2, "")
        assert out.splitlines()[0] == line
        code, out, err = await buyer(market, *args, "--exclude", "mad-4", "--json", *how)
        assert json.loads(out)["result"]["detail"] == line.split(": ", 1)[1]


async def test_fleet_asks_every_region_when_none_is_given(market: Market) -> None:
    code, out, err = await buyer(market, "fleet", "--fresh")  # nobody at all
    assert (code, out, err) == (2, "", "no worker answers in any region\n")
    long_id = "w" * 40
    await market.host(worker("mad-1"), worker(long_id, region="fra"))
    code, out, err = await buyer(market, "fleet", "--fresh", env={"COLUMNS": "40"})
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == [
        "region", "worker", "cpus", "mem", "MiB", "held", "machines", "cache", "images", "labels",
        "state", "driver", "confined", "isolated", "jetstream",
    ]  # fmt: skip
    assert [line.split()[:2] for line in lines[1:]] == [["fra", long_id], ["mad", "mad-1"]]
    assert [line.split()[6] for line in lines[1:]] == ["0/10G", "0/10G"]  # sim caches, empty
    code, out, _ = await buyer(market, "fleet", "--json", "--fresh")
    workers = json.loads(out)["workers"]
    assert [s["worker_id"] for s in workers] == [long_id, "mad-1"]
    assert [(s["cache_bytes"], s["cache_budget_bytes"]) for s in workers] == [(0, 10 << 30)] * 2


async def test_tables_print_whole_ids_in_a_pipe_whatever_the_width(market: Market) -> None:
    wid = "a-worker-with-a-rather-long-name-for-a-narrow-pipe"
    await market.host(worker(wid))
    await market.exchange()
    code, out, err = await buyer(market, *PLACE, "--json")
    mid = json.loads(out)["result"]["machine_id"]
    code, out, err = await buyer(
        market, "machines", "list", "--worker", wid, "--fresh", env={"COLUMNS": "40"}
    )
    assert (code, err) == (0, "")
    header, row = out.splitlines()
    assert header.split() == [
        "machine",
        "order",
        "state",
        "cpus",
        "memory",
        "MiB",
        "image",
        "score",
        "addresses",
    ]
    _, shown, _ = await buyer(market, "machines", "show", mid, "--json", "--fresh")
    assert row.split()[:3] == [mid, json.loads(shown)["machine"]["order_id"], "reserved"]


async def test_machines_destroy_by_app_asks_first(market: Market) -> None:
    await market.host(worker("mad-1"), worker("fra-1", region="fra"))
    await market.exchange()
    client = await market.client()
    ids = []
    for region in ("mad", "mad", "fra"):
        r = await client.place(order(region=region, metadata={"app": "shop"}))
        assert isinstance(r, Placed)
        ids.append(r.machine_id)
    other = await client.place(order(metadata={"app": "blog"}))
    assert isinstance(other, Placed)

    one_way = (
        "error: give MACHINE_IDs, or --app NAME and/or --label KEY=VALUE (one way of the two)\n"
    )
    for args, line in [
        ((ids[0], "--app", "shop"), one_way),
        ((), one_way),
        ((ids[0], "--region", "mad"), "error: --region goes with --app or --label\n"),
        (
            ("--app", "shop"),
            "error: destroy 3 machine(s) of app 'shop': not confirmed (no terminal to ask on); "
            "pass --yes\n",
        ),
    ]:
        code, out, err = await buyer(market, "machines", "destroy", *args)
        assert (code, out, err) == (1, "", line)

    # with a terminal it asks; "n" keeps them, "y" destroys them (in one region here)
    for answer, code_wanted in (("n", 1), ("y", 0)):
        code, out, err = await buyer_on_a_terminal(
            market, answer, "machines", "destroy", "--app", "shop", "--region", "mad"
        )
        assert code == code_wanted, (out, err)
        assert "destroy 2 machine(s) of app 'shop'? [y/N]" in out
    assert err == ""
    code, out, err = await buyer(market, "machines", "destroy", "--app", "shop", "--yes", "--json")
    assert (code, err) == (0, "")
    destroyed = json.loads(out)["machines"]
    assert [(m["machine_id"], m["state"]) for m in destroyed] == [(ids[2], "destroyed")]
    code, out, _ = await buyer(market, "machines", "show", other.machine_id, "--json", "--fresh")
    assert json.loads(out)["machine"]["state"] == "reserved"  # another app's is left alone
    code, out, err = await buyer(market, "machines", "destroy", "--app", "shop")
    assert (code, out, err) == (0, "app 'shop' has no live machines: nothing to destroy\n", "")


async def test_machine_verbs_take_several_ids_and_selectors(market: Market) -> None:
    """start, stop, restart and destroy act on each id given, or on what --app and --label
    select (listed, then acted on); one that cannot be done is named in the error line,
    the others done all the same."""
    await market.host(worker("mad-1"), worker("fra-1", region="fra"))
    await market.exchange()
    client = await market.client()
    tiers: dict[str, list[str]] = {"a": [], "b": []}
    for region, tier in (("mad", "a"), ("fra", "a"), ("mad", "b")):
        r = await client.place(order(region=region, metadata={"app": "shop", "tier": tier}))
        assert isinstance(r, Placed)
        tiers[tier].append(r.machine_id)
    a1, a2 = tiers["a"]
    [b1] = tiers["b"]
    code, out, err = await buyer(market, "machines", "start", a1, a2, "--json")
    assert (code, err) == (0, "")
    assert [(m["machine_id"], m["state"]) for m in json.loads(out)["machines"]] == [
        (a1, "started"), (a2, "started"),
    ]  # fmt: skip
    stops = await collect(await market.connect("watch"), market.subjects.events(kind="stopped"))
    code, out, err = await buyer(market, "machines", "restart", "--label", "tier=a", "--json")
    assert (code, err) == (0, "")
    restarted = json.loads(out)["machines"]
    assert sorted((m["machine_id"], m["state"]) for m in restarted) == sorted(
        [(a1, "started"), (a2, "started")]
    )
    await wait_until(lambda: len(stops) == 2)  # each was stopped, then started
    code, out, err = await buyer(market, "machines", "restart", b1)  # it does not run
    assert (code, out) == (1, "")
    assert (
        err
        == f"error: restart {b1}: cannot restart machine {b1}: it is reserved (start starts it)\n"
    )
    code, out, err = await buyer(market, "machines", "restart", "--label", "tier=b")
    assert (code, out, err) == (0, "no live machine matches: nothing to restart\n", "")
    gone = "nobody-1~01JD5X7Q2M4N6P8R0T2V4X6Z8B"
    code, out, err = await buyer(market, "machines", "stop", a1, gone)
    assert code == 1 and err.startswith(f"error: stop {gone}: ") and err.count("\n") == 1
    [row] = out.splitlines()[1:]  # the one done, shown
    assert row.split()[0] == a1 and row.split()[2] == "stopped"
    code, out, err = await buyer(market, "machines", "stop", a2, gone, "--json")
    shown = json.loads(out)
    assert code == 1 and [m["machine_id"] for m in shown["machines"]] == [a2]
    assert shown["error"].startswith(f"stop {gone}: ")
    code, out, err = await buyer(
        market, "machines", "destroy", "--app", "shop", "--label", "tier=b", "--yes", "--json"
    )
    assert (code, err) == (0, "")
    assert [(m["machine_id"], m["state"]) for m in json.loads(out)["machines"]] == [
        (b1, "destroyed")
    ]
    code, out, err = await buyer(market, "machines", "stop", "--label", "tier=b")
    assert (code, out, err) == (0, "no live machine matches: nothing to stop\n", "")


async def buyer_on_a_terminal(market: Market, answer: str, *args: str) -> tuple[int, str, str]:
    """The buyer with a terminal on stdin that types ``answer``."""
    master, slave = os.openpty()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "buyer_cli",
            *args,
            "--prefix",
            market.subjects.prefix,
            stdin=slave,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "BOURSE_NATS_URL": market.url},
        )
        os.write(master, f"{answer}\n".encode())  # read when it asks (the tty buffers it)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
