"""``buyer place``: one immediate-or-cancel order, its dry run (--dry-run) and the reasons
of an unfilled one (--explain)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import error_fields, fail, parse_labels
from bourse.runtime.defaults import (
    DEFAULT_CHECK_INTERVAL_S,
    DEFAULT_CHECK_TIMEOUT_S,
    DEFAULT_START_UP_S,
)
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
    from bourse.client.starting import Watched
    from bourse.wire.messages import Placed, PlaceOrder, Unfilled

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
    start: Annotated[
        bool,
        typer.Option(
            "--start",
            help="Start the machine once placed, and watch it: exit 1 with its last exit if it "
            "ends before its checks first pass or before --start-timeout.",
        ),
    ] = False,
    start_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            metavar="SECONDS",
            help="With --start: how long the machine must run without ending (a restart is "
            "an end) when its checks have not passed before (0: do not watch).",
        ),
    ] = DEFAULT_START_UP_S,
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
    from bourse.runtime.words import in_words
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
        fail(f"invalid order: {flag_names(in_words(validation_detail(exc)))}")
    if dry_run:
        if start:
            fail("--dry-run places nothing: --start does not apply")
        _dry_run(ctx, order)

    async def go(c: BourseClient) -> tuple[Placed | Unfilled, Watched | None, DryRun | None]:
        from bourse.client.starting import watch_start

        r = await c.place(order)
        if isinstance(r, Placed):
            if not start:
                return r, None, None
            started = await c.machine("start", r.machine_id)
            return r, await watch_start(c, started, start_timeout), None
        # Only now that it is unfilled: ask the region why (§5.4); one gather serves the
        # detail and --explain.
        why = await c.explain(order) if explain else None
        return await c.reasons(order, r, why), None, why

    r, watched, why = with_client(ctx, go, direct=direct, places=True)
    machine = watched.machine if watched is not None else None
    outcome = "placed" if isinstance(r, Placed) else "unfilled"
    shown = {"outcome": outcome, "result": r, "machine": machine, "explain": why}
    if session(ctx).json and not (watched and watched.outcome == "ended"):
        session(ctx).echo_json(shown)
    elif not session(ctx).json:
        render.outcome(r)
        if isinstance(r, Placed):
            typer.echo(render.visible(_started(r, watched)))
        if why is not None:
            _show_dry_run(why)
    if watched is not None and watched.outcome == "ended":
        error_fields(ctx, **shown)
        m = watched.machine
        fail(f"machine {m.machine_id} {watched.ended()}: {render.last_exit(m, detail=True)}")
    if not isinstance(r, Placed):
        raise typer.Exit(EXIT_UNFILLED)


def _started(r: Placed, watched: Watched | None) -> str:
    """The line under a placed order: how its start went, or that nothing runs yet."""
    if watched is None:
        return f"  not started: buyer machines start {r.machine_id} (or place with --start)"
    m = watched.machine
    if watched.outcome == "passing":
        return f"  machine {m.machine_id} is {m.state}, its checks passing"
    h = m.health
    if m.state != "started" or not m.checks or watched.outcome == "ended":
        return f"  machine {m.machine_id} is {m.state}"
    said = f"{h.status}: {h.detail}".rstrip(": ") if h is not None and h.status else "not run yet"
    return f"  machine {m.machine_id} is {m.state}; its checks: {said}"


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
