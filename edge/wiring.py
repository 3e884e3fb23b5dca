"""What ``edge serve`` asks of the market, wired to its NATS connection: its routes (the
view, the listing, or the view falling back to it), the apps' service sections, a machine
started or placed for a request, idle machines stopped, and the controller's actions, each
through the exchange as the edge's key may."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bourse.runtime.cli import fail

if TYPE_CHECKING:
    from collections.abc import Callable

    from nats.aio.client import Client as NATS

    from edge.healing import Controller
    from edge.idle import Idle, Running
    from edge.routes import RouteSource
    from edge.service import EdgeService
    from edge.services import AppServices
    from edge.starts import PlaceFor, PlaceMachine, StartMachine
    from edge.viewroutes import ViewRoutes


def routes(
    nc: NATS,
    prefix: str,
    source: str,
    view_db: str,
    regions: list[str],
    refresh_s: float,
    port: str,
    limits: tuple[int, int],
) -> tuple[RouteSource, ViewRoutes]:
    """The market's routes on ``nc``: the view, the listing, or the view falling back to
    the listing (``source``: auto); and the view (what a controller reads)."""
    from bourse.client import BourseClient
    from bourse.wire.subjects import Subjects
    from edge.routes import ListingRoutes
    from edge.viewroutes import Fallback, ViewRoutes

    try:
        subjects = Subjects(prefix)
    except ValueError as exc:
        fail(str(exc))
    soft, hard = limits
    view = ViewRoutes(nc, subjects, view_db, port=port, soft_limit=soft, hard_limit=hard)
    if source == "view":
        return view, view
    listing = ListingRoutes(
        BourseClient(nc, subjects),
        regions,
        refresh_s=refresh_s,
        port=port,
        soft_limit=soft,
        hard_limit=hard,
    )
    return (listing if source == "listing" else Fallback(view, listing)), view


def starter(nc: NATS, prefix: str) -> StartMachine:
    """A machine started through the exchange (the market's machine verb)."""
    from bourse.client import BourseClient
    from bourse.wire.messages import Machine
    from bourse.wire.subjects import Subjects

    client = BourseClient(nc, Subjects(prefix))

    async def start(machine_id: str) -> Machine:
        return await client.machine("start", machine_id)

    return start


def placer(
    nc: NATS, prefix: str, apps: AppServices, view: ViewRoutes, region: str
) -> tuple[PlaceFor, PlaceMachine]:
    """A new machine for an app with none to start (edge/placing.py): its order from the
    app's record and the view's rows, placed through the exchange as the shared buyer; a
    tenant's app (key ``<app>.<tenant>``) under the tenant's scope of the slot's order id,
    so the machine is the tenant's own, only for a record the tenant wrote of that app."""
    from bourse.client import BourseClient
    from bourse.client.policy import place_patiently
    from bourse.errors import BourseError
    from bourse.wire.messages import Placed, PlaceOrder
    from bourse.wire.subjects import Subjects
    from edge.placing import order_for

    client = BourseClient(nc, Subjects(prefix))

    def place_for(key: str) -> PlaceOrder | None:
        record = apps.records.get(key)
        if record is None or view.view is None:
            return None
        return order_for(key, record, view.view.db.db, region)

    async def place(order: PlaceOrder) -> str:
        got = await place_patiently(client, order)
        if not isinstance(got, Placed):
            why = await client.reasons(order, got)
            detail = f" ({why.detail})" if why.detail else ""
            raise BourseError(f"unfilled: {why.reason}{detail}")
        return got.machine_id

    return place_for, place


def app_services(nc: NATS, prefix: str, view: ViewRoutes) -> AppServices:
    """The apps' service sections, followed; the view's table made again on a change."""
    from edge.services import AppServices

    apps = AppServices(nc, prefix)
    view.services = apps
    apps.observers.append(view.refresh)
    return apps


def idle(nc: NATS, prefix: str, svc: EdgeService, apps: AppServices, view: ViewRoutes) -> Idle:
    """This edge's activity, every edge's heard, idle machines stopped (docs/edge.md)."""
    from bourse.client import BourseClient
    from bourse.wire.subjects import Subjects
    from edge.idle import Idle, running

    subjects = Subjects(prefix)
    client = BourseClient(nc, subjects)

    async def stop(machine_id: str) -> object:
        return await client.machine("stop", machine_id)

    def rows() -> list[Running]:
        return running(view.view.db.db) if view.view is not None else []

    return Idle(nc, subjects, svc.router, stop, lambda: apps.all, rows)


def controller(nc: NATS, prefix: str, edge: Callable[[], EdgeService]) -> Controller:
    """The controller, acting on the market through the exchange, with ``edge``'s evidence
    (the machines its router cannot reach) and its routes (a spare it starts routed once
    the edge's probe answers)."""
    from bourse.client import BourseClient
    from bourse.wire.messages import Machine
    from bourse.wire.subjects import Subjects
    from edge.healing import UNREACHABLE_S, Controller, market_actions

    def started(app: str, machine: Machine) -> None:
        proxy = edge().proxy
        if proxy is not None and proxy.starts is not None:
            proxy.starts.serve_started(app, machine)

    def suspects() -> set[str]:
        return edge().router.unreachable(UNREACHABLE_S)

    wanted_of, act = market_actions(BourseClient(nc, Subjects(prefix)), started)
    return Controller(wanted_of, act, suspects=suspects)
