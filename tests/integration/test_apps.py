"""Apps as a whole against a real market (nats-server, suppliers, exchange): ``buyer deploy
-f``, ``--plan``, rolling updates that keep ``count`` machines started in each region at
every moment the events show, a second run that changes nothing, scale down (spares first),
a rollout whose checks do not pass in time (exit 2, the old machines serving), the app
views and secrets, and bad input before anything is placed."""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from bourse.client.apps import spec as spec_mod
from bourse.client.apps.apply import apply, context
from bourse.client.apps.store import AppChanged, AppStore
from bourse.nats.connection import flush_all
from bourse.wire.codec import decode
from bourse.wire.messages import Event
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.runner import Runner
from tests.cli import buyer
from tests.isolation import own_worker_id
from tests.market import Market, wait_until, worker

HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "0.2"]
SPEC = """
app = "hello"
image = "web"
regions = ["mad", "ams"]
count = 1
spares = 1

[resources]
cpus = 1
memory_mb = 256
"""
V2 = SPEC.replace("memory_mb = 256", "memory_mb = 384")


async def _market(market: Market) -> None:
    await market.jetstream_init()
    for r, region in enumerate(("mad", "ams")):
        await market.host(
            *(
                worker(f"{region}-{i}", region=region, images=["web"], ports=_ports(r * 3 + i))
                for i in (1, 2, 3)
            )
        )
    await market.exchange()


def _ports(n: int) -> str:
    """Worker n's own block of ports: no two workers of the test draw the same."""
    first = 31000 + n * 100
    return f"{first}-{first + 99}"


