"""A supplier host's upkeep: the work that runs on a timer beside the messages, as tasks it
owns (one task group, cancelled with the host's).

- **The sweep**, every SWEEP_INTERVAL_S: holds past their TTL are dropped (``hold_expired``
  events), waiting bids past their ``wait_ms`` forgotten, and so is the desk's old memory
  (released auctions, the workers asked by auctions that never released); the bids shed
  since the last sweep are logged once.
- **Reclaim**, every ``reclaim_every_s``: each worker asks about its machines still
  ``reserved`` a while after their commit and destroys the orphans (supplier/reclaim.py,
  docs/protocol.md §5.3d).
- **Store health**: while the store refuses writes, every worker of the process drains (they
  share it), and a probe every STORE_PROBE_INTERVAL_S lifts the drain once a write succeeds,
  when each worker also records what its machines did meanwhile (an exit, §6.7a).
- **The scrub**, where a worker keeps a content cache: every image root read whole against
  its inventory, paced (supplier/scrub.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import anyio
import anyio.abc
import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    Machine,
    Placed,
    ReclaimCheck,
    ReclaimReply,
    ReclaimVerdict,
    ReclaimVerdicts,
    now_ms,
)
from bourse.wire.subjects import Subjects
from supplier.desk import Desk
from supplier.scrub import Scrub, Scrubbing
from supplier.store import Store, StoreError
from supplier.worker import Worker

log = structlog.get_logger("bourse.supplier")

SWEEP_INTERVAL_S = 0.05
RECLAIM_TIMEOUT_S = 2.0  # a ReclaimCheck: one KV read per machine at the exchange
# While the store refuses writes, probe it this often; a success lifts the drain.
STORE_PROBE_INTERVAL_S = 1.0


class Upkeep:
    """The timed work of one host over its workers, desk and store (see the module doc).
    ``shed()``: how many bids the host has shed so far."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        store: Store,
        workers: Mapping[str, Worker],
        desk: Desk[Worker],
        reclaim_every_s: float,
        shed: Callable[[], int],
        scrubbing: Scrubbing = Scrubbing(),
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.store = store
        self.workers = workers
        self.desk = desk
        self.reclaim_every_s = reclaim_every_s
        self.shed = shed
        self._shed_logged = 0
        self.store_failing = False  # the store refused a write: every worker here drains
        self._next_probe = 0.0
        self._probing = False
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s: the loops and the probe
        self.scrub = Scrub(workers, scrubbing)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sweep, reclaim (when a worker asks about orphans at all), probe the store and
        scrub the image roots (where a worker has any) until cancelled."""
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            tasks.start_soon(self._sweep)
            if any(w.reclaims.after_ms > 0 for w in self.workers.values()):
                tasks.start_soon(self._reclaim_orphans)
            if self.scrub:
                await tasks.start(self.scrub.run)
            task_status.started()

    # -- the sweep ----------------------------------------------------------------------------
    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(SWEEP_INTERVAL_S)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """One round of the sweep (see the module doc)."""
        for w in self.workers.values():
            if w.ledger.holds:
                w.expire_holds(now)
            if w.waiting:
                w.prune_waiting(now)
        self._watch_store(now)
        shed = self.shed()
        if shed > self._shed_logged:
            log.warning("bids_shed", total=shed, new=shed - self._shed_logged)
            self._shed_logged = shed
        self.desk.forget(now)

    # -- orphans ------------------------------------------------------------------------------
    async def _reclaim_orphans(self) -> None:
        """Every ``reclaim_every_s``: each worker asks about its machines still reserved a
        while after their commit and destroys the orphans. No exchange answering (a
        direct-mode-only market) or no claims: the machines stay."""
        while True:
            await anyio.sleep(self.reclaim_every_s)
            for w in self.workers.values():
                batch = w.reclaims.due(w.machines.values(), now_ms())
                if batch and not await self._reclaim(w, batch):
                    break  # nobody answers: try again next round

    async def _reclaim(self, w: Worker, batch: list[Machine]) -> bool:
        """Ask about ``batch`` and act on the verdicts; False if no exchange answered."""
        check = ReclaimCheck(
            worker_id=w.worker_id,
            machines=[
                Placed.of_machine(m, image_cached=w.has_image(m), elapsed_ms=0.0) for m in batch
            ],
        )
        verdicts: list[ReclaimVerdict] = []
        try:
            reply = await self.nc.request(
                self.subjects.reclaim(w.worker_id), encode(check), timeout=RECLAIM_TIMEOUT_S
            )
            answer: ReclaimReply = decode(reply.data, ReclaimReply)
            if isinstance(answer, ReclaimVerdicts):
                verdicts = answer.verdicts
            else:
                w.log.warning("reclaim_check_refused", detail=answer.detail)
        except nats.errors.Error:  # no responders, a timeout, a connection going away
            return False
        except BadMessage as exc:
            w.log.warning("reclaim_check_refused", detail=str(exc))
        finally:
            orphans = w.reclaims.settle(batch, verdicts)
        for v in orphans:
            try:
                await w.keeper.reclaim(w.machines[v.machine_id], v.detail)
            except StoreError as exc:  # the store refuses writes: the worker drains, and
                w.store_failed(str(exc))  # the orphan is asked about again next round
            finally:
                w.reclaims.done(v.machine_id)
        return True

    # -- the store's health -------------------------------------------------------------------
    def _watch_store(self, now: float) -> None:
        """Drain every worker of this process while its store refuses writes (they share
        it): offering capacity that cannot be committed only makes auctions fail later."""
        if self.store.failure and not self.store_failing:
            self.store_failing = True
            self._next_probe = now + STORE_PROBE_INTERVAL_S
            log.error(
                "supplier_draining",
                reason=f"store refuses writes: {self.store.failure}",
                path=str(self.store.path),
                workers=len(self.workers),
            )
            for w in self.workers.values():
                w.store_failed(self.store.failure)
        if self.store_failing and now >= self._next_probe and not self._probing:
            assert self._tasks is not None, "the sweep runs in run()'s task group"
            self._probing = True
            self._tasks.start_soon(self._probe_store)

    async def _probe_store(self) -> None:
        try:
            if await self.store.probe():
                self.store_failing = False
                resumed = sum(w.store_recovered() for w in self.workers.values())
                log.warning("supplier_resumed", reason="store takes writes again", workers=resumed)
            else:
                log.info("store_still_failing", reason=self.store.failure)
        finally:
            self._next_probe = time.monotonic() + STORE_PROBE_INTERVAL_S
            self._probing = False
