"""Healing (issue 38 item 5): the controller an edge runs with ``--controller``. From the
fleet view (the same one its routes come from), a machine of an app that should be serving
and cannot (started, its worker gone or its check critical) is replaced: the slot's spare
started, the failed machine's stop queued for its worker (I9: a worker that comes back
stops it before it would resume it, so two primaries never run), a new spare placed.

:func:`decide` is pure and deterministic over the view's rows: any number of controllers
reading the same rows decide the same failovers, with the same spare and the same order id
for the new spare (derived from the failed machine's order id and generation), so racing
controllers start one spare (a second start of a started machine is a no-op) and place one
machine (one order id, one machine: §5.3c). A controller whose view already shows the
spare starting does nothing: per app and region, it acts only while fewer machines serve
than the app wants (its spec's ``count`` there; without a spec, its primaries). A tenant's
apps are healed the same way, the new spare placed under the tenant's scope of its order id
(the tenant's machine, as its own ``buyer failover`` would place it).

An edge's own evidence counts too (fly-proxy's "notices, and sends a signal to start a
spare"): a machine this edge has found unreachable for UNREACHABLE_S (every connect and
probe since failed) on a worker whose last heartbeat is LATE_MS old is failed as if its
worker were gone, before the view says so (3 heartbeat intervals, at least 3 s). A spare
it starts is handed to ``started`` (the edge routes it once its own probe answers, before
its row says started and its check passes).
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import structlog

from bourse.runtime.tasks import TaskSet
from bourse.wire.metadata import PRIMARY, SPARE

if TYPE_CHECKING:
    from bourse.client import BourseClient
    from bourse.wire.messages import Machine

log = structlog.get_logger("bourse.edge")

RUNNING = frozenset({"starting", "started"})
IDLE = frozenset({"reserved", "stopped"})
CRITICAL = "critical"
# A failed machine acted on is not acted on again by this controller for this long (its
# spare's row shows it starting well before).
QUIET_S = 30.0
UNREACHABLE_S = 1.0  # an edge's connects and probes failing this long, and
LATE_MS = 1500  # its worker's last heartbeat this old: failed (its worker is dying)
TICK_S = 0.25  # how often the edge's evidence is looked at between the view's changes

_BEATS = """
SELECT w.worker_id FROM workers w JOIN beats b ON b.beat = w.beat WHERE b.at_ms < ?
"""

_ROWS = """
SELECT machine_id, order_id, tenant, app, region, worker_id, state, coalesce(role, ''),
       coalesce(slot, 0), coalesce(generation, 0), coalesce(health, ''),
       worker_gone_since_ms, coalesce(updated_at_ms, 0)
