"""A view's database read as it stands, without NATS: what the buyer answers from when its
view (bourse/view/cache.py) was caught up with the stream at most FRESH_MS ago and none of
its own commands has asked the market for a change since (cache.py's stamp says so). The
answer says how old it is (:class:`Freshness`), as every answer from a view does.

The tables are read in one transaction: a view that another invocation catches up
meanwhile is read as it was before, or after, never halfway."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bourse.view.schema import SCHEMA_VERSION

# How long after a view was caught up the buyer answers from it as it stands (a second:
# the heartbeats' interval; a worker is called gone after three); the environment variable
# sets another (0: every answer catches up first).
FRESH_MS = 1000
ENV_FRESH_MS = "BOURSE_VIEW_FRESH_MS"


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current a view is: the last stream sequence applied, and how long ago it was
    last known caught up with the stream."""

    seq: int
    age_ms: int

    def __str__(self) -> str:
        return f"as of seq {self.seq}, {self.age_ms} ms ago"


@dataclass(frozen=True, slots=True)
class Stored:
    """A view's tables (read-only, in one read transaction) and how fresh they are."""

    db: sqlite3.Connection
    freshness: Freshness


@contextmanager
def open_stored(path: Path, now_ms: int, fresh_ms: int = FRESH_MS) -> Iterator[Stored | None]:
    """The view at ``path`` as it stands when it was caught up at most ``fresh_ms`` before
    ``now_ms`` with this version's tables; None when it was not (or there is none, or it
    cannot be read): then it must be caught up first (bourse/view/view.py open_view)."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error:
        yield None
        return
    try:
        yield _read(db, now_ms, fresh_ms)
    finally:
        db.close()


def _read(db: sqlite3.Connection, now_ms: int, fresh_ms: int) -> Stored | None:
    try:
        db.execute("BEGIN")
        meta = dict(
            db.execute("SELECT key, value FROM meta WHERE key IN ('schema', 'seqs', 'synced_ms')")
        )
    except sqlite3.Error:  # none yet, or not a view's database: the caller catches it up
        return None
    if meta.get("schema") != str(SCHEMA_VERSION):
        return None
    age_ms = now_ms - int(meta.get("synced_ms", "0"))
    if not 0 <= age_ms <= fresh_ms:
        return None
    seq = max(json.loads(meta.get("seqs", "{}")).values(), default=0)
    return Stored(db, Freshness(int(seq), age_ms))
