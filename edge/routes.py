"""Where the edge's route table comes from: one small interface, :class:`RouteSource`, and
the two sources there are today.

- :class:`StaticRoutes`: a routes file (``--routes FILE``, TOML or JSON; docs/edge.md),
  read once at start: the apps, their machines and limits, and raw TCP services.
- :class:`ListingRoutes`: the market's machine listing (``BourseClient.list_machines``),
  asked again every ``refresh_s``: every started machine of an app (its metadata's ``app``,
  its tenant from its order id). A worker that does not answer a listing has no machines in
  it, so they get no requests until it answers again; a listing that fails altogether
  leaves the last table in force. The fleet view (edge/viewroutes.py) is the default
  source; this one is its fallback where the market has no state stream.

The parsing and the table built from a listing are pure (:func:`parse_routes`,
:func:`table_of`); only the ``run`` methods touch files or NATS.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Protocol

import anyio
import anyio.abc
import msgspec
import structlog

from bourse.errors import BourseError
from bourse.wire.metadata import APP, ROLE
from bourse.wire.tenancy import SEPARATOR
from edge.routing import (
    HEALTH,
    NO_CHECKS,
    PASSING,
    PENDING,
    STARTED,
    AppRoute,
    Backend,
    RouteTable,
    Service,
    app_key,
)

if TYPE_CHECKING:
    from bourse.client import BourseClient
    from bourse.wire.messages import Machine

log = structlog.get_logger("bourse.edge")

Publish = Callable[[RouteTable], None]
REFRESH_S = 2.0


class RoutesError(BourseError, ValueError):
    """A routes file that cannot be used: one line naming the file and what is wrong."""


class RouteSource(Protocol):
    """What fills the edge's route table. ``run`` calls ``publish`` with a whole table
    whenever it has a new one, calls ``task_status.started()`` once it has published the
    first (or given up on it for now), and runs until cancelled."""

    name: str

    async def run(
        self,
        publish: Publish,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None: ...


def parse_address(text: str) -> tuple[str, int]:
    """``"127.0.0.1:8081"`` -> ("127.0.0.1", 8081); ``"[::1]:80"`` -> ("::1", 80)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


# -- the routes file -----------------------------------------------------------------------

Name = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,62}\Z")]
Limit = Annotated[int, msgspec.Meta(ge=0)]


class _MachineEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    region: str = ""
    addresses: dict[str, str]
    state: str = STARTED
    health: str = NO_CHECKS
    worker_gone: bool = False
    draining: bool = False


class _AppEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    app: Name
    tenant: Name | None = None
    port: str = ""
    soft_limit: Limit = 0
    hard_limit: Limit = 0
    machines: list[_MachineEntry] = []


class _ServiceEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    listen: str
    app: str
    port: str


class _RoutesFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    apps: list[_AppEntry] = []
    services: list[_ServiceEntry] = []


def parse_routes(text: str, where: str, *, toml: bool) -> RouteTable:
    """A routes file's text -> its table. RoutesError names the file and the key."""
    try:
        raw = tomllib.loads(text) if toml else json.loads(text)
        doc = msgspec.convert(raw, _RoutesFile)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, msgspec.ValidationError) as exc:
        raise RoutesError(f"{where}: {exc}") from None
    apps: dict[str, AppRoute] = {}
    for entry in doc.apps:
        key = app_key(entry.app, entry.tenant or "")
        if key in apps:
            raise RoutesError(f"{where}: app {key!r} is listed twice")
        backends = tuple(_backend(m, f"{where}: app {key!r}") for m in entry.machines)
        apps[key] = AppRoute(key, backends, entry.soft_limit, entry.hard_limit, entry.port)
    services = []
    for s in doc.services:
        try:
            listen = parse_address(s.listen)
        except ValueError as exc:
            raise RoutesError(f"{where}: services: listen {exc}") from None
        services.append(Service(listen, s.app, s.port))
    return RouteTable(apps, tuple(services), source=where)


