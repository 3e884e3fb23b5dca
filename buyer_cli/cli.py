"""``buyer``: place orders, look at the fleet, manage machines. Thin commands over
bourse.client; ``--json`` on every command for scripts.

Exit codes: 0 placed / ok, 2 unfilled, 1 error (one clear line on stderr).
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar, get_args

import msgspec
import typer
from nats.aio.client import Client as NATS

from bourse.auction.driver import AuctionError
from bourse.client import BourseClient, ClientError, DryRun, Listing, policy, render, why_unfilled
from bourse.client.events import EventFeed, EventsError, Since, event_json, parse_since
from bourse.client.follow import follow_logs
from bourse.client.policy import Deployment
from bourse.nats.auth import AuthError, tenant_of
from bourse.nats.connection import shutdown
from bourse.runtime import logs
from bourse.runtime.cli import (
    Connection,
    CredsOpt,
    JsonOpt,
    NatsOpt,
    PrefixOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    cli_main,
    fail,
    parse_labels,
)
from bourse.runtime.supervise import run
from bourse.wire.codec import BadMessage, validation_detail
from bourse.wire.limits import DEFAULT_DEADLINE_MS, MACHINE_ID_PATTERN
from bourse.wire.messages import (
    ListMachines,
    Machine,
    MachineState,
    Placed,
    PlaceOrder,
    Resources,
    Unfilled,
    WorkerStatus,
)
from bourse.wire.resources import cpu_fields, parse_cpus
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects

app = typer.Typer(help="Bourse buyer: place machine orders on the market.", no_args_is_help=True)
machines_app = typer.Typer(help="Machines on the workers.", no_args_is_help=True)
app.add_typer(machines_app, name="machines")

T = TypeVar("T")


@dataclass(frozen=True)
class GroupTls:
    """--tls-* given before the command (``buyer --tls-ca F place ...``, documented in
    docs/security.md); carried to the command in the click context, not a global."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@app.callback()
def _callback(
    ctx: typer.Context,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
) -> None:
    """Bourse buyer: place machine orders on the market."""
    ctx.obj = GroupTls(tls_ca, tls_cert, tls_key)


def _connection(
    ctx: typer.Context,
    nats: list[str] | None,
    creds: str | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
) -> Connection:
    """The command's connection options; a --tls-* after the command wins over the same
    one given before it."""
    group = ctx.find_object(GroupTls) or GroupTls()
    return Connection.from_options(
        nats, creds, tls_ca or group.ca, tls_cert or group.cert, tls_key or group.key
    )


RegionOpt = Annotated[str, typer.Option(metavar="REGION", help="Region to place in (strict).")]


def _cpus(text: str) -> int:
    """``--cpus`` as people write it (2, 0.5, 250m), in millicores; one clear error else."""
    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# The value is in millicores once parsed (2 -> 2000, 0.5 -> 500, 250m -> 250).
CpusOpt = Annotated[
    int,
    typer.Option(
        metavar="CPUS", parser=_cpus, help="CPUs: whole (2), fractional (0.5) or millicores (250m)."
    ),
]
MemoryOpt = Annotated[int, typer.Option(metavar="MIB", help="Memory in MiB.")]
ImageOpt = Annotated[str, typer.Option(metavar="IMAGE", help="Image to run.")]
DiskOpt = Annotated[int, typer.Option(metavar="MIB", help="Disk in MiB (0: none).")]
GpusOpt = Annotated[int, typer.Option(metavar="N", help="GPUs (0: none).")]
LabelOpt = Annotated[
    list[str] | None,
    typer.Option(metavar="KEY=VALUE", help="A label the worker must have (repeatable)."),
]
MinScoreOpt = Annotated[
    float,
    typer.Option(metavar="SCORE", help="Least score (0-1) an offer needs to be taken."),
]
DeadlineOpt = Annotated[
    int, typer.Option(metavar="MS", help="How long the auction may take, in milliseconds.")
]
AppOpt = Annotated[
    str, typer.Option("--app", metavar="NAME", help="The app's name (its machines carry it).")
]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]

RESTART_POLICIES = ("no", "on-failure", "always")  # the process driver's (order metadata)


def _restart(value: str | None) -> str | None:
    if value is not None and value not in RESTART_POLICIES:
        raise typer.BadParameter(f"{value!r} is not a restart policy: use no, on-failure or always")
    return value


