"""One worker's machines: their lifecycle, driven by the worker's driver, every step in the
op log before it is reported.

    start:   reserved|stopped -> starting -> (pull the image if not cached) -> started
    stop:    started -> stopping -> stopped        (the driver stops the process)
    destroy: any live state -> destroyed           (resources go back to the market)

Each machine has its own lock, so a slow pull on one machine never delays another.

A machine of a content image (``image_digest``, supplier/images.py) pins its digest in the
worker's content cache from its commit (or its load after a restart, before anything can
evict) until its destroy. Right after its commit it pulls its image in the background, so
a reserved machine (a deploy's spare) starts without waiting for a pull; a start that comes
meanwhile waits for that pull and reports it. Every start records a ``pulled`` event with
the bytes it fetched (0 when the image was here) and the seconds; a background pull that
no start waited for records its own. A pull that fails fails the start: the machine is
``failed``, its last exit (code 125) and event say ``pull_failed: <why>``, the cache keeps
nothing half made, and the next start (or, for a machine whose order asked for
``restart: on-failure|always``, the worker itself after a backoff) pulls again.

What happened while the store refused writes is not lost: a process that ended for good, or
a stop or destroy whose process is already gone, is kept as an unrecorded fact and written
once the store takes writes again (:meth:`Machines.record_facts`, on the store probe's
success); a destroy asked while the store refuses writes is refused before it touches the
machine.

Background lifecycle work (a process exit, an abort) and the driver's own tasks run in the
task group of :meth:`Machines.run`, which the supplier host starts before it serves and
ends with :meth:`Machines.close` when it stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec
import structlog

from bourse.images.cache import Pulled
from bourse.runtime.tasks import TaskSet
from bourse.wire.messages import (
    Check,
    Error,
    Event,
    Health,
    LastExit,
    Machine,
    MachineLogs,
    now_ms,
)
from supplier.checks import HealthCore, Verdict, probe
from supplier.drivers import Driver, DriverError, ImageRun
from supplier.drivers.confine import Exit
from supplier.images import PullFailed, WorkerImages
from supplier.lifecycle import EVENT_OF, INTERMEDIATE, SHOULD_RUN, InvalidTransition, next_state
from supplier.ports import run_env
from supplier.secrets import with_secrets
from supplier.store import Op, RunSpec, Store, StoreError


class EventFn(Protocol):
    """Builds an event (kind, order id, machine id, detail, the image's digest, a pull's
    bytes and seconds, a placed or started machine's addresses, a check's health); it is
    written with the change it reports (the store's outbox: exactly-once publishing), then
    announced."""

    def __call__(
        self,
        kind: str,
        order_id: str = "",
        machine_id: str = "",
        detail: str = "",
        *,
        image_digest: str = "",
        pulled: tuple[int, float] = (0, 0.0),
        addresses: dict[str, str] | None = None,
        health: Health | None = None,
    ) -> Event: ...


# Told about an event once its change is durable.
AnnounceFn = Callable[[Event], None]
MAX_LOG_BYTES = 48 * 1024  # a logs reply stays well under the 64 KiB payload limit
# How long a stop waits for the lifecycle work under way (a store write each) to finish.
LIFECYCLE_S = 5.0
# A start that ended before its command ran (its image could not be pulled): the exit code
# runtimes give to their own failures (the exec wrapper's, when it cannot confine).
START_FAILED_CODE = 125
PULL_FAILED = "pull_failed"
# A machine whose order asks to be restarted pulls again after a failed pull: first after
# this long, doubling up to the most.
PULL_RETRY_FIRST_S = 1.0
PULL_RETRY_MAX_S = 60.0
MAX_EXIT_DETAIL = 1024  # LastExit.detail's bound on the wire


@dataclass(frozen=True, slots=True)
class Fact:
    """A change that happened to a machine in state ``was`` (its process ended, or a stop or
    destroy took it) while the store refused its record: ``_record``'s arguments, kept to
    be written later (the events keep their time)."""

    was: str
    state: str
    op: str
    detail: str = ""
    events: tuple[Event, ...] = ()
    changes: dict[str, Any] = field(default_factory=dict)


def last_exit(how: Exit) -> LastExit:
    """The wire form of how a process ended."""
    return LastExit(reason=how.reason, code=how.code, signal=how.signal, at_ms=now_ms())


def pull_failed(why: str) -> str:
    """A failed pull as a machine's event and last exit say it, within the wire's bound."""
    return f"{PULL_FAILED}: {why}"[:MAX_EXIT_DETAIL]


@dataclass(slots=True)
class _Prefetch:
    """A machine's background pull after its commit; a start that comes meanwhile takes it
    (waits for it and reports it)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    got: Pulled | None = None
    error: PullFailed | None = None
    taken: bool = False


def _unobserved(seconds: float) -> None:
    """No metrics (a worker driven alone, or a supplier without --metrics-addr)."""


class Machines:
    def __init__(
        self,
        worker_id: str,
        store: Store,
        driver: Driver,
        images: WorkerImages,
        event: EventFn,
        announce: AnnounceFn,
        on_destroyed: Callable[[Machine], None],
        on_store_error: Callable[[str], None],
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.driver = driver
        self.images = images
        self.event = event
        self.announce = announce
        self.on_destroyed = on_destroyed
        self.on_store_error = on_store_error
        self.by_id: dict[str, Machine] = {}
        self.by_order: dict[str, str] = {}  # order id -> machine id (I3)
        self.specs: dict[str, RunSpec] = {}  # machine id -> its order's env, when it has one
        self._locks: dict[str, asyncio.Lock] = {}
        # The lifecycle work (an exit, an abort): tasks owned here, ended by run()'s end.
        self._work = TaskSet(f"machines:{worker_id}")
        self._running = False  # run() is under way (its driver started), not yet ending
        self._scope: anyio.CancelScope | None = None  # run()'s shield, cancelled by close()
        self._closing = False
        # machine id -> what happened to it that the store has not recorded yet
        self.facts: dict[str, Fact] = {}
        self._prefetches: dict[str, _Prefetch] = {}  # machine id -> its background pull
        self._retries: dict[str, int] = {}  # machine id -> failed pulls in a row (backoff)
        # machine id -> the scope of its checks' tasks (while it is started, supplier/checks.py)
        self._checking: dict[str, anyio.CancelScope] = {}
        # run()'s: background pulls and pull retries, which close() cuts short
        self._timers: anyio.abc.TaskGroup | None = None
        self.on_pull: Callable[[float], None] = _unobserved  # a pull's seconds (metrics)
        self.log = structlog.get_logger("bourse.machines").bind(worker_id=worker_id)

    def lock(self, machine_id: str) -> asyncio.Lock:
        lk = self._locks.get(machine_id)
        if lk is None:
            lk = self._locks[machine_id] = asyncio.Lock()
        return lk

    def load(self) -> list[Machine]:
        """The machines of the store; each live one pins its image again before anything
        may evict it."""
        ms = self.store.load_machines(self.worker_id)
        self.specs = self.store.load_specs(self.worker_id)
        for m in ms:
            self.by_id[m.machine_id] = m
            if not m.aborted:
                self.by_order[m.order_id] = m.machine_id
            if m.state != "destroyed":
                self.images.pin(m)
        return ms

    def live(self) -> int:
        return sum(1 for m in self.by_id.values() if m.state != "destroyed")

    def in_use(self, image: str) -> bool:
        """Whether a running machine uses the catalog LRU's entry ``image``."""
        key = self.images.key
        return any(key(m) == image and m.state in SHOULD_RUN for m in self.by_id.values())

    def _event(
        self, kind: str, m: Machine, detail: str = "", pulled: tuple[int, float] = (0, 0.0)
    ) -> Event:
        """An event of ``m`` (with its image's digest)."""
        return self.event(
            kind, m.order_id, m.machine_id, detail, image_digest=m.image_digest, pulled=pulled
        )

    def _gone(self, m: Machine) -> None:
        """``m`` was destroyed: its image may go, its resources go back to the market."""
        self.images.unpin(m)
        self._retries.pop(m.machine_id, None)
        self.specs.pop(m.machine_id, None)
        self.on_destroyed(m)

    def get(self, machine_id: str) -> Machine | Error:
        m = self.by_id.get(machine_id)
        if m is None:
            return Error(
                code="bad_request", detail=f"no machine {machine_id} on worker {self.worker_id}"
            )
        return m

    def added(self, m: Machine, spec: RunSpec | None = None) -> None:
        """A commit placed ``m`` (already durable, with ``spec``): it pins its image and, if
        that is not here, pulls it in the background."""
        self.by_id[m.machine_id] = m
        if spec is not None and spec.env:
            self.specs[m.machine_id] = spec
        self.by_order[m.order_id] = m.machine_id
        self.images.pin(m)
        self._prefetch(m)

    def _prefetch(self, m: Machine) -> None:
        """Pull ``m``'s content image in the background unless it is here (or being pulled
        for it, or the worker is not running its lifecycle work)."""
        if (
            not m.image_digest
            or self.images.content is None
            or self.images.has(m)
            or m.machine_id in self._prefetches
            or not self._running
            or self._closing
        ):
            return
        pending = self._prefetches[m.machine_id] = _Prefetch()
        # beside the lifecycle work, not in it: a stop cuts a pull short at once
        assert self._timers is not None  # run() is under way
        self._timers.start_soon(self._logged, self._prefetched(m, pending))

    async def _prefetched(self, m: Machine, pending: _Prefetch) -> None:
        try:
            pending.got = await self._pull_now(m)
        except PullFailed as exc:
            pending.error = exc
        finally:
            del self._prefetches[m.machine_id]
            pending.done.set()
        if pending.taken:
            return  # a start waited for it: the start reports it
        if pending.error is not None:
            self.log.warning(
                "image_prefetch_failed",
                machine_id=m.machine_id,
                image_digest=m.image_digest,
                error=str(pending.error),
            )
        elif pending.got is not None:
            await self._report_pull(m.machine_id, pending.got)

    async def _report_pull(self, machine_id: str, got: Pulled) -> None:
        """Record a background pull that no start waited for (its machine as it is now)."""
        async with self.lock(machine_id):
            m = self.by_id[machine_id]
            if m.state == "destroyed":
                return
            ev = self._pulled_event(m, got)
            try:
                await self._record(m, m.state, "pulled", ev.detail, (ev,))
            except StoreError as exc:
                self.on_store_error(str(exc))

    def _pulled_event(self, m: Machine, got: Pulled) -> Event:
        detail = f"{m.image} ({m.image_digest}): {got.bytes} bytes in {got.seconds:.3f}s"
        return self._event("pulled", m, detail, (got.bytes, got.seconds))

    async def _pull_now(self, m: Machine) -> Pulled:
        got = await self.images.pull(m)
        if got.bytes:
            self.on_pull(got.seconds)
        return got

    async def _pull(self, m: Machine) -> Pulled:
        """``m``'s image made ready for its start: its background pull's, if one is under
        way (this start then reports it), else a pull now."""
        pending = self._prefetches.get(m.machine_id)
        if pending is None:
            return await self._pull_now(m)
        pending.taken = True
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        if pending.got is None:  # the background pull was cut short: pull now
            return await self._pull_now(m)
        return pending.got

    async def _record(
        self,
        m: Machine,
        state: str,
        op: str,
        detail: str = "",
        events: tuple[Event, ...] = (),
        **changes: Any,
    ) -> Machine:
        """Write the change and its events in one transaction, then announce the events."""
        new = msgspec.structs.replace(m, state=state, updated_at_ms=now_ms(), **changes)
        await self.store.write(Op(op, new, detail, events))
        self.by_id[m.machine_id] = new
        self._watch(new)
        for e in events:
            self.announce(e)
        return new

    # -- health checks ----------------------------------------------------------------------------
    def _watch(self, m: Machine) -> None:
        """Run a started machine's checks (in tasks of their own, from scratch: a core per
        start); end them when it is no longer started."""
        if m.state != "started":
            scope = self._checking.pop(m.machine_id, None)
            if scope is not None:
                scope.cancel()
            return
        if not m.checks or m.machine_id in self._checking or self._timers is None:
            return
        scope = self._checking[m.machine_id] = anyio.CancelScope()
        self._timers.start_soon(self._logged, self._run_checks(m, scope))

    async def _run_checks(self, m: Machine, scope: anyio.CancelScope) -> None:
        core = HealthCore(len(m.checks))
        with scope:
            async with anyio.create_task_group() as tasks:
                for i, check in enumerate(m.checks):
                    tasks.start_soon(self._check_loop, m, core, i, check)

    async def _check_loop(self, m: Machine, core: HealthCore, i: int, check: Check) -> None:
        """Run check ``i`` every ``interval_s`` (the first one interval after the start),
        while the machine is started."""
        address = m.addresses[check.port]
        while True:
            await anyio.sleep(check.interval_s)  # the check's period, not a synchronisation
            ok, detail = await probe(check, address)
            await self._checked(m.machine_id, core.observe(i, ok, detail, now_ms()))

    async def _checked(self, machine_id: str, v: Verdict) -> None:
        """A check ran: the machine's health in memory; a change of status recorded with
        its ``check`` event; a check failed 3 times in a row restarts a machine whose
        policy says so."""
        async with self.lock(machine_id):
            m = self.by_id.get(machine_id)
            if m is None or m.state != "started":
                return
            if not v.changed:
                self.by_id[machine_id] = msgspec.structs.replace(m, health=v.health)
            else:
                ev = self.event("check", m.order_id, machine_id, v.health.detail, health=v.health)
                try:
                    m = await self._record(
                        m, "started", "check", v.health.status, (ev,), health=v.health
                    )
                except StoreError as exc:
                    self.on_store_error(str(exc))
                self.log.info(
                    "machine_health",
                    machine_id=machine_id,
                    status=v.health.status,
                    detail=v.health.detail,
                )
        if v.restart and m.metadata.get("restart") in ("on-failure", "always"):
            self.spawn(self._restart_unhealthy(machine_id, v.health))

    async def _restart_unhealthy(self, machine_id: str, health: Health) -> None:
        """Restart a started machine whose check failed 3 times in a row: stop its process,
        start it again (its checks from scratch), count the restart."""
        async with self.lock(machine_id):
            m = self.by_id.get(machine_id)
            if m is None or m.state != "started":
                return
            scope = self._checking.pop(machine_id, None)
            if scope is not None:
                scope.cancel()
            detail = f"check critical: {health.detail}; restart {m.restarts + 1}"
            self.log.warning("machine_unhealthy_restart", machine_id=machine_id, detail=detail)
            try:
                await self.driver.stop(m)
                m = await self._start(m)
                ev = self._event("restarted", m, detail)
                await self._record(
                    m, "started", "restarted", detail, (ev,), restarts=m.restarts + 1
                )
            except (DriverError, StoreError) as exc:
                self.log.error("machine_restart_failed", machine_id=machine_id, error=str(exc))

    async def _record_fact(self, m: Machine, fact: Fact) -> Machine:
        """Record what already happened to ``m``; if the store refuses, keep it for
        :meth:`record_facts` (and raise StoreError all the same)."""
        try:
            return await self._record(
                m, fact.state, fact.op, fact.detail, fact.events, **fact.changes
            )
        except StoreError as exc:
            self.facts[m.machine_id] = fact
            self.on_store_error(str(exc))
            self.log.warning(
                "machine_change_unrecorded", machine_id=m.machine_id, op=fact.op, error=str(exc)
            )
            raise

    async def record_facts(self) -> None:
        """Write what happened while the store refused writes (the store takes them again),
        each unless its machine has moved on since; stops at the first refusal."""
        for machine_id, fact in list(self.facts.items()):
            async with self.lock(machine_id):
                if self.facts.get(machine_id) is not fact:
                    continue
                m = self.by_id.get(machine_id)
                if m is None or m.state != fact.was:
                    del self.facts[machine_id]
                    continue
                try:
                    new = await self._record(
                        m, fact.state, fact.op, fact.detail, fact.events, **fact.changes
                    )
                except StoreError as exc:
                    self.on_store_error(str(exc))
                    return
                del self.facts[machine_id]
                if new.state == "destroyed":
                    self._gone(new)
            self.log.warning("machine_change_recorded", machine_id=machine_id, op=fact.op)

    # -- verbs ------------------------------------------------------------------------------------
    async def transition(self, verb: str, machine_id: str) -> Machine | Error:
        async with self.lock(machine_id):
            m = self.get(machine_id)
            if isinstance(m, Error):
                return m
            try:
                to = next_state(verb, machine_id, m.state)
            except InvalidTransition as exc:
                return Error(code="bad_request", detail=str(exc))
            if to == m.state:
                return m
            if verb == "destroy" and self.store.failure:  # it could not be recorded: refuse
                return Error(  # before the machine is touched
                    code="internal",
                    detail=f"cannot destroy {machine_id}: the worker's store refuses writes "
                    f"({self.store.failure}); destroy it again once the store has room",
                )
            try:
                m = await self._run(verb, m, to)
            except StoreError as exc:
                self.on_store_error(str(exc))
                return Error(code="internal", detail=f"cannot {verb} {machine_id}: {exc}")
            except DriverError as exc:
                return Error(code="internal", detail=f"cannot {verb} {machine_id}: {exc}")
        self.log.info("machine_" + EVENT_OF[verb], order_id=m.order_id, machine_id=machine_id)
        return m

    async def _run(self, verb: str, m: Machine, to: str) -> Machine:
        if verb in INTERMEDIATE:
            m = await self._record(m, INTERMEDIATE[verb], verb)
        if verb == "start":
            return await self._start(m)
        if verb == "stop":
            await self.driver.stop(m)
        else:
            await self.driver.destroy(m)
        done = self._event(EVENT_OF[verb], m)
        m = await self._record_fact(m, Fact(m.state, to, verb, events=(done,)))
        if to == "destroyed":
            self._gone(m)
        return m

    async def _start(self, m: Machine, resumed: bool = False) -> Machine:
        """Pull if needed, run, record started; a failure records stopped (failed when the
        image could not be pulled) and re-raises as a DriverError. A pull's event is written
        with the record that follows it."""
        pulled: tuple[Event, ...] = ()
        run: ImageRun | None = None
        try:
            if m.image_digest and self.images.content is not None:
                got = await self._pull(m)
                pulled = (self._pulled_event(m, got),)
                run = ImageRun(got.root, got.run)
            else:
                pulled = await self._catalog_pull(m)
            spec, src = self.specs.get(m.machine_id), self.images.source
            env = await with_secrets(src.nc, src.prefix, m, spec.env if spec else {})
            await self.driver.start(m, run, run_env(m, env))
        except PullFailed as exc:
            await self._pull_failed(m, str(exc))
            raise DriverError(pull_failed(str(exc))) from None
        except DriverError as exc:
            stopped = self._event("stopped", m, f"start failed: {exc}")
            await self._record(m, "stopped", "start_failed", str(exc), (*pulled, stopped))
            raise
        self._retries.pop(m.machine_id, None)
        started = self.event(
            "started",
            m.order_id,
            m.machine_id,
            "resumed" if resumed else "",
            image_digest=m.image_digest,
            addresses=m.addresses,
        )
        # A machine already started before a restart is recorded as resumed: its event is a
        # committed change like any other (the op log says when the supplier resumed it).
        op = "start" if m.state != "started" else "resume"
        return await self._record(m, "started", op, events=(*pulled, started))

    async def _catalog_pull(self, m: Machine) -> tuple[Event, ...]:
        """A catalog image (or a sim worker's content image) into the catalog's LRU: its
        ``pulled`` event when it was not there."""
        key, catalog = self.images.key(m), self.images.catalog
        if key in catalog:
            catalog.touch(key)
            return ()
        size, seconds = await self.driver.pull(key)
        evicted = catalog.add(key, self.in_use)
        if evicted:
            self.log.info("images_evicted", images=evicted, for_image=key)
        return (self._event("pulled", m, f"{m.image} in {seconds:.3f}s", (size, seconds)),)

    async def _pull_failed(self, m: Machine, why: str) -> None:
        """Record a start whose image could not be pulled: ``failed``, its last exit and
        event saying why; a machine whose order asks to be restarted tries again later."""
        detail = pull_failed(why)
        how = LastExit(reason="exit", code=START_FAILED_CODE, at_ms=now_ms(), detail=detail)
        ev = self._event("failed", m, detail)
        await self._record(m, "failed", PULL_FAILED, why, (ev,), last_exit=how)
        self.log.warning(
            "machine_pull_failed", machine_id=m.machine_id, image_digest=m.image_digest, error=why
        )
        if m.metadata.get("restart") in ("on-failure", "always") and self._timers is not None:
            tries = self._retries[m.machine_id] = self._retries.get(m.machine_id, 0) + 1
            delay = min(PULL_RETRY_FIRST_S * 2 ** (tries - 1), PULL_RETRY_MAX_S)
            self._timers.start_soon(self._logged, self._retry_pull(m.machine_id, delay))

    async def _retry_pull(self, machine_id: str, delay_s: float) -> None:
        """Start a machine again after a failed pull, unless something else moved it."""
        await anyio.sleep(delay_s)  # the restart policy's backoff, not a synchronisation
        m = self.by_id.get(machine_id)
        if m is None or m.state != "failed" or m.last_exit is None:
            return
        if m.last_exit.detail.startswith(PULL_FAILED):
            self.log.info("machine_pull_retry", machine_id=machine_id, after_s=delay_s)
            await self.transition("start", machine_id)

    async def abort(self, m: Machine) -> None:
        """The auction gave up on this commit: undo it so its Unfilled stays true (I4)."""
        await self._undo(m, "abort", "the auction gave up waiting for the commit", "aborted")

    async def reclaim(self, m: Machine, why: str) -> None:
        """An orphan (docs/protocol.md §5.3d): no buyer holds it, its order's claim says
        ``why``. Destroyed like an abort (never started, so nothing runs)."""
        await self._undo(m, "reclaim", why, f"reclaimed: {why}")
        self.log.warning("machine_reclaimed", machine_id=m.machine_id, order_id=m.order_id)

    async def _undo(self, m: Machine, op: str, detail: str, event_detail: str) -> None:
        """Destroy a machine still ``reserved`` (an undone commit): the order no longer has
        it, its resources go back to the market."""
        async with self.lock(m.machine_id):
            m = self.by_id[m.machine_id]
            if m.state != "reserved":
                return
            ev = self._event("destroyed", m, event_detail)
            gone = await self._record(m, "destroyed", op, detail, (ev,), aborted=True)
            self.by_order.pop(m.order_id, None)
            self._gone(gone)
        self.log.warning("commit_aborted", order_id=m.order_id, machine_id=m.machine_id)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Own this worker's background lifecycle work and its driver's tasks until
        :meth:`close`. Shielded from the caller's cancellation: a stop lets the work under
        way finish and stops the machines (close), then this ends."""
        try:
            with anyio.CancelScope(shield=True) as self._scope:
                async with anyio.create_task_group() as tasks:
                    await tasks.start(self.driver.run)
                    self._timers = tasks
                    self._running = True
                    task_status.started()
                    await anyio.sleep_forever()  # until close() cancels the scope
        finally:
            self._running = False
            self._timers = None
            with anyio.CancelScope(shield=True):  # what close() did not wait for ends here
                await self._work.finish(0)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Background lifecycle work (an exit, an abort), while run() runs; a failure is
        logged. Work that arrives once the worker is stopping is dropped (logged)."""
        if not self._running or self._closing:
            work.close()  # never started: no "coroutine was never awaited"
            if not self._closing:
                raise RuntimeError("Machines.spawn() needs Machines.run() to be running")
            self.log.warning("lifecycle_work_dropped", reason="the worker is stopping")
            return
        self._work.spawn(self._logged(work))

    async def _logged(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as exc:  # one failed step must not end the others (nor run())
            self.log.error("lifecycle_task_failed", error=repr(exc))

    def exited(self, machine_id: str, how: Exit) -> None:
        """The driver saw the machine's process end for good (restart policy said no)."""
        self.spawn(self._exited(machine_id, how))

    def restarted(self, machine_id: str, how: Exit, restarts: int) -> None:
        """The driver restarts the machine after its process ended (its restart policy)."""
        self.spawn(self._restarted(machine_id, how, restarts))

    async def _exited(self, machine_id: str, how: Exit) -> None:
        """Record the end: ``failed`` when it was killed (``oom`` at its memory limit, or a
        signal), else ``stopped`` (it exited with a code); with its last exit."""
        async with self.lock(machine_id):
            m = self.by_id.get(machine_id)
            if m is None or m.state != "started":
                return
            detail = how.describe()
            state, op = ("failed", "failed") if how.failed else ("stopped", "exited")
            ev = self._event(state, m, detail)
            ended = Fact("started", state, op, detail, (ev,), {"last_exit": last_exit(how)})
            try:
                await self._record_fact(m, ended)
            except StoreError:
                return  # recorded once the store takes writes again
        self.log.info("machine_" + op, machine_id=machine_id, exit=detail)

    async def _restarted(self, machine_id: str, how: Exit, restarts: int) -> None:
        async with self.lock(machine_id):
            m = self.by_id.get(machine_id)
            if m is None or m.state != "started":
                return
            detail = f"{how.describe()}; restart {restarts}"
            ev = self._event("restarted", m, detail)
            try:
                await self._record(
                    m,
                    "started",
                    "restarted",
                    detail,
                    (ev,),
                    last_exit=last_exit(how),
                    restarts=restarts,
                )
            except StoreError as exc:
                self.on_store_error(str(exc))

    async def resume(self) -> None:
        """After a restart: machines that should run are started again; half-done stops
        are finished; reserved machines pull their image in the background again."""
        for m in list(self.by_id.values()):
            async with self.lock(m.machine_id):
                try:
                    if m.state in SHOULD_RUN:
                        await self._start(m, resumed=True)
                    elif m.state == "stopping":
                        await self._record(m, "stopped", "stop")
                    elif m.state == "reserved":
                        self._prefetch(m)
                except (DriverError, StoreError) as exc:
                    self.log.error("machine_resume_failed", machine_id=m.machine_id, error=str(exc))
        await self.driver.settle()  # what an earlier run left that none of them took over

    async def logs(self, machine_id: str, tail: int, since: int = -1) -> MachineLogs | Error:
        m = self.get(machine_id)
        if isinstance(m, Error):
            return m
        lines, truncated, end = self.driver.logs(machine_id, tail, MAX_LOG_BYTES, since)
        return MachineLogs(machine_id=machine_id, lines=lines, truncated=truncated, end=end)

    async def close(self, timeout_s: float = LIFECYCLE_S) -> None:
        """Stop: let the lifecycle work under way finish (for at most ``timeout_s``), stop
        every machine's process (the driver), let an exit reported meanwhile be recorded,
        then end :meth:`run`. The caller bounds the whole; run() ends even when this is cut
        short (the driver then kills what still runs)."""
        try:
            with anyio.move_on_after(timeout_s):
                await self._work.wait()
            await self.driver.close()
            with anyio.move_on_after(timeout_s):
                await self._work.wait()
        finally:
            self._closing = True
            if self._scope is not None:
                self._scope.cancel()