def _write(tmp_path: Path, text: str, name: str = "app.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


async def test_deploy_plan_rolling_update_again_and_scale_down(
    market: Market, tmp_path: Path
) -> None:
    await _market(market)
    code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, SPEC), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["generation"] == 1 and doc["complete"] is True
    slots = {(s["region"], s["role"]): s for s in doc["slots"]}
    assert {s["action"] for s in doc["slots"]} == {"create"}
    assert set(slots) == {
        ("mad", "primary"),
        ("mad", "spare"),
        ("ams", "primary"),
        ("ams", "spare"),
    }
    assert slots["mad", "primary"]["worker_id"] != slots["mad", "spare"]["worker_id"]

    # again: nothing changes; nor with a service section (how the edge serves it): the
    # same generation, every machine kept, the section in the record
    code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, SPEC), "--json")
    assert code == 0, err
    assert {(s["action"], s["result"]) for s in json.loads(out)["slots"]} == {("keep", "kept")}
    served = SPEC + "\n[service]\nauto_stop = true\nidle_s = 60\nmin_machines_running = 1\n"
    code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, served), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["generation"] == 1 and {s["action"] for s in doc["slots"]} == {"keep"}
    nc = await market.connect("apps")
    record = await (await AppStore.open(nc, market.subjects.prefix, create=False)).get("hello")
    assert record is not None and record.spec is not None
    service = record.spec.service
    assert (service.auto_stop, service.idle_s, service.min_machines_running) == (True, 60.0, 1)

    # the plan of a bigger machine: an update of each slot, nothing placed
    bigger = _write(tmp_path, SPEC.replace("memory_mb = 256", "memory_mb = 512"), "v2.toml")
    code, out, err = await buyer(market, "deploy", "-f", bigger, "--plan", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["generation"] == 2 and plan["changes"] == 4
    assert {(s["action"], tuple(s["fields"])) for s in plan["steps"]} == {
        ("update", ("resources",))
    }
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    assert len(json.loads(out)["machines"]) == 4  # the plan placed nothing

    # apply it, watching the events: at least one machine started per region all along
    nc = await market.connect("watch")
    started: dict[str, set[str]] = defaultdict(set)
    low: dict[str, int] = {"mad": 1, "ams": 1}

    async def seen(msg: Msg) -> None:
        e = decode(msg.data, Event)
        if e.kind == "started":
            started[e.region].add(e.machine_id)
        elif e.kind in ("stopped", "destroyed", "failed"):
            started[e.region].discard(e.machine_id)
        low[e.region] = min(low[e.region], len(started[e.region]))

    # the primaries running now, from the listing (their start events came before)
    for row in json.loads(out)["machines"]:
        if row["state"] == "started":
            started[row["region"]].add(row["machine_id"])
    sub = await nc.subscribe(market.subjects.events(), cb=seen)
    code, out, err = await buyer(market, "deploy", "-f", bigger, "--json")
    await flush_all(nc)
    await sub.unsubscribe()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["complete"] is True and doc["generation"] == 2
    assert [s["result"] for s in doc["slots"]] == ["done"] * 4
    assert all(s["replaced"] and s["replaced"] != s["machine_id"] for s in doc["slots"])
    assert low == {"mad": 1, "ams": 1}
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    rows = json.loads(out)["machines"]
    assert len(rows) == 4 and {r["generation"] for r in rows} == {"2"}

    # again: nothing
    code, out, err = await buyer(market, "deploy", "-f", bigger, "--json")
    assert {s["action"] for s in json.loads(out)["slots"]} == {"keep"}

    # scale down: the spares go, the primaries stay
    fewer = _write(tmp_path, SPEC.replace("memory_mb = 256", "memory_mb = 512")
                   .replace("spares = 1", "spares = 0"), "v3.toml")  # fmt: skip
    code, out, err = await buyer(market, "deploy", "-f", fewer, "--json")
    assert code == 0, err
    steps = json.loads(out)["slots"]
    assert [(s["action"], s["role"]) for s in steps] == [
        ("destroy", "spare"), ("destroy", "spare"), ("keep", "primary"), ("keep", "primary")
    ]  # fmt: skip
    code, out, _ = await buyer(market, "apps", "list", "--json")
    listed = {"app": "hello", "tenant": "", "generation": 3, "image": "web"}
    listed["regions"] = ["mad", "ams"]
    assert json.loads(out)["apps"] == [listed | {"count": 1, "spares": 0}]


async def test_checks_not_passing_in_time_stop_the_rollout(market: Market, tmp_path: Path) -> None:
    """A tcp check on a port nothing listens on (a simulated machine runs no process): a
    new machine's checks never pass, the rollout stops at the first slot with
    exit 2, the old machines serve on and the rest is skipped."""
    await _market(market)
    one = SPEC.replace("spares = 1", "spares = 0")
    code, _, err = await buyer(market, "deploy", "-f", _write(tmp_path, one))
    assert code == 0, err
    checked = one.replace('image = "web"', 'image = "web"\nports = ["web"]') + (
        '[[checks]]\nport = "web"\nkind = "tcp"\n'
    )
    code, out, err = await buyer(
        market, "deploy", "-f", _write(tmp_path, checked, "c.toml"), "--check-wait-s", "0.5",
        "--json",
    )  # fmt: skip
    assert code == 2, err
    doc = json.loads(out)
    assert doc["stopped"] is True and doc["complete"] is False
    first, second = doc["slots"]
    assert first["result"] == "stopped" and second["result"] == "skipped"
    assert first["detail"].startswith("checks not passing after 0.5 s")
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    rows = json.loads(out)["machines"]
    # the old primaries serve on (the new one is left for its logs)
    assert {r["region"] for r in rows if r["generation"] == "1" and r["state"] == "started"} == {
        "mad", "ams"
    }  # fmt: skip


async def test_bad_input_is_refused_before_anything_is_placed(
    market: Market, tmp_path: Path
) -> None:
    """Workers of the process driver, which runs only its catalog's images (the simulated
    one runs any): an image in no store and no catalog is refused."""
    await market.jetstream_init()
    catalog = {"web": {"command": HEARTBEAT}}
    for region in ("mad", "ams"):
        wid = own_worker_id(f"{region}-1")
        await market.host(
            worker(wid, region=region, driver="process", catalog=catalog, images=["web"])
        )
    await market.exchange()
    cases = [
        (SPEC.replace('"ams"]', '"xyz"]'), "region 'xyz': no worker serves it ("),
        (SPEC.replace('"ams"]', '"amz"]'),  # the nearest region the market has
         "region 'amz': no worker serves it (did you mean 'ams'?) (buyer fleet lists regions)"),
        (SPEC.replace('image = "web"', 'image = "nowhere:v1"'), "image 'nowhere:v1' is not in"),
        (SPEC.replace('image = "web"', 'image = "wbe"'),  # a catalog's image, misspelt
         "image 'wbe' is not in the image store and no worker of mad, ams can run it (did you "
         "mean 'web'?): push it first"),
        (SPEC.replace("count = 1", "count = -1"), "[count]: Expected `int` >= 0"),
        (SPEC + '[[checks]]\nport = "web2"\nkind = "tcp"\n',
         "[checks][0].port: 'web2' is not a declared port"),
    ]  # fmt: skip
    for text, error in cases:
        code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, text))
        assert code == 1 and out == "" and error in err, err
        assert len(err.strip().splitlines()) == 1
    flags = ["--app", "x", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "web"]
    for bad, error in [
        (["--check", "web:tcp"], "--check 'web:tcp': port 'web' is not one of --port (none)"),
        (["--env", "1X=y"], "--env '1X=y': '1X' is not a variable name"),
    ]:
        code, out, err = await buyer(market, "deploy", *flags, *bad)
        assert code == 1 and out == "" and error in err and len(err.strip().splitlines()) == 1
    code, _, err = await buyer(market, "deploy", "-f", _write(tmp_path, SPEC), "--port", "web")
    assert code == 1 and "exclusive" in err
    code, out, _ = await buyer(market, "apps", "list", "--json")
    assert json.loads(out)["apps"] == []
    for region in ("mad", "ams"):
        _, out, _ = await buyer(market, "fleet", "--region", region, "--json")
        assert [w["machines"] for w in json.loads(out)["workers"]] == [0]
    code, _, err = await buyer(market, "apps", "secrets", "set", "hello", "1BAD=x")
    assert code == 1 and "'1BAD' is not a valid variable name" in err
    code, _, err = await buyer(market, "deploy", "-f", _write(tmp_path, SPEC), "--app", "x")
    assert code == 1 and "exclusive" in err


