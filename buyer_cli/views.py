"""The buyer's view of the market (bourse/view): a disposable cache under the user's cache
directory, resumed by stream sequence. An answer reads it as it stands without NATS when it
was caught up at most a second ago and none of the buyer's commands asked the market for a
change since (the answer says how old it is); else it is caught up first, by the view's
keeper (bourse/view/keeper.py) when one runs, else by the invocation, which then starts one
(:func:`read_view`; :func:`with_view` catches up in the invocation). ``machines list``,
``machines show``, ``fleet``, ``apps status`` and ``buyer query`` answer from it
(``--fresh``: the workers; ``--no-jetstream``: the same, there is no stream); ``buyer
query`` runs read-only SQL on it, once or, with ``--watch``, as its rows change.

Heavy imports (NATS, the view) are made inside the functions: ``--help`` loads neither."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from buyer_cli.session import Session, session

if TYPE_CHECKING:
    import sqlite3
    from pathlib import Path

    from nats.aio.client import Client as NATS

    from bourse.view import Freshness, View
    from bourse.view.query import Result

T = TypeVar("T")

# How long an invocation waits for its view's keeper to catch the view up (its own catch-up
# would wait as long, bourse/view/view.py CATCH_UP_S), and how old a view the keeper caught
# up may be when it is read (a moment: only a clock's step makes it older).
KEEPER_WAIT_S = 30.0
SYNCED_MS = 60_000

FreshOpt = Annotated[
    bool,
    typer.Option(
        "--fresh",
        help="Ask the workers now instead of answering from the view (the market's state "
        "stream, kept in your cache directory).",
    ),
]


def from_view(ctx: typer.Context, fresh: bool) -> bool:
    """Whether a command answers from the view: not with --fresh, nor without JetStream."""
    return not fresh and not session(ctx).no_jetstream


def read_view(ctx: typer.Context, fn: Callable[[sqlite3.Connection, dict[str, int]], T]) -> T:
    """``fn`` on the view's tables and its freshness (:func:`fresh_json`): read as they
    stand when the view was caught up at most FRESH_MS ago and the buyer's commands have not
    asked the market for a change since (bourse/view/stored.py: NATS is not even imported),
    else once it is caught up (:func:`with_view`)."""
    from bourse.view.cache import stamped, view_path

    s = session(ctx)
    path = view_path(s.connection().urls, s.prefix, s.tenant())
    fresh_ms = _fresh_ms()
    if fresh_ms and stamped(path) and (got := _as_it_stands(path, fresh_ms, fn)):
        return got[0]
    idle_s = _keeper_s()
    keeper = _keeper_sync(path) if idle_s else "off"
    if keeper == "synced" and (got := _as_it_stands(path, SYNCED_MS, fn)):
        return got[0]  # caught up by the keeper a moment ago

    async def caught_up(view: View) -> T:
        return fn(view.db.db, view_json(view))

    answer = with_view(ctx, caught_up)
    if keeper == "none":
        start_keeper(s, idle_s)  # for the next invocation
    return answer


def _as_it_stands(
    path: Path, within_ms: int, fn: Callable[[sqlite3.Connection, dict[str, int]], T]
) -> list[T]:
    """``fn``'s answer on the view read as it stands (one, in a list), when it was caught
    up at most ``within_ms`` ago; none when it was not (or there is no view to read)."""
    import time

    from bourse.view.stored import open_stored

    with open_stored(path, time.time_ns() // 1_000_000, within_ms) as stored:
        return [] if stored is None else [fn(stored.db, fresh_json(stored.freshness))]


def _keeper_sync(path: Path) -> str:
    """Ask the view's keeper (bourse/view/keeper.py) to catch the view up: "synced", or
    "none" (no keeper runs) or "failed" (it could not: the invocation catches up by
    itself, and says why if it cannot either)."""
    from bourse.view.keeper import KeeperError, NoKeeper, ask

    try:
        ask(path, timeout_s=KEEPER_WAIT_S)
    except NoKeeper:
        return "none"
    except KeeperError:
        return "failed"
    return "synced"


def _keeper_s() -> float:
    from bourse.view.keeper import keeper_s

    try:
        return keeper_s()
    except ValueError as exc:
        from bourse.runtime.cli import fail

        fail(str(exc))


def start_keeper(s: Session, idle_s: float) -> None:
    """Start the keeper of this invocation's view (``buyer view keep``, with its options),
    detached: its own session, no terminal, its log beside the view."""
    import os
    import subprocess
    import sys

    from bourse.view.cache import view_path

    conn = s.connection()
    argv = [sys.executable, "-m", "buyer_cli", "--prefix", s.prefix]
    for url in conn.urls:
        argv += ["--nats", url]
    for flag, value in (("--creds", conn.creds), ("--tls-ca", conn.tls_ca),
                        ("--tls-cert", conn.tls_cert), ("--tls-key", conn.tls_key)):  # fmt: skip
        if value:
            argv += [flag, os.path.abspath(value)]  # the keeper runs in /
    argv += ["view", "keep", "--idle-s", str(idle_s)]
    log = view_path(conn.urls, s.prefix, s.tenant()).with_suffix(".keeper.log")
    try:
        with open(log, "ab") as out:
            subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                close_fds=True, cwd="/", env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
    except OSError:
        pass  # no keeper: the next invocation catches up by itself, as this one did


def _fresh_ms() -> int:
    """How long after it was caught up a view answers as it stands: FRESH_MS, or the
    environment's (bourse/view/stored.py)."""
    import os

    from bourse.view.stored import ENV_FRESH_MS, FRESH_MS

    given = os.environ.get(ENV_FRESH_MS, "").strip()
    if not given:
        return FRESH_MS
    if not given.isdigit():
        from bourse.runtime.cli import fail

        fail(f"{ENV_FRESH_MS} must be a number of milliseconds (0: always catch up), not {given!r}")
    return int(given)


