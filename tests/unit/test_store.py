"""Durable worker state (supplier/store.py): op log, machines table, group commit, I3."""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from bourse.wire.messages import Check, Event, Machine, MachineState, Resources
from supplier.oplog import Op
from supplier.store import Store, StoreError


def machine(
    order_id: str,
    n: int = 0,
    state: MachineState = "reserved",
    worker_id: str = "mad-1",
) -> Machine:
    return Machine(
        machine_id=f"{worker_id}~M{n:04d}{order_id.replace('-', '')}",
        order_id=order_id,
        worker_id=worker_id,
        region="mad",
        state=state,
        resources=Resources(cpus=2, memory_mb=2048),
        image="web",
        metadata={"n": str(n)},
        score=0.5,
        created_at_ms=1000 + n,
        updated_at_ms=1000 + n,
    )


def moved(m: Machine, state: MachineState) -> Machine:
    return msgspec.structs.replace(m, state=state, updated_at_ms=m.updated_at_ms + 1)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "data" / "supplier.db"


@pytest.fixture
def store(db: Path) -> Iterator[Store]:
    s = Store(db)
    try:
        yield s
    finally:
        s.close()


class WriterBlocked:
    """Holds the database's write lock from another connection, so the store's writer thread
    waits (busy_timeout) and every write queued meanwhile lands in at most two groups."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("BEGIN IMMEDIATE")

    async def release(self) -> None:
        self.conn.execute("COMMIT")
        self.conn.close()


async def write_all_while_blocked(store: Store, db: Path, writes: list[tuple[Op, ...]]) -> list:
    """Queue every write while the writer is blocked, then unblock; results in order."""
    lock = WriterBlocked(db)
    tasks = [asyncio.ensure_future(store.write(*ops)) for ops in writes]
    # Tasks run in creation order: every write is queued before the lock is released.
    unblock = asyncio.ensure_future(lock.release())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await unblock
    return results


# -- write and read back -----------------------------------------------------------------------


def test_store_creates_its_directory(db: Path, store: Store) -> None:
    assert db.parent.is_dir()
    assert db.is_file()
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()


async def test_write_then_load(store: Store) -> None:
    m = machine("order-1")
    await store.write(Op("place", m))
    assert store.load_machines("mad-1") == [m]
    assert store.load_machines("mad-2") == []


async def test_a_machine_stored_with_a_control_character_in_a_check_path_still_loads(
    store: Store,
) -> None:
    """Stored before the wire refused them (the CR LF that injected a header into the
    probe): each is percent-encoded as the machine loads, so its supplier starts."""
    check = Check(port="web", kind="http", path="/healthz\r\nX-Injected: 1\x85")
    m = msgspec.structs.replace(machine("order-1"), checks=[check])
    await store.write(Op("place", m))  # as an older supplier took it (nothing refused it)
    [loaded] = store.load_machines("mad-1")
    encoded = msgspec.structs.replace(check, path="/healthz%0D%0AX-Injected: 1%C2%85")
    assert loaded == msgspec.structs.replace(m, checks=[encoded])


async def test_load_returns_latest_state(store: Store) -> None:
    m = machine("order-1")
    await store.write(Op("place", m))
    started = moved(m, "started")
    await store.write(Op("start", started))
    assert store.load_machines("mad-1") == [started]


async def test_load_filters_by_worker_and_sorts_by_machine_id(store: Store) -> None:
    b = machine("order-b", 2)
    a = machine("order-a", 1)
    other = machine("order-c", 3, worker_id="mad-2")
    await store.write(Op("place", b), Op("place", other), Op("place", a))
    assert store.load_machines("mad-1") == [a, b]
    assert store.load_machines("mad-2") == [other]


async def test_oplog_records_ops_in_order(store: Store) -> None:
    m = machine("order-1")
    await store.write(Op("place", m))
    await store.write(Op("start", moved(m, "started")))
    await store.write(Op("stop", moved(m, "stopped")), Op("destroy", moved(m, "destroyed")))
    other = machine("order-9", 9, worker_id="mad-2")
    await store.write(Op("place", other))
    mid = m.machine_id
    assert store.oplog("mad-1") == [
        (1, "place", "order-1", mid, "reserved"),
        (2, "start", "order-1", mid, "started"),
        (3, "stop", "order-1", mid, "stopped"),
        (4, "destroy", "order-1", mid, "destroyed"),
    ]
    assert store.oplog() == [
        *store.oplog("mad-1"),
        (5, "place", "order-9", other.machine_id, "reserved"),
    ]
    assert store.load_machines("mad-1") == [moved(m, "destroyed")]
    assert store.writes == 4  # write() calls, not the 5 ops they carried
    assert store.batches == 4


async def test_a_queued_write_is_not_waited_for_and_lands_before_a_later_one(store: Store) -> None:
    """A start's record is queued while its machine starts (supplier/machines/keeper.py):
    a write awaited after it is applied after it, and its future says when it is durable."""
    m = machine("order-1")
    queued = store.queue(Op("start", moved(m, "starting")))
    await store.write(Op("start", moved(m, "started")))
    assert queued.done() and queued.exception() is None  # before the later write returned
    assert [row[4] for row in store.oplog("mad-1")] == ["starting", "started"]
    assert store.load_machines("mad-1") == [moved(m, "started")]


async def test_oplog_keeps_detail(db: Path, store: Store) -> None:
    m = machine("order-1")
    await store.write(Op("abort", moved(m, "destroyed"), "the auction gave up"))
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT op, detail FROM oplog").fetchall()
    finally:
        conn.close()
    assert rows == [("abort", "the auction gave up")]


async def test_restart_sees_the_data(db: Path) -> None:
    first = Store(db)
    try:
        m = machine("order-1")
        await first.write(Op("place", m))
        await first.write(Op("start", moved(m, "started")))
    finally:
        first.close()
    second = Store(db)
    try:
        assert second.load_machines("mad-1") == [moved(m, "started")]
        assert [row[1] for row in second.oplog("mad-1")] == ["place", "start"]
        # and it keeps appending after the old log
        await second.write(Op("stop", moved(m, "stopped")))
        assert [row[0] for row in second.oplog()] == [1, 2, 3]
    finally:
        second.close()


def _event(order_id: str) -> Event:
    return Event(kind="placed", region="mad", worker_id="mad-1", at_ms=1, order_id=order_id)


async def _pending_ids(db: Path, *order_ids: str) -> list[str]:
    """Write one placed event per order id into a store at ``db``, reopen it, and return the
    message ids of what it has pending."""
    s = Store(db)
    try:
        for n, oid in enumerate(order_ids):
            await s.write(Op("place", machine(oid, n), events=(_event(oid),)))
    finally:
        s.close()
    again = Store(db)
    try:
        return [row.msg_id for row in again.pending_events()]
    finally:
        again.close()


async def test_event_message_ids_differ_across_data_dirs_and_last_across_restarts(
    tmp_path: Path,
) -> None:
    first = await _pending_ids(tmp_path / "a" / "supplier.db", "o-1", "o-2")
    fresh = await _pending_ids(tmp_path / "b" / "supplier.db", "o-3")
    assert first[0].startswith("mad-1:") and first[0].endswith(":1")
    assert fresh[0].endswith(":1") and fresh[0] != first[0]  # the same row id, another file
    # reopened, the file's pending rows keep the ids they may have been published under
    assert await _pending_ids(tmp_path / "a" / "supplier.db") == first


async def test_an_outbox_of_an_older_store_gains_run_and_keeps_its_ids(db: Path) -> None:
    db.parent.mkdir(parents=True)
    conn = sqlite3.connect(db)
    conn.executescript(
        "CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, worker_id TEXT NOT NULL,"
        " region TEXT NOT NULL, kind TEXT NOT NULL, event BLOB NOT NULL);"
        "INSERT INTO outbox (worker_id, region, kind, event) VALUES ('mad-1', 'mad', 'placed',"
        " x'7b7d');"
    )
    conn.close()
    old, new = await _pending_ids(db, "o-2")
    assert old == "mad-1:1"  # as it may have been published already
    assert re.fullmatch(r"mad-1:[0-9a-f]{12}:2", new)


def test_close_is_idempotent(db: Path) -> None:
    s = Store(db)
    s.close()
    s.close()
    assert not s._thread.is_alive()


def test_cannot_open_a_directory_as_database(tmp_path: Path) -> None:
    target = tmp_path / "is-a-dir"
    target.mkdir()
    with pytest.raises(StoreError) as info:
        Store(target)
    assert str(info.value).startswith(f"cannot open {target}: ")


# -- I3 on disk: one live machine per (worker_id, order_id) ------------------------------------


async def test_unique_index_refuses_second_live_machine(store: Store) -> None:
    first = machine("order-1", 1)
    await store.write(Op("place", first))
    with pytest.raises(StoreError) as info:
        await store.write(Op("place", machine("order-1", 2)))
    assert "UNIQUE constraint failed: machines.worker_id, machines.order_id" in str(info.value)
    assert str(info.value).startswith(f"write to {store.path} failed: ")
    assert store.load_machines("mad-1") == [first]
    assert [row[1:3] for row in store.oplog()] == [("place", "order-1")]  # rolled back


async def test_same_order_on_another_worker_is_fine(store: Store) -> None:
    await store.write(Op("place", machine("order-1", 1)))
    await store.write(Op("place", machine("order-1", 2, worker_id="mad-2")))
    assert len(store.load_machines("mad-1")) == 1
    assert len(store.load_machines("mad-2")) == 1


async def test_duplicate_in_a_group_spoils_no_other_write(db: Path, store: Store) -> None:
    first = machine("order-1", 1)
    await store.write(Op("place", first))
    before = store.batches
    a, b = machine("order-a", 2), machine("order-b", 3)
    dup = machine("order-1", 4)
    c, d = machine("order-c", 5), machine("order-d", 6)
    results = await write_all_while_blocked(
        store,
        db,
        [
            (Op("place", a),),
            (Op("place", b),),
            (Op("place", dup),),
            (Op("place", c), Op("place", d)),
        ],
    )
    assert results[:2] == [None, None]
    assert isinstance(results[2], StoreError)
    assert "UNIQUE constraint failed" in str(results[2])
    assert results[3] is None
    assert store.load_machines("mad-1") == sorted([first, a, b, c, d], key=lambda m: m.machine_id)
    assert sorted(row[2] for row in store.oplog()) == [
        "order-1",
        "order-a",
        "order-b",
        "order-c",
        "order-d",
    ]
    # Whatever the split into (at most two) groups, the duplicate shared its group with another
    # write, whose success above shows the failed group was retried item by item. Successful
    # transactions: [a b dup cd] or [a b dup][cd] or [a][b dup cd] -> 3; [a b][dup cd] -> 2.
    assert store.batches - before in (2, 3)


async def test_destroyed_machine_frees_the_order(store: Store) -> None:
    first = machine("order-1", 1)
    await store.write(Op("place", first))
    await store.write(Op("destroy", moved(first, "destroyed")))
    second = machine("order-1", 2)
    await store.write(Op("place", second))
    assert store.load_machines("mad-1") == [moved(first, "destroyed"), second]
    # ...but only one live machine again
    with pytest.raises(StoreError):
        await store.write(Op("place", machine("order-1", 3)))


async def test_one_write_with_two_ops_is_atomic(store: Store) -> None:
    # Both ops in one write() are one item: a conflict inside it rolls back both.
    ok = machine("order-2", 2)
    with pytest.raises(StoreError):
        await store.write(
            Op("place", ok), Op("place", machine("order-x", 3)), Op("place", machine("order-x", 4))
        )
    assert store.load_machines("mad-1") == []
    assert store.oplog() == []


# -- group commit ------------------------------------------------------------------------------


async def test_concurrent_writes_are_grouped(db: Path, store: Store) -> None:
    n = 50
    ms = [machine(f"order-{i}", i) for i in range(n)]
    results = await write_all_while_blocked(store, db, [(Op("place", m),) for m in ms])
    assert results == [None] * n
    assert store.writes == n
    assert 1 <= store.batches <= 2 < n
    assert len(store.load_machines("mad-1")) == n
    assert len(store.oplog()) == n


async def test_many_concurrent_writes_all_resolve(store: Store) -> None:
    n = 200
    ms = [machine(f"order-{i}", i) for i in range(n)]
    await asyncio.gather(*(store.write(Op("place", m)) for m in ms))
    assert store.writes == n
    assert store.batches < n  # fsync takes long enough for the queue to fill
    assert store.load_machines("mad-1") == sorted(ms, key=lambda m: m.machine_id)
    seqs = [row[0] for row in store.oplog()]
    assert seqs == list(range(1, n + 1))


async def test_write_after_close_raises(db: Path) -> None:
    s = Store(db)
    s.close()
    # The timeout only turns the hang into a failure; a correct store raises at once.
    with pytest.raises(StoreError):
        await asyncio.wait_for(s.write(Op("place", machine("order-1"))), timeout=0.5)


# -- health: a full or vanished file ---------------------------------------------------------
def _fill(db: Path, mb: int) -> None:
    """Another writer takes the room up to the cap (as a full disk would)."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("CREATE TABLE filler (data BLOB)")
    conn.execute("INSERT INTO filler VALUES (zeroblob(?))", (mb * 1024 * 1024,))
    conn.close()


