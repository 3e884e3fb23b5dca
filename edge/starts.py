"""Started by the request (issue 38 item 3): an app with no machine that can take a request
but a stopped one gets that machine started, and the request is held meanwhile (Knative's
activator, fly-proxy's ``auto_start_machines``).

:func:`to_start` (pure) picks the machine: a stopped one whose worker is not gone, the
edge's region first, then by id (every edge picks the same one, so edges racing for one app
start one machine; a second start of a started machine is a no-op at its worker).

:class:`Starts` holds each app's requests (a bounded queue per app) while ONE start of the
app runs (concurrent requests share it): the machine started through the market's machine
verb, then the edge's own TCP probe of the machine's port until it answers (not the
worker's check interval, not the view), then the machine routed as started by this edge
(``Router.started``) and every held request routed again. Past ``timeout_s`` each held
request is answered 503 with why; a failed start is not tried again for the app for a
backoff (doubling, up to BACKOFF_MAX_S: no start storm), and the requests meanwhile get
the failure's reason.

An app with no machine to start whose spec wants more (edge/placing.py) gets one placed
first, through the market under its slot's order id (so edges and requests racing for the
app place one machine), then started and probed as above. None is started past the spec's
``count`` running in the region, nor while a failover is due there (:func:`failing_over`:
the controller starts the spare).

A request no machine can take now, when one may soon (:func:`waitable`: starting, skipped
after a failure, its check not passed yet, a spare a failover starts), waits instead:
routed again at each change the router tells (a table, a probe passed, a start), until its
deadline (then 503). So a failover shows as a pause, not as errors.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog

from bourse.runtime.tasks import TaskSet
from bourse.wire.metadata import SPARE
from edge.probe import probe
from edge.routes import machine_addresses
from edge.routing import (
    CRITICAL,
    MOVING,
    PASSING,
    PENDING,
    STARTED,
    AppRoute,
    Backend,
    Router,
)

if TYPE_CHECKING:
    from bourse.runtime.metrics import EdgeMetrics
    from bourse.wire.messages import Machine, PlaceOrder

log = structlog.get_logger("bourse.edge")

# The states a machine is started from for a request (placed and never started, stopped,
# or failed: killed, its restart policy done with it; a start that fails again backs off).
# A slot's spare is not (healing starts it, or its slot would have two primaries), unless
# a failover replaced a machine of its app in its region (to_start).
STARTABLE = frozenset({"reserved", "stopped", "failed"})
START_TIMEOUT_S = 10.0
MAX_HELD = 256  # requests held per app while its machine starts
PROBE_EVERY_S = 0.005  # the edge's probe of a starting machine's port, this often
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0

# None: a machine answers now, route the request again; text: why not (its 503).
Release = Callable[[str | None], None]
StartMachine = Callable[[str], Awaitable["Machine"]]
# The order of a new machine of an app that has none to start (None: its spec wants no
# more), and how it is placed (the machine's id).
PlaceFor = Callable[[str], "PlaceOrder | None"]
PlaceMachine = Callable[["PlaceOrder"], Awaitable[str]]
# The machines an app wants running in a region (its spec's count; None: no spec says).
Wanted = Callable[[str, str], "int | None"]
# Whether an address accepts a connection within a timeout (edge/probe.py ``probe``).
Probe = Callable[[tuple[str, int], float], Awaitable[bool]]


def to_start(route: AppRoute, region: str) -> Backend | None:
    """The app's machine to start for a request: stopped (or placed and never started), its
    worker not gone, not a spare unless a failover replaced a machine of the app in the
    spare's region (the spares are the slot's machines since: a failover started one, and
    the app stopped it when idle); in ``region`` first, a spare last, then the lowest id
    (None: there is none)."""
    healed = {b.region for b in route.backends if b.replaced}
    stopped = [
        b
        for b in route.backends
        if b.state in STARTABLE and not b.worker_gone and (b.role != SPARE or b.region in healed)
    ]
    return min(
        stopped, key=lambda b: (b.region != region, b.role == SPARE, b.machine_id), default=None
    )


def running(route: AppRoute, region: str) -> int:
    """The app's machines starting or started in ``region`` whose worker is not gone."""
    return sum(1 for b in route.backends
               if b.region == region and b.state in MOVING and not b.worker_gone)  # fmt: skip


def failing_over(route: AppRoute, region: str) -> bool:
    """Whether the app's machines in ``region`` are due a failover (one running whose
    worker is gone or whose check is critical, not replaced yet, and a spare to start in
    its place): a request starts none of its stopped machines meanwhile."""
    here = [b for b in route.backends if b.region == region]
    failed = any(
        b.state in MOVING and (b.worker_gone or b.health == CRITICAL) and not b.replaced
        for b in here
    )
    return failed and any(
        b.role == SPARE and b.state in STARTABLE and not b.worker_gone for b in here
    )


