"""A view's SQLite database: the tables ``workers``, ``machines``, ``apps`` (with their
indexes), ``beats`` and ``meta``, written one batch of the state stream at a time, each
batch with the stream sequences it reaches in the same transaction (a view killed -9
resumes from what it committed).

Liveness is the view's: a worker whose heartbeat (the one its row names, listing it) and
row are both 3 intervals old, at least 3 s, is ``gone`` since the last of them
(``workers.gone_since_ms``),
and each of its machines says so (``machines.worker_gone_since_ms``; 0: no row or heartbeat
of its worker was ever seen). Those are columns of the view: a machine's ``state`` stays the
last one its worker published. What the sweep needs (each worker's heartbeat and status,
each heartbeat's workers) is kept in memory too, loaded at open.

``meta`` keeps what the view was built from (schema, stream, tenant, the stream's epoch)
and how far (each feed's sequence, when last caught up): :meth:`ViewDB.stale` says from
them whether it can be resumed.

No NATS here: bourse/view/view.py feeds it.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bourse.nats.state import GONE_AFTER_MS, GONE_INTERVALS, RETENTION_S
from bourse.view.rows import (
    MACHINE_COLUMNS,
    WORKER_COLUMNS,
    BeatOp,
    Dropped,
    EpochOp,
    MachineRowOp,
    Op,
    WorkerRowOp,
)
from bourse.view.schema import SCHEMA, SCHEMA_VERSION, TABLES

# SQLite's page cache (KiB): the indexes of 100,000 machines stay in memory while it builds.
CACHE_KIB = 64 * 1024

_MACHINES = ", ".join(MACHINE_COLUMNS)
_WORKERS = ", ".join(WORKER_COLUMNS)
_PUT_MACHINE = (
    f"INSERT OR REPLACE INTO machines ({_MACHINES}, worker_gone_since_ms, seq, seen_ms) "
    f"VALUES ({', '.join('?' * (len(MACHINE_COLUMNS) + 3))})"
)
_PUT_WORKER = (
    f"INSERT OR REPLACE INTO workers ({_WORKERS}, gone_since_ms, seq, seen_ms) "
    f"VALUES ({', '.join('?' * (len(WORKER_COLUMNS) + 3))})"
)
_APP = """
SELECT max(generation), group_concat(DISTINCT region), count(*),
       coalesce(sum(state = 'started'), 0), coalesce(sum(role = 'spare'), 0),
       coalesce(sum(worker_gone_since_ms IS NOT NULL), 0), max(updated_at_ms)