FROM machines WHERE app IS NOT NULL AND state != 'destroyed'
ORDER BY tenant, app, region, machine_id
"""


@dataclass(frozen=True, slots=True)
class Member:
    """A machine of an app, as healing reads it."""

    machine_id: str
    order_id: str
    tenant: str
    app: str
    region: str
    worker_id: str
    state: str
    role: str = PRIMARY
    slot: int = 0
    generation: int = 0
    health: str = ""
    gone: bool = False
    unreachable: bool = False  # this edge cannot reach it, its worker's heartbeat late
    changed_ms: int = 0  # its row's last change (its worker's clock): the same in every view

    @property
    def failed(self) -> bool:
        return self.state in RUNNING and (self.gone or self.unreachable
                                          or self.health == CRITICAL)  # fmt: skip

    @property
    def serving(self) -> bool:
        return self.state in RUNNING and not self.failed


Group = tuple[str, str, str]  # tenant, app, region


@dataclass(frozen=True, slots=True)
class Replace:
    """One failover: ``spare`` started in place of ``failed``, ``failed`` stopped (queued),
    a new spare placed under the order id ending ``suffix``."""

    failed: Member
    spare: Member
    suffix: str
    used: frozenset[str] = frozenset()  # the app's workers there (the new spare avoids them)


def members(db: sqlite3.Connection) -> list[Member]:
    """Every app machine the view holds (not destroyed)."""
    out = []
    for row in db.execute(_ROWS):
        mid, oid, tenant, app, region, wid, state, role, slot, gen, health, gone, changed = row
        out.append(Member(mid, oid, tenant, app, region, wid, state, role, slot, gen, health,
                          bool(gone), changed_ms=changed))  # fmt: skip
    return out


def late_workers(db: sqlite3.Connection, now_ms: int, late_ms: int = LATE_MS) -> set[str]:
    """The workers whose last heartbeat the view has is older than ``late_ms``."""
    return {wid for (wid,) in db.execute(_BEATS, (now_ms - late_ms,))}


def unreachable(rows: list[Member], suspects: set[str], late: set[str]) -> list[Member]:
    """``rows`` with the machines this edge cannot reach on a late worker marked so."""
    return [
        replace(m, unreachable=True) if m.machine_id in suspects and m.worker_id in late else m
        for m in rows
    ]


def groups(rows: list[Member]) -> dict[Group, list[Member]]:
    out: dict[Group, list[Member]] = {}
    for m in rows:
        out.setdefault((m.tenant, m.app, m.region), []).append(m)
    return out


def failing(rows: list[Member]) -> set[Group]:
    """The apps (and regions) with a failed machine: those whose wanted count is needed."""
    return {(m.tenant, m.app, m.region) for m in rows if m.failed}


def suffix_of(failed: Member) -> str:
    """The new spare's order id suffix: the same for every controller (the failed machine's
    order id, its generation and its row's last change, which every view has alike), another
    for the next failure of the slot, the same machine's included (started again since, its
    row changed: the first failure's new spare may be destroyed by then, and its order id
    would hand that one back)."""
    seed = f"{failed.order_id}|{failed.generation}|{failed.changed_ms}".encode()
    return "heal-" + hashlib.sha256(seed).hexdigest()[:10]


def replaced(rows: list[Member]) -> set[str]:
    """The failed machines already replaced: their app has, in their region, the new spare
    a failover of each places (its order id ends with :func:`suffix_of` the failed one).
    Such a machine is due no failover again (its stop is queued; its app, an idle one's
    machines stopped since, starts its spares for a request instead: edge/starts.py)."""
    out: set[str] = set()
    for group in groups(rows).values():
        orders = [m.order_id for m in group]
        for f in group:
            if f.failed and any(o.endswith(suffix_of(f)) for o in orders):
                out.add(f.machine_id)
    return out


def decide(rows: list[Member], wanted: Mapping[Group, int]) -> list[Replace]:
    """The failovers to do now (see the module doc). ``wanted``: machines an app wants
    serving in a region (missing: its primaries there). A failed machine already replaced
    (:func:`replaced`) is not failed over again: an app whose machines stopped when idle
    since is started by its requests, not by the controller."""
    out: list[Replace] = []
    done = replaced(rows)
    for key, group in sorted(groups(rows).items()):
        failed = sorted((m for m in group if m.failed and m.machine_id not in done),
                        key=lambda m: (m.role != PRIMARY, m.machine_id))  # fmt: skip
        if not failed:
            continue
        want = wanted.get(key)
        if want is None:
            want = sum(1 for m in group if m.role == PRIMARY)
        deficit = want - sum(1 for m in group if m.serving)
        spares = sorted(
            (m for m in group if m.role == SPARE and m.state in IDLE and not m.gone),
            key=lambda m: (m.slot, m.machine_id),
        )
        for f, spare in zip(failed[: max(deficit, 0)], spares, strict=False):
            out.append(Replace(f, spare, suffix_of(f), frozenset(m.worker_id for m in group)))
    return out


# The actions, injected (the market's client; a test's own).
WantedOf = Callable[[Group], Awaitable[int | None]]
Act = Callable[[Replace], Awaitable[str]]


class Controller:
    """Reads the view's rows on each change (``changed``), decides, acts: each failover
    once per QUIET_S (see the module doc)."""

    def __init__(
        self,
        wanted_of: WantedOf,
        act: Act,
        clock: Callable[[], float] = time.monotonic,
        suspects: Callable[[], set[str]] = set,
    ) -> None:
        self.wanted_of = wanted_of
        self.act = act
        self.clock = clock
        self.suspects = suspects  # the machines this edge cannot reach (its router's)
        self.late: set[str] = set()  # the workers whose heartbeat is late
        self.rows: list[Member] = []
        self.acted: dict[str, float] = {}  # failed machine id -> when
        self._changed = anyio.Event()
        self.tasks = TaskSet("edge-controller")

    def changed(self, db: sqlite3.Connection) -> None:
        """The view changed: its rows read now, decided on in the controller's task."""
        self.rows = members(db)
        self.late = late_workers(db, int(time.time() * 1000))
        self._changed.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        try:
            while True:
                with anyio.move_on_after(TICK_S):  # or the edge's evidence, looked at again
                    await self._changed.wait()
                self._changed = anyio.Event()
                await self.turn()
        finally:
            with anyio.CancelScope(shield=True):
                await self.tasks.finish(0)

    async def turn(self) -> None:
        """One look at the rows: the failovers due, started."""
        rows = self.rows
        if self.late:
            rows = unreachable(rows, self.suspects(), self.late)
        need = failing(rows)
        if not need:
            return
        wanted: dict[Group, int] = {}
        for key in sorted(need):
            got = await self.wanted_of(key)
            if got is not None:
                wanted[key] = got
        now = self.clock()
        for mid in [m for m, at in self.acted.items() if now - at > QUIET_S]:
            del self.acted[mid]
        for r in decide(rows, wanted):
            if r.failed.machine_id in self.acted:
                continue
            self.acted[r.failed.machine_id] = now
            self.tasks.spawn(self._act(r))

    async def _act(self, r: Replace) -> None:
        f = r.failed
        log.info("heal", app=f.app, tenant=f.tenant, failed=f.machine_id, spare=r.spare.machine_id,
                 why="worker gone" if f.gone else "unreachable, its worker's heartbeat late"
                 if f.unreachable else "check critical")  # fmt: skip
        try:
            done = await self.act(r)
        except Exception as exc:  # said, and tried again after QUIET_S if still due
            log.warning("heal_failed", app=f.app, failed=f.machine_id, error=str(exc))
            return
        log.info("healed", app=f.app, tenant=f.tenant, failed=f.machine_id,
                 spare=r.spare.machine_id, did=done)  # fmt: skip


