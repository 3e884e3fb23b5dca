"""A worker's commits: a hold becomes a durable machine, once per order (docs/protocol.md
§6.5), and a commit the auction gave up on is undone (§6.6, ``Release.abort_commit``).

The commit desk answers ``Commit`` in the protocol's order: wrong worker, a machine already
placed for the order (the market's existing-machine rule, supplier/feasible.py ``handout``:
refused while it is being reclaimed or destroyed by an abort), the same order's commit
under way, draining, no (or an expired, or a too small) hold, else the durable write. Two
things make it more than a lookup:

- **coalescing**: while an order's machine is being written, a duplicate commit (an
  auction's retry, a second exchange instance) waits for that write and gets the very same
  reply, so one order id never makes two machines (I3);
- **aborts**: an auction that gave up waiting for this commit says ``abort_commit``; if the
  write is under way, the machine is destroyed as soon as it is durable; if it is already
  written and still ``reserved``, it is destroyed now. Either way the auction's Unfilled
  stays true (I4). From the moment an abort is decided until its destroy is durable the
  machine is ``undoing``: handed to nobody (a retry's bid or commit), since a Placed for a
  machine about to be destroyed is a lie.

No NATS here: the host decodes the Commit and sends the reply this returns. The worker
(supplier/worker.py) owns one commit desk, and the desk talks to it through one small
interface, :class:`CommitWorker`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Protocol

import structlog

from bourse.wire.messages import (
    Commit,
    CommitReply,
    Error,
    Event,
    Machine,
    Placed,
    Rejected,
    RejectReason,
    new_machine_id,
    now_ms,
)
from bourse.wire.resources import Vec, format_vec, leq, vec
from supplier.feasible import EXISTING, REFUSED, Placements, handout
from supplier.ledger import Hold, Ledger
from supplier.machines.api import Driver
from supplier.machines.keeper import EventFn, Machines
from supplier.oplog import Op, RunSpec
from supplier.ports import NoPort, WorkerPorts
from supplier.store import Store, StoreError

log = structlog.get_logger("bourse.supplier")


class CommitWorker(Placements, Protocol):
    """What a commit desk reads of its worker, and what it tells it."""

    @property
    def worker_id(self) -> str: ...
    @property
    def region(self) -> str: ...
    @property
    def ledger(self) -> Ledger:
        """The holds a commit converts into committed capacity (I1)."""
        ...

    @property
    def ports(self) -> WorkerPorts:
        """The host ports a commit gives its machine's named ports (I8)."""
        ...

    @property
    def keeper(self) -> Machines:
        """The worker's machines: the order -> machine map of I3, aborts."""
        ...

    @property
    def driver(self) -> Driver:
        """What runs its machines: a commit reserves the machine's private address there."""
        ...

    @property
    def store(self) -> Store:
        """Where a machine is written before ``Placed`` is sent (I2)."""
        ...

    def machine_changed(self, m: Machine) -> None:
        """A machine's change is durable: its row goes to the state stream (§4.21)."""
        ...

    def has_image(self, m: Machine) -> bool:
        """Whether ``m``'s image is here (``Placed.image_cached``)."""
        ...

    @property
    def simulated(self) -> bool:
        """It runs nothing (its driver is ``sim``): its machines say so."""
        ...

    @property
    def draining(self) -> bool: ...
    @property
    def drain_reason(self) -> str: ...

    def expire_holds(self, now: float | None = None) -> None:
        """Drop (and announce) the holds past their TTL."""
        ...

    def store_failed(self, reason: str) -> None:
        """The store refused a write: the worker drains."""
        ...

    def capacity_freed(self) -> None:
        """A commit smaller than its hold gave the rest back to the market."""
        ...

    def capacity_grew(self) -> None:
        """Committed machines grew by a whole hold (waiting bids may be hopeless)."""
        ...

    @property
    def event(self) -> EventFn:
        """Makes an event of the worker, to be written with the change it reports."""
        ...

    def emit(self, event: Event) -> None:
        """Announce an event once its change is durable."""
        ...


