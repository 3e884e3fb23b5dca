"""Health checks on real machines and sockets: a real supplier runs a started machine's
checks (supplier/checks.py), its health shows passing or critical with an event of kind
``check`` on each change, and a machine whose check fails 3 times in a row is restarted
under ``restart=on-failure``; ``buyer failover`` replaces a critical primary. Each worker's
ports are a default block claimed on the host, as ``supplier run`` claims it: tests
running at once (xdist's workers, another checkout's run) never share a port."""

from __future__ import annotations

import json
import socket

import anyio

from bourse.client import BourseClient, render
from bourse.client.policy import failover
from bourse.wire.codec import decode
from bourse.wire.messages import Check, Event, ListMachines, Machine, Placed
from supplier.checks import probe
from supplier.ports import PortClaims
from tests.cli import buyer as cli
from tests.isolation import own_worker_id
from tests.market import Market, collect, order, wait_until, worker
from tests.views import published, row

W1 = own_worker_id("checks1")

# Answers GET /healthz with $STATUS on 0.0.0.0:$PORT.
SERVER = """
import http.server, os
status = int(os.environ["STATUS"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(status if self.path == "/healthz" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
"""


async def serving(market: Market) -> BourseClient:
    """A market of one process worker that runs SERVER as image ``srv``; a buyer on it."""
    await market.host(
        worker(
            W1,
            driver="process",
            catalog={"srv": {"command": ["{python}", "-c", SERVER]}},
            advertise_host="127.0.0.1",
        ),
        port_claims=PortClaims(),
    )
    await market.exchange()
    return await market.client()


async def placed_started(buyer: BourseClient, status: int, **meta: str) -> Machine:
    check = Check(port="http", kind="http", path="/healthz", interval_s=0.1, timeout_s=1)
    r = await buyer.place(
        order(
            image="srv", ports=["http"], env={"STATUS": str(status)}, checks=[check], metadata=meta
        )
    )
    assert isinstance(r, Placed), r
    return await buyer.machine("start", r.machine_id)


async def until(
    buyer: BourseClient, machine_id: str, done: object, timeout_s: float = 15
) -> Machine:
    """Read the machine until ``done(m)`` holds (what the checks say changes over time)."""
    with anyio.fail_after(timeout_s):
        while True:
            m = await buyer.machine("get", machine_id)
            if done(m):  # type: ignore[operator]
                return m
            await anyio.sleep(0.05)  # the next read, not a synchronisation


async def test_checks_say_passing_and_critical_and_restart_on_failure(market: Market) -> None:
    buyer = await serving(market)
    events = await collect(await market.connect("watch"), market.subjects.events(kind="check"))
    good = await placed_started(buyer, 200)
    bad = await placed_started(buyer, 500, restart="on-failure")
    m = await until(buyer, good.machine_id, lambda m: m.health and m.health.status == "passing")
    assert m.health is not None and m.health.since_ms > 0 and m.restarts == 0

    def passing_event() -> bool:
        seen = [decode(e.data, Event) for e in events]
        return any(
            isinstance(e, Event) and e.machine_id == good.machine_id and e.health == m.health
            for e in seen
        )

    await wait_until(passing_event)  # the change of status, as an event of kind check
    m = await until(buyer, bad.machine_id, lambda m: m.restarts >= 1)
    assert m.state == "started"
    critical = await until(
        buyer,
        bad.machine_id,
        lambda m: m.health and m.health.detail.endswith("/healthz: status 500"),
    )
    assert critical.health is not None and critical.health.status == "critical"
    assert market.violations() == []


async def test_a_machine_that_is_not_started_has_no_health(market: Market) -> None:
    """Health is what a run's checks say: a stopped machine's is cleared by its worker
    (shown ``-``, not the last run's ``passing 47s``), and a start checks from scratch."""
    buyer = await serving(market)
    m = await placed_started(buyer, 200)
    await until(buyer, m.machine_id, lambda m: m.health and m.health.status == "passing")
    stopped = await buyer.machine("stop", m.machine_id)
    assert (stopped.state, stopped.health) == ("stopped", None)
    [listed] = (await buyer.list_machines(None, ListMachines(app=""))).machines
    assert (listed.machine_id, listed.health, render.health(listed)) == (m.machine_id, None, "-")
    again = await buyer.machine("start", m.machine_id)
    assert again.state == "started" and render.health(again) == "checking"
    await until(buyer, m.machine_id, lambda m: m.health and m.health.status == "passing")
    assert market.violations() == []


def passing(m: Machine) -> bool:
    return m.health is not None and m.health.status == "passing"