def market_actions(
    client: BourseClient, started: Callable[[str, Machine], None] | None = None
) -> tuple[WantedOf, Act]:
    """The controller's reads and actions on the market: the wanted count from the app's
    record (the apps bucket), a failover through the exchange (the spare, once started,
    handed to ``started`` with its app's key). A tenant's app is healed as any other: the
    new spare is placed under the tenant's scope of its order id (bourse/wire/tenancy.py),
    so it is the tenant's machine, its shape read from the tenant's record."""
    from bourse.client.apps.store import AppStore
    from bourse.client.policy import place_spare
    from bourse.errors import BourseError
    from bourse.wire.messages import MachineCommand
    from edge.routing import app_key

    async def wanted_of(key: Group) -> int | None:
        tenant, app, region = key
        try:
            store = await AppStore.open(
                client.nc, client.subjects.prefix, tenant=tenant, create=False
            )
            record = await store.get(app)
        except Exception:  # no apps bucket, not readable: the primaries say what is wanted
            return None
        spec = record.spec if record is not None else None
        if spec is None:
            return None
        return spec.count if region in spec.regions else 0

    async def act(r: Replace) -> str:
        f, spare = r.failed, r.spare
        machine = await client.machine("start", spare.machine_id)
        if started is not None:
            started(app_key(f.app, f.tenant), machine)
        stop: str
        try:
            outcome = await client.machine_or_kept("stop", f.machine_id)
            stop = "queued" if isinstance(outcome, MachineCommand) else outcome.state
        except BourseError as exc:
            stop = f"not queued: {exc}"
        like = await client.machine("get", spare.machine_id)
        refill = await place_spare(
            client, app=f.app, regions=[f.region], like=like, used_workers=set(r.used),
            suffix=r.suffix, tenant=f.tenant,
        )  # fmt: skip
        placed = refill.placed.machine_id if refill.placed is not None else "unfilled"
        return f"spare started; {f.machine_id} stop {stop}; new spare {placed}"

    return wanted_of, act
