"""The edge's page, its pure core (edge/admin.py): who may look (the token rules) and what
the page's JSON says, from rows as the view holds them."""

from __future__ import annotations

import pytest

from bourse.wire.messages import (
    Amount,
    Check,
    Event,
    Health,
    LastExit,
    Machine,
    Resources,
    WorkerRow,
)
from edge.admin import (
    OPERATOR,
    AppRow,
    MachineSeen,
    Refused,
    SlotRow,
    TokenError,
    Viewer,
    WorkerSeen,
    bearer,
    cookie_token,
    event_json,
    fleet_json,
    machine_json,
    parse_tokens,
    regions_json,
    viewer,
)

OP = "operator-token-0123456789"
ACME = "acme-token-0123456789abcd"
TOKENS = parse_tokens([OP, f"{ACME}=acme"])


# -- who may look ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "token", "who"),
    [
        ("127.0.0.1", "", OPERATOR),  # loopback without a token: the operator
        ("::1", "", OPERATOR),
        ("127.8.9.10", "", OPERATOR),
        ("127.0.0.1", ACME, Viewer("acme")),  # a token is always taken as given
        ("10.1.2.3", OP, OPERATOR),
        ("10.1.2.3", ACME, Viewer("acme")),
        ("::ffff:10.1.2.3", ACME, Viewer("acme")),
    ],
)
def test_who_a_request_is(peer: str, token: str, who: Viewer) -> None:
    assert viewer(peer, token, TOKENS) == who


@pytest.mark.parametrize(
    ("peer", "token", "tokens", "says"),
    [
        ("10.1.2.3", "", TOKENS, "this page needs a token from outside loopback"),
        ("10.1.2.3", "", parse_tokens([]), "the page serves loopback only and 10.1.2.3 is not"),
        ("10.1.2.3", OP + "x", TOKENS, "bad admin token"),
        ("127.0.0.1", OP[:-1], TOKENS, "bad admin token"),  # wrong on loopback: still 401
        ("127.0.0.1", OP, parse_tokens([]), "this page takes no token"),
    ],
)
def test_who_is_refused_and_why(peer: str, token: str, tokens: object, says: str) -> None:
    got = viewer(peer, token, tokens)  # type: ignore[arg-type]
    assert isinstance(got, Refused)
    assert got.message.startswith(says), got.message


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (["short"], "--admin-token: a token is at least 16 letters"),
        (["with a space inside it"], "--admin-token: a token is at least 16 letters"),
        (["semicolon;0123456789abcdef"], "--admin-token: a token is at least 16 letters"),
        ([f"{OP}=Acme!"], "--admin-token ...='Acme!': a tenant's name is lowercase letters"),
        ([OP, f"{OP}=acme"], "--admin-token: a token is given twice"),
    ],
)
def test_tokens_that_are_refused(values: list[str], says: str) -> None:
    with pytest.raises(TokenError) as caught:
        parse_tokens(values)
    assert str(caught.value).startswith(says)


def test_a_token_matches_only_itself_and_says_whose() -> None:
    assert TOKENS.match(OP) == OPERATOR
    assert TOKENS.match(ACME) == Viewer("acme")
    for wrong in ("", OP[:-1], OP + "0", ACME.upper()):
        assert TOKENS.match(wrong) is None


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", ""), ("", "")],
)
def test_a_bearer_header(header: str, token: str) -> None:
    assert bearer(header) == token


def test_the_cookie_among_others() -> None:
    assert cookie_token("a=1; bourse_admin=tok; b=2") == "tok"
    assert cookie_token("bourse_admin_x=tok") == ""


# -- what the page shows ------------------------------------------------------------------------


def worker_row(wid: str, region: str, cpus: int, free_cpus: int, **kw: object) -> WorkerRow:
    return WorkerRow(
        worker_id=wid,
        region=region,
        beat=wid,
        capacity=Amount(cpus=cpus, memory_mb=1024),
        free=Amount(cpus=free_cpus, memory_mb=512),
        **kw,  # type: ignore[arg-type]
    )


def machine(mid: str, state: str = "started", order_id: str = "o1", **kw: object) -> Machine:
    return Machine(
        machine_id=mid,
        order_id=order_id,
        worker_id="mad-1",
        region="mad",
        state=state,  # type: ignore[arg-type]
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        **kw,  # type: ignore[arg-type]
    )


def test_a_regions_bars_split_committed_into_used_and_held() -> None:
    """mad-1: 8 CPUs, 2 free, its running machines use 4: used 4, held 2 (committed to
    machines that do not run), free 2; mad-2 gone: counted as a worker, not in the bars."""
    workers = [
        WorkerSeen(worker_row("mad-1", "mad", 8, 2), None, {"cpu": 4.0, "memory_mb": 256.0}),
        WorkerSeen(worker_row("mad-2", "mad", 8, 8), 1_000),
        WorkerSeen(worker_row("fra-1", "fra", 4, 4), None),
    ]
    regions = regions_json(workers)
    assert [r["region"] for r in regions] == ["fra", "mad"]
    mad = regions[1]
    assert (mad["workers"], mad["gone"]) == (2, 1)
    assert mad["bars"] == {
        "cpu": {"capacity": 8.0, "used": 4.0, "held": 2.0, "free": 2.0},
        "memory_mb": {"capacity": 1024.0, "used": 256.0, "held": 256.0, "free": 512.0},
    }