async def test_secrets_are_names_only_and_a_change_rolls_the_app(
    market: Market, tmp_path: Path
) -> None:
    await _market(market)
    path = _write(tmp_path, SPEC.replace("spares = 1", "spares = 0"))
    assert (await buyer(market, "deploy", "-f", path))[0] == 0
    code, out, err = await buyer(market, "apps", "secrets", "set", "hello", "TOKEN=s3cr3t", "DB=x")
    assert code == 0 and "s3cr3t" not in out + err
    code, out, _ = await buyer(market, "apps", "secrets", "list", "hello", "--json")
    assert json.loads(out) == {"app": "hello", "secrets": ["DB", "TOKEN"]}
    code, out, _ = await buyer(market, "deploy", "-f", path, "--plan", "--json")
    assert {tuple(s["fields"]) for s in json.loads(out)["steps"]} == {("secrets",)}
    assert "s3cr3t" not in out
    code, out, err = await buyer(market, "apps", "status", "hello")
    assert code == 0, err
    assert out.splitlines()[0].split() == [
        "region", "slot", "role", "machine", "worker", "state", "address", "check",
        "image_digest", "restarts",
    ]  # fmt: skip
    assert len(out.splitlines()) == 3 and "s3cr3t" not in out
    code, out, err = await buyer(market, "apps", "logs", "hello", "--json")
    assert (code, out, err) == (0, "", "")  # simulated machines print nothing
    # a script is refused without --yes (no terminal to ask on), as machines destroy --app
    code, out, err = await buyer(market, "apps", "destroy", "hello", "--json")
    said = (
        "destroy app 'hello' (2 machine(s), its spec and secrets): not confirmed (no terminal "
        "to ask on); pass --yes"
    )
    assert (code, err, json.loads(out)) == (1, f"error: {said}\n", {"error": said})
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    assert len(json.loads(out)["machines"]) == 2  # nothing destroyed
    code, out, _ = await buyer(market, "apps", "destroy", "hello", "--yes", "--json")
    assert code == 0 and len(json.loads(out)["destroyed"]) == 2
    code, out, _ = await buyer(market, "apps", "secrets", "list", "hello", "--json")
    assert json.loads(out)["secrets"] == []
    code, out, _ = await buyer(market, "apps", "list", "--json")
    assert json.loads(out)["apps"] == []
    # the same app again: a new generation, new machines (no claim hands back a destroyed one)
    code, out, err = await buyer(market, "deploy", "-f", path, "--json")
    assert code == 0, err
    again = json.loads(out)["slots"]
    assert [s["result"] for s in again] == ["done", "done"]
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    rows = json.loads(out)["machines"]
    assert {r["state"] for r in rows} == {"started"} and len(rows) == 2


