"""``buyer deploy`` and ``buyer failover``: apps of machines on distinct workers with spares,
as bourse/client/policy.py decides them."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer

from bourse.client import BourseClient, ClientError, policy, render
from bourse.client.policy import Deployment
from bourse.runtime.cli import error_fields, fail, parse_labels
from bourse.wire.codec import validation_detail
from bourse.wire.limits import DEFAULT_DEADLINE_MS
from bourse.wire.messages import Resources
from bourse.wire.resources import cpu_fields
from buyer_cli.options import (
    EXIT_UNFILLED,
    AppOpt,
    CpusOpt,
    DeadlineOpt,
    DirectOpt,
    DiskOpt,
    GpusOpt,
    LabelOpt,
    MinScoreOpt,
    RestartOpt,
    check_machine_id,
    flag_names,
)
from buyer_cli.session import session, with_client

RegionsOpt = Annotated[
    list[str],
    typer.Option(metavar="REGION", help="A region to place in (repeatable: tried in order)."),
]


def deploy(
    ctx: typer.Context,
    app_name: AppOpt,
    region: RegionsOpt,
    cpus: CpusOpt,
    memory_mb: Annotated[int, typer.Option(metavar="MIB", help="Memory of each machine, MiB.")],
    image: Annotated[
        str,
        typer.Option(
            metavar="IMAGE",
            help="Image the machines run: NAME[:TAG], NAME@sha256:... or a catalog name.",
        ),
    ],
    count: Annotated[int, typer.Option(min=0, metavar="N", help="Machines to run.")] = 1,
    spares: Annotated[
        int, typer.Option(min=0, metavar="N", help="Extra machines placed, not started.")
    ] = 0,
    disk_mb: DiskOpt = 0,
    gpus: GpusOpt = 0,
    label: LabelOpt = None,
    min_score: MinScoreOpt = 0.0,
    deadline_ms: DeadlineOpt = DEFAULT_DEADLINE_MS,
    restart: RestartOpt = None,
    direct: DirectOpt = False,
) -> None:
    """Deploy an app: machines on distinct workers, plus spares (idempotent)."""
    try:
        resources = msgspec.convert(
            {**cpu_fields(cpus), "memory_mb": memory_mb, "disk_mb": disk_mb, "gpus": gpus},
            Resources,
            strict=True,
        )
    except msgspec.ValidationError as exc:
        fail(f"invalid resources: {flag_names(validation_detail(exc))}")
    constraints = parse_labels(label)

    async def go(c: BourseClient) -> Deployment:
        return await policy.deploy(
            c,
            app=app_name,
            regions=region,
            count=count,
            spares=spares,
            resources=resources,
            image=image,
            constraints=constraints,
            deadline_ms=deadline_ms,
            min_score=min_score,
            restart=restart or "",
        )

    d = with_client(ctx, go, direct=direct, places=True)
    if session(ctx).json:
        session(ctx).echo_json(render.deployment_json(d))
    else:
        render.show(render.deployment(d))
    if not d.complete:
        raise typer.Exit(EXIT_UNFILLED)


def failover(
    ctx: typer.Context,
    app_name: AppOpt,
    machine: Annotated[
        str,
        typer.Option(
            metavar="MACHINE_ID",
            help="The machine to replace (its worker is gone, or --force).",
            callback=check_machine_id,
        ),
    ],
    region: Annotated[
        list[str],
        typer.Option(
            metavar="REGION", help="A region of the app (repeatable: spares tried in order)."
        ),
    ],
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="The machine's worker still answers: stop the machine and replace it."
        ),
    ] = False,
    label: LabelOpt = None,
    deadline_ms: DeadlineOpt = DEFAULT_DEADLINE_MS,
    direct: DirectOpt = False,
) -> None:
    """Start a spare of the app in place of a machine whose worker is gone (--force: stop
    the machine first), then place a new spare as deploy would (--label as given to deploy).
    Exit 2 when no spare is left, 1 on an error; --json prints the same object whatever
    happens ("error" says what went wrong)."""
    error_fields(ctx, **render.failover_json(app_name, machine, None))
    constraints = parse_labels(label)

    async def go(c: BourseClient) -> policy.Failover:
        return await policy.failover(
            c,
            app=app_name,
            regions=region,
            machine_id=machine,
            force=force,
            constraints=constraints,
            deadline_ms=deadline_ms,
        )

    try:
        f = with_client(ctx, go, direct=direct, places=True)
    except ClientError as exc:
        if exc.code != "unfilled":
            raise
        fail(f"no failover: {exc}", EXIT_UNFILLED)
    if session(ctx).json:
        session(ctx).echo_json(render.failover_json(app_name, machine, f))
    else:
        for line in render.failover_lines(f):
            render.console.print(line)
