"""One worker's machines: their lifecycle, driven by the worker's driver, every step in the
op log before it is reported.

    start:   reserved|stopped -> starting -> (pull the image if not cached) -> started
    stop:    started -> stopping -> stopped        (the driver stops the process)
    destroy: any live state -> destroyed           (resources go back to the market)

Each machine has its own lock, so a slow pull on one machine never delays another.

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
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from bourse.runtime.tasks import TaskSet
from bourse.wire.messages import Error, Event, LastExit, Machine, MachineLogs, now_ms
from supplier.drivers import Driver, DriverError
from supplier.drivers.confine import Exit
from supplier.images import ImageCache
from supplier.lifecycle import EVENT_OF, INTERMEDIATE, SHOULD_RUN, InvalidTransition, next_state
from supplier.store import Op, Store, StoreError

# Builds an event (kind, order id, machine id, detail); it is written with the change it
# reports (the store's outbox: exactly-once publishing), then announced.
EventFn = Callable[[str, str, str, str], Event]
# Told about an event once its change is durable.
AnnounceFn = Callable[[Event], None]
MAX_LOG_BYTES = 48 * 1024  # a logs reply stays well under the 64 KiB payload limit
# How long a stop waits for the lifecycle work under way (a store write each) to finish.
LIFECYCLE_S = 5.0


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


class Machines:
    def __init__(
        self,
        worker_id: str,
        store: Store,
        driver: Driver,
        images: ImageCache,
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
        self._locks: dict[str, asyncio.Lock] = {}
        # The lifecycle work (an exit, an abort): tasks owned here, ended by run()'s end.
        self._work = TaskSet(f"machines:{worker_id}")
        self._running = False  # run() is under way (its driver started), not yet ending
        self._scope: anyio.CancelScope | None = None  # run()'s shield, cancelled by close()
        self._closing = False
        # machine id -> what happened to it that the store has not recorded yet
        self.facts: dict[str, Fact] = {}
        self.log = structlog.get_logger("bourse.machines").bind(worker_id=worker_id)

    def lock(self, machine_id: str) -> asyncio.Lock:
        lk = self._locks.get(machine_id)
        if lk is None:
            lk = self._locks[machine_id] = asyncio.Lock()
        return lk

    def load(self) -> list[Machine]:
        ms = self.store.load_machines(self.worker_id)
        for m in ms:
            self.by_id[m.machine_id] = m
            if not m.aborted:
                self.by_order[m.order_id] = m.machine_id
        return ms

    def live(self) -> int:
        return sum(1 for m in self.by_id.values() if m.state != "destroyed")

    def in_use(self, image: str) -> bool:
        return any(m.image == image and m.state in SHOULD_RUN for m in self.by_id.values())

    def get(self, machine_id: str) -> Machine | Error:
        m = self.by_id.get(machine_id)
        if m is None:
            return Error(
                code="bad_request", detail=f"no machine {machine_id} on worker {self.worker_id}"
            )
        return m

    def added(self, m: Machine) -> None:
        """A commit placed ``m`` (already durable)."""
        self.by_id[m.machine_id] = m
        self.by_order[m.order_id] = m.machine_id

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
        for e in events:
            self.announce(e)
        return new

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
                    self.on_destroyed(new)
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
        done = self.event(EVENT_OF[verb], m.order_id, m.machine_id, "")
        m = await self._record_fact(m, Fact(m.state, to, verb, events=(done,)))
        if to == "destroyed":
            self.on_destroyed(m)
        return m

    async def _start(self, m: Machine, resumed: bool = False) -> Machine:
        """Pull if needed, run, record started; a failure records stopped and re-raises.
        A pull's event is written with the record that follows it (started or stopped)."""
        pulled: tuple[Event, ...] = ()
        try:
            if m.image not in self.images:
                seconds = await self.driver.pull(m.image)
                evicted = self.images.add(m.image, self.in_use)
                detail = f"{m.image} in {seconds:.3f}s"
                pulled = (self.event("pulled", m.order_id, m.machine_id, detail),)
                if evicted:
                    self.log.info("images_evicted", images=evicted, for_image=m.image)
            else:
                self.images.touch(m.image)
            await self.driver.start(m)
        except DriverError as exc:
            stopped = self.event("stopped", m.order_id, m.machine_id, f"start failed: {exc}")
            await self._record(m, "stopped", "start_failed", str(exc), (*pulled, stopped))
            raise
        started = self.event("started", m.order_id, m.machine_id, "resumed" if resumed else "")
        # A machine already started before a restart is recorded as resumed: its event is a
        # committed change like any other (the op log says when the supplier resumed it).
        op = "start" if m.state != "started" else "resume"
        return await self._record(m, "started", op, events=(*pulled, started))

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
            gone = await self._record(
                m,
                "destroyed",
                op,
                detail,
                (self.event("destroyed", m.order_id, m.machine_id, event_detail),),
                aborted=True,
            )
            self.by_order.pop(m.order_id, None)
            self.on_destroyed(gone)
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
                    self._running = True
                    task_status.started()
                    await anyio.sleep_forever()  # until close() cancels the scope
        finally:
            self._running = False
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
            ev = self.event(state, m.order_id, machine_id, detail)
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
            ev = self.event("restarted", m.order_id, machine_id, detail)
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
        are finished."""
        for m in list(self.by_id.values()):
            async with self.lock(m.machine_id):
                try:
                    if m.state in SHOULD_RUN:
                        await self._start(m, resumed=True)
                    elif m.state == "stopping":
                        await self._record(m, "stopped", "stop")
                except (DriverError, StoreError) as exc:
                    self.log.error("machine_resume_failed", machine_id=m.machine_id, error=str(exc))

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
