"""``buyer view keep`` and ``buyer view stop``: the keeper of this invocation's view of the
market (bourse/view/keeper.py), which an invocation that answers from the view starts by
itself when none runs, and which ends itself when idle."""

from __future__ import annotations

from typing import Annotated

import typer

from buyer_cli.session import session


def keep(
    ctx: typer.Context,
    idle_s: Annotated[
        float,
        typer.Option(min=0.1, metavar="SECONDS", help="Exit after this long without a request."),
    ] = 300.0,
) -> None:
    """Keep this market's view warm and catch it up when an invocation asks (started by
    the buyer itself, detached; one a view: a second exits at once). Ends when idle, on
    `buyer view stop`, on SIGTERM."""
    from bourse.nats.connection import shutdown
    from bourse.runtime import logs
    from bourse.runtime.supervise import run
    from bourse.view.cache import view_path
    from bourse.view.keeper import keep as keep_view

    logs.configure("info")
    s = session(ctx)
    conn = s.connection()
    tenant = s.tenant()
    path = view_path(conn.urls, s.prefix, tenant)

    async def main() -> None:
        nc = await conn.connect("bourse-view-keeper")
        try:
            await keep_view(nc, s.subjects, path, tenant, idle_s)
        finally:
            await shutdown(nc)

    run(main)


def stop(ctx: typer.Context) -> None:
    """Stop the keeper of this market's view, if one runs (the next invocation that answers
    from the view starts one again; BOURSE_VIEW_KEEPER_S=0: none)."""
    from bourse.view.cache import view_path
    from bourse.view.keeper import KeeperError, NoKeeper, ask

    s = session(ctx)
    path = view_path(s.connection().urls, s.prefix, s.tenant())
    try:
        ask(path, b"stop\n", timeout_s=5.0)
    except NoKeeper:
        said = "no keeper runs for this view"
    except KeeperError as exc:
        said = f"the keeper did not stop: {exc}"
        typer.echo(said, err=True)
        raise typer.Exit(1) from None
    else:
        said = "stopped"
    if session(ctx).json:
        session(ctx).echo_json({"keeper": said})
    else:
        typer.echo(said)