async def test_a_cut_off_rollout_run_again_finishes_without_duplicates(
    market: Market, tmp_path: Path
) -> None:
    """The rollout is cancelled as soon as its first new machine is placed; the next run
    takes that machine (the same order id) and finishes: one machine per slot."""
    await _market(market)
    assert (await buyer(market, "deploy", "-f", _write(tmp_path, SPEC)))[0] == 0
    v2 = spec_mod.parse(SPEC.replace("memory_mb = 256", "memory_mb = 384"))
    c = await market.client()
    apps_kv = await AppStore.open(c.nc, market.subjects.prefix)
    ctx = await context(c, apps_kv, v2)
    nc = await market.connect("watch")
    first: list[str] = []
    placed = anyio.Event()

    async def seen(msg: Msg) -> None:
        e = decode(msg.data, Event)
        if ".g2." in e.order_id and not first:
            first.append(e.machine_id)
            placed.set()

    await nc.subscribe(market.subjects.events(kind="placed"), cb=seen)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(apply, c, apps_kv, ctx, check_wait_s=5))
        await placed.wait()
        tg.cancel_scope.cancel()  # cut off mid-slot

    code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, SPEC.replace(
        "memory_mb = 256", "memory_mb = 384"), "v2.toml"), "--json")  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["generation"] == 2
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    rows = json.loads(out)["machines"]
    assert len(rows) == 4 and {r["generation"] for r in rows} == {"2"}
    assert first[0] in {r["machine_id"] for r in rows}  # the machine placed before the cut


async def test_apps_logs_prefix_each_line_with_its_machine(market: Market, tmp_path: Path) -> None:
    """Process machines (they print): every machine's lines, each with its machine."""
    await market.jetstream_init()
    catalog = {"web": {"command": HEARTBEAT}}
    wids = [own_worker_id(f"mad-{i}") for i in (1, 2)]
    host = await market.host(*(worker(w, driver="process", catalog=catalog) for w in wids))
    await market.exchange()
    two = SPEC.replace('["mad", "ams"]', '["mad"]').replace("spares = 1", "spares = 0")
    code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, two.replace(
        "count = 1", "count = 2")), "--json")  # fmt: skip
    assert code == 0, err
    machines = {s["machine_id"]: s["worker_id"] for s in json.loads(out)["slots"]}
    for mid, wid in machines.items():
        driver = host.workers[wid].driver
        assert isinstance(driver, Runner)
        log = driver.log_path(mid)
        await wait_until(lambda log=log: log.exists() and "web alive" in log.read_text())  # type: ignore[misc]
    code, out, err = await buyer(market, "apps", "logs", "hello")
    assert code == 0, err
    for mid in machines:
        assert f"{mid} | web alive" in out.splitlines()
    assert all(line.split(" | ")[0] in machines for line in out.splitlines())
    code, out, _ = await buyer(market, "apps", "destroy", "hello", "--yes")
    assert code == 0 and out.splitlines()[-1] == "app hello: its spec and secrets removed"


# A machine that prints the secret and the variables it was given, then stays up.
PRINT_TOKEN = [
    "{python}",
    "-c",
    "import os, time; print(*(f'{k}={os.environ.get(k)}' for k in ('TOKEN', 'MODE', 'PORT')), "
    "sep=chr(10), flush=True); time.sleep(600)",  # the machine lives on: its env is read
]


