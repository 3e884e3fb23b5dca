"""A worker's machines as its store records them: the maps (by id, by order: I3), one lock a
machine, every change written with its events in one transaction before it is announced,
and the changes that happened while the store refused writes (facts), written later."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import structlog

from bourse.images.cachetypes import Pulled
from bourse.wire.messages import Error, Event, Machine, now_ms
from supplier.checks import Verdict
from supplier.images import WorkerImages
from supplier.machines.api import Exit, RunInfo
from supplier.machines.events import AnnounceFn, EventFn, Fact, last_exit
from supplier.oplog import Op, RunSpec
from supplier.store import Store, StoreError


class Records:
    """One worker's machines, recorded (see the module doc). ``changed`` hears every change
    once it is durable (the keeper follows a started machine's checks); ``gone`` a machine
    destroyed; ``on_store_error`` a write the store refused."""

    def __init__(
        self,
        worker_id: str,
        store: Store,
        images: WorkerImages,
        event: EventFn,
        announce: AnnounceFn,
        changed: Callable[[Machine], None],
        unwatch: Callable[[str], None],
        gone: Callable[[Machine], None],
        on_store_error: Callable[[str], None],
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.images = images
        self.event = event
        self.announce = announce
        self.changed = changed
        self.unwatch = unwatch  # a run ended: its checks end with it
        self.gone = gone
        self.on_store_error = on_store_error
        self.by_id: dict[str, Machine] = {}
        self.by_order: dict[str, str] = {}  # order id -> machine id (I3)
        self.specs: dict[str, RunSpec] = {}  # machine id -> its order's env, when it has one
        self.facts: dict[str, Fact] = {}  # machine id -> what the store has not recorded yet
        # Told every change as soon as it is durable: the machine's row goes to the state stream.
        self.published: Callable[[Machine], None] = lambda m: None
        self._locks: dict[str, asyncio.Lock] = {}
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

    def get(self, machine_id: str) -> Machine | Error:
        m = self.by_id.get(machine_id)
        if m is None:
            return Error(
                code="bad_request", detail=f"no machine {machine_id} on worker {self.worker_id}"
            )
        return m

    def event_of(
        self, kind: str, m: Machine, detail: str = "", pulled: tuple[int, float] = (0, 0.0)
    ) -> Event:
        """An event of ``m`` (with its image's digest)."""
        return self.event(
            kind, m.order_id, m.machine_id, detail, image_digest=m.image_digest, pulled=pulled
        )

    async def record(
        self,
        m: Machine,
        state: str,
        op: str,
        detail: str = "",
        events: tuple[Event, ...] = (),
        **changes: Any,
    ) -> Machine:
        """Write the change and its events in one transaction, then announce the events. A
        machine that is not started has no health: its checks ran on a run that is over
        (and start from scratch with the next)."""
        return await self.queued(m, state, op, detail, events, **changes).done()

    def queued(
        self,
        m: Machine,
        state: str,
        op: str,
        detail: str = "",
        events: tuple[Event, ...] = (),
        **changes: Any,
    ) -> Queued:
        """The change queued for the store's next group commit, not waited for (StoreError
        at once when the store is closed): :meth:`Queued.done` waits until it is durable,
        then does what :meth:`record` does after the write. A later change of the machine
        is queued only after it."""
        if state != "started":
            changes["health"] = None
        new = msgspec.structs.replace(m, state=state, updated_at_ms=now_ms(), **changes)
        written = self.store.queue(Op(op, new, detail, events))
        written.add_done_callback(functools.partial(self._durable, new))
        return Queued(self, new, events, written)

    def _durable(self, new: Machine, written: asyncio.Future[None]) -> None:
        """A change is durable: memory has it and its row goes, at once, whenever whoever
        queued it looks (a start's ``starting`` is looked at after its launch, a pull
        included: a view sees it while it lasts)."""
        if written.cancelled() or written.exception() is not None:
            return
        self.by_id[new.machine_id] = new
        self.published(new)

    def _recorded(self, new: Machine, events: tuple[Event, ...]) -> Machine:
        self.by_id[new.machine_id] = new
        self.changed(new)
        for e in events:
            self.announce(e)
        return new

    async def record_fact(self, m: Machine, fact: Fact) -> Machine:
        """Record what already happened to ``m``; if the store refuses, keep it for
        :meth:`record_facts` (and raise StoreError all the same)."""
        try:
            return await self.record(
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
                    new = await self.record(
                        m, fact.state, fact.op, fact.detail, fact.events, **fact.changes
                    )
                except StoreError as exc:
                    self.on_store_error(str(exc))
                    return
                del self.facts[machine_id]
                if new.state == "destroyed":
                    self.gone(new)
            self.log.warning("machine_change_recorded", machine_id=machine_id, op=fact.op)

    async def exited(self, m: Machine, how: Exit, detail: str = "") -> None:
        """Record the end: ``failed`` when it was killed (``oom`` at its memory limit, or a
        signal), else ``stopped`` (it exited with a code); with its last exit."""
        detail = detail or how.describe()
        state, op = ("failed", "failed") if how.failed else ("stopped", "exited")
        ev = self.event_of(state, m, detail)
        gone = Fact("started", state, op, detail, (ev,), {"last_exit": last_exit(how, detail)})
        self.unwatch(m.machine_id)
        try:
            await self.record_fact(m, gone)
        except StoreError:
            return  # recorded once the store takes writes again
        self.log.info("machine_" + op, machine_id=m.machine_id, exit=detail)

    async def restarted(self, m: Machine, how: Exit, why: str = "") -> Machine:
        detail = f"{why or how.describe()}; restart {m.restarts + 1}"
        self.log.info("machine_restarting", machine_id=m.machine_id, detail=detail)
        ev = self.event_of("restarted", m, detail)
        self.unwatch(m.machine_id)
        try:
            return await self.record(
                m,
                "started",
                "restarted",
                detail,
                (ev,),
                last_exit=last_exit(how, "" if not why else detail),
                restarts=m.restarts + 1,
            )
        except StoreError as exc:
            self.on_store_error(str(exc))
            return m

    async def checked(self, machine_id: str, v: Verdict) -> bool:
        """A check ran: the machine's health in memory; a change of status recorded with
        its ``check`` event. False when the machine is not started (any more)."""
        async with self.lock(machine_id):
            m = self.by_id.get(machine_id)
            if m is None or m.state != "started":
                return False
            if not v.changed:
                self.by_id[machine_id] = msgspec.structs.replace(m, health=v.health)
                return True
            ev = self.event("check", m.order_id, machine_id, v.health.detail, health=v.health)
            try:
                await self.record(m, "started", "check", v.health.status, (ev,), health=v.health)
            except StoreError as exc:
                self.on_store_error(str(exc))
            self.log.info(
                "machine_health",
                machine_id=machine_id,
                status=v.health.status,
                detail=v.health.detail,
            )
            return True

    async def report_pull(self, machine_id: str, got: Pulled) -> None:
        """Record a background pull that no start waited for (its machine as it is now)."""
        async with self.lock(machine_id):
            m = self.by_id[machine_id]
            if m.state == "destroyed":
                return
            ev = self.pulled_event(m, got)
            try:
                await self.record(m, m.state, "pulled", ev.detail, (ev,))
            except StoreError as exc:
                self.on_store_error(str(exc))

    async def started(
        self, m: Machine, resumed: bool, pulled: tuple[Event, ...], run: RunInfo | None
    ) -> Machine:
        """``m`` recorded started, with its event: its private address as its run has it
        (its own since its commit; another only when its worker's subnet changed). A
        machine started before its supplier's restart is recorded as resumed: its event is
        a committed change like any other (the op log says when it was resumed)."""
        private = run.address if run is not None and run.address else m.private_address
        ev = self.event(
            "started",
            m.order_id,
            m.machine_id,
            "resumed" if resumed else "",
            image_digest=m.image_digest,
            addresses=m.addresses,
            private_address=private,
        )
        op = "start" if m.state != "started" else "resume"
        return await self.record(m, "started", op, events=(*pulled, ev), private_address=private)

    def pulled_event(self, m: Machine, got: Pulled) -> Event:
        detail = f"{m.image} ({m.image_digest}): {got.bytes} bytes in {got.seconds:.3f}s"
        return self.event_of("pulled", m, detail, (got.bytes, got.seconds))

    # -- undone commits --------------------------------------------------------------------
    async def undo(self, m: Machine, op: str, detail: str, event_detail: str) -> None:
        """Destroy a machine still ``reserved`` (an undone commit): the order no longer has
        it, its resources go back to the market."""
        async with self.lock(m.machine_id):
            m = self.by_id[m.machine_id]
            if m.state != "reserved":
                return
            ev = self.event_of("destroyed", m, event_detail)
            gone = await self.record(m, "destroyed", op, detail, (ev,), aborted=True)
            self.by_order.pop(m.order_id, None)
            self.gone(gone)
        self.log.warning("commit_aborted", order_id=m.order_id, machine_id=m.machine_id)


class Queued:
    """A machine's change in the store's queue (:meth:`Records.queued`)."""

    def __init__(
        self,
        records: Records,
        new: Machine,
        events: tuple[Event, ...],
        written: asyncio.Future[None],
    ) -> None:
        self.records = records
        self.new = new
        self.events = events
        self.written = written
        self._told: Machine | None = None

    async def done(self) -> Machine:
        """The change, once durable, told once (StoreError when it could not be written).
        Waited for whole (the writer answers within its group commit): a cancellation
        does not leave it told to nobody."""
        if self._told is None:
            with anyio.CancelScope(shield=True):
                await self.written
            if self._told is None:
                self._told = self.records._recorded(self.new, self.events)
        return self._told
