"""``buyer apps list | status | logs | destroy``: an app as a whole (its record in the apps'
bucket, its machines on the workers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import fail
from buyer_cli.listing import own
from buyer_cli.machines import confirm
from buyer_cli.options import MachineDirectOpt, YesOpt
from buyer_cli.session import session, with_client
from buyer_cli.views import FreshOpt, from_view, view_json, with_view

if TYPE_CHECKING:
    from bourse.client import BourseClient
    from bourse.client.apps.store import AppRecord, AppStore
    from bourse.view import View
    from bourse.wire.messages import Machine

AppArg = Annotated[str, typer.Argument(metavar="NAME", help="The app's name.")]


async def app_store(c: BourseClient, create: bool = False) -> AppStore:
    from bourse.client.apps.store import AppStore

    return await AppStore.open(c.nc, c.subjects.prefix, tenant=c.tenant, create=create)


def list_apps(ctx: typer.Context) -> None:
    """The apps deployed: name, tenant, generation, regions, count and spares per region
    (the shared buyer key: every tenant's)."""
    from rich.table import Table

    from bourse.client import render

    async def go(c: BourseClient) -> list[tuple[str, AppRecord]]:
        return await (await app_store(c)).listed()

    rows = [
        {"app": s.app, "tenant": tenant, "generation": r.generation, "image": s.image,
         "regions": s.regions, "count": s.count, "spares": s.spares}
        for tenant, r in with_client(ctx, go)
        if (s := r.spec) is not None
    ]  # fmt: skip
    if session(ctx).json:
        session(ctx).echo_json({"apps": rows})
        return
    t = Table(title="apps")
    for col in rows[0] if rows else ("app",):
        t.add_column(col)
    for row in rows:
        t.add_row(*(render.safe(", ".join(v) if isinstance(v, list) else v) for v in row.values()))
    render.show(t)


async def _machines(c: BourseClient, name: str) -> tuple[list[Machine], dict[str, tuple[int, str]]]:
    """The app's machines, and each one's slot and role as the planner sees them."""
    from bourse.wire.messages import ListMachines

    rec = await (await app_store(c)).get(name)
    # one filtered listing of every region (§4.17), as a deploy lists the app's machines
    machines = (await c.list_machines(None, ListMachines(app=name))).machines
    return machines, _roles(name, rec, machines)


def _roles(name: str, rec: AppRecord | None, machines: list[Machine]) -> dict[str, tuple[int, str]]:
    """Each machine's slot and role as the planner sees them (none without a spec)."""
    if rec is None and not machines:
        fail(f"no app {name!r}: neither a spec kept nor a machine (buyer apps list)")
    if rec is None or rec.spec is None:
        return {}
    from bourse.client.apps.plan import plan

    # the roles as the planner sees them now: a spare a failover started is the primary
    now = plan(rec.spec, rec.generation, machines, rec.slots, secrets_revision=rec.secrets_revision)
    return {s.machine_id: (s.slot, s.role) for s in now.steps if s.machine_id}


def status(ctx: typer.Context, name: AppArg, fresh: FreshOpt = False) -> None:
    """Each slot of the app: machine, region, worker, state, address, check, image digest,
    restarts; from the view of the market (a machine whose worker is gone: unknown, since
    when); --fresh: its workers answer now."""
    from bourse.client import render
    from bourse.client.apps import view

    s = session(ctx)
    fresh_view: dict[str, int] | None = None
    if from_view(ctx, fresh):

        async def seen(v: View) -> tuple[list[dict[str, object]], dict[str, int]]:
            from bourse.client.apps.store import AppStore
            from bourse.view import reads

            got = reads.machines(v.db.db, reads.MachineFilter(app=name))
            machines = [own(v.tenant, x.machine()) for x in got]
            gone = {m.worker_id: x.gone_since_ms for m, x in zip(machines, got, strict=True)}
            store = await AppStore.open(v.nc, v.subjects.prefix, tenant=v.tenant)
            roles = _roles(name, await store.get(name), machines)
            alive = {w: t for w, t in gone.items() if t is not None}
            return view.status_rows(machines, roles, alive), view_json(v)

        rows, fresh_view = with_view(ctx, seen)
    else:

        async def go(c: BourseClient) -> list[dict[str, object]]:
            machines, roles = await _machines(c, name)
            return view.status_rows(machines, roles)

        rows = with_client(ctx, go)
    if s.json:
        out: dict[str, object] = {"app": name, "machines": rows}
        s.echo_json(out | ({"view": fresh_view} if fresh_view else {}))
        return
    render.show(view.status_table(name, rows))


def logs(
    ctx: typer.Context,
    name: AppArg,
    tail: Annotated[
        int, typer.Option(min=1, max=1000, metavar="N", help="Lines per machine.")
    ] = 50,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Then print new lines as they come.")
    ] = False,
    direct: MachineDirectOpt = False,
) -> None:
    """Every machine's lines, each prefixed with its machine (--json: one object a line)."""
    import anyio

    from bourse.client import render
    from bourse.client.follow import follow_logs

    json = session(ctx).json

    def emit(m: Machine, lines: list[str]) -> None:
        for line in lines:
            if json:
                typer.echo(render.as_json({"machine_id": m.machine_id, "line": line}))
            else:
                typer.echo(f"{render.visible(m.machine_id)} | {render.visible(line)}")

    async def one(c: BourseClient, m: Machine) -> None:
        if not follow:
            emit(m, (await c.logs(m.machine_id, tail)).lines)
            return
        async for got in follow_logs(c, m.machine_id, tail):
            emit(m, got.lines)

    async def go(c: BourseClient) -> None:
        machines, _ = await _machines(c, name)
        live = [m for m in machines if m.state != "destroyed"]
        if follow:
            async with anyio.create_task_group() as tg:
                for m in live:
                    tg.start_soon(one, c, m)
        else:
            for m in live:  # one machine after the other: a stable order
                await one(c, m)

    with_client(ctx, go, direct=direct)


def destroy(ctx: typer.Context, name: AppArg, yes: YesOpt = False) -> None:
    """Destroy every machine of the app, then its spec and secrets (asks first unless
    --yes, as machines destroy --app does)."""
    from bourse.client import render
    from bourse.client.apps.store import SecretStore

    machines, _ = with_client(ctx, lambda c: _machines(c, name))
    live = [m for m in machines if m.state != "destroyed"]
    if not yes:
        confirm(f"destroy app {name!r} ({len(live)} machine(s), its spec and secrets)", live)

    async def go(c: BourseClient) -> list[str]:
        gone = []
        for m in live:
            await c.machine("destroy", m.machine_id)
            gone.append(m.machine_id)
        apps = await app_store(c)
        rec = await apps.get(name)
        await apps.retire(name)
        if rec is not None and rec.secrets:
            secrets = await SecretStore.open(c.nc, c.subjects.prefix, tenant=c.tenant)
            await secrets.unset(name, list(rec.secrets))
        return gone

    gone = with_client(ctx, go)
    if session(ctx).json:
        session(ctx).echo_json({"app": name, "destroyed": gone})
    else:
        for mid in gone:
            typer.echo(f"destroyed {render.visible(mid)}")
        typer.echo(f"app {render.visible(name)}: its spec and secrets removed")