async def test_full_store_fails_the_write_and_reports_it(db: Path) -> None:
    s = Store(db, max_db_mb=1)
    try:
        await s.write(Op("place", machine("o-1", 1)))
        assert s.failure == "" and await s.probe()
        await asyncio.to_thread(_fill, db, 1)
        stored = 1
        with pytest.raises(StoreError, match="database or disk is full"):
            for n in range(2, 200):  # free pages left by the probe take a few first
                await s.write(Op("place", machine(f"o-{n}", n)))
                stored += 1
        assert "full" in s.failure
        assert not await s.probe()  # still full: the probe needs fresh room
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("DROP TABLE filler")
        conn.close()
        assert await s.probe() and s.failure == ""
        await s.write(Op("place", machine("o-last", 999)))  # and writes work again
        assert len(s.load_machines("mad-1")) == stored + 1
    finally:
        s.close()


async def test_write_after_the_file_vanished_is_refused(db: Path, store: Store) -> None:
    """SQLite would write on into the unlinked file (lost on restart): refuse instead."""
    await store.write(Op("place", machine("o-1", 1)))
    for f in db.parent.glob("supplier.db*"):
        f.unlink()
    with pytest.raises(StoreError, match="removed or replaced"):
        await store.write(Op("place", machine("o-2", 2)))
    assert "removed or replaced" in store.failure
    assert not await store.probe()