def waitable(route: AppRoute, skipped: Collection[str]) -> bool:
    """Whether a request the app's machines cannot take now may be taken soon: one of them
    is starting, or started and skipped after a failure (its probe may pass) or its check
    not passed yet, or a spare a failover may start (its worker not gone, none draining)."""
    for b in route.backends:
        if b.worker_gone or b.draining:
            continue
        if b.state == "starting" or (b.role == SPARE and b.state in STARTABLE):
            return True
        if b.state == STARTED and (b.machine_id in skipped or b.health == PENDING):
            return True
    return False


@dataclass(slots=True)
class _Start:
    machine_id: str  # the order's id until a placed machine has one
    waiters: list[Release] = field(default_factory=list)
    order: PlaceOrder | None = None  # a new machine placed first


class _NotPlaced(Exception):
    """Placing the new machine failed (its reason already said)."""


@dataclass(slots=True)
class _Failed:
    why: str
    retry_at: float
    backoff_s: float


class Starts:
    """Each app's start under way and the requests it holds (see the module doc)."""

    def __init__(
        self,
        router: Router,
        start_machine: StartMachine,
        *,
        region: str = "",
        timeout_s: float = START_TIMEOUT_S,
        max_held: int = MAX_HELD,
        probe_every_s: float = PROBE_EVERY_S,
        metrics: EdgeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe: Probe = probe,
        auto_start: Callable[[str], bool] = lambda app: True,
        place_for: PlaceFor | None = None,
        place: PlaceMachine | None = None,
        wanted: Wanted = lambda app, region: None,
    ) -> None:
        self.router = router
        self.start_machine = start_machine
        self.region = region
        self.timeout_s = timeout_s
        self.max_held = max_held
        self.probe_every_s = probe_every_s
        self.metrics = metrics
        self.clock = clock
        self.probe = probe
        self.auto_start = auto_start  # an app's service section may say no
        self.place_for = place_for if place is not None else None
        self.place = place
        self.wanted = wanted
        self.pending: dict[str, _Start] = {}
        self.failed: dict[str, _Failed] = {}
        # requests waiting for a machine of their app able to take them, with deadlines
        self.waiting: dict[str, list[tuple[Release, float]]] = {}
        self.tasks = TaskSet("edge-start")
        router.observers.append(self.changed)

    def hold(self, app: str, release: Release, deadline: float | None = None) -> str | None:
        """Hold a request of ``app`` until a machine of it is started, or until one of its
        machines can take it (``deadline``: the clock's time to give up at; default
        ``timeout_s`` from now): None when held (``release`` is called once, later); else
        why not, for its 503 ("": the app has no machine to start or wait for, answer as
        routing said)."""
        start = self.pending.get(app)
        if start is not None:
            if len(start.waiters) >= self.max_held:
                return (
                    f"{len(start.waiters)} requests of app {app!r} already wait for machine "
                    f"{start.machine_id} to start"
                )
            start.waiters.append(release)
            return None
        route = self.router.table.apps.get(app)
        if route is None:
            return ""
        why = self._begin(app, route, release)
        if why is None:
            return None
        if waitable(route, self.router.skipped) and self._wait(app, release, deadline):
            return None
        return why

    def _begin(self, app: str, route: AppRoute, release: Release) -> str | None:
        """A start (or a placing, then a start) of one of ``app``'s machines for the
        request: None when one began; else why not ("": nothing to start)."""
        if not self.auto_start(app):
            return ""
        failed = self.failed.get(app)
        if failed is not None and failed.retry_at > self.clock():
            return f"{failed.why} (started again in {failed.retry_at - self.clock():.1f} s)"
        backend = to_start(route, self.region)
        if backend is not None and failing_over(route, backend.region):
            return ""  # the controller starts the slot's spare: not a second primary
        if backend is not None and self._more(app, route, backend.region):
            start = _Start(backend.machine_id, [release])
        else:
            order = self.place_for(app) if self.place_for is not None else None
            if order is None:
                return ""
            start = _Start(f"of order {order.order_id}", [release], order)
        self.pending[app] = start
        self.tasks.spawn(self._start(app, route, start))
        return None

    def _more(self, app: str, route: AppRoute, region: str) -> bool:
        """Whether the app may have one more machine running in ``region`` (its spec's
        count there, when it has one: a failover's stopped primary is not started again
        beside the spare that replaced it)."""
        wanted = self.wanted(app, region)
        return wanted is None or running(route, region) < wanted

    # -- requests that wait for a machine able to take them ---------------------------------
    def _wait(self, app: str, release: Release, deadline: float | None) -> bool:
        """Hold the request until the router may route it (``changed``) or ``deadline``;
        False when the app holds too many already."""
        waiters = self.waiting.setdefault(app, [])
        if len(waiters) >= self.max_held:
            return False
        at = deadline if deadline is not None else self.clock() + self.timeout_s
        waiters.append((release, at))
        if len(waiters) == 1:
            self.tasks.spawn(self._expire(app))
        return True

    def changed(self) -> None:
        """A machine may take requests now (a new table, a probe passed, a start): every
        waiting request routes again (held again, until its deadline, if none can)."""
        waiting, self.waiting = self.waiting, {}
        for waiters in waiting.values():
            for release, _ in waiters:
                release(None)

    async def _expire(self, app: str) -> None:
        """Answer the app's waiting requests whose deadline passed (503 with why), until
        none waits."""
        while waiters := self.waiting.get(app):
            now = self.clock()
            due = [w for w in waiters if w[1] <= now]
            if due:
                waiters[:] = [w for w in waiters if w[1] > now]
                why = f"no machine of app {app!r} could take it within {self.timeout_s:g} s"
                for release, _ in due:
                    release(why)
                continue
            await anyio.sleep(min(w[1] for w in waiters) - now)  # until the next deadline

    async def _start(self, app: str, route: AppRoute, start: _Start) -> None:
        t0 = time.perf_counter()
        why: str | None = None
        try:
            with anyio.fail_after(self.timeout_s):
                if start.order is not None and self.place is not None:
                    try:
                        start.machine_id = await self.place(start.order)
                    except Exception as exc:
                        oid = start.order.order_id
                        why = f"placing a machine of app {app!r} (order {oid}) failed: {exc}"
                        raise _NotPlaced from exc
                why = await self._started(app, route, start.machine_id)
        except _NotPlaced:
            pass
        except TimeoutError:
            why = (
                f"machine {start.machine_id} of app {app!r} did not answer within "
                f"{self.timeout_s:g} s"
            )
        except Exception as exc:  # the start refused or failed: said to every held request
            why = f"the start of machine {start.machine_id} of app {app!r} failed: {exc}"
        finally:
            del self.pending[app]
        mid = start.machine_id
        seconds = time.perf_counter() - t0
        if why is None:
            self.failed.pop(app, None)
            log.info("cold_start", app=app, machine=mid, ms=round(seconds * 1000, 3),
                     held=len(start.waiters), placed=start.order is not None)  # fmt: skip
            if self.metrics is not None:
                self.metrics.cold_start(app, seconds)
        else:
            last = self.failed.get(app)
            backoff = min(last.backoff_s * 2, BACKOFF_MAX_S) if last else BACKOFF_S
            self.failed[app] = _Failed(why, self.clock() + backoff, backoff)
            log.warning("cold_start_failed", app=app, machine=mid, why=why, backoff_s=backoff)
        for release in start.waiters:
            release(why)

    async def _started(self, app: str, route: AppRoute, mid: str) -> str | None:
        """Start ``mid`` and probe its port until it answers, then route it: None, or why
        it cannot be."""
        machine = await self.start_machine(mid)
        backend = Backend(mid, machine.region, machine_addresses(machine), STARTED, PASSING)
        address = route.address(backend)
        if address is None:
            return f"machine {mid} of app {app!r} has no port {route.port or 'http'!r}"
        await self._answers(address)
        self.router.started(backend, app)
        return None

    def serve_started(self, app: str, machine: Machine) -> None:
        """``machine`` of ``app`` was started by another hand (this edge's controller, a
        failover's spare): routed once this edge's probe of its port answers, before its
        row says started and its check passes."""
        self.tasks.spawn(self._serve_started(app, machine))

    async def _serve_started(self, app: str, machine: Machine) -> None:
        route = self.router.table.apps.get(app)
        backend = Backend(machine.machine_id, machine.region, machine_addresses(machine),
                          STARTED, PASSING)  # fmt: skip
        address = route.address(backend) if route is not None else None
        if address is None:
            return
        with anyio.move_on_after(self.timeout_s):
            await self._answers(address)
            self.router.started(backend, app)
            log.info("spare_routed", app=app, machine=machine.machine_id)

    async def _answers(self, address: tuple[str, int]) -> None:
        """Until ``address`` accepts a connection (the edge's own probe, at its pace)."""
        while True:
            if await self.probe(address, self.probe_every_s * 20):
                return
            await anyio.sleep(self.probe_every_s)  # the probe's pace, not a synchronisation

    async def close(self) -> None:
        """Every start under way cancelled (the edge stops)."""
        await self.tasks.finish(0)
