"""``buyer machines``: show one machine, start / stop / restart /
destroy one, several, or those an app or labels select (listed, then acted on: the wire has
one machine a request, and no restart: a stop, then a start), and print what a machine
printed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import error_fields, fail, parse_labels
from buyer_cli.listing import own
from buyer_cli.options import (
    MachineDirectOpt,
    MachineIdArg,
    YesOpt,
    check_machine_id,
)
from buyer_cli.session import session, with_client
from buyer_cli.views import FreshOpt, from_view, read_view

if TYPE_CHECKING:
    from sqlite3 import Connection

    from bourse.client import BourseClient
    from bourse.view.reads import Seen
    from bourse.wire.messages import Machine

# Those of a machine that runs (what a restart selects: bourse/client/policy.py RUNS).
RUNNING = ("starting", "started", "stopping")


def show(
    ctx: typer.Context,
    machine_id: MachineIdArg,
    direct: MachineDirectOpt = False,
    fresh: FreshOpt = False,
) -> None:
    """One machine: its state, last exit, addresses, checks and health. From the view of the
    market; --fresh: its worker answers now."""
    if from_view(ctx, fresh or direct):
        _show_from_view(ctx, machine_id)
        return
    m = with_client(ctx, lambda c: c.machine("get", machine_id), direct=direct)
    verb_shown(ctx, m)
    if not session(ctx).json:
        _shown_more(m)


def _machine_ids(values: list[str] | None) -> list[str]:
    return [check_machine_id(v) for v in values or []]


MachineIdsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="<worker_id>~<ulid>, one or several; or none, with --app or --label",
        metavar="MACHINE_ID",
        callback=_machine_ids,
        show_default=False,
    ),
]
SelectAppOpt = Annotated[
    str | None,
    typer.Option(
        "--app", metavar="NAME", help="Every live machine of this app (metadata app=NAME)."
    ),
]
SelectLabelOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--label",
        metavar="KEY=VALUE",
        help="Every live machine whose metadata has KEY=VALUE (repeatable: all must match; "
        "with --app: of that app).",
    ),
]
SelectRegionOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="REGION",
        help="With --app or --label: only in this region (repeatable; default: every region).",
    ),
]


@dataclass(frozen=True)
class Chosen:
    """The machines a verb acts on: given by id, or selected (listed) by app and labels."""

    ids: list[str]
    app: str | None = None
    listed: list[Machine] | None = None  # None: given by id

    @property
    def one(self) -> bool:
        """One machine, given by its id."""
        return self.listed is None and len(self.ids) == 1


def _choose(
    ctx: typer.Context,
    ids: list[str] | None,
    app_name: str | None,
    label: list[str] | None,
    region: list[str] | None,
    direct: bool,
    states: tuple[str, ...] = (),
) -> Chosen:
    """The ids given, or (``--app``, ``--label``) the live machines that match (``states``:
    those in one of them), listed in ``region`` or every region; one line if the two ways
    are mixed or neither is given."""
    labels = parse_labels(label, "--label")
    selecting = app_name is not None or bool(labels)
    if bool(ids) == selecting:
        fail("give MACHINE_IDs, or --app NAME and/or --label KEY=VALUE (one way of the two)")
    if region and not selecting:
        fail("--region goes with --app or --label")
    if not selecting:
        return Chosen(ids or [])
    from bourse.wire.messages import ListMachines

    req = ListMachines(app=app_name or "", labels=labels, states=list(states))  # type: ignore[arg-type]  # MACHINE_STATES
    got = with_client(ctx, lambda c: c.list_machines(region or None, req), direct=direct)
    if got.missing:
        typer.echo(
            f"incomplete: no answer from worker(s) {', '.join(got.missing[:10])}: their "
            "machines are not among these",
            err=True,
        )
    return Chosen([m.machine_id for m in got.machines], app_name, got.machines)


def _act(ctx: typer.Context, verb: str, chosen: Chosen, direct: bool) -> list[Machine]:
    """``verb`` on every chosen machine, each whatever became of the others; the machines
    as they are after, shown (a table, or JSON: ``{"machine"}`` for one given by id, as
    before there were several, but ``destroy``'s, always ``{"machines"}``); those not done
    are one error line naming each (exit 1)."""
    from bourse.client import policy, render

    ids = chosen.ids
    done, failed = with_client(ctx, lambda c: policy.on_each(c, verb, ids), direct=direct)
    one = chosen.one and verb != "destroy"
    shape = {"machine": done[0]} if one and done else {"machines": done}
    if failed:
        error_fields(ctx, **({} if one else shape))
        if done and not session(ctx).json:
            render.show(render.machines(done))
        fail("; ".join(f"{verb} {mid}: {why}" for mid, why in failed.items()))
    if session(ctx).json:
        session(ctx).echo_json(shape)
    elif done:
        render.show(render.machines(done))
    return done


def _none_chosen(ctx: typer.Context, chosen: Chosen, verb: str) -> bool:
    """Nothing matched a selection: said (``{"machines": []}`` with --json); True."""
    if chosen.ids:
        return False
    if session(ctx).json:
        session(ctx).echo_json({"machines": []})
    elif chosen.app is not None:
        typer.echo(f"app {chosen.app!r} has no live machines: nothing to {verb}")
    else:
        typer.echo(f"no live machine matches: nothing to {verb}")
    return True


def selecting(verb: str, help_text: str, states: tuple[str, ...] = ()) -> Callable[..., None]:
    """``machines start`` and ``restart``: ``verb`` on the machines given, or on those the
    selectors choose (``states``: only those in one of them)."""

    def command(
        ctx: typer.Context,
        machine_ids: MachineIdsArg = None,
        app_name: SelectAppOpt = None,
        label: SelectLabelOpt = None,
        region: SelectRegionOpt = None,
        direct: MachineDirectOpt = False,
    ) -> None:
        chosen = _choose(ctx, machine_ids, app_name, label, region, direct, states)
        if not _none_chosen(ctx, chosen, verb):
            _act(ctx, verb, chosen, direct)

    command.__doc__ = help_text
    return command


def _shown_more(m: Machine) -> None:
    """``machines show``'s lines under the table: its last exit, how it is reached."""
    from bourse.client import render

    render.console.print(render.last_exit(m))
    for line in render.reach(m):
        typer.echo(line)


def _show_from_view(ctx: typer.Context, machine_id: str) -> None:
    """``machines show`` from the view: ``{"machine", "worker_gone_since_ms", "view"}``; a
    machine the view does not have (yet) is asked of its worker (its id names it)."""
    s = session(ctx)

    def go(db: Connection, fresh: dict[str, int]) -> tuple[Seen | None, dict[str, int]]:
        from bourse.view import reads

        return reads.machine(db, machine_id), fresh

    seen, fresh = read_view(ctx, go)
    if seen is None:  # not (yet) in the view, e.g. placed a moment ago: its worker says
        m = with_client(ctx, lambda c: c.machine("get", machine_id))
        verb_shown(ctx, m)
        if not s.json:
            _shown_more(m)
        return
    m = own(s.tenant(), seen.machine())
    if s.json:
        s.echo_json({"machine": m, "worker_gone_since_ms": seen.gone_since_ms, "view": fresh})
        return
    from bourse.client import render

    gone = {} if seen.gone_since_ms is None else {m.worker_id: seen.gone_since_ms}
    render.show(render.machines([m], gone))
    _shown_more(m)


start = selecting("start", "Start machines: those given, or those --app and --label select.")
restart = selecting(
    "restart",
    "Restart machines (stop, then start): those given, or those --app and --label select "
    "that run (a spare or a stopped machine is left as it is).",
    RUNNING,
)


QueueOpt = Annotated[
    bool,
    typer.Option(
        "--queue-if-away",
        help="When the machine's worker does not answer, keep the command for it: the "
        "worker applies it when it is back, before it resumes its machines.",
    ),
]


def stop(
    ctx: typer.Context,
    machine_ids: MachineIdsArg = None,
    app_name: SelectAppOpt = None,
    label: SelectLabelOpt = None,
    region: SelectRegionOpt = None,
    queue_if_away: QueueOpt = False,
    direct: MachineDirectOpt = False,
) -> None:
    """Stop machines: those given, or those --app and --label select. With --queue-if-away
    (one MACHINE_ID), a machine whose worker does not answer is stopped when it is back."""
    chosen = _choose(ctx, machine_ids, app_name, label, region, direct)
    if queue_if_away:
        if not chosen.one:
            fail("--queue-if-away goes with one MACHINE_ID")
        _kept_or_shown(ctx, "stop", chosen.ids[0], direct)
    elif not _none_chosen(ctx, chosen, "stop"):
        _act(ctx, "stop", chosen, direct)


def _kept_or_shown(ctx: typer.Context, verb: str, machine_id: str, direct: bool) -> None:
    """``verb`` (stop, destroy) kept for the worker when it does not answer: the machine as
    it is after, or the command queued for its worker."""
    from bourse.wire.messages import Machine

    got = with_client(ctx, lambda c: c.machine_or_kept(verb, machine_id), direct=direct)
    if isinstance(got, Machine) and verb == "destroy":
        _destroyed(ctx, [got])
    elif isinstance(got, Machine):
        verb_shown(ctx, got)
    elif session(ctx).json:
        session(ctx).echo_json({"queued": got})
    else:
        typer.echo(
            f"{verb} of {machine_id} queued for worker {got.worker_id} (command "
            f"{got.command_id}): applied when the worker is back, before it resumes its "
            "machines"
        )


def verb_shown(ctx: typer.Context, m: Machine) -> None:
    """One machine after a verb: ``{"machine": …}`` with --json, else a table."""
    if session(ctx).json:
        session(ctx).echo_json({"machine": m})
        return
    from bourse.client import render

    render.show(render.machines([m]))


def logs(
    ctx: typer.Context,
    machine_id: MachineIdArg,
    tail: Annotated[
        int, typer.Option(min=1, max=1000, metavar="N", help="How many lines, the last ones.")
    ] = 100,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Then print new lines as they come (Ctrl-C stops)."),
    ] = False,
    direct: MachineDirectOpt = False,
) -> None:
    """The last lines a machine printed (process driver); --follow: and what it prints next."""
    json = session(ctx).json
    if follow:
        with_client(ctx, lambda c: _follow(c, machine_id, tail, json), direct=direct)
        return
    out = with_client(ctx, lambda c: c.logs(machine_id, tail), direct=direct)
    if json:
        session(ctx).echo_json(out)
        return
    if out.truncated:
        typer.echo("... (older lines left out)")
    for line in out.lines:
        typer.echo(line)