def with_view(ctx: typer.Context, fn: Callable[[View], Awaitable[T]]) -> T:
    """Run ``fn`` on the invocation's view, caught up with the stream (made, resumed or
    rebuilt in the cache directory; one invocation writes it at a time), and stamp it
    caught up (bourse/view/cache.py)."""
    import asyncio

    from bourse.runtime import logs

    s = session(ctx)
    logs.configure("warning", lazy=True)  # structlog imported only if a line is logged

    async def main() -> T:
        from bourse.view import ViewUnavailable, open_view
        from bourse.view.cache import locked, stamp, view_path

        tenant = s.tenant()
        path = view_path(s.connection().urls, s.prefix, tenant)
        nc = await s.connect("bourse-buyer-view")
        try:
            with locked(path):
                async with open_view(nc, s.subjects, path, tenant) as view:
                    stamp(path)
                    return await fn(view)
        except ViewUnavailable as exc:
            from bourse.client import ClientError  # the client's whole package: only now

            raise ClientError(await _unavailable(nc, str(exc)), "no_view") from None
        finally:
            await nc.drain()

    try:
        return asyncio.run(main())
    finally:  # what the command imports next may log through structlog itself: configured
        logs.configure("warning", lazy=True)


async def _unavailable(nc: NATS, why: str) -> str:
    """Why there is no view, and what to do: without JetStream, say so as every program
    does (--no-jetstream); else the view's reason (--fresh)."""
    from bourse.nats.jetstream import HOW_TO_TURN_ON, NO_JETSTREAM_FLAG, jetstream_available

    if not await jetstream_available(nc):
        return (
            "the NATS server has no JetStream: the buyer answers from the market's view, "
            f"which JetStream keeps; {HOW_TO_TURN_ON}, or pass {NO_JETSTREAM_FLAG} (or "
            "--fresh) to ask the workers"
        )
    return f"{why}; --fresh asks the workers instead"


def view_json(view: View) -> dict[str, int]:
    """The freshness every answer from the view carries: ``{"seq", "age_ms"}``."""
    return fresh_json(view.freshness())


def fresh_json(f: Freshness) -> dict[str, int]:
    return {"seq": f.seq, "age_ms": f.age_ms}


def say_freshness(s: Session, view: dict[str, int]) -> None:
    """``view: as of seq N, T ms ago`` on stderr, under a query's rows (JSON carries it, as
    every answer from the view does: ``"view"``)."""
    if not s.json:
        typer.echo(f"view: as of seq {view['seq']}, {view['age_ms']} ms ago", err=True)


