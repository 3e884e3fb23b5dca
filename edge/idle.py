"""Stopped when idle (issue 38 item 4, docs/protocol.md §4.23): each edge publishes its
requests per machine (``EdgeActivity`` on ``R.edge.activity.<edge>``, every second) and
hears every edge's; the live edge with the smallest id decides, from the view's rows and
the apps' service sections, which machines are idle and stops them through the exchange,
never below an app's ``min_machines_running`` in a region. With each report goes each
tenant's share of it (:func:`shares`, on ``R.edge.activity.<edge>.<tenant>``): a tenant's
deploy drains on what its key may hear, its own machines only.

:func:`idle_stops` is the decision, pure: in, the started machines (from the view), each
app's service section, the latest request time per machine across the live edges, the
time and when the deciding edge started; out, the machines to stop. :class:`Idle` is the
shell: the publisher, the listener, the decider's turn, the stops.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import msgspec
import structlog

from bourse.runtime.tasks import TaskSet
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import MAX_ACTIVITY_MACHINES, EdgeActivity, now_ms
from edge.routing import app_key, split_key

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.aio.msg import Msg

    from bourse.client.apps.spec import AppService
    from bourse.wire.subjects import Subjects
    from edge.routing import Router

log = structlog.get_logger("bourse.edge")

INTERVAL_S = 1.0
GONE_INTERVALS = 3  # an edge not heard from for this many intervals is gone

_ROWS = """
SELECT machine_id, tenant, app, region, updated_at_ms FROM machines
WHERE app IS NOT NULL AND state = 'started' AND worker_gone_since_ms IS NULL
ORDER BY machine_id
"""


@dataclass(frozen=True, slots=True)
class Running:
    """A started machine of an app (its worker beats), as the idle rule reads it."""

    machine_id: str
    key: str  # its app's key: web, web.acme
    region: str
    updated_at_ms: int = 0


def running(db: sqlite3.Connection) -> list[Running]:
    """The view's started app machines whose worker is not gone."""
    return [
        Running(mid, app_key(app, tenant), region, updated or 0)
        for mid, tenant, app, region, updated in db.execute(_ROWS)
    ]


def idle_stops(
    machines: list[Running],
    services: Mapping[str, AppService],
    last_ms: Mapping[str, int],
    now: int,
    since_ms: int,
) -> list[str]:
    """The machines to stop now: of each app with ``auto_stop``, in each region, those no
    request began at for ``idle_s`` (the latest of ``last_ms``, its row's update and
    ``since_ms``, when the decider started), the longest idle first, leaving at least
    ``min_machines_running`` started."""
    groups: dict[tuple[str, str], list[Running]] = {}
    for m in machines:
        svc = services.get(m.key)
        if svc is not None and svc.auto_stop:
            groups.setdefault((m.key, m.region), []).append(m)
    out: list[str] = []
    for (key, _), group in sorted(groups.items()):
        svc = services[key]
        last = {m.machine_id: max(last_ms.get(m.machine_id, 0), m.updated_at_ms, since_ms)
                for m in group}  # fmt: skip
        idle = sorted(
            (m.machine_id for m in group if now - last[m.machine_id] >= svc.idle_s * 1000),
            key=lambda mid: (last[mid], mid),
        )
        out += idle[: max(0, len(group) - svc.min_machines_running)]
    return out


def shares(report: EdgeActivity, owners: Mapping[str, str]) -> dict[str, EdgeActivity]:
    """``report`` cut to each tenant's machines (``owners``: machine -> tenant, "" none), for
    each tenant it names a machine of: a tenant's key hears its own share only (§4.23)."""
    by_tenant: dict[str, dict[str, int]] = {}
    for mid, at in report.machines.items():
        tenant = owners.get(mid, "")
        if tenant:
            by_tenant.setdefault(tenant, {})[mid] = at
    return {t: msgspec.structs.replace(report, machines=ms) for t, ms in sorted(by_tenant.items())}


def decider(heard: Mapping[str, float], me: str, now: float, interval_s: float) -> bool:
    """Whether ``me`` decides: the smallest id of the edges heard within GONE_INTERVALS
    (``heard``: edge -> when, this edge's own clock; itself always counts)."""
    live = [e for e, at in heard.items() if now - at <= GONE_INTERVALS * interval_s]
    return min([*live, me]) == me


def edge_id() -> str:
    """A new edge id (at each start): time-ordered, so a restarted edge is not the smallest
    at once, unique among edges started in the same millisecond."""
    return f"e{now_ms():013d}-{os.urandom(3).hex()}"


StopMachine = Callable[[str], Awaitable[object]]


