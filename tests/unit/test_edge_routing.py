"""The edge's routing core (edge/routing.py), its Host rule (edge/hosts.py) and its route
tables (edge/routes.py): tables of cases, a clock the test moves, no I/O."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bourse.wire.messages import Health, Machine, Resources
from edge.hosts import BadHost, NotRouted, app_of
from edge.routes import RoutesError, parse_routes, table_of
from edge.routing import (
    CRITICAL,
    NO_MACHINE,
    PASSING,
    PENDING,
    UNKNOWN_APP,
    AppRoute,
    Backend,
    Choice,
    NoRoute,
    Router,
    RouteTable,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def b(mid: str, region: str = "mad", **kw: object) -> Backend:
    port = 8000 + sum(map(ord, mid))
    return Backend(mid, region, {"http": ("127.0.0.1", port)}, **kw)  # type: ignore[arg-type]


def router(*backends: Backend, soft: int = 0, hard: int = 0, region: str = "mad") -> Router:
    r = Router(region, Clock(), probe_every_s=1.0, probe_max_s=4.0)
    r.update(RouteTable({"web": AppRoute("web", backends, soft, hard)}))
    return r


def picked(r: Router, exclude: tuple[str, ...] = ()) -> str:
    choice = r.pick("web", exclude=exclude)
    assert isinstance(choice, Choice), choice
    return choice.backend.machine_id


# (case, backends, the machine picked or the NoRoute detail)
READY_CASES = [
    ("started and passing", [b("a", health=PASSING)], "a"),
    ("no checks is routed", [b("a")], "a"),
    ("stopped", [b("a", state="stopped"), b("b")], "b"),
    ("critical", [b("a", health=CRITICAL), b("b")], "b"),
    ("pending", [b("a", health=PENDING), b("b")], "b"),
    ("worker gone", [b("a", worker_gone=True), b("b")], "b"),
    ("draining", [b("a", draining=True), b("b")], "b"),
    ("nearest region first", [b("a", "fra"), b("b", "mad")], "b"),
    ("another region when it is all", [b("a", "fra")], "a"),
    (
        "none at all, each reason counted",
        [b("a", state="stopped"), b("b", health=CRITICAL), b("c", worker_gone=True)],
        "no machine of app 'web' can take it (1 check critical, 1 not started, 1 worker gone)",
    ),
    ("an app without machines", [], "app 'web' has no machine"),
]


@pytest.mark.parametrize(("case", "backends", "want"), READY_CASES, ids=[c[0] for c in READY_CASES])
def test_which_machines_take_requests(case: str, backends: list[Backend], want: str) -> None:
    choice = router(*backends).pick("web")
    got = choice.backend.machine_id if isinstance(choice, Choice) else choice.detail
    assert got == want


def test_an_unknown_app() -> None:
    choice = router(b("a")).pick("api")
    assert isinstance(choice, NoRoute) and choice.reason == UNKNOWN_APP
    assert choice.detail == "no app 'api' at this edge"


def test_least_outstanding_then_in_turn() -> None:
    r = router(b("a"), b("b"), b("c"))
    r.begin("a")
    r.begin("a")
    r.begin("b")
    assert picked(r) == "c"
    r.begin("c")  # a 2, b 1, c 1: b and c tie, taken in turn
    assert [picked(r) for _ in range(4)] == ["c", "b", "c", "b"]
    r.end("a")
    r.end("a")  # a 0
    assert picked(r) == "a"


def test_the_hard_limit_is_never_passed() -> None:
    r = router(b("a"), b("b"), hard=2)
    for mid in ("a", "a", "b", "b"):
        r.begin(mid)
    choice = r.pick("web")
    assert isinstance(choice, NoRoute) and choice.reason == NO_MACHINE
    assert choice.detail == "no machine of app 'web' can take it (2 at its hard limit)"
    r.end("b")
    assert picked(r) == "b"


def test_under_the_soft_limit_before_the_nearest_region() -> None:
    r = router(b("near", "mad"), b("far", "fra"), soft=1, hard=5)
    assert picked(r) == "near"
    r.begin("near")  # at its soft limit: the far one, under its own, comes first
    assert picked(r) == "far"
    r.begin("far")  # both past soft: the nearest again, under hard
    assert picked(r) == "near"


def test_a_retry_excludes_the_machines_tried() -> None:
    r = router(b("a"), b("b"))
    assert picked(r, exclude=("a",)) == "b"
    choice = r.pick("web", exclude=("a", "b"))
    assert isinstance(choice, NoRoute) and choice.detail.endswith("(2 tried already)")


def test_a_failed_machine_is_skipped_until_a_probe_passes() -> None:
    r = router(b("a"), b("b"))
    clock = r.clock
    assert isinstance(clock, Clock)
    r.failed("a", ("127.0.0.1", 1))
    assert [picked(r) for _ in range(3)] == ["b", "b", "b"]
    assert r.next_probe_in() == 1.0 and r.probes_due() == []
    clock.now += 1.0
    assert r.probes_due() == [("a", ("127.0.0.1", 1))]
    assert r.probes_due() == [] and r.next_probe_in() is None  # its probe is running
    r.probed("a", ok=False)  # the next one after twice as long
    assert r.next_probe_in() == 2.0
    clock.now += 2.0
    assert r.probes_due() == [("a", ("127.0.0.1", 1))]
    r.probed("a", ok=False)
    r.probes_due()
    clock.now += 4.0  # capped at probe_max_s
    assert r.probes_due() == [("a", ("127.0.0.1", 1))]
    r.probed("a", ok=True)
    assert sorted(picked(r) for _ in range(2)) == ["a", "b"]


@pytest.mark.parametrize("row", ["stopped", "started"])
def test_a_skipped_machine_whose_start_answered_is_routed_at_once(row: str) -> None:
    """A machine skipped after a failure (its worker killed), stopped, then started by this
    edge (a request's cold start, a controller's spare): its port answering the start's
    probe is a passing probe, so the held requests need not wait for the skip's own next
    probe (its backoff: up to probe_max_s). Its row may still say stopped, or already
    started."""
    r = router(b("a", state="stopped"))
    woken: list[int] = []
    r.observers.append(lambda: woken.append(1))
    r.failed("a", ("127.0.0.1", 1))
    r.update(RouteTable({"web": AppRoute("web", (b("a", state=row),))}))
    woken.clear()
    r.started(b("a"), "web")
    assert picked(r) == "a" and r.skipped == {} and r.next_probe_in() is None
    assert woken  # held requests route again


def test_a_new_table_keeps_outstanding_counts_and_forgets_machines_gone() -> None:
    r = router(b("a"), b("b"))
    r.begin("a")
    r.failed("b", ("127.0.0.1", 2))
    r.update(RouteTable({"web": AppRoute("web", (b("a"), b("c")))}))
    assert r.outstanding == {"a": 1} and r.skipped == {}
    assert picked(r) == "c"


def test_the_port_a_request_goes_to() -> None:
    two = Backend("m", "mad", {"admin": ("h", 1), "web": ("h", 2), "http": ("h", 3)})
    first = Backend("n", "mad", {"admin": ("h", 4), "web": ("h", 5)})
    route = AppRoute("web", (two, first))
    assert route.address(two) == ("h", 3)  # 'http' when it has one
    assert route.address(first) == ("h", 4)  # else its first port
    assert replace(route, port="web").address(first) == ("h", 5)
    assert route.address(first, "pg") is None
    r = Router("mad", Clock())
    r.update(RouteTable({"db": AppRoute("db", (two, Backend("p", "mad", {"pg": ("h", 6)})))}))
    choice = r.pick("db", port="pg")
    assert isinstance(choice, Choice) and choice.address == ("h", 6)
    assert isinstance(r.pick("db", port="redis"), NoRoute)


HOSTS = [
    (b"web.localhost", "web"),
    (b"WEB.Localhost:8080", "web"),
    (b"web.acme.localhost", "web.acme"),
    (b"web.localhost.", "web"),
]


@pytest.mark.parametrize(("host", "key"), HOSTS)
def test_hosts_name_apps(host: bytes, key: str) -> None:
    assert app_of(host, "localhost") == key


@pytest.mark.parametrize(
    ("host", "error", "text"),
    [
        (b"", BadHost, "no Host header"),
        (b"web\x01.localhost", BadHost, "control characters"),
        (b"web\x7f.localhost", BadHost, "control characters"),
        (b"w" * 300, BadHost, "too long"),
        (b"web.example.com", NotRouted, "is not under 'localhost'"),
        (b"localhost", NotRouted, "is not under"),
        (b"a.b.c.localhost", NotRouted, "names no app"),
        (b"we_b.localhost", NotRouted, "names no app"),
    ],
)
def test_hosts_refused(host: bytes, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text) as caught:
        app_of(host, "localhost")
    if error is NotRouted:
        assert "<app>.localhost or <app>.<tenant>.localhost" in str(caught.value)


ROUTES = """
[[apps]]
app = "web"
tenant = "acme"
soft_limit = 5
hard_limit = 10
[[apps.machines]]
id = "m1"
region = "mad"
addresses = { http = "127.0.0.1:8081" }
health = "critical"

