"""A view's tables (bourse/view/db.py), fed rows as the stream would: machines with their
worker's liveness (alive while its heartbeat or its row is fresh, gone since the last of
them after 3 s, back when it beats again), the apps they make up, a batch and its
sequences in one transaction (what a resume starts from), old destroyed rows pruned; when
what it holds cannot be resumed from (the stream made again: another epoch)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest

from bourse.nats.state import RETENTION_S
from bourse.view.db import SCHEMA_VERSION, ViewDB
from bourse.view.rows import Op, Reader
from bourse.wire.codec import encode
from bourse.wire.messages import Amount, Heartbeat, Machine, Resources, StateEpoch, WorkerRow
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


def epoch_op(epoch: str) -> Op:
    return READER.read(S.state_epoch, encode(StateEpoch(epoch=epoch)))


E1, E2 = "01KBX2W7Q4M1S8YV3D5N0RZ6TC", "01KBX2XA0G5C7M3Q9T2V8W4YHB"
STREAM = "BOURSE_STATE"


def built(epoch: str | None) -> ViewDB:
    """A view that applied a batch at T0 (with the stream's epoch ``epoch``, if any)."""
    db = ViewDB(":memory:")
    for key, value in (("schema", str(SCHEMA_VERSION)), ("stream", STREAM), ("tenant", "")):
        db.put(key, value)
    ops = [(worker_op("mad-1"), 2, T0)] + ([(epoch_op(epoch), 1, T0)] if epoch else [])
    db.apply(ops, {**FEED, "seqs": {"f": 2}, "synced_ms": str(T0)}, T0)
    return db


@pytest.mark.parametrize(
    ("view_epoch", "stream_epoch", "made_again"),
    [
        (E1, E1, False),  # the same stream
        (E1, None, False),  # purged: no epoch, not made again (the suppliers send again)
        (E1, E2, True),  # made again: its sequences start over, its epoch is another
        (None, E2, True),  # built while it had none, one written since: not known the same
        (None, None, False),
    ],
)
def test_a_stream_made_again_is_told_by_its_epoch(
    view_epoch: str | None, stream_epoch: str | None, made_again: bool
) -> None:
    db = built(view_epoch)
    assert db.get("epoch") == (view_epoch or "")
    why = db.stale(STREAM, "", stream_epoch, T0 + 1000)
    assert why.startswith("the stream was made again") == made_again, why


def test_what_else_a_view_cannot_resume_from() -> None:
    assert ViewDB(":memory:").stale(STREAM, "", E2, T0) == ""  # nothing applied: a build anyway
    db = built(E1)
    assert db.stale(STREAM, "", E1, T0 + RETENTION_S * 1000) == ""
    assert db.stale(STREAM, "", E1, T0 + RETENTION_S * 1000 + 1000).startswith("away 3601 s")
    assert db.stale("OTHER_STATE", "", E1, T0) == "another market or tenant"
    assert db.stale(STREAM, "alice", E1, T0) == "another market or tenant"
    db.put("schema", "0")  # a view of other tables
    assert db.stale(STREAM, "", E1, T0) == f"schema 0, now {SCHEMA_VERSION}"


def test_an_epoch_that_comes_while_following_is_kept() -> None:
    """A view following the stream when its maker writes an epoch (after a purge) saw it
    come: it keeps it, and resumes later without a rebuild."""
    db = built(None)
    batch = db.apply([(epoch_op(E2), 3, T0)], {"seqs": {"f": 3}}, T0)
    assert batch.applied == 1 and not batch.dropped
    assert db.stale(STREAM, "", E2, T0) == ""
    db.wipe()
    assert db.get("epoch") == ""  # a rebuild reads it again from sequence 1


def test_a_view_of_older_tables_is_rebuilt_with_these(tmp_path: Path) -> None:
    """A view written before the workers' isolation column: resumed from it cannot be (its
    schema), and the rebuild makes the tables again, that column included."""
    path = tmp_path / "view.sqlite"
    old = built(E1)
    old.db.execute("VACUUM INTO ?", (str(path),))
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE workers DROP COLUMN isolation")
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")
    db = ViewDB(path)
    assert db.stale(STREAM, "", E1, T0).startswith("schema 1, now")
    db.wipe()
    w = WorkerRow(
        worker_id="mad-1", region="mad", beat="mad-1", capacity=Amount(), free=Amount(),
        isolation="users,network",
    )  # fmt: skip
    db.apply([(READER.read(S.state_worker("mad", "mad-1"), encode(w)), 1, T0)], FEED, T0)
    assert db.db.execute("SELECT isolation FROM workers").fetchall() == [("users,network",)]
    assert db.get("schema") == str(SCHEMA_VERSION) and db.seqs() == FEED["seqs"]


def test_a_listings_json_is_its_rows_as_the_stream_holds_them_in_listing_order() -> None:
    """``machines list --json`` from the view (bourse/view/reads.py write_machines_json):
    the rows as published, written as read (in chunks: more rows than one), in the order and
    with the filters of reads.machines, and the workers gone among them; a filter by label
    needs the rows decoded."""
    from bourse.view import reads

    def written(f: reads.MachineFilter) -> tuple[bytes, dict[str, int]]:
        out = bytearray()
        gone = reads.write_machines_json(db.db, f, out.extend)
        return bytes(out), gone

    db = ViewDB(":memory:")
    ops: list[tuple[Op, int, int]] = [
        (worker_op("mad-1"), 1, T0),
        (worker_op("mad-2", beat="mad-2"), 2, T0),
        (beat_op("mad-1"), 3, T0),
        (machine_op(2, "mad-2", app="shop"), 4, T0),
        (machine_op(1, "mad-1", app="shop"), 5, T0),
        (machine_op(3, "mad-1", state="destroyed"), 6, T0),
    ]
    db.apply(ops, FEED, T0)
    db.sweep(T0 + 1000)
    db.apply([(beat_op("mad-1"), 7, T0 + 3500)], FEED, T0 + 3500)
    assert db.sweep(T0 + 3500) == ["mad-2"]  # its heartbeat never came
    every = reads.MachineFilter()
    listed, gone_workers = written(every)
    assert [m["machine_id"] for m in msgspec.json.decode(listed)] == ["mad-1~M1", "mad-2~M2"]
    assert listed == msgspec.json.encode([s.json for s in reads.machines(db.db, every)])
    assert gone_workers == {"mad-2": T0}
    destroyed = reads.MachineFilter(states=("destroyed",))
    assert [m["machine_id"] for m in msgspec.json.decode(written(destroyed)[0])] == ["mad-1~M3"]
    assert written(reads.MachineFilter(regions=("fra",))) == (b"[]", {})
    with pytest.raises(ValueError):
        written(reads.MachineFilter(labels=(("app", "shop"),)))
    many = 2 * reads.CHUNK + 1
    db.apply([(machine_op(10 + i, "mad-1"), 8 + i, T0 + 3500) for i in range(many)], FEED, T0)
    listed, _ = written(every)
    assert listed == msgspec.json.encode([s.json for s in reads.machines(db.db, every)])
    assert len(msgspec.json.decode(listed)) == many + 2


def test_a_view_caught_up_a_moment_ago_is_read_as_it_stands(tmp_path: Path) -> None:
    """bourse/view/stored.py: a view caught up at most FRESH_MS ago (its ``synced_ms``) is
    read as it stands, in one read transaction, with how old it is; older, of another
    schema, never caught up or not there: None (it must be caught up first)."""
    from bourse.view.stored import FRESH_MS, Freshness, open_stored

    path = tmp_path / "view.sqlite"
    with open_stored(path, T0) as none:
        assert none is None  # no view yet (and none made by looking)
    assert not path.exists()
    db = ViewDB(path)
    db.apply([(worker_op("mad-1"), 1, T0), (machine_op(1), 7, T0)], FEED, T0)
    with open_stored(path, T0) as never:
        assert never is None  # applied, never caught up
    db.put("synced_ms", str(T0))
    db.put("schema", str(SCHEMA_VERSION))  # as a View says it
    with open_stored(path, T0 + FRESH_MS) as stored:
        assert stored is not None and stored.freshness == Freshness(0, FRESH_MS)
        # caught up again meanwhile: the transaction still reads what it began with
        db.apply([(machine_op(2), 8, T0)], FEED | {"seqs": {"bourse.v1.state.>": 8}}, T0)
        assert stored.db.execute("SELECT count(*) FROM machines").fetchone() == (1,)
    with open_stored(path, T0 + FRESH_MS) as stored:
        assert stored is not None and stored.freshness.seq == 8
        assert stored.db.execute("SELECT count(*) FROM machines").fetchone() == (2,)
        with pytest.raises(sqlite3.OperationalError):  # read-only
            stored.db.execute("DELETE FROM machines")
    with open_stored(path, T0 + FRESH_MS + 1) as old:
        assert old is None
    with open_stored(path, T0 - 1) as ahead:  # a clock gone back: not trusted
        assert ahead is None
    db.put("schema", "0")
    with open_stored(path, T0) as other:
        assert other is None
    db.close()
