"""``buyer place``: one immediate-or-cancel order, its dry run (--dry-run) and the reasons
of an unfilled one (--explain)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import fail, parse_labels
from bourse.runtime.defaults import DEFAULT_CHECK_INTERVAL_S, DEFAULT_CHECK_TIMEOUT_S
from bourse.wire.limits import DEFAULT_DEADLINE_MS
from buyer_cli.options import (
    EXIT_UNFILLED,
    CheckIntervalOpt,
    CheckOpt,
    CheckTimeoutOpt,
    CpusOpt,
    DeadlineOpt,
    DirectOpt,
    DiskOpt,
    EnvOpt,
    GpusOpt,
    ImageOpt,
    LabelOpt,
    MemoryOpt,
    MinScoreOpt,
    PortOpt,
    RestartOpt,
    flag_names,
    reach,
)
from buyer_cli.session import session, with_client

if TYPE_CHECKING:
    from bourse.client import BourseClient, DryRun
    from bourse.wire.messages import Machine, Placed, PlaceOrder, Unfilled

RegionOpt = Annotated[str, typer.Option(metavar="REGION", help="Region to place in (strict).")]


def place(
    ctx: typer.Context,
    region: RegionOpt,
    cpus: CpusOpt,
    memory_mb: MemoryOpt,
    image: ImageOpt,
    disk_mb: DiskOpt = 0,
    gpus: GpusOpt = 0,
    label: LabelOpt = None,
    exclude: Annotated[
        list[str] | None, typer.Option(metavar="WORKER", help="A worker to avoid (repeatable).")
    ] = None,
    min_score: MinScoreOpt = 0.0,
    deadline_ms: DeadlineOpt = DEFAULT_DEADLINE_MS,
    order_id: Annotated[
        str | None,
        typer.Option(
            metavar="ID",
            help="Idempotency key (a ULID when omitted). A given id is sent as a retry: the "
            "worker that already placed it answers first.",
        ),
    ] = None,
    meta: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="Metadata the machine carries (repeatable)."),
    ] = None,
    restart: RestartOpt = None,
    port: PortOpt = None,
    env: EnvOpt = None,
    check: CheckOpt = None,
    check_interval: CheckIntervalOpt = DEFAULT_CHECK_INTERVAL_S,
    check_timeout: CheckTimeoutOpt = DEFAULT_CHECK_TIMEOUT_S,
    start: Annotated[bool, typer.Option("--start", help="Start the machine once placed.")] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Place nothing: ask every worker of the region for its score or its reasons "
            "(exit 0 if one would take the order, else 2).",
        ),
    ] = False,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="If the order is unfilled, show every worker's reasons under it."
            " (Without it an unfilled order's detail already says why, in one line.)",
        ),
    ] = False,
    direct: DirectOpt = False,
) -> None:
    """Place one immediate-or-cancel order."""
    import msgspec

    from bourse.client import render
    from bourse.wire.codec import validation_detail
    from bourse.wire.messages import Placed, PlaceOrder
    from bourse.wire.resources import cpu_fields

    reached = reach(port, env, check, check_interval, check_timeout)
    raw: dict[str, object] = {
        "region": region,
        "resources": {**cpu_fields(cpus), "memory_mb": memory_mb, "disk_mb": disk_mb, "gpus": gpus},
        "image": image,
        "constraints": parse_labels(label),
        "exclude_workers": exclude or [],
        "min_score": min_score,
        "deadline_ms": deadline_ms,
        "metadata": dict(pair.partition("=")[::2] for pair in meta or [])
        | ({"restart": restart} if restart is not None else {}),
        **({"restart": restart} if restart is not None else {}),
        **{k: v for k, v in reached.items() if v},
    }
    if order_id:
        raw["order_id"] = order_id
        raw["retry"] = True  # the id may have been placed before (I3)
    try:
        order = msgspec.convert(raw, PlaceOrder, strict=True)
    except msgspec.ValidationError as exc:
        fail(f"invalid order: {flag_names(validation_detail(exc))}")
    if dry_run:
        if start:
            fail("--dry-run places nothing: --start does not apply")
        _dry_run(ctx, order)

    async def go(c: BourseClient) -> tuple[Placed | Unfilled, Machine | None, DryRun | None]:
        r = await c.place(order)
        if isinstance(r, Placed):
            return r, await c.machine("start", r.machine_id) if start else None, None
        # Only now that it is unfilled: ask the region why (§5.4); one gather serves the
        # detail and --explain.
        why = await c.explain(order) if explain else None
        return await c.reasons(order, r, why), None, why

    r, machine, why = with_client(ctx, go, direct=direct, places=True)
    if session(ctx).json:
        outcome = "placed" if isinstance(r, Placed) else "unfilled"
        session(ctx).echo_json(
            {"outcome": outcome, "result": r, "machine": machine, "explain": why}
        )
    else:
        render.outcome(r)
        if machine is not None:
            typer.echo(render.visible(f"  machine {machine.machine_id} is {machine.state}"))
        if why is not None:
            _show_dry_run(why)
    if not isinstance(r, Placed):
        raise typer.Exit(EXIT_UNFILLED)


def _dry_run(ctx: typer.Context, order: PlaceOrder) -> None:
    """``place --dry-run``: every worker's verdict, nothing placed or held."""
    d = with_client(ctx, lambda c: c.explain(order))
    if session(ctx).json:
        session(ctx).echo_json(d)
    else:
        _show_dry_run(d)
    raise typer.Exit(0 if d.winner else EXIT_UNFILLED)


def _show_dry_run(d: DryRun) -> None:
    from bourse.client import render

    render.show(render.dry_run(d))
    render.console.print(render.dry_run_summary(d))
