"""``buyer machines list``: the machines of the fleet, from the view of the market or
(--fresh) as every worker answers now, with filters; what a listing lacks said on stderr."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import fail, parse_labels
from buyer_cli.options import EXIT_UNFILLED, MachineDirectOpt
from buyer_cli.session import session, with_client
from buyer_cli.views import FreshOpt, from_view, gone_line, read_view

if TYPE_CHECKING:
    from sqlite3 import Connection

    from bourse.client import Listing
    from bourse.view.reads import MachineFilter, Seen
    from bourse.wire.messages import Machine

# bourse.wire.messages.MachineState's values, for --state and its help: that module loads
# msgspec and ulid (a quarter of `buyer --help`), which the help does not need; the two are
# checked to agree (tests/unit/test_cli_help.py).
MACHINE_STATES = ("reserved", "starting", "started", "stopping", "stopped", "failed", "destroyed")


def _states(values: list[str] | None) -> list[str]:
    """``--state`` values, each a machine state, or one line naming the valid ones."""
    for v in values or []:
        if v not in MACHINE_STATES:
            fail(f"unknown state {v!r}: use one of {', '.join(MACHINE_STATES)}")
    return list(dict.fromkeys(values or []))


def list_machines(
    ctx: typer.Context,
    worker: Annotated[
        str | None,
        typer.Option(
            metavar="WORKER",
            help="Only this worker's machines (through the exchange; --direct: to the worker).",
        ),
    ] = None,
    region: Annotated[
        list[str] | None,
        typer.Option(
            metavar="REGION", help="A region to list (repeatable; default: every region)."
        ),
    ] = None,
    app_name: Annotated[
        str | None,
        typer.Option(
            "--app", metavar="NAME", help="Only the machines of this app (metadata app=NAME)."
        ),
    ] = None,
    state: Annotated[
        list[str] | None,
        typer.Option(
            metavar="STATE",
            help=f"Only machines in this state (repeatable): {', '.join(MACHINE_STATES)}.",
        ),
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY=VALUE",
            help="Only machines whose metadata has KEY=VALUE (repeatable; all must match). "
            "Machines carry their order's metadata (--meta, --app), not its --label "
            "constraints.",
        ),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="Include destroyed machines.")] = False,
    direct: MachineDirectOpt = False,
    fresh: FreshOpt = False,
) -> None:
    """Machines of every worker in every region (or those given), sorted by region, worker
    and age, with filters; --worker: one worker's. From the view of the market (a machine
    whose worker is gone: unknown, since when); --fresh: every worker answers now, in pages.
    Exit 2 when a region asked for (or, with none given, any region) has no worker that
    beats (--fresh: answers), or a worker's answer is missing."""
    if from_view(ctx, fresh or direct):
        from bourse.view.reads import MachineFilter

        if region and worker is not None:
            fail("--region and --worker do not go together: a worker is in one region")
        f = MachineFilter(
            regions=tuple(dict.fromkeys(region or ())),
            worker=worker or "",
            app=app_name or "",
            states=tuple(_states(state)),
            # checked as labels only when given: that loads the wire's types
            labels=tuple(parse_labels(label, "--label").items()) if label else (),
            include_destroyed=all_,
        )
        _list_from_view(ctx, f)
        return
    from bourse.client import Listing, render
    from bourse.wire.messages import ListMachines

    req = ListMachines(
        include_destroyed=all_,
        states=_states(state),  # type: ignore[arg-type]  # checked against MachineState
        app=app_name or "",
        labels=parse_labels(label, "--label"),
    )
    if worker is not None:
        if region:
            fail("--region and --worker do not go together: a worker is in one region")
        wid = worker
        listed = with_client(ctx, lambda c: c.machines(wid, request=req), direct=direct)
        if session(ctx).json:
            regions = sorted({m.region for m in listed.machines})
            session(ctx).echo_json(
                Listing(machines=listed.machines, complete=True, regions=regions)
            )
        else:
            render.show(render.machines(listed.machines))  # as before: with order ids
        return
    if direct:
        fail("--direct goes with --worker (a listing of every worker asks the suppliers anyway)")
    got = with_client(ctx, lambda c: c.list_machines(region or None, req))
    if session(ctx).json:
        session(ctx).echo_json(got)
    elif got.machines:
        render.show(render.machine_listing(got.machines))
    elif got.regions:
        typer.echo("no machine matches")
    _listing_problems(got, region or [])


