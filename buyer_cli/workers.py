"""``buyer workers drain | stop | start``: the operator's verbs on workers (docs/protocol.md
§4.22), each answered by the worker's supplier. Under ``bourse auth init``'s permissions only
the operator's key (``--creds operator.seed``) may use them; a market without credentials
(``bourse up``) takes them from anyone who reaches it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import error_fields, fail
from buyer_cli.session import session, with_client

if TYPE_CHECKING:
    from bourse.client import BourseClient
    from bourse.wire.messages import WorkerAction, WorkerState


def _worker_ids(values: list[str]) -> list[str]:
    from bourse.wire.subjects import is_valid_id

    for v in values:
        if not is_valid_id(v):
            raise typer.BadParameter(f"{v!r} is not a worker id (buyer fleet lists them)")
    return list(dict.fromkeys(values))


WorkerIdsArg = Annotated[
    list[str],
    typer.Argument(
        help="A worker's id, one or several (buyer fleet lists them).",
        metavar="WORKER",
        callback=_worker_ids,
    ),
]


def verb(action: WorkerAction, help_text: str) -> Callable[..., None]:
    """One of the verbs: ``action`` on each worker given, each whatever became of the
    others; a table of the workers as they are after (``{"workers": [WorkerState]}``), the
    ones that could not be reached named in one error line (exit 1)."""

    def command(ctx: typer.Context, worker_ids: WorkerIdsArg) -> None:
        from bourse.client import render
        from bourse.errors import BourseError

        async def each(c: BourseClient) -> tuple[list[WorkerState], dict[str, str]]:
            done: list[WorkerState] = []
            failed: dict[str, str] = {}
            for wid in worker_ids:
                try:
                    done.append(await c.control(wid, action))
                except BourseError as exc:
                    failed[wid] = str(exc)
            return done, failed

        done, failed = with_client(ctx, each)
        if failed:
            error_fields(ctx, workers=done)
        if session(ctx).json and not failed:
            session(ctx).echo_json({"workers": done})
        elif done and not session(ctx).json:
            render.show(render.worker_states(done))
        if failed:
            fail("; ".join(f"{action} {wid}: {why}" for wid, why in failed.items()))

    command.__doc__ = help_text
    return command


drain = verb(
    "drain",
    "Drain workers: they offer nothing more; their machines run on (start lifts it).",
)
stop = verb(
    "stop",
    "Stop workers: each leaves the market as if its supplier had stopped (its machines "
    "stop with it, or run on under --keep-machines); start brings it back.",
)
start = verb(
    "start",
    "Start workers: a stopped one applies the commands kept for it, resumes its machines "
    "and serves again; a drain the operator asked for is lifted.",
)