RestartOpt = Annotated[
    str | None,
    typer.Option(
        help="Restart the machine's process when it ends: no, on-failure (non-zero exit, "
        "signal, oom), always (process driver; sent as metadata restart=...). Default: "
        "the image's policy.",
        metavar="POLICY",
        callback=_restart,
    ),
]
DirectOpt = Annotated[
    bool, typer.Option("--direct", help="Run the auction here; no exchange needed.")
]
# On a machine command --direct skips the exchange's routing, not an auction.
MachineDirectOpt = Annotated[
    bool, typer.Option("--direct", help="Talk to the worker directly; no exchange needed.")
]
EXIT_UNFILLED = 2
# JSON paths of a PlaceOrder (or Resources) -> the flag a person typed.
_FLAGS = {
    "resources.cpus": "--cpus",
    "resources.cpu_millis": "--cpus",
    "resources.memory_mb": "--memory-mb",
    "resources.disk_mb": "--disk-mb",
    "resources.gpus": "--gpus",
    "cpus": "--cpus",
    "cpu_millis": "--cpus",
    "memory_mb": "--memory-mb",
    "disk_mb": "--disk-mb",
    "gpus": "--gpus",
    "region": "--region",
    "image": "--image",
    "constraints": "--label",
    "exclude_workers": "--exclude",
    "min_score": "--min-score",
    "deadline_ms": "--deadline-ms",
    "order_id": "--order-id",
    "metadata": "--meta",
}
_PATH = re.compile(r" - at `\$\.([A-Za-z_.]+)[^`]*`")


def _flag_names(text: str) -> str:
    """``Expected `int` >= 1 - at `$.resources.cpus` `` -> ``... (--cpus)``."""

    def sub(m: re.Match[str]) -> str:
        path = m.group(1)
        for key in sorted(_FLAGS, key=len, reverse=True):
            if path == key or path.startswith(key + "."):
                return f" ({_FLAGS[key]})"
        return m.group(0)

    return _PATH.sub(sub, text)


def _tenant(conn: Connection) -> str:
    """The tenant a ``--creds`` file is for ("" for the operator's shared buyer key)."""
    if not conn.creds:
        return ""
    try:
        return tenant_of(conn.creds)
    except AuthError as exc:
        fail(str(exc))
    raise AssertionError("unreachable")


def _with_client(
    conn: Connection,
    prefix: str,
    direct: bool,
    fn: Callable[[BourseClient], Awaitable[T]],
) -> T:
    logs.configure("warning")
    try:
        subjects = Subjects(prefix)
    except ValueError as exc:
        fail(str(exc))

    async def main() -> T:
        try:
            nc = await conn.connect("bourse-buyer", service=False)
        except Exception as exc:
            fail(f"cannot connect to NATS at {', '.join(conn.urls)}: {exc or type(exc).__name__}")
        client = BourseClient(nc, subjects, direct=direct, tenant=_tenant(conn))
        try:
            return await fn(client)
        except (ClientError, AuctionError) as exc:
            fail(str(exc))
        finally:
            await client.close()
            await nc.drain()
        raise AssertionError("unreachable")

    return asyncio.run(main())


@app.command()
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
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Place one immediate-or-cancel order."""
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
    }
    if order_id:
        raw["order_id"] = order_id
        raw["retry"] = True  # the id may have been placed before (I3)
    try:
        order = msgspec.convert(raw, PlaceOrder, strict=True)
    except msgspec.ValidationError as exc:
        fail(f"invalid order: {_flag_names(validation_detail(exc))}")
    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)
    if dry_run:
        if start:
            fail("--dry-run places nothing: --start does not apply")
        _dry_run(conn, prefix, order, json)

    async def go(c: BourseClient) -> tuple[Placed | Unfilled, Machine | None, DryRun | None]:
        r = await c.place(order)
        machine: Machine | None = None
        why: DryRun | None = None
        if start and isinstance(r, Placed):
            machine = await c.machine("start", r.machine_id)
        if isinstance(r, Unfilled) and (explain or r.reason == "no_offers"):
            # Only now that it is unfilled: ask the region why (§5.4); one gather serves
            # the detail and --explain.
            why = await c.explain(order)
            if r.reason == "no_offers":
                r = _with_reasons(r, why_unfilled(order, why))
        return r, machine, why if explain else None

    r, machine, why = _with_client(conn, prefix, direct, go)
    if json:
        out: dict[str, object] = {"result": r, "machine": machine}
        if explain:
            out["explain"] = why
        typer.echo(render.as_json(out))
    else:
        render.outcome(r)
        if machine is not None:
            render.console.print(f"  machine {machine.machine_id} is {machine.state}")
        if why is not None:
            render.show(render.dry_run(why))
            render.console.print(render.dry_run_summary(why))
    if not isinstance(r, Placed):
        raise typer.Exit(EXIT_UNFILLED)


def _with_reasons(r: Unfilled, detail: str | None) -> Unfilled:
    return r if detail is None else msgspec.structs.replace(r, detail=detail)


def _dry_run(conn: Connection, prefix: str, order: PlaceOrder, json: bool) -> None:
    """``place --dry-run``: every worker's verdict, nothing placed or held."""
    d = _with_client(conn, prefix, False, lambda c: c.explain(order))
    if json:
        typer.echo(render.as_json(d))
    else:
        render.show(render.dry_run(d))
        render.console.print(render.dry_run_summary(d))
    raise typer.Exit(0 if d.winner else EXIT_UNFILLED)


