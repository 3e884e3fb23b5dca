"""The rollout: a plan's steps carried out one at a time, as a pure state machine.

Events in (a machine placed, started, its health, destroyed, an order unfilled, a start
that failed, the clock), actions out (place, start, watch the health, destroy, finished).
The shell (bourse/client/apps/apply.py) performs each action and feeds back what happened;
nothing is decided there.

One step at a time, so an app never has more than one extra machine: an update places the
new machine (on a worker the app does not use in the region, else beside the old one),
starts it (a primary), waits for its checks to pass (none: started is enough), then drains
the old one if it was started (the edges send it no new request and the requests under way
finish; then it is stopped) and destroys it. A running machine a scale-down (or a region
left) destroys is drained first the same way. An update with no room for the new machine,
or whose checks do not pass in time, stops the rollout there: the old machines keep
serving.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from bourse.client.apps.plan import DESTROY, KEEP, START, UPDATE, Plan, Step
from bourse.wire.metadata import PRIMARY

# The states of an old machine that may be serving requests: drained before its destroy.
RUNNING = frozenset({"starting", "started"})
# What became of a step.
DONE, UNFILLED, STOPPED, SKIPPED, FAILED = "done", "unfilled", "stopped", "skipped", "failed"


# -- events --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placed:
    machine_id: str
    worker_id: str


@dataclass(frozen=True)
class Unfilled:
    reason: str


@dataclass(frozen=True)
class Started:
    machine_id: str


@dataclass(frozen=True)
class StartFailed:
    detail: str


@dataclass(frozen=True)
class Health:
    """A machine's health as last seen (``passing``, ``critical``, ``""``: not checked yet)."""

    status: str
    detail: str = ""


@dataclass(frozen=True)
class Destroyed:
    machine_id: str


@dataclass(frozen=True)
class Drained:
    """The old machine was drained (and stopped)."""

    machine_id: str


@dataclass(frozen=True)
class Tick:
    """Time passed (the shell's watch found nothing new)."""


Event = Placed | Unfilled | Started | StartFailed | Health | Destroyed | Drained | Tick


# -- actions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Place:
    """Place the step's machine under ``order_id``, on none of ``exclude_workers``."""

    step: Step
    order_id: str
    exclude_workers: tuple[str, ...]


@dataclass(frozen=True)
class StartMachine:
    machine_id: str


@dataclass(frozen=True)
class WatchHealth:
    """Look at the machine's health again (and say Tick when nothing changed)."""

    machine_id: str


@dataclass(frozen=True)
class DrainMachine:
    """Drain the machine an update replaces: no new request through the edges, those under
    way finished (or a bound passed), then stopped."""

    machine_id: str


@dataclass(frozen=True)
class DestroyMachine:
    machine_id: str


@dataclass(frozen=True)
class Finished:
    pass


Action = Place | StartMachine | WatchHealth | DrainMachine | DestroyMachine | Finished


