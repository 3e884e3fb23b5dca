"""EdgeService: one edge process: its route source, its router, its listeners (HTTP and
raw TCP services, each socket bound with SO_REUSEPORT so several edge processes share a
port), its prober, the starts its requests ask for (edge/starts.py: given a way to start a
machine); a task of the program's task group that stops with it.

The stop (a cancellation: SIGTERM) closes the listeners at once, lets the requests under
way finish for at most ``stop_grace_s``, then closes every connection left: the program
exits within its bound whatever its clients and upstreams are doing.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import structlog

from bourse.errors import BourseError
from bourse.runtime.endpoint import format_addr
from bourse.runtime.metrics import EdgeMetrics
from bourse.runtime.supervise import cleanup_scope
from edge.http import Client
from edge.probe import run_prober
from edge.proxy import EdgeConfig, Proxy
from edge.routes import RouteSource
from edge.routing import Router, RouteTable, Service
from edge.starts import (
    MAX_HELD,
    START_TIMEOUT_S,
    PlaceFor,
    PlaceMachine,
    StartMachine,
    Starts,
    Wanted,
)
from edge.tcp import TcpClient

log = structlog.get_logger("bourse.edge")

STOP_GRACE_S = 0.5
BACKLOG = 1024


class ListenError(BourseError, OSError):
    """An address the edge cannot listen on."""


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that other processes may share (SO_REUSEPORT:
    the kernel spreads connections among them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ListenError(
            f"cannot listen on {format_addr(host, port)}: {exc.strerror or exc}"
        ) from None
    return sock


@dataclass
class EdgeService:
    """One edge: see the module's docstring. ``address`` and ``services`` are set once
    it listens (a port 0 given is the port the system chose)."""

    source: RouteSource
    listen: tuple[str, int]
    config: EdgeConfig = field(default_factory=EdgeConfig)
    region: str = ""
    services: Sequence[Service] = ()
    metrics: EdgeMetrics | None = None
    stop_grace_s: float = STOP_GRACE_S
    # how a request starts a stopped machine (the market's machine verb; None: it does not)
    start_machine: StartMachine | None = None
    start_timeout_s: float = START_TIMEOUT_S
    max_held: int = MAX_HELD
    auto_start: Callable[[str], bool] | None = None  # per app (None: every app)
    # an app with no machine to start: the order of a new one, and how it is placed
    # (edge/placing.py; None: nothing is placed)
    place_for: PlaceFor | None = None
    place: PlaceMachine | None = None
    wanted: Wanted | None = None  # an app's machines wanted running in a region (its spec)
    address: str = ""
    service_addresses: dict[str, str] = field(default_factory=dict)
    router: Router = field(init=False)
    proxy: Proxy | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.router = Router(self.region)

    def publish(self, table: RouteTable) -> None:
        """The source's new table: routed by from the next request on; the requests under
        way at machines it says ended (or whose worker is gone) cut short, retried."""
        self.router.update(table)
        dead = self.router.dead_in_flight()
        if dead and self.proxy is not None:
            log.info("cut", machines=sorted(dead))
            self.proxy.cut(dead)
        log.debug("routes", source=table.source, apps=len(table.apps))

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled; ``started`` once every listener listens."""
        loop = asyncio.get_running_loop()
        proxy = self.proxy = Proxy(self.router, self.config, self.metrics)
        if self.start_machine is not None:
            proxy.starts = Starts(
                self.router,
                self.start_machine,
                region=self.region,
                timeout_s=self.start_timeout_s,
                max_held=self.max_held,
                metrics=self.metrics,
                auto_start=self.auto_start or every_app,
                place_for=self.place_for,
                place=self.place,
                wanted=self.wanted or no_spec,
            )
        servers: list[asyncio.Server] = []
        try:
            async with anyio.create_task_group() as tasks:
                await tasks.start(self.source.run, self.publish)
                services = list(self.services) + list(self.router.table.services)
                sock = reuseport_socket(*self.listen)
                servers.append(
                    await loop.create_server(lambda: Client(proxy), sock=sock, backlog=BACKLOG)
                )
                self.address = format_addr(self.listen[0], sock.getsockname()[1])
                for service in services:
                    ssock = reuseport_socket(*service.listen)
                    make = _service_protocol(proxy, service)
                    servers.append(await loop.create_server(make, sock=ssock, backlog=BACKLOG))
                    where = format_addr(service.listen[0], ssock.getsockname()[1])
                    self.service_addresses[f"{service.app}:{service.port}"] = where
                await tasks.start(run_prober, self.router)
                log.info(
                    "edge_serving",
                    address=self.address,
                    domain=self.config.domain,
                    region=self.region,
                    routes=self.source.name,
                    services=self.service_addresses,
                )
                task_status.started()
                await anyio.sleep_forever()
        finally:
            with cleanup_scope():
                await self._stop(proxy, servers)

    async def _stop(self, proxy: Proxy, servers: list[asyncio.Server]) -> None:
        for server in servers:
            server.close()
        with anyio.move_on_after(self.stop_grace_s):
            await proxy.wait_idle()
        cut = proxy.in_flight
        proxy.close()
        if proxy.starts is not None:
            await proxy.starts.close()
        await proxy.tasks.finish(0)
        log.info("edge_stopped", cut_short=cut)


def every_app(app: str) -> bool:
    return True


def no_spec(app: str, region: str) -> int | None:
    return None


def _service_protocol(proxy: Proxy, service: Service) -> Callable[[], TcpClient]:
    return lambda: TcpClient(proxy, service)