async def test_a_machine_is_given_its_apps_secrets_and_nothing_says_them(
    market: Market, tmp_path: Path
) -> None:
    """A secret set before the first deploy is in the env of the app's process machine (it
    prints it), over the order's env of the same name; no event of the deploy, and no
    output of a command, carries the value. The spec from deploy's flags: a port, env."""
    await market.jetstream_init()
    wid = own_worker_id("mad-1")
    host = await market.host(
        worker(wid, driver="process", catalog={"web": {"command": PRINT_TOKEN}})
    )
    await market.exchange()
    nc = await market.connect("watch")
    events: list[bytes] = []

    async def seen(msg: Msg) -> None:
        events.append(msg.data)

    sub = await nc.subscribe(market.subjects.events(), cb=seen)
    code, out, err = await buyer(market, "apps", "secrets", "set", "hello", "TOKEN=s3cr3t")
    assert code == 0 and "s3cr3t" not in out + err
    flags = ["--app", "hello", "--region", "mad", "--cpus", "1", "--memory-mb", "256"]
    flags += ["--image", "web", "--port", "web", "--env", "MODE=blue", "--env", "TOKEN=plain"]
    code, out, err = await buyer(market, "deploy", *flags, "--json")
    assert code == 0, out + err
    [mid] = [s["machine_id"] for s in json.loads(out)["slots"]]
    driver = host.workers[wid].driver
    assert isinstance(driver, Runner)
    log = driver.log_path(mid)
    await wait_until(lambda: log.exists() and "PORT=" in log.read_text())  # its last line
    lines = log.read_text().splitlines()
    assert "TOKEN=s3cr3t" in lines and "MODE=blue" in lines
    assert any(line.startswith("PORT=") and line != "PORT=None" for line in lines)
    code, out, err = await buyer(market, "apps", "logs", "hello")
    assert code == 0 and f"{mid} | TOKEN=s3cr3t" in out  # the machine's own output says it
    for cmd in (["apps", "status", "hello", "--json"], ["machines", "show", mid, "--json"]):
        code, out, err = await buyer(market, *cmd)
        assert code == 0 and "s3cr3t" not in out + err, cmd
    await flush_all(nc)
    await sub.unsubscribe()
    assert events and not [e for e in events if b"s3cr3t" in e]


async def test_two_deploys_at_once_one_is_refused_before_it_places_anything(
    market: Market,
) -> None:
    """Two deploys of one app read its record at once (none yet), with different specs:
    the one that writes the record second is refused with one line and places nothing; the
    app is the other's, one machine per slot."""
    await _market(market)
    c = await market.client()
    apps_kv = await AppStore.open(c.nc, market.subjects.prefix)
    specs = [spec_mod.parse(SPEC), spec_mod.parse(SPEC.replace("256", "384"))]
    contexts = [await context(c, apps_kv, s) for s in specs]
    refused: list[str] = []

    async def deploy(i: int) -> None:
        try:
            await apply(c, apps_kv, contexts[i], check_wait_s=5)
        except AppChanged as exc:
            refused.append(f"{i}: {exc}")

    async with anyio.create_task_group() as tg:
        for i in (0, 1):
            tg.start_soon(deploy, i)
    assert len(refused) == 1, refused
    assert refused[0].endswith("app 'hello' changed while this deploy ran: run it again")
    winner = specs[1 - int(refused[0][0])]
    code, out, err = await buyer(market, "apps", "status", "hello", "--json")
    assert code == 0, err
    rows = json.loads(out)["machines"]
    assert len(rows) == 4 and {(r["region"], r["slot"]) for r in rows} == {
        (region, slot) for region in ("mad", "ams") for slot in (0, 1)
    }
    kept = await apps_kv.get("hello")
    assert kept is not None and kept.spec == winner


async def test_a_deploy_whose_app_changes_meanwhile_stops_at_its_next_step(
    market: Market, tmp_path: Path
) -> None:
    """While an update rolls, the app's record changes (a secret set): the rollout stops
    at its next step with one line; the next deploy rolls the app to what it is now."""
    await _market(market)
    assert (await buyer(market, "deploy", "-f", _write(tmp_path, SPEC)))[0] == 0
    c = await market.client()
    apps_kv = await AppStore.open(c.nc, market.subjects.prefix)
    ctx = await context(c, apps_kv, spec_mod.parse(V2))
    changed = False

    async def seen(msg: Msg) -> None:
        nonlocal changed
        if ".g2." in decode(msg.data, Event).order_id and not changed:
            changed = True  # as `apps secrets set` does, while the rollout runs
            await apps_kv.change("hello", lambda r: msgspec.structs.replace(r, secrets={"X": 7}))

    nc = await market.connect("watch")
    await nc.subscribe(market.subjects.events(kind="placed"), cb=seen)
    with pytest.raises(AppChanged, match="app 'hello' changed while this deploy ran"):
        await apply(c, apps_kv, ctx, check_wait_s=5)
    assert changed
    code, out, err = await buyer(market, "deploy", "-f", _write(tmp_path, V2, "v2.toml"), "--json")
    assert code == 0, err
    assert json.loads(out)["generation"] == 3  # the secrets' revision is part of it
    code, out, _ = await buyer(market, "apps", "status", "hello", "--json")
    rows = json.loads(out)["machines"]
    assert len(rows) == 4 and {r["generation"] for r in rows} == {"3"}