class Outcome(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What became of one step: ``done``, ``unfilled`` (no room), ``stopped`` (checks not
    passing in time), ``failed`` (the machine did not start) or ``skipped`` (after a stop);
    the machine it made, if any."""

    step: Step
    result: str
    machine_id: str = ""
    worker_id: str = ""
    detail: str = ""


@dataclass
class _Current:
    step: Step
    stage: str  # place | beside | start | health | drain | destroy
    new_id: str = ""
    new_worker: str = ""
    deadline_ms: int = 0
    last_health: str = ""


@dataclass
class Rollout:
    """The state machine over ``plan``; ``checks``: the spec has checks (a new primary must
    pass them); ``wait_ms``: how long they may take."""

    plan: Plan
    checks: bool
    wait_ms: int
    outcomes: list[Outcome] = field(default_factory=list)
    _queue: list[Step] = field(default_factory=list)
    _cur: _Current | None = None
    # the app's machines per worker in each region (anti-affinity)
    _workers: dict[str, Counter[str]] = field(default_factory=dict)
    _stopped: bool = False

    def begin(self, now_ms: int) -> Action:
        """The first action."""
        self._queue = [s for s in self.plan.steps if s.action != KEEP]
        for s in self.plan.steps:
            if s.worker_id:
                self._workers.setdefault(s.region, Counter())[s.worker_id] += 1
        return self._next(now_ms)

    @property
    def stopped(self) -> bool:
        """A step stopped the rollout (no room, checks not passing in time)."""
        return self._stopped

    @property
    def complete(self) -> bool:
        """Every step done."""
        return all(o.result == DONE for o in self.outcomes)

    def _next(self, now_ms: int) -> Action:
        if not self._queue:
            self._cur = None
            return Finished()
        step = self._queue.pop(0)
        self._cur = cur = _Current(step, "")
        if step.action == DESTROY:
            if step.state in RUNNING:  # scaled down: drained first, as an update's old one
                cur.stage = "drain"
                return DrainMachine(step.machine_id)
            cur.stage = "destroy"
            return DestroyMachine(step.machine_id)
        if step.action == START:
            cur.stage, cur.new_id = "start", step.machine_id
            return StartMachine(step.machine_id)
        cur.stage = "place"
        return Place(step, step.order_id, self._exclude(step, beside=False))

    def _exclude(self, step: Step, *, beside: bool) -> tuple[str, ...]:
        """The app's workers in the region (anti-affinity); beside: all but the old
        machine's."""
        mine = self._workers.get(step.region, Counter())
        return tuple(
            sorted(w for w, n in mine.items() if n and not (beside and w == step.worker_id))
        )

    def _end(self, result: str, now_ms: int, detail: str = "") -> Action:
        cur = self._cur
        assert cur is not None
        self.outcomes.append(
            Outcome(
                step=cur.step,
                result=result,
                machine_id=cur.new_id,
                worker_id=cur.new_worker,
                detail=detail,
            )
        )
        if result in (STOPPED, FAILED) or (result == UNFILLED and cur.step.action == UPDATE):
            self._stopped = True
            for rest in self._queue:
                self.outcomes.append(Outcome(step=rest, result=SKIPPED, detail="rollout stopped"))
            self._queue = []
        return self._next(now_ms)

    def on(self, event: Event, now_ms: int) -> Action:
        """The next action, given what the last one led to."""
        cur = self._cur
        if cur is None:
            return Finished()
        step = cur.step
        match event:
            case Placed(machine_id=mid, worker_id=wid):
                cur.new_id, cur.new_worker = mid, wid
                self._workers.setdefault(step.region, Counter())[wid] += 1
                if step.role == PRIMARY:
                    cur.stage = "start"
                    return StartMachine(mid)
                return self._settled(now_ms)
            case Unfilled(reason=reason):
                if step.action == UPDATE and cur.stage == "place":
                    cur.stage = "beside"
                    return Place(step, step.order_id + ".b", self._exclude(step, beside=True))
                what = "no room for the new machine" if step.action == UPDATE else "unfilled"
                return self._end(UNFILLED, now_ms, f"{what} in {step.region}: {reason}")
            case Started():
                if not self.checks:
                    return self._settled(now_ms)
                cur.stage, cur.deadline_ms = "health", now_ms + self.wait_ms
                return WatchHealth(cur.new_id)
            case StartFailed(detail=detail):
                return self._end(FAILED, now_ms, detail)
            case Health(status=status, detail=detail):
                if status == "passing":
                    return self._settled(now_ms)
                cur.last_health = f"{status}: {detail}" if detail else status
                return self._waiting(now_ms)
            case Tick():
                return self._waiting(now_ms)
            case Drained():
                cur.stage = "destroy"
                return DestroyMachine(step.machine_id)
            case Destroyed():
                self._workers.setdefault(step.region, Counter())[step.worker_id] -= 1
                return self._end(DONE, now_ms)
        raise AssertionError(f"unexpected event {event!r}")  # pragma: no cover

    def _waiting(self, now_ms: int) -> Action:
        cur = self._cur
        assert cur is not None and cur.stage == "health"
        if now_ms < cur.deadline_ms:
            return WatchHealth(cur.new_id)
        seen = cur.last_health or "not checked yet"
        detail = f"checks not passing after {self.wait_ms / 1000:g} s ({seen})"
        if cur.step.action == UPDATE:
            detail += f"; {cur.step.machine_id} keeps serving"
        return self._end(STOPPED, now_ms, detail)

    def _settled(self, now_ms: int) -> Action:
        """The new machine is as it should be: an update destroys the old one, drained
        first if it runs (the edges may be sending it requests)."""
        cur = self._cur
        assert cur is not None
        if cur.step.action == UPDATE:
            if cur.step.state in RUNNING:
                cur.stage = "drain"
                return DrainMachine(cur.step.machine_id)
            cur.stage = "destroy"
            return DestroyMachine(cur.step.machine_id)
        return self._end(DONE, now_ms)
