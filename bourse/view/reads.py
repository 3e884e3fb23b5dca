"""What the CLI asks of a view's database: machines (filtered and sorted as a listing is,
§4.17), one machine, workers, an app's machines; each machine with its worker's liveness.
Rows come back as their JSON as the stream holds it (``msgspec.Raw``; a listing's written
as one JSON array, :func:`write_machines_json`: 10,000 machines are passed through, not
decoded and encoded again) and, decoded, for tables (the wire's types imported then: a
listing's JSON does without them)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from bourse.wire.messages import Machine, WorkerRow

# A listing's order (§4.17): region, worker, creation, id.
_ORDER = " ORDER BY region, worker_id, created_at_ms, machine_id"
# Rows a listing's JSON writes at a time: ~54 KB, under malloc's threshold for a mapping of
# its own, so each chunk's buffer reuses the memory of the one before.
CHUNK = 64


@dataclass(frozen=True, slots=True)
class Seen:
    """A machine or a worker as the view has it: its row (JSON) and since when its worker
    is gone (None: its worker beats; 0: never seen beating)."""

    raw: bytes
    gone_since_ms: int | None

    def machine(self) -> Machine:
        from bourse.wire.codec import decode
        from bourse.wire.messages import Machine

        return decode(self.raw, Machine)

    def worker(self) -> WorkerRow:
        from bourse.wire.codec import decode
        from bourse.wire.messages import WorkerRow

        return decode(self.raw, WorkerRow)

    @property
    def json(self) -> msgspec.Raw:
        return msgspec.Raw(self.raw)


@dataclass(frozen=True, slots=True)
class MachineFilter:
    """A listing's filters (``buyer machines list``): any empty one matches everything."""

    regions: tuple[str, ...] = ()
    worker: str = ""
    app: str = ""
    states: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    include_destroyed: bool = False

    def where(self) -> tuple[str, list[object]]:
        clauses: list[str] = []
        args: list[object] = []
        for column, values in (("region", self.regions), ("state", self.states)):
            if values:
                clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
                args += values
        if self.worker:
            clauses.append("worker_id = ?")
            args.append(self.worker)
        if self.app:
            clauses.append("app = ?")
            args.append(self.app)
        if not self.include_destroyed and "destroyed" not in self.states:
            clauses.append("state != 'destroyed'")
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), args


def machines(db: sqlite3.Connection, f: MachineFilter) -> list[Seen]:
    where, args = f.where()
    rows = db.execute(
        f"SELECT CAST(row AS BLOB), worker_gone_since_ms FROM machines{where}{_ORDER}",
        args,
    ).fetchall()
    out = [Seen(row, gone) for row, gone in rows]
    if f.labels:  # metadata key=value: on the decoded machine (rare: a listing's --label)
        out = [s for s in out if all(s.machine().metadata.get(k) == v for k, v in f.labels)]
    return out


def write_machines_json(
    db: sqlite3.Connection, f: MachineFilter, write: Callable[[bytes], object]
) -> dict[str, int]:
    """What :func:`machines` finds, written with ``write`` as one JSON array of the rows as
    the stream holds them, CHUNK rows at a time as SQLite reads them (no object a row, no
    buffer of the whole: a listing of 10,000 machines is 8 MB, and each new buffer of it a
    process's memory faulted in, twice the SQL's time); returns the workers gone among them
    (worker -> since when), from the same rows. Not for a filter by label, which needs the
    rows decoded."""
    if f.labels:
        raise ValueError("a filter by label needs the rows decoded: machines()")
    where, args = f.where()
    rows = db.execute(
        f"SELECT CAST(row AS BLOB), worker_id, worker_gone_since_ms FROM machines{where}{_ORDER}",
        args,
    )
    gone: dict[str, int] = {}
    between = b"["
    while chunk := rows.fetchmany(CHUNK):
        write(between)
        write(b",".join([row for row, _, _ in chunk]))
        between = b","
        for _, wid, since in chunk:
            if since is not None:
                gone[wid] = since
    write(b"]" if between == b"," else b"[]")
    return gone


def machine(db: sqlite3.Connection, machine_id: str) -> Seen | None:
    row = db.execute(
        "SELECT CAST(row AS BLOB), worker_gone_since_ms FROM machines WHERE machine_id = ?",
        (machine_id,),
    ).fetchone()
    return None if row is None else Seen(row[0], row[1])


def workers(db: sqlite3.Connection, regions: tuple[str, ...] = ()) -> list[Seen]:
    where = f" WHERE region IN ({', '.join('?' * len(regions))})" if regions else ""
    rows = db.execute(
        f"SELECT CAST(row AS BLOB), gone_since_ms FROM workers{where} ORDER BY region, worker_id",
        regions,
    ).fetchall()
    return [Seen(row, gone) for row, gone in rows]


@dataclass(frozen=True, slots=True)
class Liveness:
    worker_id: str
    region: str
    gone_since_ms: int | None


def liveness(db: sqlite3.Connection) -> list[Liveness]:
    """Every worker's region and since when it is gone (None: it beats)."""
    rows = db.execute("SELECT worker_id, region, gone_since_ms FROM workers ORDER BY worker_id")
    return [Liveness(*row) for row in rows]


def beating_regions(db: sqlite3.Connection) -> list[str]:
    """The regions where a worker beats."""
    rows = db.execute(
        "SELECT DISTINCT region FROM workers WHERE gone_since_ms IS NULL ORDER BY region"
    )
    return [r for (r,) in rows]