async def _follow(c: BourseClient, machine_id: str, tail: int, json: bool) -> None:
    """Print the tail, then new lines as they come (one MachineLogs per line with --json)."""
    from bourse.client import render
    from bourse.client.follow import follow_logs

    async for got in follow_logs(c, machine_id, tail):
        if json:
            typer.echo(render.as_json(got))
            continue
        if got.truncated:
            typer.echo("... (lines left out)")
        for line in got.lines:
            typer.echo(line)


def destroy(
    ctx: typer.Context,
    machine_ids: MachineIdsArg = None,
    app_name: SelectAppOpt = None,
    label: SelectLabelOpt = None,
    region: SelectRegionOpt = None,
    yes: YesOpt = False,
    queue_if_away: QueueOpt = False,
    direct: MachineDirectOpt = False,
) -> None:
    """Destroy machines and free their resources: those given, or every live machine --app
    and --label select (asks first unless --yes; an app's spec stays: buyer apps destroy
    removes it too). With --queue-if-away (one MACHINE_ID), a machine whose worker does not
    answer is destroyed when the worker is back."""
    chosen = _choose(ctx, machine_ids, app_name, label, region, direct)
    if queue_if_away:
        if not chosen.one:
            fail("--queue-if-away goes with one MACHINE_ID")
        _kept_or_shown(ctx, "destroy", chosen.ids[0], direct)
        return
    if not _none_chosen(ctx, chosen, "destroy"):
        if chosen.listed is not None and not yes:
            whose = f"of app {app_name!r}" if app_name is not None else "selected"
            confirm(f"destroy {len(chosen.ids)} machine(s) {whose}", chosen.listed)
        _act(ctx, "destroy", chosen, direct)
    if app_name is not None:
        _spec_stays(ctx, app_name, direct)


