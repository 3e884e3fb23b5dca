"""``buyer``: place orders, look at the fleet, manage machines. Thin commands over
bourse.client; ``--json`` on every command for scripts.

Exit codes: 0 placed / ok, 2 unfilled, 1 error (one clear line on stderr).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

import msgspec
import typer
from nats.aio.client import Client as NATS

from bourse.auction.driver import AuctionError
from bourse.client import BourseClient, ClientError, DryRun, policy, render
from bourse.client.events import EventFeed, EventsError, Since, event_json, parse_since
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
    Machine,
    Placed,
    PlaceOrder,
    Resources,
    Unfilled,
    WorkerStatus,
)
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
    "resources.memory_mb": "--memory-mb",
    "resources.disk_mb": "--disk-mb",
    "resources.gpus": "--gpus",
    "cpus": "--cpus",
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
    region: Annotated[str, typer.Option(help="Region to place in (strict).")],
    cpus: Annotated[int, typer.Option(help="CPUs.")],
    memory_mb: Annotated[int, typer.Option(help="Memory in MiB.")],
    image: Annotated[str, typer.Option(help="Image to run.")],
    disk_mb: Annotated[int, typer.Option()] = 0,
    gpus: Annotated[int, typer.Option()] = 0,
    label: Annotated[
        list[str] | None, typer.Option(help="Constraint key=value the worker must have.")
    ] = None,
    exclude: Annotated[list[str] | None, typer.Option(help="Worker ids to avoid.")] = None,
    min_score: Annotated[float, typer.Option()] = 0.0,
    deadline_ms: Annotated[int, typer.Option()] = DEFAULT_DEADLINE_MS,
    order_id: Annotated[
        str | None,
        typer.Option(
            help="Idempotency key (a ULID when omitted). A given id is sent as a retry: the "
            "worker that already placed it answers first."
        ),
    ] = None,
    meta: Annotated[list[str] | None, typer.Option(help="Metadata key=value.")] = None,
    start: Annotated[bool, typer.Option(help="Start the machine once placed.")] = False,
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
            "--explain", help="If the order is unfilled, show every worker's reasons under it."
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
        "resources": {"cpus": cpus, "memory_mb": memory_mb, "disk_mb": disk_mb, "gpus": gpus},
        "image": image,
        "constraints": parse_labels(label),
        "exclude_workers": exclude or [],
        "min_score": min_score,
        "deadline_ms": deadline_ms,
        "metadata": dict(pair.partition("=")[::2] for pair in meta or []),
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
        if explain and isinstance(r, Unfilled):
            why = await c.explain(order)
        return r, machine, why

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
            render.console.print(render.dry_run(why))
            render.console.print(render.dry_run_summary(why))
    if not isinstance(r, Placed):
        raise typer.Exit(EXIT_UNFILLED)


def _dry_run(conn: Connection, prefix: str, order: PlaceOrder, json: bool) -> None:
    """``place --dry-run``: every worker's verdict, nothing placed or held."""
    d = _with_client(conn, prefix, False, lambda c: c.explain(order))
    if json:
        typer.echo(render.as_json(d))
    else:
        render.console.print(render.dry_run(d))
        render.console.print(render.dry_run_summary(d))
    raise typer.Exit(0 if d.winner else EXIT_UNFILLED)