def gone_line(gone: dict[str, int]) -> str | None:
    """One line naming the workers gone (their machines shown as last known), or None."""
    if not gone:
        return None
    from bourse.client import render

    shown = ", ".join(f"{w} (since {render.clock(t)})" for w, t in sorted(gone.items())[:10])
    more = f" and {len(gone) - 10} more" if len(gone) > 10 else ""
    return f"worker(s) gone: {render.visible(shown)}{more}: their machines are shown as unknown"


def query(
    ctx: typer.Context,
    sql: Annotated[str, typer.Argument(metavar="SQL", help="One SELECT statement.")],
    watch: Annotated[
        bool,
        typer.Option("--watch", help="Then print rows as they change (+ new, - gone; Ctrl-C)."),
    ] = False,
    timeout_s: Annotated[
        float, typer.Option(min=0.01, metavar="SECONDS", help="Stop a query that takes longer.")
    ] = 5.0,
) -> None:
    """Read-only SQL on the view of the market: tables workers, machines, apps, beats, meta
    (docs/architecture.md, bourse/view/db.py). --json: {"columns", "rows": [{col: value}],
    "view": {"seq", "age_ms"}}; with --watch one {"op", "row", "seq"} per line."""
    s = session(ctx)

    def once(_: sqlite3.Connection, fresh: dict[str, int]) -> tuple[Result, dict[str, int]]:
        from bourse.runtime.cli import fail
        from bourse.view.cache import view_path
        from bourse.view.query import QueryError, connect_ro, run

        db = connect_ro(view_path(s.connection().urls, s.prefix, s.tenant()))
        try:
            return run(db, sql, timeout_s), fresh
        except QueryError as exc:
            fail(str(exc))
        finally:
            db.close()

    async def follow(view: View) -> None:
        from bourse.view.query import connect_ro, run

        db = connect_ro(view.db.path)  # type: ignore[arg-type]
        try:
            got = run(db, sql, timeout_s)
            _changes(s, got, [], view.freshness().seq, first=True)
            async for _ in view.follow():
                before, got = got.rows, run(db, sql, timeout_s)
                _changes(s, got, before, view.freshness().seq, first=False)
        finally:
            db.close()

    if watch:
        with_view(ctx, _query_errors(follow))
        return
    result, fresh = read_view(ctx, once)  # as it stands when caught up a moment ago
    if s.json:
        s.echo_json({"columns": result.columns, "rows": result.objects(), "view": fresh})
        return
    _table(result)
    say_freshness(s, fresh)


def _query_errors(fn: Callable[[View], Awaitable[T]]) -> Callable[[View], Awaitable[T]]:
    """A refused or failed query is the command's one error line."""

    async def wrapped(view: View) -> T:
        from bourse.runtime.cli import fail
        from bourse.view.query import QueryError

        try:
            return await fn(view)
        except QueryError as exc:
            fail(str(exc))

    return wrapped


def _table(result: Result) -> None:
    from rich.table import Table

    from bourse.client import render

    t = Table(title="query")
    for col in result.columns:
        t.add_column(col, no_wrap=True)
    for row in result.rows:
        t.add_row(*(render.safe("NULL" if v is None else v) for v in row))
    render.show(t)


def _changes(s: Session, got: Result, before: list[tuple[Any, ...]], seq: int, first: bool) -> None:
    """What changed between two runs of a watched query: rows that are new (``+``), rows
    that are gone (``-``); the first run's rows are all new."""
    from collections import Counter

    from bourse.client import render

    now, was = Counter(got.rows), Counter(before)
    lines = [("-", r) for r in (was - now).elements()] + [("+", r) for r in (now - was).elements()]
    if first and not s.json:
        typer.echo("  ".join(render.visible(c) for c in got.columns))
    for op, row in lines:
        if s.json:
            obj = dict(zip(got.columns, row, strict=True))
            typer.echo(render.as_json({"op": op, "row": obj, "seq": seq}))
        else:
            cells = ("NULL" if v is None else str(v) for v in row)
            typer.echo(f"{op} " + "  ".join(render.visible(c) for c in cells))
