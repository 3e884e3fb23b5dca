"""``buyer query``'s SQL (bourse/view/query.py): it reads, and nothing else: no write, no
schema change, no ATTACH, no pragma, no extension, on a connection opened read-only; a
statement past its time limit is stopped; each refusal is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from bourse.view.db import ViewDB
from bourse.view.query import QueryError, connect_ro, run


@pytest.fixture
def view(tmp_path: Path) -> Path:
    path = tmp_path / "view.sqlite"
    db = ViewDB(path)
    db.db.executemany(
        "INSERT INTO apps VALUES (?, ?, 1, '[]', ?, ?, 0, 0, 0)",
        [("", "shop", 3, 2), ("alice", "blog", 1, 1)],
    )
    db.close()
    return path


def test_a_select_answers_with_columns_and_rows(view: Path) -> None:
    got = run(connect_ro(view), "SELECT app, machines FROM apps ORDER BY app")
    assert got.columns == ["app", "machines"]
    assert got.rows == [("blog", 1), ("shop", 3)]
    assert got.objects() == [{"app": "blog", "machines": 1}, {"app": "shop", "machines": 3}]
    grouped = "SELECT tenant, sum(started) FROM apps GROUP BY tenant ORDER BY tenant"
    assert run(connect_ro(view), grouped).rows == [("", 2), ("alice", 1)]
    recursive = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
    assert run(connect_ro(view), recursive + "SELECT count(*) FROM n").rows == [(3,)]


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM apps",
        "UPDATE apps SET machines = 0",
        "INSERT INTO apps VALUES ('', 'x', 1, '[]', 1, 1, 0, 0, 0)",
        "DROP TABLE apps",
        "CREATE TABLE t (x)",
        "CREATE TEMP TABLE t (x)",
        "ATTACH DATABASE '/tmp/other.sqlite' AS other",
        "PRAGMA journal_mode",
        "PRAGMA writable_schema = 1",
        "SELECT load_extension('/tmp/x.so')",
        "VACUUM INTO '/tmp/copy.sqlite'",
        "SELECT * FROM pragma_table_info('apps')",
    ],
)
def test_anything_but_reading_is_refused(view: Path, sql: str) -> None:
    with pytest.raises(QueryError) as info:
        run(connect_ro(view), sql)
    assert "\n" not in str(info.value)
    assert run(connect_ro(view), "SELECT count(*) FROM apps").rows == [(2,)]  # untouched


def test_a_query_past_its_time_limit_is_stopped(view: Path) -> None:
    forever = (
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    )
    with pytest.raises(QueryError, match=r"took longer than 0\.05 s"):
        run(connect_ro(view), forever, timeout_s=0.05)


@pytest.mark.parametrize(
    ("sql", "said"),
    [
        ("SELECT nope FROM apps", "no such column: nope"),
        ("SELEC 1", "syntax error"),
        ("SELECT 1; SELECT 2", "one statement"),
    ],
)
def test_a_wrong_query_is_one_line(view: Path, sql: str, said: str) -> None:
    with pytest.raises(QueryError, match=said):
        run(connect_ro(view), sql)