def test_a_cap_below_one_mib_is_refused(db: Path) -> None:
    with pytest.raises(StoreError, match="max_db_mb must be at least 1"):
        Store(db, max_db_mb=0)


@pytest.mark.timeout(5)  # a linger would show as a 10 s stall, past this
async def test_an_idle_store_writes_each_lone_write_at_once(db: Path) -> None:
    s = Store(db, linger_ms=10_000)
    try:
        for i in range(5):
            await s.write(Op("place", machine(f"order-{i}", i)))
        assert (s.writes, s.batches) == (5, 5)
    finally:
        s.close()


async def test_a_busy_store_lingers_to_share_an_fsync(db: Path) -> None:
    s = Store(db, linger_ms=200)
    try:
        ms = [machine(f"order-{i}", i) for i in range(12)]
        # two at once: the writer sees load, so the next group waits for company
        await write_all_while_blocked(s, db, [(Op("place", m),) for m in ms[:2]])
        before = s.batches
        pending = []
        for m in ms[2:]:  # a trickle: one write every ~2 ms, each alone in the queue
            pending.append(asyncio.ensure_future(s.write(Op("place", m))))
            await asyncio.sleep(0.002)  # the arrival pace is the load under test, not a sync
        await asyncio.gather(*pending)
        assert s.batches - before <= 3  # without the linger: ~10 groups of one
        assert len(s.load_machines("mad-1")) == 12
    finally:
        s.close()