@app.command()
def fleet(
    ctx: typer.Context,
    region: Annotated[
        list[str] | None,
        typer.Option(metavar="REGION", help="A region to ask (repeatable; default: every region)."),
    ] = None,
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Every worker's capacity, commitments, holds and images (status scatter-gather), in
    every region or those given. Exit 2 when a region asked for (or, with none given, any
    region) has no worker that answers."""

    async def go(c: BourseClient) -> list[WorkerStatus]:
        if not region:
            return await c.status(None)
        return [s for r in dict.fromkeys(region) for s in await c.status(r)]

    statuses = _with_client(
        _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key), prefix, False, go
    )
    if json:
        typer.echo(render.as_json(statuses))
    elif statuses:  # nobody answered: the line on stderr says so, no empty table
        render.show(render.fleet(statuses))
    if not region and not statuses:
        typer.echo("no worker answers in any region", err=True)
        raise typer.Exit(2)
    answered = {s.region for s in statuses}
    silent = [r for r in dict.fromkeys(region or ()) if r not in answered]
    for r in silent:
        typer.echo(f"no worker answers in region {r!r}", err=True)
    if silent:
        raise typer.Exit(2)


MACHINE_STATES: tuple[str, ...] = get_args(MachineState)


def _states(values: list[str] | None) -> list[str]:
    """``--state`` values, each a machine state, or one line naming the valid ones."""
    for v in values or []:
        if v not in MACHINE_STATES:
            fail(f"unknown state {v!r}: use one of {', '.join(MACHINE_STATES)}")
    return list(dict.fromkeys(values or []))


@machines_app.command("list")
def machines_list(
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
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Machines of every worker in every region (or those given), sorted by region, worker
    and age, with filters; --worker: one worker's. Every worker answers in pages, so any
    number of machines lists completely. Exit 2 when a region asked for (or, with none
    given, any region) has no worker that answers, or a worker's answer is missing."""
    req = ListMachines(
        include_destroyed=all_,
        states=_states(state),  # type: ignore[arg-type]  # checked against MachineState
        app=app_name or "",
        labels=parse_labels(label, "--label"),
    )
    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)
    if worker is not None:
        if region:
            fail("--region and --worker do not go together: a worker is in one region")
        wid = worker
        listed = _with_client(conn, prefix, direct, lambda c: c.machines(wid, request=req))
        if json:
            typer.echo(render.as_json(listed))
        else:
            render.show(render.machines(listed.machines))  # as before: with order ids
        return
    if direct:
        fail("--direct goes with --worker (a listing of every worker asks the suppliers anyway)")
    got = _with_client(conn, prefix, False, lambda c: c.list_machines(region or None, req))
    if json:
        typer.echo(render.as_json(got))
    elif got.machines:
        render.show(render.machine_listing(got.machines))
    elif got.regions:
        typer.echo("no machine matches")
    _listing_problems(got, region or [])


def _listing_problems(got: Listing, regions: list[str]) -> None:
    """One line on stderr per problem (a silent region, missing workers, a supplier's
    error); exit 2 if there was one."""
    problems = [f"supplier: {e}" for e in got.errors]
    if not regions and not got.regions:
        problems.append("no worker answers in any region")
    problems += [
        f"no worker answers in region {r!r}" for r in dict.fromkeys(regions) if r not in got.regions
    ]
    if got.missing:
        shown = ", ".join(got.missing[:10])
        more = f" and {len(got.missing) - 10} more" if len(got.missing) > 10 else ""
        problems.append(f"incomplete: no (whole) answer from worker(s) {shown}{more}")
    for p in problems:
        typer.echo(p, err=True)
    if problems:
        raise typer.Exit(2)