async def test_the_views_listings_show_no_health_for_a_spare_or_a_stopped_machine(
    market: Market,
) -> None:
    """``apps status`` and ``machines list`` answer from the view by default: a spare
    (placed, not started) shows ``-``, a started machine what its checks say, and once it is
    stopped ``-`` too (its worker cleared its health, and the row it published says so)."""
    buyer = await serving(market)
    app = {"app": "hc", "slot": "0"}
    good = await placed_started(buyer, 200, role="primary", **app)
    check = Check(port="http", kind="http", path="/healthz", interval_s=0.1, timeout_s=1)
    spare = await buyer.place(
        order(image="srv", ports=["http"], env={"STATUS": "200"}, checks=[check],
              metadata={**app, "slot": "1", "role": "spare"})
    )  # fmt: skip
    assert isinstance(spare, Placed), spare
    nc = await market.connect("rows")
    with anyio.fail_after(15):  # the started machine's row once its checks pass
        while not ((r := await row(nc, market.subjects, good.machine_id)) and passing(r)):
            pass  # each ask a round trip to the server
    await published(nc, market.subjects, spare.machine_id, "reserved")

    async def shown() -> tuple[dict[str, str], dict[str, object], str]:
        code, out, err = await cli(market, "apps", "status", "hc", "--json")
        assert code == 0, out + err
        checks = {m["machine_id"]: m["check"] for m in json.loads(out)["machines"]}
        code, out, err = await cli(market, "machines", "list", "--app", "hc", "--json")
        assert code == 0, out + err
        health = {m["machine_id"]: m.get("health") for m in json.loads(out)["machines"]}
        code, table, err = await cli(market, "machines", "list", "--app", "hc")
        assert code == 0, table + err
        return checks, health, table

    checks, health, table = await shown()
    assert checks == {good.machine_id: "passing", spare.machine_id: "-"}
    assert health[spare.machine_id] is None and health[good.machine_id] is not None
    assert "passing " in next(ln for ln in table.splitlines() if good.machine_id in ln)
    assert "checking" not in table and "pending" not in table

    await buyer.machine("stop", good.machine_id)
    await published(nc, market.subjects, good.machine_id, "stopped")
    checks, health, table = await shown()
    assert checks == {good.machine_id: "-", spare.machine_id: "-"}
    assert health == {good.machine_id: None, spare.machine_id: None}
    assert "passing" not in table and "checking" not in table, table
    assert market.violations() == []


async def test_place_start_says_started_once_the_checks_pass(market: Market) -> None:
    """`place --start` waits for a machine's first passing check rather than a fixed time
    (a --start-timeout this long would otherwise be waited whole)."""
    await serving(market)
    code, out, err = await cli(
        market,
        *("place", "--region", "mad", "--cpus", "1", "--memory-mb", "64", "--image", "srv"),
        *("--port", "http", "--env", "STATUS=200", "--check", "http:http:/healthz"),
        *("--check-interval", "0.1", "--start", "--start-timeout", "600"),
    )
    assert (code, err) == (0, ""), out + err
    mid = out.split("placed ")[1].split()[0]
    assert out.splitlines()[-1] == f"  machine {mid} is started, its checks passing"


async def test_probes_on_real_sockets() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        ok, detail = await probe(Check(port="p", kind="tcp"), f"127.0.0.1:{port}")
        assert (ok, detail) == (False, f"tcp 127.0.0.1:{port}: Connection refused")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        assert await probe(Check(port="p", kind="tcp"), addr) == (True, "")
        # accepts, never answers: an http check times out
        ok, detail = await probe(Check(port="p", kind="http", path="/", timeout_s=0.2), addr)
        assert (ok, detail) == (False, f"http {addr}: no answer within 0.2s")


async def test_failover_replaces_a_critical_primary_whose_worker_still_answers(
    market: Market,
) -> None:
    wids = [own_worker_id(f"fo{i}") for i in range(3)]
    await market.host(
        *(
            worker(
                wid,
                region="ams",
                driver="process",
                catalog={"srv": {"command": ["{python}", "-c", SERVER]}},
                advertise_host="127.0.0.1",
            )
            for wid in wids
        ),
        port_claims=PortClaims(),
    )
    await market.exchange()
    buyer = await market.client()
    check = Check(port="http", kind="http", path="/healthz", interval_s=0.1, timeout_s=1)

    async def placed(role: str, status: int, exclude: list[str]) -> Placed:
        r = await buyer.place(
            order(
                region="ams",
                image="srv",
                ports=["http"],
                env={"STATUS": str(status)},
                checks=[check],
                metadata={"app": "api", "role": role, "slot": "0"},
                exclude_workers=exclude,
            )
        )
        assert isinstance(r, Placed), r
        return r

    primary = await placed("primary", 500, [])
    spare = await placed("spare", 200, [primary.worker_id])
    await buyer.machine("start", primary.machine_id)
    await until(buyer, primary.machine_id, lambda m: m.health and m.health.status == "critical")
    f = await failover(buyer, app="api", regions=["ams"], machine_id=primary.machine_id)
    assert f.started.machine_id == spare.machine_id and f.started.state == "started"
    assert f.stopped is not None and f.stopped.machine_id == primary.machine_id
    assert f.stopped.state == "stopped"
    assert market.violations() == []