def _backend(m: _MachineEntry, where: str) -> Backend:
    if m.health not in HEALTH:
        raise RoutesError(f"{where}: machine {m.id!r}: health must be one of {HEALTH}")
    try:
        addresses = {name: parse_address(a) for name, a in m.addresses.items()}
    except ValueError as exc:
        raise RoutesError(f"{where}: machine {m.id!r}: address {exc}") from None
    return Backend(
        m.id, m.region, addresses, m.state, m.health, m.worker_gone, m.draining
    )  # fmt: skip


def read_routes(path: Path) -> RouteTable:
    """The routes file at ``path`` (``.json``: JSON; anything else: TOML)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RoutesError(f"{path}: {exc.strerror or exc}") from None
    return parse_routes(text, str(path), toml=path.suffix.lower() != ".json")


class StaticRoutes:
    """The routes file, read at start."""

    def __init__(self, table: RouteTable) -> None:
        self.table = table
        self.name = f"file {table.source}"

    async def run(
        self,
        publish: Publish,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        publish(self.table)
        task_status.started()
        await anyio.sleep_forever()


# -- the market's machine listing ----------------------------------------------------------


def _health(machine: Machine) -> str:
    if not machine.checks and machine.health is None:
        return NO_CHECKS
    status = machine.health.status if machine.health is not None else ""
    return status if status in (PASSING, "critical") else PENDING


def machine_addresses(machine: Machine) -> dict[str, tuple[str, int]]:
    out = {}
    for name, text in machine.addresses.items():
        try:
            out[name] = parse_address(text)
        except ValueError:
            continue  # a worker's malformed address: that port is not routed
    return out


def table_of(
    machines: Iterable[Machine],
    *,
    port: str = "",
    soft_limit: int = 0,
    hard_limit: int = 0,
    source: str = "listing",
) -> RouteTable:
    """The table of every app machine in ``machines`` (those whose metadata names an app),
    keyed by app and tenant (a tenant's order ids are ``<tenant>:<id>``); every app gets
    ``port``, ``soft_limit`` and ``hard_limit``."""
    grouped: dict[str, list[Backend]] = {}
    for m in machines:
        app = m.metadata.get(APP, "")
        if not app:
            continue
        tenant, sep, _ = m.order_id.partition(SEPARATOR)
        key = app_key(app, tenant if sep else "")
        backend = Backend(
            m.machine_id, m.region, machine_addresses(m), m.state, _health(m),
            role=m.metadata.get(ROLE, ""),
        )  # fmt: skip
        grouped.setdefault(key, []).append(backend)
    apps = {
        key: AppRoute(key, tuple(bs), soft_limit, hard_limit, port) for key, bs in grouped.items()
    }
    return RouteTable(apps, source=source)


class ListingRoutes:
    """The market's machine listing, asked every ``refresh_s`` (docs/edge.md: the fleet
    view replaces it)."""

    name = "machine listing"

    def __init__(
        self,
        client: BourseClient,
        regions: list[str],
        *,
        refresh_s: float = REFRESH_S,
        port: str = "",
        soft_limit: int = 0,
        hard_limit: int = 0,
    ) -> None:
        self.client = client
        self.regions = regions
        self.refresh_s = refresh_s
        self.port = port
        self.limits = (soft_limit, hard_limit)

    async def run(
        self,
        publish: Publish,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        from bourse.wire.messages import ListMachines

        request = ListMachines()  # every state: a stopped machine is the app's too
        started = False
        while True:
            try:
                listing = await self.client.list_machines(self.regions or None, request)
            except Exception as exc:  # NATS away, a timeout: keep the last table
                log.warning("routes_listing_failed", error=repr(exc))
            else:
                soft, hard = self.limits
                publish(
                    table_of(listing.machines, port=self.port, soft_limit=soft, hard_limit=hard)
                )
                if listing.missing:
                    log.info("routes_workers_missing", workers=listing.missing)
            if not started:
                task_status.started()
                started = True
            await anyio.sleep(self.refresh_s)  # a refresh interval, not a wait for an event
