"""``buyer deploy`` (an app converged to its spec: bourse/client/apps) and ``buyer failover``
(a spare started in a lost machine's place: bourse/client/policy.py)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import error_fields, fail, parse_labels
from bourse.runtime.defaults import (
    DEFAULT_CHECK_INTERVAL_S,
    DEFAULT_CHECK_TIMEOUT_S,
    DEFAULT_CHECK_WAIT_S,
)
from bourse.wire.limits import DEFAULT_DEADLINE_MS
from buyer_cli.options import (
    EXIT_UNFILLED,
    AppOpt,
    CheckIntervalOpt,
    CheckOpt,
    CheckTimeoutOpt,
    DeadlineOpt,
    DirectOpt,
    DiskOpt,
    EnvOpt,
    GpusOpt,
    LabelOpt,
    MinScoreOpt,
    OptionalCpusOpt,
    PortOpt,
    RestartOpt,
    check_machine_id,
    reach,
)
from buyer_cli.session import session, with_client

if TYPE_CHECKING:
    from bourse.client import BourseClient, policy
    from bourse.client.apps.apply import Applied
    from bourse.client.apps.plan import Plan
    from bourse.client.apps.spec import AppSpec

RegionsOpt = Annotated[
    list[str] | None,
    typer.Option(metavar="REGION", help="A region the app runs in (repeatable)."),
]
# Each of these builds the spec without a file (all or none of them: a file is exclusive).
SPEC_FLAGS = ("--app", "--region", "--cpus", "--memory-mb", "--image")


def _spec_from_flags(flags: Mapping[str, object], more: dict[str, object]) -> AppSpec:
    """The whole spec the flags say (they patch nothing): ``--app … --region …``."""
    if missing := [name for name, v in zip(SPEC_FLAGS, flags.values(), strict=True) if not v]:
        fail(f"deploy needs -f APP.TOML or the spec's flags: {', '.join(missing)} missing")
    from bourse.client.apps import spec as spec_mod

    app_name, region, cpus, memory_mb, image = flags.values()
    resources: dict[str, object] = {"cpus": f"{cpus}m", "memory_mb": memory_mb}
    resources |= {k: more.pop(k) for k in ("disk_mb", "gpus")}
    raw = {"app": app_name, "image": image, "regions": region, "resources": resources}
    return spec_mod.from_dict(raw | more, where="flags")


def _read_spec(path: Path) -> AppSpec:
    from bourse.client.apps import spec as spec_mod

    try:
        text = path.read_text()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    return spec_mod.parse(text, where=path.name)


def deploy(
    ctx: typer.Context,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", metavar="APP.TOML", help="The app's spec (TOML)."),
    ] = None,
    plan_only: Annotated[
        bool, typer.Option("--plan", help="Print what would change; place and hold nothing.")
    ] = False,
    app_name: Annotated[
        str | None, typer.Option("--app", metavar="NAME", help="The app's name.")
    ] = None,
    region: RegionsOpt = None,
    cpus: OptionalCpusOpt = None,
    memory_mb: Annotated[
        int | None, typer.Option(metavar="MIB", help="Memory of each machine, MiB.")
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            metavar="IMAGE",
            help="Image the machines run: NAME[:TAG], NAME@sha256:... or a catalog name.",
        ),
    ] = None,
    count: Annotated[
        int, typer.Option(min=0, metavar="N", help="Machines started per region.")
    ] = 1,
    spares: Annotated[
        int, typer.Option(min=0, metavar="N", help="Machines placed, not started, per region.")
    ] = 0,
    disk_mb: DiskOpt = 0,
    gpus: GpusOpt = 0,
    label: LabelOpt = None,
    restart: RestartOpt = None,
    port: PortOpt = None,
    env: EnvOpt = None,
    check: CheckOpt = None,
    check_interval: CheckIntervalOpt = DEFAULT_CHECK_INTERVAL_S,
    check_timeout: CheckTimeoutOpt = DEFAULT_CHECK_TIMEOUT_S,
    check_wait_s: Annotated[
        float,
        typer.Option(
            min=0.1, metavar="S", help="How long a new machine's checks may take to pass."
        ),
    ] = DEFAULT_CHECK_WAIT_S,
    drain_s: Annotated[
        float,
        typer.Option(
            min=0,
            metavar="S",
            help="How long the requests under way through the edges at a machine the deploy "
            "replaces or scales down may take.",
        ),
    ] = 30.0,
    min_score: MinScoreOpt = 0.0,
    deadline_ms: DeadlineOpt = DEFAULT_DEADLINE_MS,
    direct: DirectOpt = False,
) -> None:
    """Deploy an app: converge it to its spec (-f APP.TOML, or the flags: a whole spec,
    --port/--env/--check as `buyer place` reads them),
    updates rolling one slot at a time. --plan prints the plan only. Exit 2 when a slot is
    left unfilled or the rollout stopped (no room, checks not passing in time), 1 on an
    error."""
    import msgspec

    from bourse.client import render
    from bourse.client.apps import view
    from bourse.client.apps.apply import apply, context
    from bourse.client.apps.plan import Plan
    from bourse.client.apps.store import AppStore

    flags = {"app": app_name, "region": region, "cpus": cpus, "memory": memory_mb, "image": image}
    given = [f for f, v in zip(SPEC_FLAGS, flags.values(), strict=True) if v]
    others: dict[str, object] = {"--count": count != 1, "--spares": spares, "--gpus": gpus}
    others |= {"--disk-mb": disk_mb, "--label": label, "--restart": restart}
    others |= {"--port": port, "--env": env, "--check": check}
    others |= {"--check-interval": check_interval != DEFAULT_CHECK_INTERVAL_S}
    others |= {"--check-timeout": check_timeout != DEFAULT_CHECK_TIMEOUT_S}
    given += [f for f, v in others.items() if v]
    if file is not None and given:
        fail(f"-f and the spec's flags are exclusive (a spec is the file or the flags): {given[0]}")
    if file is not None:
        spec = _read_spec(file)
    else:
        more: dict[str, object] = {"count": count, "spares": spares, "restart": restart or ""}
        more |= {"disk_mb": disk_mb, "gpus": gpus, "labels": parse_labels(label)}
        more |= msgspec.to_builtins(reach(port, env, check, check_interval, check_timeout))
        spec = _spec_from_flags(flags, more)

    async def go(c: BourseClient) -> Plan | Applied:
        apps_kv = await AppStore.open(
            c.nc, c.subjects.prefix, tenant=c.tenant, create=not plan_only
        )
        ctx_ = await context(c, apps_kv, spec)
        if plan_only:
            return ctx_.plan()
        return await apply(
            c,
            apps_kv,
            ctx_,
            check_wait_s=check_wait_s,
            deadline_ms=deadline_ms,
            min_score=min_score,
            drain_s=drain_s,
        )

    result = with_client(ctx, go, direct=direct, places=not plan_only)
    s = session(ctx)
    if isinstance(result, Plan):
        if s.json:
            s.echo_json(view.plan_json(result))
        else:
            render.show(view.plan_table(result))
        return
    if s.json:
        s.echo_json(view.applied_json(result))
    else:
        render.show(view.applied_table(result))
    if not result.complete:
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
    from bourse.client import ClientError, policy, render

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
