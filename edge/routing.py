"""Which machine of an app takes the next request: the edge's routing, a pure core.

In: a :class:`RouteTable` (each app's machines with what routing reads of them: address,
region, state, health, worker gone or not, draining; the app's concurrency limits), the
requests this edge has outstanding per machine, the machines this edge skips after a
failure, and a clock. Out: a :class:`Choice` (the machine and its address) or a
:class:`NoRoute` (why none, in words a 503 can carry).

The rules, in the order :meth:`Router.pick` applies them:

1. only a machine that is ``started``, whose checks pass (or that has none), whose worker is
   not gone and that is not draining (:func:`unready`, named reasons as Nomad's checkers
   record theirs); a machine this edge skips after a failed connection waits for its next
   passing probe (:meth:`Router.failed`, :meth:`Router.probed`);
2. never one at its hard limit of outstanding requests (this edge's count);
3. of the rest, one under its soft limit first, then the edge's own region first, then the
   fewest outstanding requests, ties taken in turn (round robin per app).

Who fills the table is not decided here (edge/routes.py: a routes file, the machines'
listing, later the fleet view): the core only reads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

# A machine's health as routing reads it: its checks pass, one failed, none ran yet, or it
# has no checks (routed: nothing says it is unwell).
PASSING = "passing"
CRITICAL = "critical"
PENDING = "pending"
NO_CHECKS = "none"
HEALTH = (PASSING, CRITICAL, PENDING, NO_CHECKS)
ROUTABLE_HEALTH = frozenset({PASSING, NO_CHECKS})

STARTED = "started"
MOVING = frozenset({"starting", STARTED})
ENDED = frozenset({"stopped", "failed", "destroyed"})  # its requests under way cannot end well

# Why a machine takes no request (named once: the 503's detail counts them).
NOT_STARTED = "not started"
CHECK_CRITICAL = "check critical"
CHECK_PENDING = "check not passed yet"
WORKER_GONE = "worker gone"
DRAINING = "draining"
NO_PORT = "no such port"
SKIPPED = "skipped after a failure"
AT_HARD_LIMIT = "at its hard limit"
TRIED = "tried already"

# Why an app's request found no machine.
UNKNOWN_APP = "unknown_app"
NO_MACHINE = "no_machine"

# The probe of a skipped machine: first after this long, then twice as long each time it
# fails, up to PROBE_MAX_S.
PROBE_EVERY_S = 0.5
PROBE_MAX_S = 5.0
HTTP = "http"
# A machine this edge started and probed itself is routed as started for at most this
# long before the table says so (the view's row follows the start by a round trip or two).
STARTED_HERE_S = 10.0


@dataclass(frozen=True, slots=True)
class Backend:
    """One machine of an app, as routing reads it."""

    machine_id: str
    region: str
    # its named ports: name -> (host, port)
    addresses: Mapping[str, tuple[str, int]]
    state: str = STARTED
    health: str = NO_CHECKS
    worker_gone: bool = False
    draining: bool = False
    role: str = ""  # its metadata's role (a spare is started for a request only as below)
    # failed (its worker gone, or its check critical) and already replaced by a failover
    # (edge/healing.py ``replaced``): its app's spares in its region may be started for a
    # request, and no failover is due for it
    replaced: bool = False


@dataclass(frozen=True, slots=True)
class AppRoute:
    """An app's machines and its limits (per machine, counted by each edge: 0 is none).
    ``port``: the named port its HTTP requests go to ("" : ``http`` if a machine has one,
    else its first)."""

    key: str
    backends: tuple[Backend, ...] = ()
    soft_limit: int = 0
    hard_limit: int = 0
    port: str = ""

    def address(self, backend: Backend, port: str = "") -> tuple[str, int] | None:
        """Where ``backend`` takes this app's connections on ``port`` (or its HTTP port)."""
        name = port or self.port
        if name:
            return backend.addresses.get(name)
        got = backend.addresses.get(HTTP)
        return got if got is not None else next(iter(backend.addresses.values()), None)