class Idle:
    """This edge's part in the idle rule: its activity published, every edge's heard, and,
    when it decides, the stops (see the module doc)."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        router: Router,
        stop_machine: StopMachine,
        services: Callable[[], Mapping[str, AppService]],
        rows: Callable[[], list[Running]],
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.router = router
        self.stop_machine = stop_machine
        self.services = services
        self.rows = rows
        self.interval_s = interval_s
        self.me = edge_id()
        self.started_ms = now_ms()
        self.heard: dict[str, float] = {}  # edge -> when (monotonic)
        self.last: dict[str, dict[str, int]] = {}  # edge -> machine -> last request (ms)
        self.stopping: set[str] = set()
        self.tasks = TaskSet("edge-idle")

    # -- what this edge says ----------------------------------------------------------------
    def activity(self) -> EdgeActivity:
        """This edge's requests per machine now (the most recent MAX_ACTIVITY_MACHINES)."""
        now_wall, now_mono = now_ms(), self.router.clock()
        began = self.router.began
        recent = sorted(began.items(), key=lambda kv: -kv[1])[:MAX_ACTIVITY_MACHINES]
        machines = {mid: now_wall - int((now_mono - at) * 1000) for mid, at in recent}
        for mid in self.router.outstanding:  # in flight: active now
            machines[mid] = now_wall
        return EdgeActivity(
            edge=self.me,
            at_ms=now_wall,
            interval_ms=int(self.interval_s * 1000),
            machines=machines,
        )

    def tenants_activity(self, report: EdgeActivity) -> dict[str, EdgeActivity]:
        """``report`` cut to each tenant's machines (by the route table's app keys), for the
        tenants it names: what each tenant's key may hear (§4.23)."""
        return shares(report, self.owners())

    def owners(self) -> dict[str, str]:
        """Each routed machine's tenant ("" none)."""
        out: dict[str, str] = {}
        for key, route in self.router.table.apps.items():
            tenant = split_key(key)[1]
            for b in route.backends:
                out[b.machine_id] = tenant
        return out

    async def _heard(self, msg: Msg) -> None:
        try:
            a = decode(msg.data, EdgeActivity)
        except BadMessage as exc:
            log.warning("activity_dropped", subject=msg.subject, error=str(exc))
            return
        if msg.subject != self.subjects.edge_activity(a.edge):
            return  # another edge's name on this subject: not its word
        self.heard[a.edge] = time.monotonic()
        self.last[a.edge] = dict(a.machines)

    # -- the decision -----------------------------------------------------------------------
    def last_ms(self) -> dict[str, int]:
        """Each machine's latest request across the live edges (this one's included)."""
        now = time.monotonic()
        out: dict[str, int] = {}
        for edge, machines in self.last.items():
            if now - self.heard.get(edge, 0.0) > GONE_INTERVALS * self.interval_s:
                continue
            for mid, at in machines.items():
                out[mid] = max(out.get(mid, 0), at)
        for mid, at in self.activity().machines.items():
            out[mid] = max(out.get(mid, 0), at)
        return out

    def turn(self) -> list[str]:
        """One decision: the machines to stop (none unless this edge decides)."""
        if not decider(self.heard, self.me, time.monotonic(), self.interval_s):
            return []
        services = self.services()
        if not any(s.auto_stop for s in services.values()):
            return []
        stops = idle_stops(self.rows(), services, self.last_ms(), now_ms(), self.started_ms)
        return [mid for mid in stops if mid not in self.stopping]

    async def _stop(self, machine_id: str) -> None:
        self.stopping.add(machine_id)
        try:
            await self.stop_machine(machine_id)
            log.info("idle_stop", machine=machine_id, edge=self.me)
        except Exception as exc:  # tried again at a later turn if still idle
            log.warning("idle_stop_failed", machine=machine_id, error=str(exc))
        finally:
            self.stopping.discard(machine_id)

    # -- the loop ---------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        sub = await self.nc.subscribe(self.subjects.edge_activity(), cb=self._heard)
        task_status.started()
        try:
            while True:
                report = self.activity()
                await self.nc.publish(self.subjects.edge_activity(self.me), encode(report))
                for tenant, share in self.tenants_activity(report).items():
                    subject = self.subjects.edge_activity_of(tenant, self.me)
                    await self.nc.publish(subject, encode(share))
                for mid in self.turn():
                    self.tasks.spawn(self._stop(mid))
                await anyio.sleep(self.interval_s)  # the activity's period
        finally:
            with anyio.CancelScope(shield=True):
                await self.tasks.finish(0)
                await sub.unsubscribe()