FROM machines WHERE tenant = ? AND app = ? AND state != 'destroyed'
"""


def _files(path: Path | str) -> list[Path]:
    if str(path) == ":memory:":
        return []
    return [Path(f"{path}{tail}") for tail in ("", "-wal", "-shm")]


def _open(path: Path | str) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=5.0)
    db.execute("PRAGMA journal_mode=WAL")
    # A view is a cache: a kill -9 loses nothing committed (the system has it), an OS crash
    # may lose or damage the last batches, and a damaged view is made anew (above). So no
    # fsync: a build writes 100,000 rows in a few large transactions.
    db.execute("PRAGMA synchronous=OFF")
    db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    db.executescript(SCHEMA)
    return db


@dataclass(slots=True)
class Beat:
    at_ms: int  # the stream's timestamp of the heartbeat
    interval_ms: int
    workers: frozenset[str]

    def limit_ms(self) -> int:
        """How old it may be before the workers it names are gone."""
        return max(GONE_AFTER_MS, GONE_INTERVALS * self.interval_ms)


@dataclass(slots=True)
class Liveness:
    """A worker as the sweep sees it."""

    beat: str
    seen_ms: int  # when its row was stored
    gone_since_ms: int | None = 0  # None: alive; 0: not known yet

    def gone(self, beats: dict[str, Beat], wid: str, now_ms: int) -> int | None:
        """None while it shows life: the heartbeat its row names lists it and is fresh, or
        its row itself is (a supplier sends its rows before its first heartbeat); else
        since when it is gone: the last of those."""
        beat = beats.get(self.beat)
        named = beat is not None and wid in beat.workers
        last = max(self.seen_ms, beat.at_ms) if beat is not None and named else self.seen_ms
        limit = beat.limit_ms() if beat is not None else GONE_AFTER_MS
        return None if now_ms - last <= limit else last


@dataclass(slots=True)
class Batch:
    """What one batch did: rows applied, dropped (by reason), workers whose liveness
    changed."""

    applied: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    changed: list[str] = field(default_factory=list)


class ViewDB:
    """The SQLite side of a view (see the module doc); ``path`` ``":memory:"`` for a
    program's view kept in memory."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        try:
            self.db = _open(path)
        except sqlite3.DatabaseError:  # not a view's database, or damaged: made anew
            for stale in _files(path):
                stale.unlink(missing_ok=True)
            self.db = _open(path)
        self.beats: dict[str, Beat] = {}
        self.workers: dict[str, Liveness] = {}
        self._stale_apps: set[tuple[str, str | None]] = set()
        self._load()

    def close(self) -> None:
        self.db.close()

    # -- meta ---------------------------------------------------------------------------------
    def get(self, key: str, default: str = "") -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else str(row[0])

    def put(self, key: str, value: object) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, text))

    def seqs(self) -> dict[str, int]:
        """Each feed's (filter subject's) last stream sequence applied."""
        return {k: int(v) for k, v in json.loads(self.get("seqs", "{}")).items()}

    def counts(self) -> Counter[str]:
        """Rows dropped so far, by reason."""
        return Counter(json.loads(self.get("dropped", "{}")))

    def stale(self, stream: str, tenant: str, epoch: str | None, now_ms: int) -> str:
        """Why what the database holds cannot be resumed from ("" when it can), the
        stream's epoch now being ``epoch`` (None: it has none): another schema, market or
        tenant; away longer than the retention window (a machine destroyed meanwhile may
        have left the stream); or the stream was made again since (its epoch is not the one
        the view was built from; a stream without one, purged, was not made again, and a
        view built without one rebuilds once the stream has one)."""
        if not self.seqs():
            return ""  # nothing applied yet: a build from sequence 1 anyway
        if self.get("schema") != str(SCHEMA_VERSION):
            return f"schema {self.get('schema') or '?'}, now {SCHEMA_VERSION}"
        if (self.get("stream"), self.get("tenant")) != (stream, tenant):
            return "another market or tenant"
        away_ms = now_ms - int(self.get("synced_ms", "0"))
        if away_ms > RETENTION_S * 1000:
            return f"away {away_ms // 1000} s, longer than the retention window"
        built = self.get("epoch")
        if epoch and epoch != built:
            return f"the stream was made again (epoch {epoch}, the view's {built or 'none'})"
        return ""

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def wipe(self) -> None:
        """Every table dropped and made again, empty (a rebuild from sequence 1; a view of
        another schema gets this one's tables)."""
        with self.transaction():
            for table in TABLES:
                self.db.execute(f"DROP TABLE IF EXISTS {table}")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self.db.execute(statement)
            self.put("schema", str(SCHEMA_VERSION))
        self.beats.clear()
        self.workers.clear()

    def _load(self) -> None:
        for beat, workers, at_ms, interval_ms in self.db.execute(
            "SELECT beat, workers, at_ms, interval_ms FROM beats"
        ):
            self.beats[beat] = Beat(at_ms, interval_ms, frozenset(json.loads(workers)))
        for wid, beat, seen, gone in self.db.execute(
            "SELECT worker_id, beat, seen_ms, gone_since_ms FROM workers"
        ):
            self.workers[wid] = Liveness(beat, seen, gone)

    # -- a batch ------------------------------------------------------------------------------
    def apply(
        self,
        ops: Iterable[tuple[Op, int, int]],
        meta: dict[str, object],
        now_ms: int,
        apps: bool = True,
    ) -> Batch:
        """Apply one batch (each op with its stream sequence and stored time, ms) and
        ``meta`` (the feeds' sequences it reaches, ...), in one transaction: fleet rows
        first, then the liveness they change, then machines (each with its worker's
        liveness), then the apps they touch (``apps`` False: later, :meth:`refresh_apps`;
        a build's batches touch every app again and again)."""
        out = Batch()
        machines: dict[str, tuple[MachineRowOp, int, int]] = {}
        workers: dict[str, tuple[WorkerRowOp, int, int]] = {}
        beats: dict[str, tuple[BeatOp, int, int]] = {}
        epoch = ""
        for op, seq, at in ops:
            if isinstance(op, MachineRowOp):
                machines[op.machine.machine_id] = (op, seq, at)
            elif isinstance(op, WorkerRowOp):
                workers[op.row.worker_id] = (op, seq, at)
            elif isinstance(op, BeatOp):
                beats[op.beat.beat] = (op, seq, at)
            elif isinstance(op, EpochOp):
                epoch = op.epoch
            elif isinstance(op, Dropped):
                out.dropped[op.reason] += 1
        with self.transaction():
            self._workers(workers.values())
            self._beats(beats.values())
            # only these can have changed now: the rest changes with time (sweep)
            named = {wid for op, _, _ in beats.values() for wid in op.beat.workers}
            out.changed = self._sweep(now_ms, set(workers) | named)
            self._machines(machines.values())
            touched = {(op.values[2], op.values[6]) for op, _, _ in machines.values()}
            self._apps_later(touched | self._apps_of(out.changed), now=apps)
            for key, value in meta.items():
                self.put(key, value)
            if epoch:
                self.put("epoch", epoch)
            if out.dropped:
                self.put("dropped", self.counts() + out.dropped)
        out.applied = len(machines) + len(workers) + len(beats) + bool(epoch)
        return out

    def _workers(self, rows: Iterable[tuple[WorkerRowOp, int, int]]) -> None:
        put = []
        for op, seq, at in rows:
            wid = op.row.worker_id
            was = self.workers.get(wid)
            live = Liveness(op.row.beat, at, was.gone_since_ms if was else 0)  # sweep decides
            self.workers[wid] = live
            put.append((*op.values, live.gone_since_ms, seq, at))
        self.db.executemany(_PUT_WORKER, put)

    def _beats(self, rows: Iterable[tuple[BeatOp, int, int]]) -> None:
        put = []
        for op, seq, at in rows:
            hb = op.beat
            self.beats[hb.beat] = Beat(at, hb.interval_ms, frozenset(hb.workers))
            put.append((hb.beat, op.region, json.dumps(hb.workers), at, hb.interval_ms,
                        hb.version, seq))  # fmt: skip
        self.db.executemany("INSERT OR REPLACE INTO beats VALUES (?, ?, ?, ?, ?, ?, ?)", put)

    def _machines(self, rows: Iterable[tuple[MachineRowOp, int, int]]) -> None:
        put = []
        for op, seq, at in rows:
            live = self.workers.get(op.machine.worker_id)
            gone = 0 if live is None else live.gone_since_ms
            put.append((*op.values, gone, seq, at))
        self.db.executemany(_PUT_MACHINE, put)

    # -- liveness ------------------------------------------------------------------------------
    def sweep(self, now_ms: int) -> list[str]:
        """Workers gone or back since the last sweep (their rows and their machines'
        updated, and their apps'), in one transaction; destroyed machines' rows older than
        the retention window removed (they have left the stream)."""
        with self.transaction():
            changed = self._sweep(now_ms)
            self._apps(self._apps_of(changed))
            self.db.execute(
                "DELETE FROM machines WHERE state = 'destroyed' AND seen_ms < ?",
                (now_ms - RETENTION_S * 1000,),
            )
        return changed

    def _sweep(self, now_ms: int, only: Iterable[str] | None = None) -> list[str]:
        """The workers (of ``only``, else every one) whose liveness changed: updated, with
        their machines."""
        changed = []
        for wid in self.workers if only is None else only:
            live = self.workers.get(wid)
            if live is None:
                continue
            gone = live.gone(self.beats, wid, now_ms)
            if gone != live.gone_since_ms:
                live.gone_since_ms = gone
                changed.append(wid)
        self.db.executemany(
            "UPDATE workers SET gone_since_ms = ? WHERE worker_id = ?",
            [(self.workers[wid].gone_since_ms, wid) for wid in changed],
        )
        self.db.executemany(
            "UPDATE machines SET worker_gone_since_ms = ? WHERE worker_id = ?",
            [(self.workers[wid].gone_since_ms, wid) for wid in changed],
        )
        return changed

    def _apps_later(self, keys: set[tuple[str, str | None]], now: bool) -> None:
        keys = {k for k in keys if k[1] is not None}
        if now and not self._stale_apps:
            self._apps(keys)
        elif keys:
            self._stale_apps |= keys
            self.put("apps_stale", "1")  # a view killed before the refresh refreshes at open

    def refresh_apps(self) -> None:
        """The apps touched by batches applied without them, made again."""
        if not self._stale_apps and self.get("apps_stale") != "1":
            return
        with self.transaction():
            if not self._stale_apps:  # a view killed before its refresh: every app
                self.db.execute("DELETE FROM apps")
                self._stale_apps.update(
                    self.db.execute(
                        "SELECT DISTINCT tenant, app FROM machines WHERE app IS NOT NULL"
                    )
                )
            self._apps(self._stale_apps)
            self.put("apps_stale", "0")
        self._stale_apps.clear()

    def _apps_of(self, workers: list[str]) -> set[tuple[str, str | None]]:
        out: set[tuple[str, str | None]] = set()
        for wid in workers:
            out.update(
                self.db.execute(
                    "SELECT DISTINCT tenant, app FROM machines WHERE worker_id = ? "
                    "AND app IS NOT NULL",
                    (wid,),
                )
            )
        return out

    def _apps(self, keys: Iterable[tuple[str, str | None]]) -> None:
        for tenant, app in keys:
            if app is None:
                continue
            gen, regions, n, started, spares, unknown, at = self.db.execute(
                _APP, (tenant, app)
            ).fetchone()
            if not n:
                self.db.execute("DELETE FROM apps WHERE tenant = ? AND app = ?", (tenant, app))
                continue
            self.db.execute(
                "INSERT OR REPLACE INTO apps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (tenant, app, gen, json.dumps(sorted(regions.split(","))), n, started, spares,
                 unknown, at),
            )  # fmt: skip