def _spec_stays(ctx: typer.Context, app_name: str, direct: bool) -> None:
    """After an app's machines are destroyed: say that its spec is kept (a deploy would
    place them again) and how to remove it."""
    from buyer_cli.app_views import app_store

    async def kept(c: BourseClient) -> bool:
        rec = await (await app_store(c)).get(app_name)
        return rec is not None and rec.spec is not None

    if with_client(ctx, kept, direct=direct):
        typer.echo(
            f"app {app_name!r}: its spec stays (buyer apps list; a deploy places its machines "
            f"again): buyer apps destroy {app_name} removes it",
            err=True,
        )


def _destroyed(ctx: typer.Context, machines: list[Machine]) -> None:
    if session(ctx).json:
        session(ctx).echo_json({"machines": machines})
    else:
        from bourse.client import render

        render.show(render.machines(machines))


def confirm(what: str, machines: list[Machine]) -> None:
    """Ask on the terminal; without one (a script, a pipe) refuse: --yes says it."""
    if not sys.stdin.isatty():
        fail(f"{what}: not confirmed (no terminal to ask on); pass --yes")
    from bourse.client import render

    if machines:
        render.show(render.machines(machines))
    if not typer.confirm(f"{what}?", default=False):
        fail(f"{what}: not confirmed")