def test_running_more_than_committed_is_all_used() -> None:
    """A row behind its machines (a start seen before the worker's row): used is at most
    what is committed, never negative held."""
    w = WorkerSeen(worker_row("mad-1", "mad", 8, 6), None, {"cpu": 5.0, "memory_mb": 0.0})
    assert regions_json([w])[0]["bars"]["cpu"] == {  # type: ignore[index]
        "capacity": 8.0,
        "used": 2.0,
        "held": 0.0,
        "free": 6.0,
    }


@pytest.mark.parametrize(
    ("state", "checks", "health", "shown"),
    [
        ("started", True, Health(status="passing", since_ms=1), "passing"),
        ("started", True, Health(status="critical"), "critical"),
        ("started", True, None, "checking"),
        ("stopped", True, Health(status="passing", since_ms=1), "-"),  # stale: not shown
        ("reserved", True, None, "-"),  # a spare: nothing runs to check
        ("started", False, None, "-"),  # no checks
    ],
)
def test_a_machines_health_as_shown(
    state: str, checks: bool, health: Health | None, shown: str
) -> None:
    given = [Check(kind="tcp", port="http")] if checks else []
    m = machine("mad-1~A", state, checks=given, health=health)
    assert machine_json(MachineSeen(m, None))["health"] == shown


def test_a_machines_row() -> None:
    m = machine(
        "mad-1~A",
        order_id="acme:o1",
        metadata={"app": "shop", "role": "primary", "slot": "0", "gen": "3"},
        addresses={"http": "127.0.0.1:20001", "admin": "127.0.0.1:20002"},
        last_exit=LastExit(reason="signal", signal=9),
        restarts=2,
    )
    row = machine_json(MachineSeen(m, 5))
    assert {k: row[k] for k in ("tenant", "app", "role", "slot", "generation")} == {
        "tenant": "acme",
        "app": "shop",
        "role": "primary",
        "slot": "0",
        "generation": "3",
    }
    assert row["address"] == "admin 127.0.0.1:20002, http 127.0.0.1:20001"
    assert (row["worker_gone"], row["restarts"], row["last_exit"]) == (True, 2, "signal (signal 9)")


def test_an_apps_slots_in_order() -> None:
    """By region, slot (a number; none last), machine; a destroyed one left out; another
    app's not in it."""
    slots = [
        SlotRow("", "shop", "mad", 10, "spare", "b", "reserved", 2, None),
        SlotRow("", "shop", "mad", 2, "primary", "a", "started", 2, 5),
        SlotRow("", "shop", "fra", None, None, "z", "started", None, None),
        SlotRow("", "shop", "mad", 1, "primary", "c", "destroyed", 1, None),
        SlotRow("acme", "shop", "mad", 0, "primary", "d", "started", 1, None),
    ]
    doc = fleet_json(
        OPERATOR, [], [], 0, [AppRow("", "shop", 2, "mad,fra", 3, 2, 1, 0)], slots, {}, {"seq": 7}
    )
    [app] = doc["apps"]  # type: ignore[misc]
    assert [(s["region"], s["slot"], s["role"], s["machine_id"]) for s in app["slots"]] == [
        ("fra", None, "", "z"),
        ("mad", 2, "primary", "a"),
        ("mad", 10, "spare", "b"),
    ]
    assert app["slots"][1]["worker_gone"] is True
    assert app["regions"] == ["mad", "fra"]
    assert doc["view"] == {"seq": 7}
    assert doc["filters"]["apps"] == ["shop"]  # type: ignore[index]


def test_a_tenant_sees_its_own_events_only() -> None:
    mine = Event(kind="placed", region="mad", worker_id="mad-1", at_ms=1, order_id="acme:o1")
    shared = Event(kind="placed", region="mad", worker_id="mad-1", at_ms=1, order_id="o2")
    acme = Viewer("acme")
    assert event_json(acme, mine) is not None
    assert event_json(acme, shared) is None
    assert event_json(Viewer(""), shared) is not None  # the shared key's machines' tenant
    assert event_json(OPERATOR, mine) == {
        "kind": "placed",
        "region": "mad",
        "worker_id": "mad-1",
        "machine_id": "",
        "at_ms": 1,
        "detail": "",
        "health": "",
    }


# -- the flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--admin", "nowhere"], "error: --admin 'nowhere': expected HOST:PORT, or PORT"),
        (["--admin", "0", "--admin-token", "short"], "error: --admin-token: a token is at least"),
        (
            ["--admin", "0", "--source", "listing"],
            "error: --admin reads the fleet view: not with --routes or a listing",
        ),
    ],
)
def test_edge_serve_refuses_a_page_it_cannot_serve(args: list[str], says: str) -> None:
    from edge.cli import app
    from tests.cli import run_cli

    code, out, err = run_cli(app, "serve", *args)
    assert (code, out) == (1, "")
    assert err.strip().startswith(says), err
    assert len(err.strip().splitlines()) == 1
