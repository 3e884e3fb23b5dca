"""``edge serve``: an HTTP/1.1 reverse proxy routing ``<app>.<domain>`` to the app's
machines (docs/edge.md). What it serves is imported when it runs, so ``edge --help``
loads no NATS, no structlog, no httptools."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import (
    CredsOpt,
    LogJsonOpt,
    LogLevelOpt,
    MetricsAddrOpt,
    NatsOpt,
    PrefixOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    VersionOpt,
    cli_main,
    fail,
)
from bourse.runtime.connection import Connection

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from edge.admin import Tokens
    from edge.admin_server import AdminPage
    from edge.healing import Controller
    from edge.routes import RouteSource
    from edge.routing import Service
    from edge.service import EdgeService
    from edge.services import AppServices
    from edge.starts import PlaceFor, PlaceMachine, StartMachine
    from edge.viewroutes import ViewRoutes

DEFAULT_PREFIX = "bourse"  # bourse/wire/subjects.py's, not imported for a help
SOURCES = ("auto", "view", "listing")

app = typer.Typer(
    help="Bourse edge: one address per app, routed to its passing machines.",
    rich_markup_mode=None,  # plain help: rich would nearly double a help's time
)


@app.callback()
def _callback(version: VersionOpt = False) -> None:
    """Bourse edge."""


@app.command()
def serve(
    listen: Annotated[
        str,
        typer.Option(
            metavar="HOST:PORT",
            help="Where to take HTTP requests (port 0: any free one, printed). Several edge "
            "processes may listen on one port (SO_REUSEPORT).",
        ),
    ] = "127.0.0.1:8080",
    domain: Annotated[
        str,
        typer.Option(
            help="Requests for <app>.DOMAIN (a tenant's: <app>.<tenant>.DOMAIN) go to the app."
        ),
    ] = "localhost",
    region: Annotated[
        str, typer.Option(help="This edge's region: its machines are preferred.")
    ] = "",
    routes: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="A routes file (TOML, or JSON by its .json suffix: docs/edge.md), read at "
            "start; without it, the market (--nats): see --source.",
        ),
    ] = None,
    source: Annotated[
        str,
        typer.Option(
            metavar="auto|view|listing",
            help="Without --routes, where the routes come from: the fleet view (the state "
            "stream, followed), the machine listing (asked every --refresh-s), or auto: the "
            "view, the listing where the market has no state stream.",
        ),
    ] = "auto",
    view_db: Annotated[
        str,
        typer.Option(
            metavar="PATH",
            help="The view's SQLite database (resumed at the next start; ':memory:': built "
            "from the stream at each start).",
        ),
    ] = ":memory:",
    regions: Annotated[
        str, typer.Option(help='The listing\'s regions, comma-separated ("": every region).')
    ] = "",
    refresh_s: Annotated[
        float, typer.Option(min=0.1, help="How often the machine listing is asked again.")
    ] = 2.0,
    port: Annotated[
        str,
        typer.Option(
            help="The machines' named port HTTP goes to (\"\": 'http' where a machine has "
            "one, else its first)."
        ),
    ] = "",
    soft_limit: Annotated[
        int,
        typer.Option(
            min=0,
            help="Listing: outstanding requests per machine past which others are preferred "
            "(0: none).",
        ),
    ] = 0,
    hard_limit: Annotated[
        int,
        typer.Option(
            min=0, help="Listing: outstanding requests per machine never exceeded (0: none)."
        ),
    ] = 0,
    tcp: Annotated[
        list[str] | None,
        typer.Option(
            metavar="HOST:PORT=APP:PORTNAME",
            help="A raw TCP service: connections to HOST:PORT go to APP's machines on their "
            "port PORTNAME (repeat for more; APP of a tenant: <app>.<tenant>).",
        ),
    ] = None,
    controller: Annotated[
        bool,
        typer.Option(
            help="Also heal apps from the view: a machine whose worker is gone or whose "
            "check is critical replaced by its slot's spare (docs/edge.md; any number of "
            "edges may run one).",
        ),
    ] = False,
    auto_start: Annotated[
        bool,
        typer.Option(
            help="With the market as the routes: a request that finds no machine able to "
            "take it starts one of its app's stopped machines and waits for it.",
        ),
    ] = True,
    start_timeout_s: Annotated[
        float,
        typer.Option(
            min=0.1, help="A request waits this long for its app's machine to start (503 past it)."
        ),
    ] = 10.0,
    max_held: Annotated[
        int,
        typer.Option(min=1, help="Requests held per app while its machine starts (503 past it)."),
    ] = 256,
    max_body_mb: Annotated[
        float, typer.Option(min=0, help="Refuse (413) a request body larger than this.")
    ] = 10.0,
    header_timeout_s: Annotated[
        float,
        typer.Option(min=0.01, help="A request's head must arrive within this (408 past it)."),
    ] = 10.0,
    idle_timeout_s: Annotated[
        float, typer.Option(min=0.01, help="Close a client connection idle this long.")
    ] = 60.0,
    max_conns_per_ip: Annotated[
        int, typer.Option(min=1, help="Connections one client address may hold (429 past it).")
    ] = 256,
    connect_timeout_s: Annotated[
        float, typer.Option(min=0.01, help="An upstream connect that takes longer failed.")
    ] = 2.0,
    attempts: Annotated[
        int,
        typer.Option(min=1, help="Machines one request may be sent to, retries included."),
    ] = 3,
    pool_idle_s: Annotated[
        float,
        typer.Option(min=0, help="An idle upstream connection is not reused after this long."),
    ] = 1.0,
    stop_grace_s: Annotated[
        float,
        typer.Option(min=0, help="At SIGTERM, how long requests under way may finish."),
    ] = 0.5,
    access_log: Annotated[
        bool, typer.Option(help="Log one line per request (structlog, key=value or JSON).")
    ] = True,
    admin: Annotated[
        str,
        typer.Option(
            metavar="HOST:PORT",
            help="Serve the page (regions, workers, machines, apps, events: docs/page.md) on "
            "a listener of its own, from the fleet view (PORT alone: on 127.0.0.1; port 0: "
            "any free one, printed). '': no page.",
        ),
    ] = "",
    admin_token: Annotated[
        list[str] | None,
        typer.Option(
            metavar="TOKEN[=TENANT]",
            envvar="BOURSE_ADMIN_TOKENS",
            help="Who may look from outside loopback: TOKEN the operator's view, "
            "TOKEN=TENANT that tenant's machines and apps (repeat for more; env: "
            "space-separated).",
        ),
    ] = None,
    nats: NatsOpt = None,
    creds: CredsOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    prefix: PrefixOpt = DEFAULT_PREFIX,
    metrics_addr: MetricsAddrOpt = "",
    log_level: LogLevelOpt = "info",
    log_json: LogJsonOpt = False,
) -> None:
    """Serve HTTP (and raw TCP services) until SIGINT/SIGTERM."""
    import anyio

    from bourse.runtime import logs
    from bourse.runtime.endpoint import MetricsAddrError, parse_addr, start_endpoint
    from bourse.runtime.metrics import EdgeMetrics
    from bourse.runtime.supervise import run, settle_heap
    from edge import wiring
    from edge.admin import TokenError, parse_tokens
    from edge.proxy import EdgeConfig
    from edge.routes import RoutesError, StaticRoutes, parse_address, read_routes
    from edge.service import EdgeService

    logs.configure(log_level, log_json)
    try:
        listen_at = parse_address(listen)
        admin_at = _admin_address(admin) if admin else None
        tokens = parse_tokens(admin_token or [])
        if admin_at is not None and (routes is not None or source == "listing"):
            raise ValueError("--admin reads the fleet view: not with --routes or a listing")
        metrics_at = parse_addr(metrics_addr)
        services = [_service(text) for text in tcp or []]
        table = read_routes(routes) if routes is not None else None
        if source not in SOURCES:
            raise ValueError(f"--source {source!r}: expected one of {', '.join(SOURCES)}")
        if controller and (routes is not None or source == "listing"):
            raise ValueError("--controller reads the fleet view: not with --routes or a listing")
    except (ValueError, RoutesError, MetricsAddrError, TokenError) as exc:
        fail(str(exc))
    conn = Connection.from_options(nats, creds, tls_ca, tls_cert, tls_key) if not routes else None
    config = EdgeConfig(
        domain=domain.strip(".").lower(),
        max_body_bytes=int(max_body_mb * 1024 * 1024),
        header_timeout_s=header_timeout_s,
        idle_timeout_s=idle_timeout_s,
        max_conns_per_ip=max_conns_per_ip,
        connect_timeout_s=connect_timeout_s,
        attempts=attempts,
        pool_idle_s=pool_idle_s,
        access_log=access_log,
    )
    region_list = [r.strip() for r in regions.split(",") if r.strip()]
    limits = (soft_limit, hard_limit)

    async def main() -> None:
        nc: NATS | None = None
        start_machine: StartMachine | None = None
        placing: tuple[PlaceFor, PlaceMachine] | None = None
        healer: Controller | None = None
        apps: AppServices | None = None
        view: ViewRoutes | None = None
        edges: list[EdgeService] = []  # the service, once made (the controller reads it)
        page: AdminPage | None = None
        try:
            routes_from: RouteSource
            if table is not None:
                routes_from = StaticRoutes(table)
            else:
                assert conn is not None
                nc = await conn.connect("bourse-edge")
                routes_from, view = wiring.routes(
                    nc, prefix, source, view_db, region_list, refresh_s, port, limits
                )
                apps = wiring.app_services(nc, prefix, view)
                if auto_start:
                    start_machine = wiring.starter(nc, prefix)
                    placing = wiring.placer(nc, prefix, apps, view, region)
                if controller:
                    healer = wiring.controller(nc, prefix, lambda: edges[0])
                    view.observers.append(healer.changed)
                if admin_at is not None:
                    page = _page(nc, prefix, admin_at, tokens, view)
            metrics = EdgeMetrics() if metrics_at is not None else None
            svc = EdgeService(
                routes_from,
                listen_at,
                config,
                region=region,
                services=services,
                metrics=metrics,
                stop_grace_s=stop_grace_s,
                start_machine=start_machine,
                start_timeout_s=start_timeout_s,
                max_held=max_held,
                auto_start=apps.auto_start if apps is not None else None,
                place_for=placing[0] if placing else None,
                place=placing[1] if placing else None,
                wanted=apps.wanted if apps is not None else None,
            )
            edges.append(svc)
            async with anyio.create_task_group() as tasks:
                serving = ""
                if metrics is not None and metrics_at is not None:
                    serving = (
                        f"; metrics on {(await start_endpoint(tasks, metrics, metrics_at)).url}"
                    )
                if apps is not None:
                    await tasks.start(apps.run)
                if healer is not None:
                    await tasks.start(healer.run)
                await tasks.start(svc.run)  # ListenError: one line, as any BourseError
                if nc is not None and apps is not None and view is not None:
                    await tasks.start(wiring.idle(nc, prefix, svc, apps, view).run)
                if page is not None:
                    await tasks.start(page.run)
                    serving += f"; page on {page.url}"
                settle_heap()
                extra = "".join(f"; {k} on {v}" for k, v in svc.service_addresses.items())
                typer.echo(
                    f"edge serving on {svc.address} (*.{config.domain}, routes: "
                    f"{routes_from.name}){extra}{serving}"
                )
        finally:
            if nc is not None:
                from bourse.nats.connection import shutdown

                await shutdown(nc)

    run(main)


def _admin_address(text: str) -> tuple[str, int]:
    """``--admin``: HOST:PORT, or PORT alone on loopback."""
    from edge.routes import parse_address

    try:
        return parse_address(f"127.0.0.1:{text}" if text.isdigit() else text)
    except ValueError:
        raise ValueError(f"--admin {text!r}: expected HOST:PORT, or PORT (on 127.0.0.1)") from None


def _page(
    nc: NATS, prefix: str, listen: tuple[str, int], tokens: Tokens, view: ViewRoutes
) -> AdminPage:
    """The page on its own listener, reading the edge's view; the market's events heard."""
    from bourse.wire.subjects import Subjects
    from edge.admin_server import AdminPage

    page = AdminPage(listen, lambda: view.view, tokens, nc, Subjects(prefix))
    view.observers.append(page.changed)
    return page


def _service(text: str) -> Service:
    """``127.0.0.1:5432=db:pg`` -> the service."""
    from edge.routes import parse_address
    from edge.routing import Service

    listen, sep, target = text.partition("=")
    app_name, sep2, port_name = target.rpartition(":")
    if not sep or not sep2 or not app_name or not port_name:
        raise ValueError(f"--tcp {text!r}: expected HOST:PORT=APP:PORTNAME")
    try:
        return Service(parse_address(listen), app_name, port_name)
    except ValueError as exc:
        raise ValueError(f"--tcp {text!r}: {exc}") from None


def main() -> None:
    cli_main(app)