@app.command()
def fleet(
    ctx: typer.Context,
    region: Annotated[list[str], typer.Option(help="Region(s) to ask (repeatable).")],
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Every worker's capacity, commitments, holds and images (status scatter-gather).
    Exit 2 when a region asked for has no worker that answers (one line per such region)."""

    async def go(c: BourseClient) -> list[WorkerStatus]:
        return [s for r in region for s in await c.status(r)]

    statuses = _with_client(
        _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key), prefix, False, go
    )
    if json:
        typer.echo(render.as_json(statuses))
    else:
        render.console.print(render.fleet(statuses))
    answered = {s.region for s in statuses}
    silent = [r for r in dict.fromkeys(region) if r not in answered]
    for r in silent:
        typer.echo(f"no worker answers in region {r!r}", err=True)
    if silent:
        raise typer.Exit(2)


@machines_app.command("list")
def machines_list(
    ctx: typer.Context,
    worker: Annotated[str, typer.Option(help="Worker whose machines to list.")],
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
    """Machines on one worker."""
    listed = _with_client(
        _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key),
        prefix,
        direct,
        lambda c: c.machines(worker, all_),
    )
    if json:
        typer.echo(render.as_json(listed))
    else:
        render.console.print(render.machines(listed.machines))


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
            render.console.print(render.machines([m]))

    command.__doc__ = help_text
    machines_app.command("show" if verb == "get" else verb)(command)


@machines_app.command("logs")
def machines_logs(
    ctx: typer.Context,
    machine_id: MachineIdArg,
    tail: Annotated[int, typer.Option(min=1, max=1000, help="How many lines.")] = 100,
    direct: MachineDirectOpt = False,
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """The last lines a machine printed (process driver)."""
    out = _with_client(
        _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key),
        prefix,
        direct,
        lambda c: c.logs(machine_id, tail),
    )
    if json:
        typer.echo(render.as_json(out))
        return
    if out.truncated:
        typer.echo("... (older lines left out)")
    for line in out.lines:
        typer.echo(line)


_verb("get", "One machine.")
_verb("start", "Start a machine.")
_verb("stop", "Stop a machine.")
_verb("destroy", "Destroy a machine and free its resources.")


def main() -> None:
    cli_main(app)


@app.command()
def deploy(
    ctx: typer.Context,
    app_name: Annotated[str, typer.Option("--app", help="App name (machines carry it).")],
    region: Annotated[list[str], typer.Option(help="Regions, tried in this order.")],
    cpus: Annotated[int, typer.Option()],
    memory_mb: Annotated[int, typer.Option()],
    image: Annotated[str, typer.Option()],
    count: Annotated[int, typer.Option(min=0, help="Machines to run.")] = 1,
    spares: Annotated[int, typer.Option(min=0, help="Extra machines placed, not started.")] = 0,
    disk_mb: Annotated[int, typer.Option()] = 0,
    gpus: Annotated[int, typer.Option()] = 0,
    label: Annotated[list[str] | None, typer.Option(help="Constraint key=value.")] = None,
    min_score: Annotated[float, typer.Option()] = 0.0,
    deadline_ms: Annotated[int, typer.Option()] = DEFAULT_DEADLINE_MS,
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
            {"cpus": cpus, "memory_mb": memory_mb, "disk_mb": disk_mb, "gpus": gpus},
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
        render.console.print(render.deployment(d))
    if not d.complete:
        raise typer.Exit(EXIT_UNFILLED)


@app.command()
def failover(
    ctx: typer.Context,
    app_name: Annotated[str, typer.Option("--app", help="The app.")],
    machine: Annotated[str, typer.Option(help="The machine whose worker is gone.")],
    region: Annotated[list[str], typer.Option(help="Regions to look for spares in, in order.")],
    force: Annotated[bool, typer.Option(help="Start a spare even if the worker answers.")] = False,
    direct: DirectOpt = False,
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Start a spare of the app in place of a machine whose worker is gone."""

    async def go(c: BourseClient) -> Machine | str:
        try:
            return await policy.failover(
                c, app=app_name, regions=region, machine_id=machine, force=force
            )
        except ClientError as exc:
            if exc.code == "unfilled":
                return str(exc)
            raise

    conn = _connection(ctx, nats, creds, tls_ca, tls_cert, tls_key)

    m = _with_client(conn, prefix, direct, go)
    if isinstance(m, str):
        typer.echo(f"no failover: {m}", err=True)
        raise typer.Exit(EXIT_UNFILLED)
    if json:
        typer.echo(render.as_json(m))
    else:
        render.console.print(f"started spare {m.machine_id} on {m.worker_id} ({m.region})")


@app.command()
def watch(
    ctx: typer.Context,
    region: Annotated[str, typer.Option(help="Region, or * for all.")] = "*",
    worker: Annotated[str, typer.Option(help="Worker id, or * for all.")] = "*",
    kind: Annotated[str, typer.Option(help="Event kind, or * for all.")] = "*",
    count: Annotated[int, typer.Option(min=0, help="Stop after this many (0: never).")] = 0,
    since: Annotated[
        str | None,
        typer.Option(
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
    """Print market events as they happen, until Ctrl-C; with --since, replay stored ones
    first. --json: one event per line, with its stream sequence ("seq")."""
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
