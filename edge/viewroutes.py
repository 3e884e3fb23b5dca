"""The route table from the fleet view (issue 37: ``bourse.view``, the state stream
``<PREFIX>_STATE`` materialized into SQLite): the edge's default source where JetStream is.

:class:`ViewRoutes` keeps a view (in memory, or in a data dir: resumed from the last
sequence it applied) and publishes a whole table at start and after every batch that
changed a row or a worker's liveness. Nothing is asked of the workers and nothing per
request: a machine's start, its checks, its worker gone are rows of the stream.

:func:`view_table` is the table from the view's ``machines`` rows, a pure function of the
database: every app machine not destroyed (a stopped one is the app's too: it may be
started), with its worker gone when the view says so (``worker_gone_since_ms`` set: the
router sends it nothing, so a partitioned worker's old primary never serves beside the
new one).

:class:`Fallback` runs the first source and, when it cannot start (no state stream, no
JetStream: :class:`bourse.view.ViewUnavailable`), the second (the machine listing).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import structlog

from bourse.view import ViewUnavailable, open_view
from edge.healing import members, replaced
from edge.routes import Publish, RouteSource, parse_address
from edge.routing import (
    CRITICAL,
    NO_CHECKS,
    PASSING,
    PENDING,
    AppRoute,
    Backend,
    RouteTable,
    app_key,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from bourse.client.apps.spec import AppService
    from bourse.view import View
    from bourse.wire.subjects import Subjects
    from edge.services import AppServices

log = structlog.get_logger("bourse.edge")

SOURCE = "view"

# An app's machines, with what routing reads of each: its checks counted from the row
# (a machine with none is routed on its state alone; one whose checks have not run yet is
# pending).
_ROWS = """
SELECT machine_id, tenant, app, region, state, health, addresses, worker_gone_since_ms,
       coalesce(json_array_length(row, '$.checks'), 0), coalesce(role, '')
FROM machines WHERE app IS NOT NULL AND state != 'destroyed'
ORDER BY tenant, app, machine_id
"""


def _health(status: str | None, checks: int) -> str:
    if status in (PASSING, CRITICAL):
        return status
    return NO_CHECKS if not checks else PENDING


def _addresses(text: str | None) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    try:
        doc = json.loads(text or "{}")
    except ValueError:
        return out
    for name, where in doc.items() if isinstance(doc, dict) else ():
        try:
            out[name] = parse_address(str(where))
        except ValueError:
            continue  # a malformed address: that port is not routed
    return out


def view_table(
    db: sqlite3.Connection,
    *,
    port: str = "",
    soft_limit: int = 0,
    hard_limit: int = 0,
    services: Mapping[str, AppService] | None = None,
    draining: Collection[str] = (),
) -> RouteTable:
    """The table of every app machine the view holds (not destroyed), keyed by app and
    tenant; a machine whose worker the view says is gone is marked so (0, "never seen
    beating", is not gone: nothing says so, and the edge's probe catches a dead address).
    An app with a service section (``services``, by key) takes its port and limits from
    it; the others ``port``, ``soft_limit`` and ``hard_limit``. A deployed app (one with a
    section) with no machine is in the table too, with none: its request may place one.
    A machine in ``draining`` (a deploy drains it: its app's record says so) takes no new
    request."""
    grouped: dict[str, list[Backend]] = {key: [] for key in services or {}}
    done = replaced(members(db))
    for mid, tenant, app, region, state, status, addrs, gone, checks, role in db.execute(_ROWS):
        health = _health(status, checks)
        backend = Backend(mid, region, _addresses(addrs), state, health, bool(gone),
                          mid in draining, role, mid in done)  # fmt: skip
        grouped.setdefault(app_key(app, tenant), []).append(backend)
    apps = {}
    for key, bs in grouped.items():
        svc = (services or {}).get(key)
        if svc is None:
            apps[key] = AppRoute(key, tuple(bs), soft_limit, hard_limit, port)
        else:
            apps[key] = AppRoute(key, tuple(bs), svc.soft_limit, svc.hard_limit, svc.port or port)
    return RouteTable(apps, source=SOURCE)


class ViewRoutes:
    """The fleet view as the route source (see the module doc). ``path``: the view's
    database (``":memory:"``: built from the stream at each start)."""

    name = SOURCE

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        path: Path | str = ":memory:",
        *,
        port: str = "",
        soft_limit: int = 0,
        hard_limit: int = 0,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.path = path
        self.port = port
        self.limits = (soft_limit, hard_limit)
        self.view: View | None = None
        # told the view's database after each table published (the controller reads it)
        self.observers: list[Callable[[sqlite3.Connection], None]] = []
        self.services: AppServices | None = None  # the apps' service sections, followed
        self._publish_to: Publish | None = None

    def table(self, view: View) -> RouteTable:
        soft, hard = self.limits
        services = self.services.all if self.services is not None else None
        draining = self.services.draining if self.services is not None else ()
        return view_table(view.db.db, port=self.port, soft_limit=soft, hard_limit=hard,
                          services=services, draining=draining)  # fmt: skip

    def refresh(self) -> None:
        """Publish the table again (the apps' service sections changed)."""
        if self.view is not None and self._publish_to is not None:
            self._publish(self.view, self._publish_to)

    async def run(
        self,
        publish: Publish,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Open the view (ViewUnavailable before ``started`` when the stream cannot be
        read), publish its table, then again after every batch that changed something."""
        async with open_view(self.nc, self.subjects, self.path) as view:
            self.view = view
            self._publish_to = publish
            self._publish(view, publish)
            log.info("routes_view", freshness=str(view.freshness()))
            task_status.started()
            async for _batch in view.follow():
                self._publish(view, publish)

    def _publish(self, view: View, publish: Publish) -> None:
        publish(self.table(view))
        for observe in self.observers:
            observe(view.db.db)


class Fallback:
    """``first``, or ``then`` when ``first`` cannot start (ViewUnavailable): ``name`` is
    the one in force."""

    def __init__(self, first: RouteSource, then: RouteSource) -> None:
        self.first = first
        self.then = then
        self.name = first.name

    async def run(
        self,
        publish: Publish,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        started = False
        try:
            async with anyio.create_task_group() as tasks:
                await tasks.start(self.first.run, publish)
                started = True
                task_status.started()
            return
        except* ViewUnavailable as group:
            if started:  # the view failed later: not a fallback's case
                raise
            why = str(group.exceptions[0])
        log.warning("routes_fallback", unavailable=self.first.name, why=why, to=self.then.name)
        self.name = f"{self.then.name} (the {self.first.name} unavailable: {why})"
        await self.then.run(publish, task_status=task_status)
