"""Durable worker state: an append-only op log plus the materialized machines table.

One SQLite file per supplier process (``<data_dir>/supplier.db``), WAL mode,
``synchronous=FULL``; rows carry the worker id, so many virtual workers in one process
share a file. Every change is one transaction that appends to ``oplog`` and upserts
``machines`` together, so the two never disagree.

Writes go through one writer thread with group commit: whatever is queued when the
thread wakes is written in one transaction and fsynced once, then every waiter is told.
Under load (the last group had several writes, or more came while it was written) the
thread lingers up to ``linger_ms`` for more before it writes: an fsync costs ~100 us of CPU
here whatever it carries, so this trades a fraction of a millisecond of latency, only
when busy, for fewer fsyncs. A lone write on an idle store never waits.
``await store.write(...)`` returns only after the data is durable, so a ``Placed`` reply
sent after it survives kill -9 (I2). The event loop never blocks on the disk.

Health: a write that fails (disk full, read-only or moved file, I/O error) sets
``store.failure``, and only a probe clears it (a lone write that fits in a free page proves
little): the host then drains its workers (no offers for capacity it could not commit) and
calls ``probe()`` until a test transaction that needs fresh space succeeds again; then it
lifts the drain and records what its machines did meanwhile. ``max_db_mb`` caps the file
(``PRAGMA max_page_count``): past it SQLite reports "database or disk is full", the same
path as a full disk.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import msgspec
import structlog

from bourse.errors import BourseError
from bourse.wire.limits import CONTROL_CHARACTERS
from bourse.wire.messages import Machine
from supplier.oplog import (
    OUTBOX_RUN,
    SCHEMA,
    Op,
    OutboxRow,
    RunSpec,
    apply,
    rollback,
    spec_decoder,
)

log = structlog.get_logger("bourse.store")

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Machine)
_CONTROL = re.compile(f"[{CONTROL_CHARACTERS}]")


def _machine(raw: bytes) -> Machine:
    """A stored machine. One stored before the wire refused control characters in a check's
    path (a CR LF that injected a header into the probe) loads with each of them
    percent-encoded: its check probes that path, and the supplier starts."""
    try:
        return _dec.decode(raw)
    except msgspec.ValidationError:
        data = msgspec.json.decode(raw)
        for check in data.get("checks") or ():
            path = check.get("path") if isinstance(check, dict) else None
            if isinstance(path, str):
                check["path"] = _CONTROL.sub(lambda c: quote(c.group(), safe=""), path)
        return msgspec.convert(data, Machine)


_STOP = object()
_PROBE = object()
_FORGET = object()  # queued as (_FORGET, ids): outbox rows acknowledged, to delete
# A queued write (or probe): its ops (or _PROBE), its future, the loop that awaits it.
# (Any: a tuple of Ops or the _PROBE sentinel, told apart by identity, not by type.)
_Queued = tuple[Any, "asyncio.Future[None]", asyncio.AbstractEventLoop]
# The probe writes (then deletes) this much, so it needs fresh pages or WAL space: a store
# that is full again fails it instead of passing on a tiny in-place update.
PROBE_BYTES = 64 * 1024
DEFAULT_LINGER_MS = 0.5
MAX_GROUP = 1024


class StoreError(BourseError, RuntimeError):
    """The data dir cannot take writes (disk full, read-only, corrupt file)."""


# Told (on the writer's event loop, before the writes' waiters) the outbox rows a group
# commit made durable, in id order.
CommittedFn = Callable[[list[OutboxRow]], None]


class Store:
    # Told each group commit's duration in seconds (from the writer thread): metrics.
    on_commit: Callable[[float], None] | None = None

    def __init__(
        self,
        path: str | Path,
        max_db_mb: int | None = None,
        linger_ms: float = DEFAULT_LINGER_MS,
    ) -> None:
        if max_db_mb is not None and max_db_mb < 1:
            raise StoreError(f"max_db_mb must be at least 1, got {max_db_mb}")
        self.linger_s = max(0.0, linger_ms) / 1000.0
        self.path = Path(path)
        self.max_db_mb = max_db_mb
        # Why the last write failed ("" while healthy); set by the writer thread.
        self.failure = ""
        # This opening's name in the message ids of the events it writes (OutboxRow.msg_id).
        self.run = secrets.token_hex(6)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._connect() as conn:
                conn.executescript(SCHEMA)
                if "run" not in {c[1] for c in conn.execute("PRAGMA table_info(outbox)")}:
                    conn.execute(OUTBOX_RUN)
            st = os.stat(self.path)
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from None
        # The file we write to: if the path stops naming it (the data dir was deleted, a
        # mount went away), writes would land in an unlinked file and vanish on restart.
        self._identity = (st.st_dev, st.st_ino)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._writer, name=f"store:{self.path}", daemon=True)
        self._thread.start()
        self.batches = 0
        self.writes = 0  # write() calls stored (each may carry several ops)
        self._closed = False
        # The event outbox's listener (the host's EventOutbox.committed); None: rows only wait.
        self.on_events: CommittedFn | None = None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=5000")
        if self.max_db_mb is not None:
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {self.max_db_mb * 1024 * 1024 // page}")
        return conn

    # -- reads (start-up and tests) ------------------------------------------------------------
    def load_machines(self, worker_id: str) -> list[Machine]:
        """The materialized state of one worker, for recovery after a restart."""
        conn = self._connect()
        try:
            rows = conn.execute(
                "SELECT machine FROM machines WHERE worker_id = ? ORDER BY machine_id", (worker_id,)
            ).fetchall()
        finally:
            conn.close()
        return [_machine(r[0]) for r in rows]

    def load_specs(self, worker_id: str) -> dict[str, RunSpec]:
        """Machine id -> run spec, of one worker's machines that have one."""
        conn = self._connect()
        try:
            rows = conn.execute(
                "SELECT machine_id, spec FROM machine_specs WHERE worker_id = ?", (worker_id,)
            ).fetchall()
        finally:
            conn.close()
        return {r[0]: spec_decoder.decode(r[1]) for r in rows}

    def kept_port_ranges(self) -> dict[str, str]:
        """Worker id -> the default port range it had (supplier/ports.py)."""
        conn = self._connect()
        try:
            return dict(conn.execute("SELECT worker_id, port_range FROM worker_ports").fetchall())
        finally:
            conn.close()

    def keep_port_ranges(self, ranges: dict[str, str]) -> None:
        """Remember workers' default port ranges (at start, before the workers serve)."""
        if not ranges:
            return
        conn = self._connect()
        try:
            conn.executemany(
                "INSERT INTO worker_ports (worker_id, port_range) VALUES (?, ?) ON CONFLICT"
                " (worker_id) DO UPDATE SET port_range = excluded.port_range",
                list(ranges.items()),
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write {self.path}: {exc}") from None
        finally:
            conn.close()

    def oplog(self, worker_id: str | None = None) -> list[tuple[int, str, str, str, str]]:
        """(seq, op, order_id, machine_id, state) rows, oldest first."""
        conn = self._connect()
        try:
            sql = "SELECT seq, op, order_id, machine_id, state FROM oplog"
            args: tuple[str, ...] = ()
            if worker_id:
                sql += " WHERE worker_id = ?"
                args = (worker_id,)
            return conn.execute(sql + " ORDER BY seq", args).fetchall()
        finally:
            conn.close()

    def pending_events(self) -> list[OutboxRow]:
        """The outbox rows not yet acknowledged (start-up: publish them again), oldest first."""
        conn = self._connect()
        try:
            rows = conn.execute(
                "SELECT id, worker_id, region, kind, event, run FROM outbox ORDER BY id"
            ).fetchall()
        finally:
            conn.close()
        return [OutboxRow(*r) for r in rows]

    # -- writes ----------------------------------------------------------------------------------
    async def write(self, *ops: Op) -> None:
        """Append ``ops`` in one transaction; returns once it is durable. Raises StoreError."""
        await self.queue(*ops)

    def queue(self, *ops: Op) -> asyncio.Future[None]:
        """Append ``ops`` in one transaction, as :meth:`write`, without waiting: the future
        is done once they are durable (StoreError when they could not be written). Writes
        are applied in the order they were queued."""
        if self._closed:
            raise StoreError(f"store {self.path} is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._queue.put((ops, fut, loop))
        return fut

    def forget_events(self, ids: list[int]) -> None:
        """Delete acknowledged outbox rows, in the writer's next transaction; no wait: a
        delete lost to a crash only republishes an event the stream then drops as a
        duplicate (its ``Nats-Msg-Id`` is the same)."""
        if ids and not self._closed:
            self._queue.put((_FORGET, ids))

    async def probe(self) -> bool:
        """Can the store take writes again? One transaction that needs fresh space, rolled
        into the writer's queue like any write; clears ``failure`` when it succeeds."""
        if self._closed:
            return False
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._queue.put((_PROBE, fut, loop))
        try:
            await fut
        except StoreError:
            return False
        return True

    def _writer(self) -> None:
        try:
            conn = self._connect()
        except sqlite3.Error as exc:
            log.error("store_open_failed", path=str(self.path), error=str(exc))
            conn = None
        busy = False
        while True:
            first = self._queue.get()
            if first is _STOP:
                break
            batch = [cast(_Queued, first)]
            stop = False
            until = time.monotonic() + self.linger_s if busy else 0.0
            while len(batch) < MAX_GROUP:
                try:
                    wait = until - time.monotonic()
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(cast(_Queued, item))
            forget = [i for item in batch if item[0] is _FORGET for i in item[1]]
            if forget:
                batch = [item for item in batch if item[0] is not _FORGET]
            probes = [item for item in batch if item[0] is _PROBE]
            if probes:
                batch = [item for item in batch if item[0] is not _PROBE]
                self._probe(conn, probes)
            if batch:
                more = self._write_batch(conn, batch, forget)
            else:
                if forget:
                    self._forget(conn, forget)
                more = not self._queue.empty()
            if stop:
                break
            busy = len(batch) > 1 or more
        if conn is not None:
            conn.close()
        # Writes that raced with close(): tell their waiters instead of leaving them hanging.
        closed = StoreError(f"store {self.path} is closed")
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP and cast(tuple[object, ...], item)[0] is not _FORGET:
                _, fut, loop = cast(_Queued, item)
                loop.call_soon_threadsafe(_resolve, fut, closed)

    def _write_batch(
        self, conn: sqlite3.Connection | None, batch: list[_Queued], forget: Sequence[int] = ()
    ) -> bool:
        """Write one group and tell its waiters; whether more was queued meanwhile, looked
        at before they are told (a write one of them queues at once is no company)."""
        try:
            if conn is None:
                raise sqlite3.OperationalError("database could not be opened")
            self._check_identity()
            t0 = time.perf_counter()
            rows = apply(conn, [op for ops, _, _ in batch for op in ops], self.run, forget)
            if self.on_commit is not None:  # metrics: the transaction and its fsync
                self.on_commit(time.perf_counter() - t0)
            self.batches += 1
            self.writes += len(batch)
            if rows and self.on_events is not None:
                # before the waiters: an event is queued before the reply that announces it
                batch[0][2].call_soon_threadsafe(self.on_events, rows)
            more = not self._queue.empty()
            for _, fut, loop in batch:
                loop.call_soon_threadsafe(_resolve, fut, None)
            return more
        except sqlite3.Error as exc:
            # A failed group: retry each change alone so one bad change spoils no other.
            if len(batch) > 1 and conn is not None:
                for item in batch:
                    self._write_batch(conn, [item])
                self._forget(conn, forget)
                return True  # several writes: busy whatever came meanwhile
            err = StoreError(f"write to {self.path} failed: {exc}")
            if _is_storage_fault(exc):
                self.failure = str(exc)
            more = not self._queue.empty()
            for _, fut, loop in batch:
                loop.call_soon_threadsafe(_resolve, fut, err)
            return more

    def _check_identity(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._identity:
            raise sqlite3.OperationalError(
                "the state file was removed or replaced under the running supplier"
            )

    def _probe(self, conn: sqlite3.Connection | None, probes: list[_Queued]) -> None:
        err: StoreError | None = None
        try:
            if conn is None:
                raise sqlite3.OperationalError("database could not be opened")
            self._check_identity()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("CREATE TABLE IF NOT EXISTS probe (data BLOB)")
                conn.execute("INSERT INTO probe VALUES (zeroblob(?))", (PROBE_BYTES,))
                conn.execute("DELETE FROM probe")
                conn.execute("COMMIT")
            except BaseException:
                rollback(conn)
                raise
            self.failure = ""
        except sqlite3.Error as exc:
            self.failure = str(exc)
            err = StoreError(f"probe of {self.path} failed: {exc}")
        for _, fut, loop in probes:
            loop.call_soon_threadsafe(_resolve, fut, err)

    @staticmethod
    def _forget(conn: sqlite3.Connection | None, ids: Sequence[int]) -> None:
        if not ids or conn is None:
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])
                conn.execute("COMMIT")
            except BaseException:
                rollback(conn)
                raise
        except sqlite3.Error as exc:  # the rows stay: republished, then dropped as duplicates
            log.warning("outbox_forget_failed", rows=len(ids), error=str(exc))

    def close(self) -> None:
        self._closed = True
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=10)


def _is_storage_fault(exc: sqlite3.Error) -> bool:
    """A fault of the disk or the file (not of one change, e.g. a constraint violation)."""
    return not isinstance(exc, sqlite3.IntegrityError)


def _resolve(fut: asyncio.Future[None], err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