@dataclass(frozen=True, slots=True)
class Service:
    """A raw TCP service: the edge listens on ``listen`` and passes each connection to a
    machine of ``app``, on the machine's port named ``port``."""

    listen: tuple[str, int]
    app: str
    port: str


@dataclass(frozen=True, slots=True)
class RouteTable:
    """Every app this edge routes (by key: ``<app>`` or ``<app>.<tenant>``, the Host's
    labels before the domain) and its raw TCP services; ``source`` says who filled it."""

    apps: Mapping[str, AppRoute] = field(default_factory=dict)
    services: tuple[Service, ...] = ()
    source: str = ""


def app_key(app: str, tenant: str = "") -> str:
    """The key of a tenant's app: ``web.acme``; of an app of no tenant: ``web``."""
    return f"{app}.{tenant}" if tenant else app


def split_key(key: str) -> tuple[str, str]:
    """An app key back to its app and tenant (``web.acme`` -> web, acme; ``web`` -> web,
    ""): an app's name has no dot."""
    app, _, tenant = key.partition(".")
    return app, tenant


def unready(backend: Backend, route: AppRoute, port: str = "") -> str | None:
    """Why ``backend`` takes no new request whatever the load (None: it may)."""
    if backend.state != STARTED:
        return NOT_STARTED
    if backend.worker_gone:
        return WORKER_GONE
    if backend.draining:
        return DRAINING
    if backend.health not in ROUTABLE_HEALTH:
        return CHECK_CRITICAL if backend.health == CRITICAL else CHECK_PENDING
    if route.address(backend, port) is None:
        return NO_PORT
    return None


@dataclass(frozen=True, slots=True)
class Choice:
    backend: Backend
    address: tuple[str, int]


@dataclass(frozen=True, slots=True)
class NoRoute:
    """No machine for the request: ``reason`` (UNKNOWN_APP, NO_MACHINE) and, for people,
    how many machines were passed over for what."""

    reason: str
    app: str
    passed_over: Mapping[str, int] = field(default_factory=dict)

    @property
    def detail(self) -> str:
        if self.reason == UNKNOWN_APP:
            return f"no app {self.app!r} at this edge"
        if not self.passed_over:
            return f"app {self.app!r} has no machine"
        why = ", ".join(f"{n} {what}" for what, n in sorted(self.passed_over.items()))
        return f"no machine of app {self.app!r} can take it ({why})"


@dataclass(slots=True)
class _Skip:
    address: tuple[str, int]
    due: float  # when to probe next (math.inf while a probe runs)
    interval: float
    since: float = 0.0  # when it was first skipped


@dataclass(slots=True)
class _Here:
    """A machine this edge started: as its start answered, when, and whether the table
    has shown it starting or started since (a stopped row after that is a new stop)."""

    backend: Backend
    at: float
    moved: bool = False
    key: str = ""  # its app's (routed before the table has a row of it: a new machine)
    seen: bool = False  # the table has had a row of it


@dataclass(frozen=True, slots=True)
class _Ready:
    """An app's machines that pass the table's own tests (computed once per table), and
    the count of the others by reason."""

    route: AppRoute
    backends: tuple[tuple[Backend, tuple[str, int]], ...]
    passed_over: Mapping[str, int]


