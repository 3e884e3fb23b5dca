"""What a worker's store holds, and how one change is written: the schema (the op log, the
machines table, the machines' run specs, the events' outbox), the change (:class:`Op`), an
outbox row (:class:`OutboxRow`), and :func:`apply`: one transaction of changes, the op log
and the machines table written together so that the two never disagree, each change's events
into the outbox with it (exactly-once publishing). Blocking SQLite calls: the store's writer
thread runs them (supplier/store.py)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import msgspec

from bourse.wire.messages import Event, Machine, now_ms

SCHEMA = """
CREATE TABLE IF NOT EXISTS oplog (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    worker_id  TEXT    NOT NULL,
    at_ms      INTEGER NOT NULL,
    op         TEXT    NOT NULL,
    order_id   TEXT    NOT NULL,
    machine_id TEXT    NOT NULL,
    state      TEXT    NOT NULL,
    detail     TEXT    NOT NULL DEFAULT '',
    machine    BLOB    NOT NULL
);
CREATE TABLE IF NOT EXISTS machines (
    machine_id    TEXT PRIMARY KEY,
    worker_id     TEXT    NOT NULL,
    order_id      TEXT    NOT NULL,
    state         TEXT    NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    machine       BLOB    NOT NULL
);
-- I3 on disk: at most one live machine per order id on a worker.
CREATE UNIQUE INDEX IF NOT EXISTS machines_live_order
    ON machines (worker_id, order_id) WHERE state != 'destroyed';
CREATE INDEX IF NOT EXISTS oplog_machine ON oplog (machine_id);
-- What a machine runs with beyond its record (RunSpec): its order's environment (values
-- may be secrets: they never travel). A row only for a machine with an environment;
-- removed when it is destroyed.
CREATE TABLE IF NOT EXISTS machine_specs (
    machine_id TEXT PRIMARY KEY,
    worker_id  TEXT NOT NULL,
    spec       BLOB NOT NULL
);
-- A worker's default port range, kept across its supplier's restarts (supplier/ports.py).
CREATE TABLE IF NOT EXISTS worker_ports (
    worker_id  TEXT PRIMARY KEY,
    port_range TEXT NOT NULL
);
-- The event outbox: each event of a committed change, written in the change's transaction,
-- deleted once JetStream acknowledged it (supplier/outbox.py EventOutbox). Its message id
-- for deduplication is "<worker_id>:<run>:<id>" (OutboxRow.msg_id): AUTOINCREMENT never
-- reuses an id in this file, and ``run`` (random, new each time the store is opened)
-- keeps a fresh or restored file's ids apart from every id another file published.
CREATE TABLE IF NOT EXISTS outbox (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    worker_id  TEXT    NOT NULL,
    region     TEXT    NOT NULL,
    kind       TEXT    NOT NULL,
    event      BLOB    NOT NULL,
    run        TEXT    NOT NULL DEFAULT ''
);
"""
# An outbox of a store made before ``run`` existed gets the column (its rows keep '': their
# message ids stay "<worker_id>:<id>", as they may have been published under them).
OUTBOX_RUN = "ALTER TABLE outbox ADD COLUMN run TEXT NOT NULL DEFAULT ''"

_enc = msgspec.json.Encoder()


class RunSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a machine runs with beyond its wire record: its order's environment (kept here
    only: its values may be secrets, they never travel back)."""

    env: dict[str, str] = {}


spec_decoder = msgspec.json.Decoder(RunSpec)


@dataclass(slots=True)
class Op:
    """One change: ``op`` names it (place, start, stop, destroy, ...); ``machine`` is the
    machine's full state after it."""

    op: str
    machine: Machine
    detail: str = ""
    # Events of this change: written to the outbox in the same transaction (exactly-once
    # publishing: a change is never durable without its events, nor an event without it).
    events: tuple[Event, ...] = ()
    # The machine's run spec, written with the change (None: unchanged); a destroyed
    # machine's is removed.
    spec: RunSpec | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One event waiting in the outbox: published with ``Nats-Msg-Id: msg_id``."""

    id: int
    worker_id: str
    region: str
    kind: str
    data: bytes
    run: str = ""  # the store opening that wrote it ("": a row of an older supplier)

    @property
    def msg_id(self) -> str:
        """Unique across data dirs: a fresh one restarts the row ids at 1."""
        if not self.run:
            return f"{self.worker_id}:{self.id}"
        return f"{self.worker_id}:{self.run}:{self.id}"


def apply(
    conn: sqlite3.Connection, ops: list[Op], run: str, forget: Sequence[int] = ()
) -> list[OutboxRow]:
    """One transaction: the ops (op log, machines, their events into the outbox, marked
    with the store's ``run``) and the deletes of acknowledged outbox rows; returns the
    outbox rows it wrote."""
    at = now_ms()
    rows: list[OutboxRow] = []
    conn.execute("BEGIN IMMEDIATE")
    try:
        if forget:
            conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in forget])
        for op in ops:
            m = op.machine
            blob = _enc.encode(m)
            conn.execute(
                "INSERT INTO oplog (worker_id, at_ms, op, order_id, machine_id, state, detail,"
                " machine) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (m.worker_id, at, op.op, m.order_id, m.machine_id, m.state, op.detail, blob),
            )
            conn.execute(
                "INSERT INTO machines (machine_id, worker_id, order_id, state, updated_at_ms,"
                " machine) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (machine_id) DO UPDATE SET"
                " state = excluded.state, updated_at_ms = excluded.updated_at_ms,"
                " machine = excluded.machine",
                (m.machine_id, m.worker_id, m.order_id, m.state, m.updated_at_ms, blob),
            )
            if op.spec is not None or m.state == "destroyed":
                write_spec(conn, m, op.spec or RunSpec())
            for e in op.events:
                data = _enc.encode(e)
                cur = conn.execute(
                    "INSERT INTO outbox (worker_id, region, kind, event, run)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (e.worker_id, e.region, e.kind, data, run),
                )
                rowid = cast(int, cur.lastrowid)
                rows.append(OutboxRow(rowid, e.worker_id, e.region, e.kind, data, run))
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
    return rows


def write_spec(conn: sqlite3.Connection, m: Machine, spec: RunSpec) -> None:
    if m.state == "destroyed" or spec == RunSpec():
        conn.execute("DELETE FROM machine_specs WHERE machine_id = ?", (m.machine_id,))
        return
    conn.execute(
        "INSERT INTO machine_specs (machine_id, worker_id, spec) VALUES (?, ?, ?)"
        " ON CONFLICT (machine_id) DO UPDATE SET spec = excluded.spec",
        (m.machine_id, m.worker_id, _enc.encode(spec)),
    )


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back if a transaction is still open: SQLite ends some on its own (a full disk),
    and a second ROLLBACK would hide the real error behind "no transaction is active"."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")
