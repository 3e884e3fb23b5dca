"""``buyer watch``: market events as they happen, after a replay of stored ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import fail
from buyer_cli.session import session

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from bourse.client.events import Since
    from bourse.wire.codec import BadMessage
    from bourse.wire.subjects import Subjects


def watch(
    ctx: typer.Context,
    region: Annotated[str, typer.Option(metavar="REGION", help="Region, or * for all.")] = "*",
    worker: Annotated[
        str,
        typer.Option(metavar="WORKER", help="Worker id, or * for all (exchange: unfilled orders)."),
    ] = "*",
    kind: Annotated[
        str,
        typer.Option(
            metavar="KIND",
            help="Event kind (placed, unfilled, started, stopped, destroyed, ...), or * for all.",
        ),
    ] = "*",
    count: Annotated[
        int, typer.Option(min=0, metavar="N", help="Stop after this many (0: never).")
    ] = 0,
    since: Annotated[
        str | None,
        typer.Option(
            metavar="SEQ|DURATION|all",
            help="Replay stored events first (JetStream): a stream sequence (1234), a "
            "duration back from now (90s, 15m, 2h, 7d) or 'all'; then follow.",
        ),
    ] = None,
) -> None:
    """Print market events as they happen (order outcomes: placed, unfilled; machine events),
    until Ctrl-C; with --since, replay stored ones first. --json: one event per line, with
    its stream sequence ("seq")."""
    from bourse.client.events import parse_since
    from bourse.nats.connection import shutdown
    from bourse.runtime import logs
    from bourse.runtime.supervise import run

    logs.configure("warning")
    s = session(ctx)
    if tenant := s.tenant():
        fail(
            f"tenant {tenant!r} may not read events (they carry every tenant's machines): "
            "watch with the operator's buyer key (docs/security.md)"
        )
    start = parse_since(since) if since is not None else None

    async def main() -> None:
        nc = await s.connect("bourse-watch")
        try:
            await _watch(nc, s.subjects, (region, worker, kind), start, count, s.json)
        finally:
            await shutdown(nc)

    run(main)


async def _watch(
    nc: NATS,
    subjects: Subjects,
    filters: tuple[str, str, str],
    since: Since | None,
    count: int,
    json: bool,
) -> None:
    """Print events until ``count`` were printed (0: until cancelled: Ctrl-C, SIGTERM)."""
    from bourse.client import render
    from bourse.client.events import EventFeed, event_json

    def unreadable(subject: str, exc: BadMessage) -> None:
        typer.echo(render.visible(f"(unreadable event on {subject}: {exc})"), err=True)

    region, worker, kind = filters
    seen = 0
    async with EventFeed(nc, subjects, region, worker, kind, since, unreadable) as feed:
        if not json:
            how = "" if since is None else f", replaying from {since.describe()}"
            typer.echo(f"watching {feed.subject}{how} (Ctrl-C to stop)", err=True)
        async for item in feed:
            if json:
                typer.echo(event_json(item.event, item.seq))
            else:
                at = f"#{item.seq}  " if item.seq else ""
                typer.echo(at + render.event_line(item.event))
            seen += 1
            if count and seen >= count:
                return