[[services]]
listen = "127.0.0.1:5432"
app = "db"
port = "pg"
"""


def test_a_routes_file() -> None:
    table = parse_routes(ROUTES, "r.toml", toml=True)
    route = table.apps["web.acme"]
    assert (route.soft_limit, route.hard_limit) == (5, 10)
    assert route.backends == (Backend("m1", "mad", {"http": ("127.0.0.1", 8081)}, health=CRITICAL),)
    [service] = table.services
    assert (service.listen, service.app, service.port) == (("127.0.0.1", 5432), "db", "pg")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[apps]]\napp = "Web"', "r.toml: Expected `str` matching regex"),
        ('[[apps]]\napp = "web"\ncolour = 1', "Object contains unknown field `colour`"),
        (
            '[[apps]]\napp = "web"\n[[apps.machines]]\nid = "m"\naddresses = {http = "x"}',
            "machine 'm': address 'x' is not HOST:PORT",
        ),
        (
            '[[apps]]\napp = "web"\n[[apps.machines]]\nid = "m"\naddresses = {}\nhealth = "ok"',
            "health must be one of",
        ),
        ('[[apps]]\napp = "web"\n[[apps]]\napp = "web"', "app 'web' is listed twice"),
    ],
)
def test_a_bad_routes_file(text: str, error: str) -> None:
    with pytest.raises(RoutesError, match=error):
        parse_routes(text, "r.toml", toml=True)


def machine(mid: str, order_id: str, **kw: object) -> Machine:
    base: dict[str, object] = {
        "machine_id": f"w1~{mid}",
        "order_id": order_id,
        "worker_id": "w1",
        "region": "mad",
        "state": "started",
        "resources": Resources(cpus=1, memory_mb=64),
        "image": "web",
        "metadata": {"app": "web"},
        "addresses": {"http": "127.0.0.1:9000"},
    }
    return Machine(**(base | kw))  # type: ignore[arg-type]


def test_a_listing_becomes_a_table() -> None:
    machines = [
        machine("a", "web.g1.mad.0"),
        machine("b", "acme:web.g1.mad.0", health=Health(status="passing")),
        machine("c", "acme:web.g1.mad.1", health=Health(status=""), checks=[]),
        machine("d", "x", metadata={}),  # no app: not routed
        machine("e", "web.g1.mad.1", state="stopped", addresses={"http": "bad"}),
    ]
    table = table_of(machines, soft_limit=2, hard_limit=4)
    assert sorted(table.apps) == ["web", "web.acme"]
    web = table.apps["web"]
    assert [(x.machine_id, x.state, dict(x.addresses)) for x in web.backends] == [
        ("w1~a", "started", {"http": ("127.0.0.1", 9000)}),
        ("w1~e", "stopped", {}),
    ]
    assert (web.soft_limit, web.hard_limit) == (2, 4)
    acme = table.apps["web.acme"]
    assert [(x.machine_id, x.health) for x in acme.backends] == [
        ("w1~b", PASSING),
        ("w1~c", PENDING),
    ]


def test_the_machines_ended_under_requests_in_flight() -> None:
    """Requests outstanding at machines the table says stopped, failed or destroyed (gone
    from it), or whose worker is gone: theirs are cut; not a started or stopping one's, nor
    a machine this edge started before its row came."""
    ip = {"http": ("127.0.0.1", 1)}
    router = Router("mad")
    machines = [
        Backend("a", "mad", ip),
        Backend("b", "mad", ip, "stopped"),
        Backend("c", "mad", ip, worker_gone=True),
        Backend("d", "mad", ip, "stopping"),
    ]
    router.update(RouteTable({"web": AppRoute("web", tuple(machines))}))
    router.started(Backend("new", "mad", ip), "web")
    for mid in ("a", "b", "c", "d", "e", "new"):
        router.begin(mid)
    assert router.dead_in_flight() == {"b", "c", "e"}


def test_the_machines_unreachable_for_a_while() -> None:
    now = [0.0]
    r = Router("mad", clock=lambda: now[0])
    r.failed("m1", ("127.0.0.1", 1))
    now[0] = 0.6
    r.failed("m2", ("127.0.0.1", 2))
    assert r.unreachable(0.5) == {"m1"}
    now[0] = 1.2
    assert r.unreachable(0.5) == {"m1", "m2"}
    r.probed("m1", ok=True)  # its probe passed: reachable again
    assert r.unreachable(0.5) == {"m2"}
