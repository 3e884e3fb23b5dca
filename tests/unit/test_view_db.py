"""A view's tables (bourse/view/db.py), fed rows as the stream would: machines with their
worker's liveness (alive while its heartbeat or its row is fresh, gone since the last of
them after 3 s, back when it beats again), the apps they make up, a batch and its
sequences in one transaction (what a resume starts from), old destroyed rows pruned."""

from __future__ import annotations

from pathlib import Path

import pytest

from bourse.nats.state import RETENTION_S
from bourse.view.db import ViewDB
from bourse.view.rows import Op, Reader
from bourse.wire.codec import encode
from bourse.wire.messages import Amount, Heartbeat, Machine, Resources, WorkerRow
from bourse.wire.subjects import Subjects

S = Subjects("bourse")
READER = Reader(S)
T0 = 1_800_000_000_000
FEED: dict[str, object] = {"seqs": {"bourse.v1.state.>": 0}}


def worker_op(wid: str, beat: str = "mad-1") -> Op:
    w = WorkerRow(worker_id=wid, region="mad", beat=beat, capacity=Amount(), free=Amount())
    return READER.read(S.state_worker("mad", wid), encode(w))


def beat_op(*wids: str) -> Op:
    hb = Heartbeat(beat=wids[0], workers=list(wids), at_ms=0)
    return READER.read(S.state_beat("mad", wids[0]), encode(hb))


def machine_op(n: int, wid: str = "mad-1", state: str = "started", **meta: str) -> Op:
    m = Machine(
        machine_id=f"{wid}~M{n}",
        order_id=f"o{n}",
        worker_id=wid,
        region="mad",
        state=state,  # type: ignore[arg-type]
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        metadata=dict(meta),
    )
    return READER.read(S.state_machine("_", "mad", wid, m.machine_id), encode(m))


def gone(db: ViewDB) -> dict[str, int | None]:
    return dict(db.db.execute("SELECT machine_id, worker_gone_since_ms FROM machines"))


def test_machines_carry_their_workers_liveness() -> None:
    db = ViewDB(":memory:")
    # a machine before any row of its worker: gone, never seen beating (0)
    db.apply([(machine_op(1), 1, T0)], FEED, T0)
    assert gone(db) == {"mad-1~M1": 0}
    # its worker's row and its process's heartbeat: alive
    db.apply([(worker_op("mad-1"), 2, T0), (beat_op("mad-1"), 3, T0)], FEED, T0)
    assert gone(db) == {"mad-1~M1": None}
    assert db.sweep(T0 + 3000) == []  # 3 s: still within the window
    # no heartbeat since: gone since the last one, the machine says so
    assert db.sweep(T0 + 3001) == ["mad-1"]
    assert gone(db) == {"mad-1~M1": T0}
    assert db.db.execute("SELECT gone_since_ms FROM workers").fetchall() == [(T0,)]
    db.apply([(machine_op(2), 4, T0 + 4000)], FEED, T0 + 4000)  # its row, last published
    assert gone(db)["mad-1~M2"] == T0
    # it beats again: back, with all its machines
    db.apply([(beat_op("mad-1"), 5, T0 + 5000)], FEED, T0 + 5000)
    assert set(gone(db).values()) == {None}


def test_a_worker_is_alive_only_in_the_heartbeat_that_names_it() -> None:
    db = ViewDB(":memory:")
    ops: list[tuple[Op, int, int]] = [
        (worker_op("mad-1"), 1, T0),
        (worker_op("mad-2", beat="mad-1"), 2, T0),
        (worker_op("mad-3", beat="mad-3"), 3, T0),  # its heartbeat never comes
        (beat_op("mad-1"), 4, T0 + 2000),  # names mad-1 only: mad-2 left the process
        (machine_op(1, "mad-2"), 5, T0),
    ]
    db.apply(ops, FEED, T0 + 2000)
    assert sorted(db.sweep(T0 + 3500)) == ["mad-2", "mad-3"]  # their rows' 3 s are over
    assert dict(db.db.execute("SELECT worker_id, gone_since_ms FROM workers")) == {
        "mad-1": None,
        "mad-2": T0,
        "mad-3": T0,
    }
    assert gone(db) == {"mad-2~M1": T0}


