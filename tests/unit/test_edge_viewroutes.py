"""The edge's table from a view's rows (edge/viewroutes.py ``view_table``): each app's
machines not destroyed, keyed by app and tenant, with what routing reads (health from the
checks and their status, the worker gone when the view says so, the named ports' addresses)."""

from __future__ import annotations

from bourse.client.apps.spec import AppService
from bourse.view.db import ViewDB
from bourse.view.rows import Op, Reader
from bourse.wire.codec import encode
from bourse.wire.messages import Amount, Check, Health, Heartbeat, Machine, Resources, WorkerRow
from bourse.wire.subjects import Subjects
from edge.routing import CRITICAL, NO_CHECKS, PASSING, PENDING, Backend
from edge.viewroutes import view_table

S = Subjects("bourse")
READER = Reader(S)
T0 = 1_800_000_000_000
FEED: dict[str, object] = {"seqs": {"bourse.v1.state.>": 0}}


def worker_ops(wid: str) -> list[Op]:
    w = WorkerRow(worker_id=wid, region="mad", beat=wid, capacity=Amount(), free=Amount())
    hb = Heartbeat(beat=wid, workers=[wid], at_ms=0)
    return [
        READER.read(S.state_worker("mad", wid), encode(w)),
        READER.read(S.state_beat("mad", wid), encode(hb)),
    ]


def machine_op(
    name: str,
    wid: str = "mad-1",
    state: str = "started",
    app: str | None = "web",
    owner: str = "_",
    checks: bool = False,
    health: str = "",
) -> Op:
    m = Machine(
        machine_id=f"{wid}~{name}",
        order_id=f"{owner}:{name}" if owner != "_" else name,
        worker_id=wid,
        region="mad",
        state=state,  # type: ignore[arg-type]
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        metadata={"app": app} if app else {},
        addresses={"http": "10.0.0.1:8080", "bad": "nowhere"},
        checks=[Check(port="http", kind="tcp")] if checks else [],
        health=Health(status=health) if checks else None,
    )
    return READER.read(S.state_machine(owner, "mad", wid, m.machine_id), encode(m))


def feed(db: ViewDB, ops: list[Op], now_ms: int = T0) -> None:
    db.apply([(op, i + 1, T0) for i, op in enumerate(ops)], FEED, now_ms)


def test_every_app_machine_not_destroyed_with_what_routing_reads() -> None:
    db = ViewDB(":memory:")
    feed(
        db,
        [
            *worker_ops("mad-1"),
            machine_op("a"),
            machine_op("b", checks=True, health=PASSING),
            machine_op("c", checks=True, health=CRITICAL),
            machine_op("d", checks=True),  # not checked yet
            machine_op("e", state="stopped"),
            machine_op("f", state="destroyed"),
            machine_op("g", app=None),  # no app: not routed
            machine_op("h", owner="acme"),  # a tenant's web
        ],
    )
    table = view_table(db.db, port="http", soft_limit=2, hard_limit=5)
    assert table.source == "view" and sorted(table.apps) == ["web", "web.acme"]
    web = table.apps["web"]
    assert (web.port, web.soft_limit, web.hard_limit) == ("http", 2, 5)
    addrs = {"http": ("10.0.0.1", 8080)}  # a malformed address is left out
    assert web.backends == (
        Backend("mad-1~a", "mad", addrs, "started", NO_CHECKS),
        Backend("mad-1~b", "mad", addrs, "started", PASSING),
        Backend("mad-1~c", "mad", addrs, "started", CRITICAL),
        Backend("mad-1~d", "mad", addrs, "started", PENDING),
        Backend("mad-1~e", "mad", addrs, "stopped", NO_CHECKS),
    )
    assert [b.machine_id for b in table.apps["web.acme"].backends] == ["mad-1~h"]


def test_a_machine_whose_worker_is_gone_is_marked_so() -> None:
    db = ViewDB(":memory:")
    feed(
        db, [*worker_ops("mad-1"), *worker_ops("mad-2"), machine_op("a"), machine_op("b", "mad-2")]
    )
    assert [b.worker_gone for b in view_table(db.db).apps["web"].backends] == [False, False]
    db.apply([(op, 10 + i, T0 + 60_000) for i, op in enumerate(worker_ops("mad-2"))], FEED, T0)
    db.sweep(T0 + 60_000)  # mad-1 silent for a minute: gone; mad-2 beat again
    gone = {b.machine_id: b.worker_gone for b in view_table(db.db).apps["web"].backends}
    assert gone == {"mad-1~a": True, "mad-2~b": False}


def test_a_machine_whose_worker_was_never_seen_is_not_marked_gone() -> None:
    db = ViewDB(":memory:")
    feed(db, [machine_op("a")])
    assert [b.worker_gone for b in view_table(db.db).apps["web"].backends] == [False]


def test_a_draining_machine_is_marked_and_a_deployed_app_without_machines_is_routed() -> None:
    """A machine its app's record names draining (a deploy drains it) is marked so: the
    router sends it nothing new; an app with a record (a service section) and no machine
    is in the table, with none (a request may place one)."""
    db = ViewDB(":memory:")
    feed(db, [*worker_ops("mad-1"), machine_op("a"), machine_op("b")])
    services = {"web": AppService(), "zero": AppService()}
    table = view_table(db.db, services=services, draining={"mad-1~b"})
    assert [(b.machine_id, b.draining) for b in table.apps["web"].backends] == [
        ("mad-1~a", False),
        ("mad-1~b", True),
    ]
    assert table.apps["zero"].backends == ()