class Router:
    """The routing state of one edge: the table, its outstanding requests per machine, the
    machines it skips until a probe passes. ``clock`` is injected (seconds, monotonic)."""

    def __init__(
        self,
        region: str = "",
        clock: Callable[[], float] | None = None,
        probe_every_s: float = PROBE_EVERY_S,
        probe_max_s: float = PROBE_MAX_S,
    ) -> None:
        self.region = region
        self.clock = clock or time.monotonic
        self.probe_every_s = probe_every_s
        self.probe_max_s = max(probe_max_s, probe_every_s)
        self.table = RouteTable()
        self.outstanding: dict[str, int] = {}
        self.skipped: dict[str, _Skip] = {}
        self._ready: dict[tuple[str, str], _Ready] = {}
        self._turn: dict[str, int] = {}
        # machines this edge started and whose port answered its probe
        self.started_here: dict[str, _Here] = {}
        # when this edge last sent a request to each machine (its clock): its activity
        self.began: dict[str, float] = {}
        # told when a machine may have become able to take requests: a new table, a
        # probe that passed, a machine this edge started (held requests route again)
        self.observers: list[Callable[[], None]] = []

    def _changed(self) -> None:
        for observe in self.observers:
            observe()

    # -- the table -------------------------------------------------------------------------

    def update(self, table: RouteTable) -> None:
        """Route by ``table`` from now on. Outstanding counts carry over (those requests are
        still in flight); a skipped machine no longer in the table is forgotten."""
        self.table = table
        self._ready = {}
        present = {b.machine_id: b for r in table.apps.values() for b in r.backends}
        for gone in [m for m in self.skipped if m not in present]:
            del self.skipped[gone]
        for gone in [m for m in self.began if m not in present]:
            del self.began[gone]
        old = self.clock() - STARTED_HERE_S
        for mid, here in list(self.started_here.items()):
            row = present.get(mid)
            if row is not None:
                here.seen = True
                if row.state in MOVING:
                    here.moved = True
            # gone (its row was there, or never came), started by the table, too old, or
            # started and then stopped again
            vanished = row is None and here.seen
            # (a started row whose check has not passed yet: this edge's probe answered)
            routed = row is not None and row.state == STARTED and row.health != PENDING
            done = vanished or routed or here.at < old
            if done or (here.moved and row is not None and row.state not in MOVING):
                del self.started_here[mid]
        self._changed()

    def dead_in_flight(self) -> set[str]:
        """The machines this edge has requests outstanding at that the table says ended
        (stopped, failed, destroyed: gone from it) or whose worker is gone; a machine this
        edge started and routes before its row comes is not among them."""
        present = {b.machine_id: b for r in self.table.apps.values() for b in r.backends}
        return {
            mid
            for mid in self.outstanding
            if mid not in self.started_here
            and ((b := present.get(mid)) is None or b.worker_gone or b.state in ENDED)
        }

    def started(self, backend: Backend, key: str = "") -> None:
        """This edge started ``backend`` (of app ``key``) and its port answered: routed as
        started until the table says so (its row was older than the start, or there is none
        yet: a machine just placed), or STARTED_HERE_S passed, or the table shows it
        starting and then stopping (it moved on). Its port answering is a passing probe: a
        machine skipped after an earlier failure (its worker killed, then back) is skipped
        no more (its held requests waited for the skip's next probe, up to probe_max_s)."""
        unskipped = self.skipped.pop(backend.machine_id, None) is not None
        route = self.table.apps
        row = next(
            (b for r in route.values() for b in r.backends if b.machine_id == backend.machine_id),
            None,
        )
        if row is not None and row.state == STARTED and row.health != PENDING:
            if unskipped:
                self._changed()
            return  # the table has it already
        moved = row is not None and row.state in MOVING
        self.started_here[backend.machine_id] = _Here(
            backend, self.clock(), moved, key, seen=row is not None
        )
        self._ready = {}
        self._changed()

    def _ready_of(self, key: str, port: str) -> _Ready | None:
        ready = self._ready.get((key, port))
        if ready is not None:
            return ready
        route = self.table.apps.get(key)
        if route is None:
            return None
        good: list[tuple[Backend, tuple[str, int]]] = []
        passed: dict[str, int] = {}
        listed = {b.machine_id for b in route.backends}
        new = [h.backend for h in self.started_here.values() if h.key == key and not h.seen
               and h.backend.machine_id not in listed]  # fmt: skip
        for b in (*route.backends, *new):
            here = self.started_here.get(b.machine_id)
            if here is not None and not b.worker_gone and (b.state != STARTED
                                                           or b.health == PENDING):  # fmt: skip
                b = here.backend
            why = unready(b, route, port)
            if why is None:
                address = route.address(b, port)
                assert address is not None  # unready checked it
                good.append((b, address))
            else:
                passed[why] = passed.get(why, 0) + 1
        ready = self._ready[(key, port)] = _Ready(route, tuple(good), passed)
        return ready

    # -- a request -------------------------------------------------------------------------

    def pick(self, key: str, port: str = "", exclude: Collection[str] = ()) -> Choice | NoRoute:
        """The machine of app ``key`` for the next request (or connection, on ``port``),
        other than those in ``exclude`` (tried already)."""
        ready = self._ready_of(key, port)
        if ready is None:
            return NoRoute(UNKNOWN_APP, key)
        hard = ready.route.hard_limit
        soft = ready.route.soft_limit
        outstanding = self.outstanding
        skipped = self.skipped
        best: list[tuple[Backend, tuple[str, int]]] = []
        best_rank: tuple[bool, bool, int] | None = None
        for backend, address in ready.backends:
            mid = backend.machine_id
            load = outstanding.get(mid, 0)
            if mid in exclude or mid in skipped or (hard and load >= hard):
                continue
            rank = (bool(soft) and load >= soft, backend.region != self.region, load)
            if best_rank is None or rank < best_rank:
                best, best_rank = [(backend, address)], rank
            elif rank == best_rank:
                best.append((backend, address))
        if not best:
            return NoRoute(NO_MACHINE, key, self._passed_over(ready, exclude))
        turn = self._turn.get(key, 0)
        self._turn[key] = turn + 1
        backend, address = best[turn % len(best)]
        return Choice(backend, address)

    def _passed_over(self, ready: _Ready, exclude: Collection[str]) -> dict[str, int]:
        """Why each machine of the app was passed over (the 503's words)."""
        passed = dict(ready.passed_over)
        hard = ready.route.hard_limit
        for backend, _ in ready.backends:
            mid = backend.machine_id
            why = (
                TRIED
                if mid in exclude
                else SKIPPED
                if mid in self.skipped
                else AT_HARD_LIMIT
                if hard and self.outstanding.get(mid, 0) >= hard
                else None
            )
            if why is not None:
                passed[why] = passed.get(why, 0) + 1
        return passed

    def begin(self, machine_id: str) -> None:
        """A request (or connection) went to ``machine_id``."""
        self.outstanding[machine_id] = self.outstanding.get(machine_id, 0) + 1
        self.began[machine_id] = self.clock()

    def end(self, machine_id: str) -> None:
        """It ended (answered, failed or cut short)."""
        left = self.outstanding.get(machine_id, 0) - 1
        if left > 0:
            self.outstanding[machine_id] = left
        else:
            self.outstanding.pop(machine_id, None)

    # -- failures and probes ---------------------------------------------------------------

    def failed(self, machine_id: str, address: tuple[str, int]) -> None:
        """A connection to ``machine_id`` at ``address`` failed: skip it until a probe of
        that address passes."""
        if machine_id not in self.skipped:
            now = self.clock()
            self.skipped[machine_id] = _Skip(
                address, now + self.probe_every_s, self.probe_every_s, now
            )

    def unreachable(self, for_s: float) -> set[str]:
        """The machines skipped for at least ``for_s`` (every probe since failed)."""
        now = self.clock()
        return {mid for mid, s in self.skipped.items() if now - s.since >= for_s}

    def probes_due(self) -> list[tuple[str, tuple[str, int]]]:
        """The skipped machines to probe now (machine id, address); each is then not due
        again until :meth:`probed` says how its probe went."""
        now = self.clock()
        due = [(mid, s.address) for mid, s in self.skipped.items() if s.due <= now]
        for mid, _ in due:
            self.skipped[mid].due = math.inf
        return due

    def next_probe_in(self) -> float | None:
        """Seconds until the next probe is due (0: now; None: nothing to probe)."""
        due = min((s.due for s in self.skipped.values()), default=math.inf)
        return None if due == math.inf else max(0.0, due - self.clock())

    def probed(self, machine_id: str, ok: bool) -> None:
        """A probe of a skipped machine passed (routed again) or failed (probed again
        later, each interval twice the last, up to ``probe_max_s``)."""
        skip = self.skipped.get(machine_id)
        if skip is None:
            return
        if ok:
            del self.skipped[machine_id]
            self._changed()
            return
        skip.interval = min(skip.interval * 2, self.probe_max_s)
        skip.due = self.clock() + skip.interval
