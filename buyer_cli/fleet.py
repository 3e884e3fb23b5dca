"""``buyer fleet``: every worker's capacity, commitments, holds, image cache and images."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from buyer_cli.options import EXIT_UNFILLED
from buyer_cli.session import session, with_client

if TYPE_CHECKING:
    from bourse.client import BourseClient
    from bourse.wire.messages import WorkerStatus


def fleet(
    ctx: typer.Context,
    region: Annotated[
        list[str] | None,
        typer.Option(metavar="REGION", help="A region to ask (repeatable; default: every region)."),
    ] = None,
) -> None:
    """Every worker's capacity, commitments, holds, image cache (bytes used / budget) and
    images (status scatter-gather), in every region or those given. Exit 2 when a region
    asked for (or, with none given, any region) has no worker that answers."""
    from bourse.client import render

    async def go(c: BourseClient) -> list[WorkerStatus]:
        if not region:
            return await c.status(None)
        return [s for r in dict.fromkeys(region) for s in await c.status(r)]

    statuses = with_client(ctx, go)
    answered = sorted({s.region for s in statuses})
    if session(ctx).json:
        session(ctx).echo_json({"workers": statuses, "regions": answered})
    elif statuses:  # nobody answered: the line on stderr says so, no empty table
        render.show(render.fleet(statuses))
    silent = [f"region {r!r}" for r in dict.fromkeys(region or ()) if r not in answered]
    if not region and not statuses:
        silent = ["any region"]
    for where in silent:
        typer.echo(f"no worker answers in {where}", err=True)
    if silent:
        raise typer.Exit(EXIT_UNFILLED)