def _list_from_view(ctx: typer.Context, f: MachineFilter) -> None:
    """``machines list`` from the view: the machines as their workers last published them,
    those of a worker gone shown as unknown (JSON: ``gone``, worker -> since when)."""
    s = session(ctx)
    if s.json and not f.labels and not s.tenant():
        _json_from_view(ctx, f)
        return

    def go(db: Connection, fresh: dict[str, int]) -> tuple[list[Seen], list[str], dict[str, int]]:
        from bourse.view import reads

        return reads.machines(db, f), reads.beating_regions(db), fresh

    seen, regions, fresh = read_view(ctx, go)
    from bourse.client import render

    tenant = s.tenant()
    gone = {x.machine().worker_id: x.gone_since_ms for x in seen if x.gone_since_ms is not None}
    machines = [own(tenant, x.machine()) for x in seen] if tenant or not s.json else []
    if s.json:
        listed: list[object] = list(machines) if tenant else [x.json for x in seen]
        s.echo_json(
            {"machines": listed, "complete": True, "missing": [], "regions": regions,
             "errors": [], "gone": gone, "view": fresh}
        )  # fmt: skip
    elif machines:
        render.show(render.machine_listing(machines, gone=gone))
    elif regions:
        typer.echo("no machine matches")
    line = gone_line(gone)
    if line and not s.json:
        typer.echo(line, err=True)
    _problems([], regions, [], list(f.regions))


def _json_from_view(ctx: typer.Context, f: MachineFilter) -> None:
    """``machines list --json`` from the view with the shared key: its rows as the stream
    holds them, written as SQLite reads them (``reads.write_machines_json``), neither
    decoded nor encoded again, nor held whole (a tenant's are decoded: its order ids are
    shown without their scope)."""
    s = session(ctx)

    def go(db: Connection, fresh: dict[str, int]) -> list[str]:
        import msgspec

        from bourse.view import reads

        write = s.stdout_bytes()
        write(b'{"machines":')
        gone = reads.write_machines_json(db, f, write)
        regions = reads.beating_regions(db)
        rest = {"complete": True, "missing": [], "regions": regions, "errors": [],
                "gone": gone, "view": fresh}  # fmt: skip
        write(b"," + msgspec.json.encode(rest)[1:] + b"\n")  # the object's rest: past its "{"
        s.flush_stdout()
        return regions

    regions = read_view(ctx, go)
    _problems([], regions, [], list(f.regions))


def own(tenant: str, m: Machine) -> Machine:
    """A machine as its tenant sees it: its own order id (the scope taken off)."""
    from bourse.wire.tenancy import unscoped

    return unscoped(tenant, m) if tenant else m


def _listing_problems(got: Listing, regions: list[str]) -> None:
    """One line on stderr per problem of a listing (see :func:`_problems`)."""
    _problems(got.errors, got.regions, got.missing, regions)


def _problems(errors: list[str], found: list[str], missing: list[str], asked: list[str]) -> None:
    """One line on stderr per problem (a region ``asked`` for, or with none asked any
    region, not ``found``; missing workers; a supplier's error); exit 2 if there was one."""
    problems = [f"supplier: {e}" for e in errors]
    if not asked and not found:
        problems.append("no worker answers in any region")
    problems += [
        f"no worker answers in region {r!r}" for r in dict.fromkeys(asked) if r not in found
    ]
    if missing:
        shown = ", ".join(missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        problems.append(f"incomplete: no (whole) answer from worker(s) {shown}{more}")
    if not problems:
        return
    from bourse.client import render

    for p in problems:
        typer.echo(render.visible(p), err=True)
    raise typer.Exit(EXIT_UNFILLED)