def _machine_id(value: str) -> str:
    """A machine id as the CLI takes it, or a usage error that says what one looks like."""
    if re.match(MACHINE_ID_PATTERN, value) is None:
        raise typer.BadParameter(
            f"{value!r} is not a machine id: one looks like <worker_id>~<ulid>, e.g. "
            "mad-1~01JD5X7Q2M4N6P8R0T2V4X6Z8B (copy it from `buyer place` or `machines list`)"
        )
    return value


MachineIdArg = Annotated[
    str, typer.Argument(help="<worker_id>~<ulid>", metavar="MACHINE_ID", callback=_machine_id)
]


def _verb(verb: str, help_text: str) -> None:
    def command(
        ctx: typer.Context,
        machine_id: MachineIdArg,
        direct: MachineDirectOpt = False,
        json: JsonOpt = False,
        nats: NatsOpt = None,
        creds: CredsOpt = None,
        tls_ca: TlsCaOpt = None,
        tls_cert: TlsCertOpt = None,
        tls_key: TlsKeyOpt = None,
        prefix: PrefixOpt = DEFAULT_PREFIX,
    ) -> None:
        m = _with_client(
            _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key),
            prefix,
            direct,
            lambda c: c.machine(verb, machine_id),
        )
        if json:
            typer.echo(render.as_json(m))
        else:
            render.show(render.machines([m]))
            if verb == "get":
                render.console.print(render.last_exit(m))

    command.__doc__ = help_text
    machines_app.command("show" if verb == "get" else verb)(command)


@machines_app.command("logs")
def machines_logs(
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
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """The last lines a machine printed (process driver); --follow: and what it prints next."""
    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)
    if follow:
        _with_client(conn, prefix, direct, lambda c: _follow(c, machine_id, tail, json))
        return
    out = _with_client(conn, prefix, direct, lambda c: c.logs(machine_id, tail))
    if json:
        typer.echo(render.as_json(out))
        return
    if out.truncated:
        typer.echo("... (older lines left out)")
    for line in out.lines:
        typer.echo(line)


async def _follow(c: BourseClient, machine_id: str, tail: int, json: bool) -> None:
    """Print the tail, then new lines as they come (one MachineLogs per line with --json)."""
    async for got in follow_logs(c, machine_id, tail):
        if json:
            typer.echo(render.as_json(got))
            continue
        if got.truncated:
            typer.echo("... (lines left out)")
        for line in got.lines:
            typer.echo(line)


_verb("get", "One machine.")
_verb("start", "Start a machine.")
_verb("stop", "Stop a machine.")


@machines_app.command("destroy")
def machines_destroy(
    ctx: typer.Context,
    machine_id: Annotated[
        str | None,
        typer.Argument(
            help="<worker_id>~<ulid>; or none, with --app",
            metavar="MACHINE_ID",
            callback=lambda v: None if v is None else _machine_id(v),
        ),
    ] = None,
    app_name: Annotated[
        str | None,
        typer.Option(
            "--app", metavar="NAME", help="Destroy every live machine of this app instead."
        ),
    ] = None,
    region: Annotated[
        list[str] | None,
        typer.Option(
            metavar="REGION", help="With --app: only in this region (repeatable; default: all)."
        ),
    ] = None,
    yes: YesOpt = False,
    direct: MachineDirectOpt = False,
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Destroy a machine and free its resources; with --app, every live machine of the app
    (asks first unless --yes)."""
    if (machine_id is None) == (app_name is None):
        fail("give a MACHINE_ID or --app NAME (one of them)")
    if region and app_name is None:
        fail("--region goes with --app")
    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)
    if machine_id is not None:
        mid = machine_id
        m = _with_client(conn, prefix, direct, lambda c: c.machine("destroy", mid))
        if json:
            typer.echo(render.as_json(m))
        else:
            render.show(render.machines([m]))
        return
    assert app_name is not None
    name = app_name
    found = _with_client(
        conn, prefix, direct, lambda c: policy.app_machines(c, name, region or None)
    )
    if not found:
        where = f" in {', '.join(region)}" if region else ""
        if json:
            typer.echo(render.as_json([]))
        else:
            typer.echo(f"app {name!r} has no live machines{where}: nothing to destroy")
        return
    if not yes:
        _confirm(f"destroy {len(found)} machine(s) of app {name!r}", found)

    async def destroy_all(c: BourseClient) -> list[Machine]:
        return [await c.machine("destroy", m.machine_id) for m in found]

    gone = _with_client(conn, prefix, direct, destroy_all)
    if json:
        typer.echo(render.as_json(gone))
    else:
        render.show(render.machines(gone))


def _confirm(what: str, machines: list[Machine]) -> None:
    """Ask on the terminal; without one (a script, a pipe) refuse: --yes says it."""
    if not sys.stdin.isatty():
        fail(f"{what}: not confirmed (no terminal to ask on); pass --yes")
    render.show(render.machines(machines))
    if not typer.confirm(f"{what}?", default=False):
        fail(f"{what}: not confirmed")


def main() -> None:
    cli_main(app)


@app.command()
def deploy(
    ctx: typer.Context,
    app_name: AppOpt,
    region: Annotated[
        list[str],
        typer.Option(metavar="REGION", help="A region to place in (repeatable: tried in order)."),
    ],
    cpus: Annotated[
        int,
        typer.Option(
            metavar="CPUS", parser=_cpus, help="CPUs of each machine: 2, 0.5 or 250m (millicores)."
        ),
    ],
    memory_mb: Annotated[int, typer.Option(metavar="MIB", help="Memory of each machine, MiB.")],
    image: Annotated[str, typer.Option(metavar="IMAGE", help="Image the machines run.")],
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
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Deploy an app: machines on distinct workers, plus spares (idempotent)."""
    try:
        resources = msgspec.convert(
            {**cpu_fields(cpus), "memory_mb": memory_mb, "disk_mb": disk_mb, "gpus": gpus},
            Resources,
            strict=True,
        )
    except msgspec.ValidationError as exc:
        fail(f"invalid resources: {_flag_names(validation_detail(exc))}")
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

    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)

    d = _with_client(conn, prefix, direct, go)
    if json:
        typer.echo(
            render.as_json(
                {
                    "app": d.app,
                    "complete": d.complete,
                    "slots": [
                        {
                            "slot": s.name,
                            "role": s.role,
                            "machine": s.machine,
                            "existed": s.existed,
                            "unfilled": s.unfilled,
                        }
                        for s in d.slots
                    ],
                }
            )
        )
    else:
        render.show(render.deployment(d))
    if not d.complete:
        raise typer.Exit(EXIT_UNFILLED)