def test_apps_are_made_of_their_live_machines() -> None:
    db = ViewDB(":memory:")
    app = {"app": "shop", "gen": "3"}
    ops: list[tuple[Op, int, int]] = [
        (worker_op("mad-1"), 1, T0),
        (beat_op("mad-1", "mad-2"), 2, T0),
        (machine_op(1, role="primary", **app), 3, T0),
        (machine_op(2, "mad-2", state="reserved", role="spare", **app), 4, T0),
        (machine_op(3, state="destroyed", role="primary", **app), 5, T0),
        (machine_op(4), 6, T0),  # no app
    ]
    db.apply(ops, FEED, T0)
    row = db.db.execute("SELECT * FROM apps").fetchall()
    assert row == [("", "shop", 3, '["mad"]', 2, 1, 1, 1, 0)]  # mad-2: no row of its own
    # a build applies without them, then makes them once (and so would a view killed first)
    db.apply([(machine_op(5, role="primary", app="blog"), 7, T0)], FEED, T0, apps=False)
    assert db.get("apps_stale") == "1"
    assert [a for (a,) in db.db.execute("SELECT app FROM apps")] == ["shop"]
    ViewDB.refresh_apps(db)
    assert [a for (a,) in db.db.execute("SELECT app FROM apps ORDER BY 1")] == ["blog", "shop"]
    assert db.get("apps_stale") == "0"
    db.apply([(machine_op(5, state="destroyed", app="blog"), 8, T0)], FEED, T0)
    db.apply([(machine_op(1, state="destroyed", **app), 7, T0)], FEED, T0)
    db.apply([(machine_op(2, "mad-2", state="destroyed", **app), 8, T0)], FEED, T0)
    assert db.db.execute("SELECT count(*) FROM apps").fetchone() == (0,)


def test_a_batch_and_its_sequences_are_one_transaction(tmp_path: Path) -> None:
    path = tmp_path / "view.sqlite"
    db = ViewDB(path)
    db.apply([(machine_op(1), 7, T0), (beat_op("mad-1"), 9, T0)], {"seqs": {"f": 9}}, T0)
    with pytest.raises(ZeroDivisionError), db.transaction():
        db.put("seqs", {"f": 99})
        raise ZeroDivisionError  # a batch cut short: neither its rows nor its sequences
    db.close()
    again = ViewDB(path)  # what a view restarted after kill -9 finds
    assert again.seqs() == {"f": 9}
    assert again.db.execute("SELECT machine_id, seq FROM machines").fetchall() == [("mad-1~M1", 7)]
    assert set(again.beats) == {"mad-1"}  # its liveness state comes back too


def test_dropped_rows_are_counted_by_reason() -> None:
    db = ViewDB(":memory:")
    bad = READER.read(S.state_machine("_", "mad", "mad-1", "mad-1~M1"), b'{"type": "Machine"}')
    batch = db.apply([(bad, 1, T0), (READER.read("bourse.v1.state.x", b"{}"), 2, T0)], FEED, T0)
    assert (batch.applied, dict(batch.dropped)) == (0, {"malformed": 1, "unknown_subject": 1})
    assert db.counts() == {"malformed": 1, "unknown_subject": 1}


def test_destroyed_rows_older_than_the_retention_window_are_pruned() -> None:
    db = ViewDB(":memory:")
    db.apply([(machine_op(1, state="destroyed"), 1, T0), (machine_op(2), 2, T0)], FEED, T0)
    db.sweep(T0 + RETENTION_S * 1000)
    assert db.db.execute("SELECT count(*) FROM machines").fetchone() == (2,)
    db.sweep(T0 + RETENTION_S * 1000 + 1)
    assert [m for (m,) in db.db.execute("SELECT machine_id FROM machines")] == ["mad-1~M2"]
    db.wipe()
    assert db.db.execute("SELECT count(*) FROM machines").fetchone() == (0,)
    assert db.seqs() == {} and not db.workers and not db.beats


def test_a_damaged_view_is_made_anew(tmp_path: Path) -> None:
    """A view is a cache: a file that is no view's database (or a damaged one) is replaced,
    and the view then builds from sequence 1."""
    path = tmp_path / "view.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    db = ViewDB(path)
    assert db.seqs() == {} and db.db.execute("SELECT count(*) FROM machines").fetchone() == (0,)