class CommitDesk:
    """One worker's commits, over its :class:`CommitWorker` interface."""

    def __init__(self, worker: CommitWorker) -> None:
        self.w = worker
        # order id -> the reply of its commit being written (duplicates wait for it)
        self.writing: dict[str, asyncio.Future[CommitReply]] = {}
        # orders whose commit under way is undone once written (abort_commit came meanwhile)
        self.aborts: set[str] = set()
        # orders whose machine was handed to someone beyond the auction that committed it (a
        # duplicate commit, an existing-machine offer): an abort never takes it back, since
        # a buyer may hold its Placed (docs/protocol.md §6.6)
        self.given: set[str] = set()
        # orders whose machine an abort is destroying (decided, not yet durable): it is
        # handed to nobody meanwhile (supplier/feasible.py ``handout``: UNDOING)
        self.undoing: set[str] = set()
        self.log = log.bind(worker_id=worker.worker_id, region=worker.region)

    # -- commit -------------------------------------------------------------------------------
    async def commit(self, c: Commit) -> CommitReply:
        """The reply to ``c`` (docs/protocol.md §6.5, rows 1-7 in order)."""
        t0 = time.perf_counter()
        w = self.w
        if c.worker_id != w.worker_id:
            return Error(
                code="bad_request",
                detail=f"commit for worker {c.worker_id!r} sent to worker {w.worker_id!r}",
            )
        standing = handout(w, c.order_id)
        if standing is not None and standing in REFUSED:  # being reclaimed (§5.3d) or
            return self._rejected(c, "no_hold", REFUSED[standing])  # aborted: to nobody
        if standing == EXISTING:
            self.give(c.order_id)
            return self._placed(w.keeper.by_id[w.keeper.by_order[c.order_id]], t0, existing=True)
        pending = self.writing.get(c.order_id)
        if pending is not None:
            self.give(c.order_id)  # this duplicate gets the same Placed
            # shield: a duplicate that is cancelled must not cancel the write it waits for
            return await asyncio.shield(pending)
        if w.draining:
            return self._rejected(c, "draining", w.drain_reason)
        return await self._commit_hold(c, t0)

    async def _commit_hold(self, c: Commit, t0: float) -> CommitReply:
        """Rows 5-7: the order's live hold, if it covers the commit, is written as a machine."""
        self.w.expire_holds()
        h = self.w.ledger.holds.get(c.order_id)
        if h is None:
            if c.order_id in self.w.ledger.recently_expired:
                return self._rejected(c, "hold_expired", "the hold's TTL passed before the commit")
            return self._rejected(c, "no_hold", "no hold for this order on this worker")
        want = vec(c.resources, len(c.ports))
        if not leq(want, h.want):
            return self._rejected(
                c,
                "insufficient",
                f"commit asks for {format_vec(want)} but the hold is for {format_vec(h.want)}",
            )
        return await self._write(c, h, want, t0)

    async def _write(self, c: Commit, h: Hold, want: Vec, t0: float) -> CommitReply:
        """Write the machine, with duplicates coalesced onto this write and an abort that
        arrives meanwhile applied once it is durable."""
        try:
            machine = self._reserved(c, h)
        except NoPort as exc:  # the hold counted free ports, but the host uses them
            self.w.ledger.unpin(h)
            self.w.capacity_freed()
            return self._rejected(c, "insufficient", str(exc))
        h.committing = True  # pinned: the hold can neither expire nor be released under us
        fut: asyncio.Future[CommitReply] = asyncio.get_running_loop().create_future()
        self.writing[c.order_id] = fut
        try:
            result = await self._store(machine, h, want, t0, RunSpec(env=dict(c.env)))
            fut.set_result(result)
        finally:
            del self.writing[c.order_id]
            aborted = c.order_id in self.aborts and c.order_id not in self.given
            self.aborts.discard(c.order_id)
            if not fut.done():  # cancelled mid-write (shutdown): waiters must not hang
                fut.cancel()
        if aborted and isinstance(result, Placed):
            await self._undo(machine)
        return result

    def _reserved(self, c: Commit, h: Hold) -> Machine:
        """The machine a commit places: ``reserved``, with the hold's score and its bid's
        constraints (a later order under the same id is checked against them, §5.3b), its
        ports given host ports (NoPort when too few can be bound), its checks and the names
        of its environment."""
        at = now_ms()
        machine_id = new_machine_id(self.w.worker_id)
        return Machine(
            machine_id=machine_id,
            order_id=c.order_id,
            worker_id=self.w.worker_id,
            region=self.w.region,
            state="reserved",
            resources=c.resources,
            image=c.image,
            image_digest=c.image_digest,
            metadata=dict(c.metadata),
            score=h.score,
            created_at_ms=at,
            updated_at_ms=at,
            constraints=dict(h.constraints),
            addresses=self.w.ports.take(machine_id, c.ports),
            checks=list(c.checks),
            env_keys=sorted(c.env),
            restart=c.restart,
            simulated=self.w.simulated,
            private_address=self.w.driver.private_address(machine_id),
        )

    async def _store(
        self, machine: Machine, h: Hold, want: Vec, t0: float, spec: RunSpec
    ) -> CommitReply:
        """Row 7: durable first, then the ledger, the machine map, the log and the event."""
        w = self.w
        placed = w.event(
            "placed",
            machine.order_id,
            machine.machine_id,
            image_digest=machine.image_digest,
            addresses=machine.addresses,
            private_address=machine.private_address,
        )
        try:
            await w.store.write(Op("place", machine, events=(placed,), spec=spec))
        except StoreError as exc:
            w.ports.give_back(machine.machine_id)
            w.driver.give_back_address(machine.machine_id)
            w.ledger.unpin(h)
            w.store_failed(str(exc))
            return Error(code="internal", detail=f"worker {w.worker_id} cannot store: {exc}")
        w.ledger.convert(h, want)
        if want != h.want:
            w.capacity_freed()  # the rest of the hold goes back to the market
        else:
            w.capacity_grew()
        w.keeper.added(machine, spec)
        w.machine_changed(machine)
        self.log.info(
            "machine_placed",
            order_id=machine.order_id,
            machine_id=machine.machine_id,
            score=h.score,
            addresses=machine.addresses,
        )
        w.emit(placed)
        return self._placed(machine, t0, subscores=h.subscores)

    def _placed(
        self,
        m: Machine,
        t0: float,
        *,
        existing: bool = False,
        subscores: dict[str, float] | None = None,
    ) -> Placed:
        return Placed.of_machine(
            m,
            image_cached=self.w.has_image(m),
            elapsed_ms=round((time.perf_counter() - t0) * 1000.0, 3),
            subscores=subscores,
            existing=existing,
        )

    def _rejected(self, c: Commit, reason: RejectReason, detail: str) -> Rejected:
        self.log.info("commit_rejected", order_id=c.order_id, reason=reason)
        return Rejected(
            order_id=c.order_id, worker_id=self.w.worker_id, reason=reason, detail=detail
        )

    # -- abort --------------------------------------------------------------------------------
    def give(self, order_id: str) -> None:
        """The order's machine was (or is being) handed to another auction than the one that
        committed it: from now on no abort undoes it."""
        self.given.add(order_id)

    def abort(self, order_id: str) -> bool:
        """``Release.abort_commit``: the auction gave up waiting for this order's commit.
        True when there was a commit to undo (under way: undone once written; written and
        still ``reserved``: destroyed now, in the background); False when there is none
        and the release is a plain one (drop the hold)."""
        if order_id in self.writing:
            self.aborts.add(order_id)
            return True
        keeper = self.w.keeper
        mid = keeper.by_order.get(order_id)
        if mid is None or keeper.by_id[mid].state != "reserved":
            return False
        if order_id in self.given:
            self.log.warning("abort_refused", order_id=order_id, machine_id=mid)
            return True  # the commit stands: nothing to undo, nothing to release either
        keeper.spawn(self._undo(keeper.by_id[mid]))
        return True

    def _undo(self, m: Machine) -> Coroutine[None, None, None]:
        """Destroy ``m``, whose commit an abort undoes: from now (no await between the
        decision and this call) until the destroy is durable, its order's machine is
        handed to nobody, so no retry is told Placed for it."""
        self.undoing.add(m.order_id)
        return self._undone(m)

    async def _undone(self, m: Machine) -> None:
        try:
            await self.w.keeper.abort(m)
        finally:
            self.undoing.discard(m.order_id)