@app.command()
def failover(
    ctx: typer.Context,
    app_name: AppOpt,
    machine: Annotated[
        str,
        typer.Option(
            metavar="MACHINE_ID",
            help="The machine to replace (its worker is gone, or --force).",
            callback=_machine_id,
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
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Start a spare of the app in place of a machine whose worker is gone (--force: stop
    the machine first), then place a new spare as deploy would (--label as given to deploy).
    Exit 2 when no spare is left, 1 on an error; --json prints one object whatever happens
    ("error" says what went wrong)."""
    constraints = parse_labels(label)

    async def go(c: BourseClient) -> policy.Failover | ClientError:
        try:
            return await policy.failover(
                c,
                app=app_name,
                regions=region,
                machine_id=machine,
                force=force,
                constraints=constraints,
                deadline_ms=deadline_ms,
            )
        except ClientError as exc:
            return exc

    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)
    f = _with_client(conn, prefix, direct, go)
    if isinstance(f, ClientError):
        if json:
            typer.echo(render.as_json(render.failover_json(app_name, machine, None, str(f))))
        no_spare = f.code == "unfilled"
        typer.echo(f"error: {'no failover: ' if no_spare else ''}{f}", err=True)
        raise typer.Exit(EXIT_UNFILLED if no_spare else 1)
    if json:
        typer.echo(render.as_json(render.failover_json(app_name, machine, f, None)))
    else:
        for line in render.failover_lines(f):
            render.console.print(line)


@app.command()
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
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Print market events as they happen (order outcomes: placed, unfilled; machine events),
    until Ctrl-C; with --since, replay stored ones first. --json: one event per line, with
    its stream sequence ("seq")."""
    logs.configure("warning")
    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)
    if tenant := _tenant(conn):
        fail(
            f"tenant {tenant!r} may not read events (they carry every tenant's machines): "
            "watch with the operator's buyer key (docs/security.md)"
        )
    subjects = Subjects(prefix)
    try:
        start = parse_since(since) if since is not None else None
    except EventsError as exc:
        fail(str(exc))

    async def main() -> None:
        try:
            nc = await conn.connect("bourse-watch", service=False)
        except Exception as exc:
            fail(f"cannot connect to NATS at {', '.join(conn.urls)}: {exc}")
        try:
            await _watch(nc, subjects, (region, worker, kind), start, count, json)
        except EventsError as exc:
            fail(str(exc))
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

    def unreadable(subject: str, exc: BadMessage) -> None:
        typer.echo(f"(unreadable event on {subject}: {exc})", err=True)

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
