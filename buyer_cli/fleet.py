"""``buyer fleet``: every worker's capacity, commitments, holds, image cache and images."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from buyer_cli.options import EXIT_UNFILLED
from buyer_cli.session import session, with_client
from buyer_cli.views import FreshOpt, from_view, read_view

if TYPE_CHECKING:
    from sqlite3 import Connection

    from bourse.client import BourseClient
    from bourse.view.reads import Seen
    from bourse.wire.messages import WorkerStatus


def fleet(
    ctx: typer.Context,
    region: Annotated[
        list[str] | None,
        typer.Option(metavar="REGION", help="A region to ask (repeatable; default: every region)."),
    ] = None,
    fresh: FreshOpt = False,
) -> None:
    """Every worker's capacity, commitments, machines, image cache (bytes used / budget),
    labels, and whether it is gone, from the view of the market; --fresh: the workers
    answer now (status scatter-gather: holds and images too). In every region or those
    given. Exit 2 when a region asked for (or, with none given, any region) has no worker
    that beats (--fresh: answers)."""
    if from_view(ctx, fresh):
        _fleet_from_view(ctx, tuple(dict.fromkeys(region or ())))
        return
    from bourse.client import render
    from bourse.client.fleet import fleet

    async def go(c: BourseClient) -> list[WorkerStatus]:
        if not region:
            return await c.status(None)
        return [s for r in dict.fromkeys(region) for s in await c.status(r)]

    statuses = with_client(ctx, go)
    answered = sorted({s.region for s in statuses})
    if session(ctx).json:
        session(ctx).echo_json({"workers": statuses, "regions": answered})
    elif statuses:  # nobody answered: the line on stderr says so, no empty table
        render.show(fleet(statuses))
    _silent(region or [], answered)


def _fleet_from_view(ctx: typer.Context, regions: tuple[str, ...]) -> None:
    """``fleet`` from the view: ``{"workers": [WorkerRow], "regions", "gone", "view"}``."""
    s = session(ctx)

    def go(db: Connection, fresh: dict[str, int]) -> tuple[list[Seen], list[str], dict[str, int]]:
        from bourse.view import reads

        return reads.workers(db, regions), reads.beating_regions(db), fresh

    seen, beating, fresh = read_view(ctx, go)
    rows = [x.worker() for x in seen]
    gone = {
        w.worker_id: x.gone_since_ms
        for w, x in zip(rows, seen, strict=True)
        if x.gone_since_ms is not None
    }
    if s.json:
        s.echo_json({"workers": [x.json for x in seen], "regions": beating, "gone": gone,
                     "view": fresh})  # fmt: skip
    elif rows:
        from bourse.client import render
        from bourse.client.fleet import fleet_rows

        render.show(fleet_rows(rows, gone))
    _silent(list(regions), beating)


def _silent(region: list[str], answered: list[str]) -> None:
    """One line on stderr for each region asked for where no worker answers (any region,
    when none was asked for); exit 2 if there is one."""
    silent = [f"region {r!r}" for r in dict.fromkeys(region or ()) if r not in answered]
    if not region and not answered:
        silent = ["any region"]
    for where in silent:
        typer.echo(f"no worker answers in {where}", err=True)
    if silent:
        raise typer.Exit(EXIT_UNFILLED)
