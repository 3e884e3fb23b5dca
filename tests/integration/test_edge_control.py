"""The edge's control plane, end to end: a real ``edge serve`` program (a subprocess) on a
real market (tests/market.py: suppliers, an exchange, the state stream), routing from the
fleet view. The apps' machines are on sim workers (nothing runs there): a test server on
the address a worker gave a machine's port plays the machine. Every wait is on an event
(an answer, a line), never a sleep."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from bourse.client import BourseClient
from bourse.client.apps.apply import apply, context
from bourse.client.apps.spec import AppService, AppSpec
from bourse.client.apps.store import AppRecord, AppStore
from bourse.wire.messages import Machine, Placed, Resources
from edge.routing import app_key
from supplier.host import SupplierHost
from supplier.ports import PortClaims
from tests.edgekit import HOST, Answer, Edge, Upstream, answered, edge, get
from tests.isolation import own_worker_id
from tests.market import Market, order, wait_for, wait_until, worker
from tests.views import published, row

if TYPE_CHECKING:
    from nats.aio.msg import Msg

# Answers every GET with "hello" on 0.0.0.0:$PORT, after sleeping $DELAY s (an app's own
# start); GET /slow after 3 s (a long request); "slow" and "never" machines: see the
# catalog below.
SERVER = """
import http.server, os, time
time.sleep(float(os.environ.get("DELAY", "0")))  # the app's own start: the workload, not a wait
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path == "/slow":
            time.sleep(3)  # a long request: the workload
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
"""
# Runs, never listens.
NEVER = "import time; time.sleep(3600)"  # the workload: an app that never listens


def market_args(market: Market, *more: str) -> tuple[str, ...]:
    return ("--nats", market.url, "--prefix", market.subjects.prefix, *more)


async def place_app(
    buyer: BourseClient, app: str, exclude: list[str] | None = None
) -> tuple[Placed, Upstream]:
    """A machine of ``app`` placed (on none of ``exclude``) and a test server where its
    port is."""
    placed = await buyer.place(
        order(image="web", ports=["http"], metadata={"app": app}, exclude_workers=exclude or [])
    )
    assert isinstance(placed, Placed), placed
    upstream = Upstream(placed.machine_id, port=int(placed.addresses["http"].rsplit(":", 1)[1]))
    return placed, await upstream.start()


async def only(address: str, host: str, body: bytes, timeout_s: float = 30.0) -> None:
    """Until two requests in a row are answered ``body`` (an app of two machines taken in
    turn: the other one is out)."""

    async def twice() -> bool:
        return all([(await get(address, host=host)).body == body for _ in range(2)])

    await wait_for(twice, bool, timeout_s)


async def test_the_view_routes_started_machines_and_none_whose_worker_is_gone(
    market: Market, tmp_path: Path
) -> None:
    """Two machines of one app on two suppliers' workers: the edge (the view its default
    source) routes to each once started; the first supplier stopped, its worker goes gone
    in the view and its machine gets no request, although its server still answers (a
    partitioned worker's old primary)."""
    w1, w2 = own_worker_id("edgev1"), own_worker_id("edgev2")
    gone_host = await market.host(worker(w1, ports="29550-29559", advertise_host=HOST))
    await market.host(worker(w2, ports="29560-29569", advertise_host=HOST))
    await market.exchange()
    buyer = await market.client()
    (p1, u1), (p2, u2) = [await place_app(buyer, "shop", [w]) for w in (w2, w1)]
    try:
        async with edge(tmp_path, *market_args(market, "--no-auto-start")) as e:
            assert "routes: view)" in e.ready_line, e.ready_line
            got = await get(e.address, host="shop.localhost")
            assert (got.status, got.body) == (
                503,
                b"no machine of app 'shop' can take it (2 not started)\n",
            )
            for p in (p1, p2):
                await buyer.machine("start", p.machine_id)
            await answered(e.address, "shop.localhost", lambda a: a.body == p1.machine_id.encode())
            await answered(e.address, "shop.localhost", lambda a: a.body == p2.machine_id.encode())
            await market.stop(gone_host)  # its worker beats no more: gone in >= 3 s
            # taken in turn while both are routable: two in a row from one says the other
            # is out, though its server (u1) still answers
            await only(e.address, "shop.localhost", p2.machine_id.encode())
            served_by_gone = u1.requests
            for _ in range(4):
                assert (await get(e.address, host="shop.localhost")).body == p2.machine_id.encode()
            assert u1.requests == served_by_gone
    finally:
        await u1.close()
        await u2.close()


async def test_without_a_state_stream_the_listing_routes(market: Market, tmp_path: Path) -> None:
    """No exchange has made the state stream (a direct buyer places): the edge falls back
    to the machine listing and says so on its line."""
    w = own_worker_id("edgev3")
    await market.host(worker(w, ports="29570-29579", advertise_host=HOST))
    buyer = await market.client(direct=True)
    placed, upstream = await place_app(buyer, "shop")
    try:
        await buyer.machine("start", placed.machine_id)
        async with edge(tmp_path, *market_args(market, "--refresh-s", "0.1")) as e:
            assert "routes: machine listing (the view unavailable: " in e.ready_line, e.ready_line
            got = await answered(e.address, "shop.localhost", lambda a: a.status == 200)
            assert got.body == placed.machine_id.encode()
    finally:
        await upstream.close()


async def process_market(market: Market, *names: str) -> BourseClient:
    """A process worker of each name (real machines: the catalog's srv and never) on one
    supplier, an exchange, a buyer."""
    catalog = {
        "srv": {"command": ["{python}", "-c", SERVER]},
        "never": {"command": ["{python}", "-c", NEVER]},
    }
    ws = [worker(own_worker_id(n), driver="process", catalog=catalog, advertise_host=HOST)
          for n in names]  # fmt: skip
    await market.host(*ws, port_claims=PortClaims())
    await market.exchange()
    return await market.client()


async def placed(buyer: BourseClient, app: str, image: str = "srv", **env: str) -> Placed:
    got = await buyer.place(
        order(image=image, ports=["http"], metadata={"app": app}, env=env or {})
    )
    assert isinstance(got, Placed), got
    return got


async def test_a_request_starts_a_stopped_machine_and_every_held_request_is_served(
    market: Market, tmp_path: Path
) -> None:
    """An app whose one machine is placed and not started: ten requests at once start it
    once, are held until its port answers (the app sleeps 0.3 s before listening), and are
    all served by it; stopped, the next request starts it again."""
    buyer = await process_market(market, "edges1")
    p = await placed(buyer, "cold", DELAY="0.3")
    async with edge(tmp_path, *market_args(market)) as e:
        await answered(e.address, "web.localhost", lambda a: a.status == 404)  # view caught up
        got = await all_of(e.address, "cold.localhost", 10)
        assert {(a.status, a.body, a.headers["bourse-machine"]) for a in got} == {
            (200, b"hello", p.machine_id)
        }
        assert e.log.count("event='cold_start'") == 1 and "held=10" in e.log, e.log[-3000:]
        assert (await buyer.machine("get", p.machine_id)).state == "started"

        await buyer.machine("stop", p.machine_id)
        await answered(e.address, "cold.localhost", lambda a: a.status == 200, 20.0)
        assert e.log.count("event='cold_start'") == 2, e.log[-3000:]


async def test_a_raw_tcp_connection_starts_a_stopped_machine(
    market: Market, tmp_path: Path
) -> None:
    """A raw TCP service of an app whose one machine is placed and not started: the
    connection is held while the edge starts it and its port answers, then passed to it
    (the app sleeps 0.3 s before listening)."""
    buyer = await process_market(market, "edget1")
    p = await placed(buyer, "tcpcold", DELAY="0.3")
    args = market_args(market, "--tcp", f"{HOST}:0=tcpcold:http")
    async with edge(tmp_path, *args) as e:
        where = e.ready_line.split("tcpcold:http on ")[1].split(";")[0].split()[0]
        reader, writer = await asyncio.open_connection(*where.rsplit(":", 1))
        try:
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            with anyio.fail_after(30):
                answer = await reader.read()
        finally:
            writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello"), answer
        assert f"machine='{p.machine_id}'" in cold(e.log), e.log[-3000:]


async def test_a_machine_that_never_answers_gets_a_503_that_says_why(
    market: Market, tmp_path: Path
) -> None:
    """A machine that runs and never listens: the held request is answered 503 past
    --start-timeout-s, saying so; the requests after it start nothing more."""
    buyer = await process_market(market, "edges2")
    p = await placed(buyer, "mute", image="never")
    async with edge(tmp_path, *market_args(market, "--start-timeout-s", "1")) as e:
        await answered(e.address, "web.localhost", lambda a: a.status == 404)  # view caught up
        got = await get(e.address, host="mute.localhost")
        assert (got.status, got.body.decode()) == (
            503,
            f"machine {p.machine_id} of app 'mute' did not answer within 1 s\n",
        )
        # its worker says it started: routed, refused, skipped; no start again meanwhile
        for _ in range(3):
            again = await get(e.address, host="mute.localhost")
            assert again.status in (502, 503), again
        assert e.log.count("event='cold_start_failed'") == 1


async def test_two_edges_and_concurrent_requests_place_one_machine_for_an_app_with_none(
    market: Market, tmp_path: Path
) -> None:
    """An app deployed (one primary) whose machine was then destroyed: nothing to start.
    Two edges, ten requests at each at once: ONE new machine is placed (both edges derive
    the slot's next order id, its claim gives both the same machine), started, and every
    request is served by it; the next deploy keeps it in its slot."""
    buyer = await process_market(market, "edgep1")
    spec = AppSpec(app="zero", image="srv", regions=["mad"], ports=["http"], env={"DELAY": "0.2"},
                   resources=Resources(cpus=1, memory_mb=256))  # fmt: skip
    store = await AppStore.open(buyer.nc, market.subjects.prefix)
    done = await apply(buyer, store, await context(buyer, store, spec), check_wait_s=5)
    assert done.complete, done.outcomes
    [first] = [o.machine_id for o in done.outcomes]
    await buyer.machine("destroy", first)
    nc = await market.connect("watch")
    await published(nc, market.subjects, first, "destroyed", timeout_s=30)
    # each edge is ready once its view and the apps' records are read: the destroy in them
    async with (
        edge(tmp_path, *market_args(market)) as e1,
        edge(tmp_path, *market_args(market)) as e2,
    ):
        new = await placed_once((e1, e2), "zero.localhost")
        assert new != first
        live = [m for m in await market_machines(buyer, "zero") if m.state != "destroyed"]
        assert [(m.machine_id, m.order_id, m.state) for m in live] == [
            (new, "zero.g1.mad.0.r1", "started")
        ]
    again = await apply(buyer, store, await context(buyer, store, spec), check_wait_s=5)
    assert [(s.action, s.machine_id) for s in again.plan.steps] == [("keep", new)]


async def placed_once(edges: tuple[Edge, Edge], host: str) -> str:
    """Ten requests at each edge at once to ``host``'s app, which has no machine to start:
    every one served by ONE machine placed for them (each edge's cold start says placed):
    its id."""
    got: list[Answer] = []

    async def ten(address: str) -> None:
        got.extend(await all_of(address, host, 10))

    async with anyio.create_task_group() as tasks:
        for e in edges:
            tasks.start_soon(ten, e.address)
    machines = {a.headers.get("bourse-machine") for a in got}
    assert {a.status for a in got} == {200} and len(machines) == 1, got
    placed_lines = [ln for e in edges for ln in cold(e.log).splitlines()]
    assert placed_lines and all("placed=True" in ln for ln in placed_lines), placed_lines
    [new] = machines
    assert new is not None
    return new


async def slow(address: str, host: str, into: list[Answer]) -> None:
    """A 3 s request (the app's GET /slow), its answer put ``into``."""
    into.append(await get(address, "/slow", host=host))


async def test_a_rolling_deploy_drains_the_old_machine_before_it_destroys_it(
    market: Market, tmp_path: Path
) -> None:
    """An app of one primary behind an edge, a 3 s request under way at it: a deploy that
    replaces it starts the new machine, names the old one draining (the edge sends it
    nothing new from then on), waits until the edge's activity says the request finished,
    and only then stops and destroys it: the long request is answered by the old machine,
    the requests after the mark by the new one."""
    buyer = await process_market(market, "edged1")
    spec = AppSpec(app="roll", image="srv", regions=["mad"], ports=["http"], env={"V": "1"},
                   resources=Resources(cpus=1, memory_mb=256))  # fmt: skip
    store = await AppStore.open(buyer.nc, market.subjects.prefix)
    first = await apply(buyer, store, await context(buyer, store, spec), check_wait_s=5)
    [old] = [o.machine_id for o in first.outcomes]
    async with edge(tmp_path, *market_args(market)) as e:
        await answered(e.address, "roll.localhost", lambda a: a.status == 200)
        long: list[Answer] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(slow, e.address, "roll.localhost", long)
            await in_flight(buyer, old)  # the edge's activity says so
            v2 = msgspec.structs.replace(spec, env={"V": "2"})
            second = await apply(buyer, store, await context(buyer, store, v2), check_wait_s=5)
        assert second.complete, second.outcomes
        [new] = [o.machine_id for o in second.outcomes]
        [answer] = long
        assert (answer.status, answer.headers["bourse-machine"]) == (200, old)
        await drained(e, buyer, store, "roll", old, new)


async def test_a_scale_down_drains_the_machine_it_destroys(market: Market, tmp_path: Path) -> None:
    """An app of two primaries behind an edge, a 3 s request under way at each: a deploy
    down to one names the machine it destroys draining (the edge sends it nothing new),
    waits until the edge's activity says its request finished, and only then stops and
    destroys it: both long requests are answered by their machines, the requests after
    the mark by the machine kept."""
    buyer = await process_market(market, "edgesd1", "edgesd2")  # a machine on each
    spec = AppSpec(app="down", image="srv", regions=["mad"], ports=["http"], count=2,
                   resources=Resources(cpus=1, memory_mb=256))  # fmt: skip
    store = await AppStore.open(buyer.nc, market.subjects.prefix)
    first = await apply(buyer, store, await context(buyer, store, spec), check_wait_s=5)
    assert first.complete, first.outcomes
    both = {o.machine_id for o in first.outcomes}
    async with edge(tmp_path, *market_args(market)) as e:
        seen: set[str] = set()

        async def each() -> set[str]:  # both routed: each has answered
            seen.add((await get(e.address, host="down.localhost")).headers["bourse-machine"])
            return seen

        await wait_for(each, lambda s: s == both)
        long: list[Answer] = []
        async with anyio.create_task_group() as tasks:
            for _ in range(2):  # the fewest outstanding first: one at each machine
                tasks.start_soon(slow, e.address, "down.localhost", long)
            for mid in both:
                await in_flight(buyer, mid)
            one = msgspec.structs.replace(spec, count=1)
            second = await apply(buyer, store, await context(buyer, store, one), check_wait_s=5)
        assert second.complete, second.outcomes
        [gone] = [s.machine_id for s in second.plan.steps if s.action == "destroy"]
        [kept] = both - {gone}
        assert sorted((a.status, a.headers["bourse-machine"]) for a in long) == sorted(
            (200, m) for m in both
        )
        await drained(e, buyer, store, "down", gone, kept)


async def drained(
    e: Edge, buyer: BourseClient, store: AppStore, app: str, gone: str, kept: str
) -> None:
    """A deploy that drained ``gone`` done: the edge heard it draining, the next request
    goes to ``kept``, ``gone`` is destroyed (as ``buyer`` lists the app: a tenant's, its
    own) and the record drains nothing more."""
    assert "event='draining'" in e.log and gone in e.log, e.log[-3000:]
    got = await get(e.address, host=f"{app_key(app, buyer.tenant)}.localhost")
    assert (got.status, got.headers["bourse-machine"]) == (200, kept)
    machines = {m.machine_id: m.state for m in await market_machines(buyer, app)}
    assert machines == {gone: "destroyed", kept: "started"}
    record = await store.get(app)
    assert record is not None and record.draining == []


async def in_flight(buyer: BourseClient, machine_id: str) -> None:
    """Until an edge's activity report says a request to ``machine_id`` is in flight."""
    from bourse.wire.codec import decode
    from bourse.wire.messages import EdgeActivity

    seen = anyio.Event()

    async def report(msg: Msg) -> None:
        a = decode(msg.data, EdgeActivity)
        if a.machines.get(machine_id) == a.at_ms:
            seen.set()

    sub = await buyer.nc.subscribe(buyer.subjects.edge_activity(), cb=report)
    try:
        with anyio.fail_after(30):
            await seen.wait()
    finally:
        await sub.unsubscribe()


async def market_machines(buyer: BourseClient, app: str) -> list[Machine]:
    from bourse.wire.messages import ListMachines

    listing = await buyer.list_machines(["mad"], ListMachines(app=app, include_destroyed=True))
    return listing.machines


def cold(log: str) -> str:
    """An edge's cold_start lines."""
    return "\n".join(ln for ln in log.splitlines() if "event='cold_start'" in ln)


async def all_of(address: str, host: str, n: int) -> list[Answer]:
    """``n`` requests at once, each on a connection of its own."""
    out: list[Answer] = []

    async def one() -> None:
        out.append(await get(address, host=host))

    async with anyio.create_task_group() as tasks:
        for _ in range(n):
            tasks.start_soon(one)
    return out


async def heal_hosts(market: Market, name: str, ports: int) -> tuple[SupplierHost, SupplierHost]:
    """Three sim workers ``<name>1..3`` (ports from ``ports`` up, ten each): the first on a
    supplier of its own (the one a test stops), the others on one; an exchange."""
    w1, w2, w3 = (own_worker_id(f"{name}{i}") for i in (1, 2, 3))
    gone_host = await market.host(worker(w1, ports=f"{ports}-{ports + 9}", advertise_host=HOST))
    other = await market.host(
        worker(w2, ports=f"{ports + 10}-{ports + 19}", advertise_host=HOST),
        worker(w3, ports=f"{ports + 20}-{ports + 29}", advertise_host=HOST),
    )
    await market.exchange()
    return gone_host, other


async def primary_and_spare(
    client: BourseClient, gone_host: SupplierHost, other: SupplierHost
) -> tuple[Placed, Placed]:
    """App heal's primary on ``gone_host``'s worker (started), its slot's spare on the
    first of ``other``'s, placed by ``client``."""
    [w1], [w2, w3] = list(gone_host.workers), list(other.workers)

    async def place(role: str, on: str) -> Placed:
        meta = {"app": "heal", "role": role, "slot": "0"}
        others = [w for w in (w1, w2, w3) if w != on]
        got = await client.place(order(ports=["http"], metadata=meta, exclude_workers=others))
        assert isinstance(got, Placed), got
        return got

    primary, spare = await place("primary", w1), await place("spare", w2)
    await client.machine("start", primary.machine_id)
    return primary, spare


async def healed_once(
    edges: tuple[Edge, Edge], other: SupplierHost, primary: Placed, spare: Placed, scope: str = ""
) -> Machine:
    """Once ONE new spare of app heal is on ``other``'s second worker (under ``scope``) and
    every controller that acted says the same spare started, the same refill, the failed
    primary's stop queued: the new spare."""
    [w2, w3] = list(other.workers)
    refill = other.workers[w3]
    await wait_until(lambda: len(refill.machines) == 1, 30)
    new_spare = next(iter(refill.machines.values()))
    assert new_spare.metadata == {"app": "heal", "role": "spare", "slot": "0"}
    assert new_spare.order_id.startswith(f"{scope}heal.spare-0.mad.heal-")

    def logs() -> str:
        return "".join(e.log for e in edges)

    await wait_until(lambda: "event='healed'" in logs(), 30)
    healed = [ln for ln in logs().splitlines() if "event='healed'" in ln]
    for line in healed:  # each controller that acted: the same spare, the same refill
        assert f"spare='{spare.machine_id}'" in line and new_spare.machine_id in line, line
        assert f"{primary.machine_id} stop queued" in line, line
    assert len(refill.machines) == 1 and len(other.workers[w2].machines) == 1
    return new_spare


async def test_two_controllers_heal_a_gone_primary_with_one_failover(
    market: Market, tmp_path: Path
) -> None:
    """A primary on one supplier's worker, its slot's spare on another's, a third worker
    for the new spare; two edges each run a controller. The primary's supplier stopped:
    the spare is started, the primary's stop queued for its worker, and ONE new spare is
    placed (both controllers derive its order id), on the third worker."""
    gone_host, other = await heal_hosts(market, "edgeh", 29580)
    buyer = await market.client()
    primary, spare = await primary_and_spare(buyer, gone_host, other)
    args = market_args(market, "--controller", "--no-auto-start")
    async with edge(tmp_path, *args) as e1, edge(tmp_path, *args) as e2:
        await market.stop(gone_host)
        nc = await market.connect("watch")
        await published(nc, market.subjects, spare.machine_id, "started", timeout_s=30)
        await healed_once((e1, e2), other, primary, spare)


async def test_idle_machines_are_stopped_down_to_the_minimum_by_one_edge(
    market: Market, tmp_path: Path
) -> None:
    """Apps whose service section says auto_stop after 1 s: 'nap' with two machines and a
    minimum of one, 'solo' with one machine and none. Two edges hear each other's
    activity; one of them (the smaller id) stops solo's machine and one of nap's, never
    both; a request to solo then starts it again, and once idle it is stopped again."""
    w = own_worker_id("edgei1")
    await market.host(worker(w, ports="29610-29619", advertise_host=HOST))
    await market.exchange()
    buyer = await market.client()
    placed = {app: [await place_app(buyer, app) for _ in range(n)] for app, n in
              (("nap", 2), ("solo", 1))}  # fmt: skip
    nc = await market.connect("apps")
    store = await AppStore.open(nc, market.subjects.prefix)
    for app, minimum in (("nap", 1), ("solo", 0)):
        for p, _ in placed[app]:
            await buyer.machine("start", p.machine_id)
        service = AppService(port="http", auto_stop=True, idle_s=1, min_machines_running=minimum)
        spec = AppSpec(app=app, image="web", regions=["mad"], ports=["http"],
                       resources=Resources(cpus=1, memory_mb=256), service=service)  # fmt: skip
        await store.write(app, AppRecord(spec=spec), 0)
    solo = placed["solo"][0][0].machine_id
    try:
        async with (
            edge(tmp_path, *market_args(market)) as e1,
            edge(tmp_path, *market_args(market)) as e2,
        ):
            await published(nc, market.subjects, solo, "stopped", timeout_s=30)
            # started by a request once the edge's view has it stopped (until then its
            # test server, which a stop does not end, answers at its old address)
            got = await answered(
                e1.address, "solo.localhost", lambda a: f"machine='{solo}'" in cold(e1.log)
            )
            assert (got.status, got.headers["bourse-machine"]) == (200, solo)

            def stops() -> list[tuple[str, str]]:
                return [(e.address, ln) for e in (e1, e2) for ln in e.log.splitlines()
                        if "event='idle_stop'" in ln]  # fmt: skip

            # idle again: stopped a second time (its row may not say started yet: the log)
            await wait_until(lambda: sum(f"machine='{solo}'" in ln for _, ln in stops()) == 2, 30)
            states = [(await row(nc, market.subjects, p.machine_id)) for p, _ in placed["nap"]]
            assert sorted(m.state for m in states if m is not None) == ["started", "stopped"]
            assert len(stops()) == 3 and len({a for a, _ in stops()}) == 1, stops()
    finally:
        for ups in placed.values():
            for _, u in ups:
                await u.close()
