"""Read-only SQL on a view's database (``buyer query``): opened ``mode=ro``, an authorizer
that allows reading and nothing else (no write, no ``ATTACH``, no pragma, no extension), and
a time limit (the statement is interrupted past it)."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bourse.errors import BourseError

QUERY_TIMEOUT_S = 5.0
# How many SQLite steps between two looks at the clock.
_STEPS = 1000
_READING = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
)  # fmt: skip
# Functions a query may not call even read-only.
_REFUSED_FUNCTIONS = frozenset(
    {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
)


class QueryError(BourseError, ValueError):
    """A query refused (it writes, attaches, sets a pragma), wrong, or too slow: one line."""


@dataclass(frozen=True, slots=True)
class Result:
    columns: list[str]
    rows: list[tuple[Any, ...]]

    def objects(self) -> list[dict[str, Any]]:
        """Each row as ``{column: value}`` (``--json``)."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


def _authorize(
    action: int, arg1: str | None, arg2: str | None, db: str | None, src: str | None
) -> int:
    if action in _READING:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in _REFUSED_FUNCTIONS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def connect_ro(path: Path) -> sqlite3.Connection:
    """The view's database opened read-only, every statement authorized as above."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    db.set_authorizer(_authorize)
    return db


def run(db: sqlite3.Connection, sql: str, timeout_s: float = QUERY_TIMEOUT_S) -> Result:
    """One statement's rows; QueryError says why not (one line)."""
    deadline = time.monotonic() + timeout_s
    db.set_progress_handler(lambda: int(time.monotonic() > deadline), _STEPS)
    try:
        cur = db.execute(sql)
        rows = cur.fetchall()
    except sqlite3.DatabaseError as exc:
        if time.monotonic() > deadline:
            raise QueryError(f"the query took longer than {timeout_s:g} s: stopped") from None
        if "not authorized" in str(exc) or "prohibited" in str(exc):
            raise QueryError(
                f"refused: {exc} (a query may only read: no writes, ATTACH or pragmas)"
            ) from None
        raise QueryError(f"query: {exc}") from None
    except sqlite3.Warning as exc:  # e.g. "You can only execute one statement at a time."
        raise QueryError(f"query: {exc}") from None
    finally:
        db.set_progress_handler(None, 0)
    return Result([d[0] for d in cur.description or ()], rows)
