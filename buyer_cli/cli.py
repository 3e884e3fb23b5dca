"""``buyer``: place orders, look at the fleet, manage machines. Thin commands over
buyer_cli.client; ``--json`` on every command for scripts.

Exit codes: 0 placed / ok, 2 unfilled, 1 error (one clear line on stderr).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec
import typer

from buyer_cli import render
from buyer_cli.client import BourseClient, ClientError
from exchange import logs
from exchange.auction import AuctionError
from exchange.connection import connect, split_urls
from exchange.protocol import DEFAULT_DEADLINE_MS, Placed, PlaceOrder
from exchange.runtime import CredsOpt, NatsOpt, PrefixOpt, fail, parse_labels
from exchange.subjects import DEFAULT_PREFIX, Subjects

app = typer.Typer(help="Bourse buyer: place machine orders on the market.", no_args_is_help=True)
machines_app = typer.Typer(help="Machines on the workers.", no_args_is_help=True)
app.add_typer(machines_app, name="machines")

T = TypeVar("T")
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
DirectOpt = Annotated[
    bool, typer.Option("--direct", help="Run the auction here; no exchange needed.")
]
EXIT_UNFILLED = 2


def _with_client(
    nats: list[str] | None,
    creds: str | None,
    prefix: str,
    direct: bool,
    fn: Callable[[BourseClient], Awaitable[T]],
) -> T:
    logs.configure("warning")
    urls = split_urls(nats)
    if not urls:
        fail("no NATS server given: pass --nats URL or set BOURSE_NATS_URL")
    try:
        subjects = Subjects(prefix)
    except ValueError as exc:
        fail(str(exc))

    async def main() -> T:
        try:
            nc = await connect(urls, name="bourse-buyer", creds=creds, service=False)
        except Exception as exc:
            fail(f"cannot connect to NATS at {', '.join(urls)}: {exc or type(exc).__name__}")
        client = BourseClient(nc, subjects, direct=direct)
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
        str | None, typer.Option(help="Idempotency key (a ULID when omitted).")
    ] = None,
    meta: Annotated[list[str] | None, typer.Option(help="Metadata key=value.")] = None,
    start: Annotated[bool, typer.Option(help="Start the machine once placed.")] = False,
    direct: DirectOpt = False,
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
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
    try:
        order = msgspec.convert(raw, PlaceOrder, strict=True)
    except msgspec.ValidationError as exc:
        fail(f"invalid order: {exc}")

    async def go(c: BourseClient):  # type: ignore[no-untyped-def]
        r = await c.place(order)
        machine = None
        if start and isinstance(r, Placed):
            machine = await c.machine("start", r.machine_id)
        return r, machine

    r, machine = _with_client(nats, creds, prefix, direct, go)
    if json:
        typer.echo(render.as_json({"result": r, "machine": machine}))
    else:
        render.outcome(r)
        if machine is not None:
            render.console.print(f"  machine {machine.machine_id} is {machine.state}")
    if not isinstance(r, Placed):
        raise typer.Exit(EXIT_UNFILLED)


@app.command()
def fleet(
    region: Annotated[list[str], typer.Option(help="Region(s) to ask (repeatable).")],
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Every worker's capacity, commitments, holds and images (status scatter-gather)."""

    async def go(c: BourseClient):  # type: ignore[no-untyped-def]
        return [s for r in region for s in await c.status(r)]

    statuses = _with_client(nats, creds, prefix, False, go)
    if json:
        typer.echo(render.as_json(statuses))
    else:
        render.console.print(render.fleet(statuses))


@machines_app.command("list")
def machines_list(
    worker: Annotated[str, typer.Option(help="Worker whose machines to list.")],
    all_: Annotated[bool, typer.Option("--all", help="Include destroyed machines.")] = False,
    direct: DirectOpt = False,
    json: JsonOpt = False,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
) -> None:
    """Machines on one worker."""
    listed = _with_client(nats, creds, prefix, direct, lambda c: c.machines(worker, all_))
    if json:
        typer.echo(render.as_json(listed))
    else:
        render.console.print(render.machines(listed.machines))


def _verb(verb: str, help_text: str) -> None:
    def command(
        machine_id: Annotated[str, typer.Argument(help="<worker_id>~<ulid>")],
        json: JsonOpt = False,
        nats: NatsOpt = None,
        creds: CredsOpt = None,
        prefix: PrefixOpt = DEFAULT_PREFIX,
    ) -> None:
        m = _with_client(nats, creds, prefix, False, lambda c: c.machine(verb, machine_id))
        if json:
            typer.echo(render.as_json(m))
        else:
            render.console.print(render.machines([m]))

    command.__doc__ = help_text
    machines_app.command("show" if verb == "get" else verb)(command)


_verb("get", "One machine.")
_verb("start", "Start a machine.")
_verb("stop", "Stop a machine.")
_verb("destroy", "Destroy a machine and free its resources.")
