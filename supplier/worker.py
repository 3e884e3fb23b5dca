"""One worker's market logic: answer bids, hold, commit durably, release, report status.

No NATS here: the host (supplier/host.py) decodes messages and calls these methods, so
the same code serves a real worker and a thousand virtual ones in a load test.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import structlog

from bourse.wire.messages import (
    Amount,
    Bid,
    Commit,
    CommitReply,
    Error,
    Event,
    Machine,
    MachineList,
    MachineReply,
    Offer,
    Placed,
    Rejected,
    Resources,
    Waiting,
    WorkerStatus,
    new_machine_id,
    now_ms,
)
from supplier.config import WorkerConfig
from supplier.drivers import Driver
from supplier.drivers.process import ProcessDriver
from supplier.drivers.sim import SimDriver
from supplier.images import DEFAULT_IMAGE_MB, ImageCache
from supplier.ledger import Hold, Ledger, Vec, leq
from supplier.machines import Machines
from supplier.pricing import INSUFFICIENT, Pricer, check_fit
from supplier.store import Op, Store, StoreError

log = structlog.get_logger("bourse.supplier")

EmitFn = Callable[[Event], None]
# (reply inbox, auction id, reply, delay in s): how a waiting bid's late answer goes out.
SendOfferFn = Callable[[str, str, Offer | Waiting, float], None]
# At most this many bids wait for held capacity on one worker; more are not answered.
MAXWAITING = 1024
# Drain reasons that a store failure sets start with this; only they are lifted by a probe.
STORE_DRAIN = "store: "
WAIT = object()  # a bid blocked only by other orders' holds


class Quote:
    """A worker's price for a bid, before anything is held."""

    __slots__ = ("cached", "score", "want")

    def __init__(self, score: float, cached: bool, want: Vec) -> None:
        self.score = score
        self.cached = cached
        self.want = want


class _Waiting:
    __slots__ = ("bid", "inbox", "until")

    def __init__(self, bid: Bid, inbox: str, until: float) -> None:
        self.bid = bid
        self.inbox = inbox
        self.until = until


def vec(r: Resources | Amount) -> Vec:
    return (r.cpus, r.memory_mb, r.disk_mb, r.gpus)


def amount(v: Vec) -> Amount:
    return Amount(cpus=v[0], memory_mb=v[1], disk_mb=v[2], gpus=v[3])


class Worker:
    def __init__(
        self, cfg: WorkerConfig, store: Store, emit: EmitFn, driver: Driver | None = None
    ) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id
        self.region = cfg.region
        self.labels = dict(cfg.labels)
        sizes = {name: spec.size_mb for name, spec in cfg.catalog.items()}
        self.images = ImageCache(
            cfg.image_budget_mb, cfg.images, lambda i: sizes.get(i, DEFAULT_IMAGE_MB)
        )
        self.driver: Driver = driver or SimDriver(cfg.pull_mb_per_s, sizes)
        self.pricer = Pricer(cfg.pricing)
        self.ledger = Ledger(vec(cfg.capacity))
        self.draining = cfg.draining
        self.drain_reason = "configured" if cfg.draining else ""
        self.store = store
        self.emit = emit
        self.keeper = Machines(
            self.worker_id,
            store,
            self.driver,
            self.images,
            self._event,
            self._destroyed,
            self.store_failed,
        )
        if isinstance(self.driver, ProcessDriver):
            self.driver.on_exit = self.keeper.exited
        self.machines = self.keeper.by_id
        self.by_order = self.keeper.by_order  # order id -> machine id (I3)
        self.committing: dict[str, asyncio.Future[CommitReply]] = {}
        self.aborts: set[str] = set()
        self.waiting: deque[_Waiting] = deque()
        self.send_offer: SendOfferFn = lambda inbox, auction_id, offer, delay: None
        self.log = log.bind(worker_id=self.worker_id, region=self.region)

    # -- start-up ---------------------------------------------------------------------------
    def recover(self) -> None:
        """Resume from the store: machines and their committed resources come back."""
        for m in self.keeper.load():
            if m.state != "destroyed":
                self.ledger.load_committed(vec(m.resources))
        if not leq(self.ledger.committed, self.ledger.capacity):
            self.set_draining(
                f"committed {self.ledger.committed} exceeds capacity {self.ledger.capacity}"
            )
        self.log.info("worker_recovered", machines=self.live_machines())

    def live_machines(self) -> int:
        return self.keeper.live()

    def _destroyed(self, m: Machine) -> None:
        """A machine is gone: its resources go back to the market."""
        self.ledger.free_committed(vec(m.resources))
        self._freed()

    def set_draining(self, reason: str) -> None:
        if not self.draining:
            self.log.error("worker_draining", reason=reason)
        self.draining = True
        self.drain_reason = reason

    def store_failed(self, reason: str) -> None:
        """The store refused a write: offer nothing that could not be committed."""
        if not self.drain_reason.startswith(STORE_DRAIN):
            self.set_draining(f"{STORE_DRAIN}{reason}")

    def store_recovered(self) -> bool:
        """Lift a drain that a store failure caused (never one the operator configured)."""
        if not (self.draining and self.drain_reason.startswith(STORE_DRAIN)):
            return False
        self.draining = False
        self.drain_reason = ""
        self.log.warning("worker_resumed", reason="the store takes writes again")
        self._freed()  # queued bids may be answered now
        return True

    def _event(self, kind: str, order_id: str = "", machine_id: str = "", detail: str = "") -> None:
        self.emit(
            Event(
                kind=kind,
                region=self.region,
                worker_id=self.worker_id,
                at_ms=now_ms(),
                order_id=order_id,
                machine_id=machine_id,
                detail=detail,
            )
        )

    # -- the auction ---------------------------------------------------------------------------
    def expire_holds(self, now: float | None = None) -> None:
        gone = self.ledger.expire(now)
        for h in gone:
            self._event("hold_expired", order_id=h.order_id)
        if gone:
            self._freed()

    def bid(self, bid: Bid, now: float, inbox: str = "") -> tuple[Offer | Waiting, float] | None:
        """A reply and how long to wait before sending it, or None to stay silent.

        A bid that only lacks capacity because of other orders' holds is kept (up to
        ``bid.wait_ms``; the reply says so with a Waiting) and answered through
        ``send_offer`` when a hold goes away. (A host with many workers uses the steps
        quote / take / wait itself, to offer only its best workers.)
        """
        q = self.quote(bid, now)
        if isinstance(q, Offer):
            return q, 0.0
        if isinstance(q, Quote):
            return self.take(bid, now, q)
        if q is WAIT:
            return self.wait(bid, now, inbox)
        return None

    def quote(self, bid: Bid, now: float) -> Offer | Quote | object | None:
        """Price a bid without holding anything: an Offer for a machine this order already
        has here, a Quote, WAIT (only holds are in the way), or None (silent)."""
        existing = self.by_order.get(bid.order_id)
        if existing is not None:
            m = self.machines[existing]
            return Offer(
                order_id=bid.order_id,
                worker_id=self.worker_id,
                region=self.region,
                score=m.score,
                image_cached=m.image in self.images,
                machine_id=m.machine_id,
                auction_id=bid.auction_id,
            )
        old = self.ledger.holds.get(bid.order_id)
        if old is not None:
            if old.committing:
                return None  # a commit for this order is under way here
            self.ledger.drop(bid.order_id)  # a re-bid replaces the earlier hold
            self._freed()  # waiting bids may take that capacity first (first come first)
        self.expire_holds(now)
        return self._quote(bid)

    def _quote(self, bid: Bid) -> Quote | object | None:
        want = vec(bid.resources)
        reason = check_fit(
            worker_id=self.worker_id,
            labels=self.labels,
            draining=self.draining,
            free=self.ledger.free,
            want=want,
            constraints=bid.constraints,
            exclude_workers=bid.exclude_workers,
        )
        if reason == INSUFFICIENT and leq(want, self.ledger.free_of_committed):
            return WAIT
        if reason or not self.driver.can_run(bid.image):
            return None
        cached = bid.image in self.images
        score, _ = self.pricer.price(self.ledger.capacity, self.ledger.used, want, cached, False)
        return Quote(score, cached, want)

    def take(self, bid: Bid, now: float, q: Quote) -> tuple[Offer, float] | None:
        """Hold the quoted resources and make the Offer (sent after its delay). Only now, for
        the workers actually offered, are the subscores worked out."""
        _, subscores = self.pricer.price(self.ledger.capacity, self.ledger.used, q.want, q.cached)
        hold = Hold(
            bid.order_id,
            q.want,
            now + bid.hold_ms / 1000.0,
            q.score,
            subscores,
            q.cached,
            bid.auction_id,
        )
        if not self.ledger.hold(hold):
            return None
        offer = Offer(
            order_id=bid.order_id,
            worker_id=self.worker_id,
            region=self.region,
            score=q.score,
            subscores=subscores,
            image_cached=q.cached,
            hold_expires_at_ms=now_ms() + bid.hold_ms,
            auction_id=bid.auction_id,
        )
        return offer, self.pricer.delay_s(q.score)

    def wait(self, bid: Bid, now: float, inbox: str) -> tuple[Waiting, float] | None:
        """Keep a bid blocked only by holds (if the bidder allows waiting)."""
        if bid.wait_ms and inbox and len(self.waiting) < MAXWAITING:
            self.waiting.append(_Waiting(bid, inbox, now + bid.wait_ms / 1000.0))
            return self._waiting(bid, bid.wait_ms), 0.0
        return None

    def _waiting(self, bid: Bid, wait_ms: int) -> Waiting:
        return Waiting(
            order_id=bid.order_id, worker_id=self.worker_id, region=self.region, wait_ms=wait_ms
        )

    def _try(self, bid: Bid, now: float) -> tuple[Offer, float] | object | None:
        q = self._quote(bid)
        return self.take(bid, now, q) if isinstance(q, Quote) else q

    def _freed(self) -> None:
        """Capacity came back: answer waiting bids that fit now, oldest first."""
        if not self.waiting:
            return
        now = time.monotonic()
        keep: deque[_Waiting] = deque()
        while self.waiting:
            w = self.waiting.popleft()
            if w.until <= now or w.bid.order_id in self.ledger.holds:
                continue
            answer = self._try(w.bid, now)
            if answer is WAIT:
                keep.append(w)
            elif answer is not None:
                offer, delay = answer  # type: ignore[misc]
                self.send_offer(w.inbox, w.bid.auction_id, offer, delay)
            else:  # committed machines took the capacity: withdraw, so the auction need not wait
                self.send_offer(w.inbox, w.bid.auction_id, self._waiting(w.bid, 0), 0.0)
        self.waiting = keep

    def _withdraw_hopeless(self) -> None:
        """Committed machines grew: bids that can no longer fit even if every hold went
        away are withdrawn, so their auctions stop waiting for this worker."""
        free = self.ledger.free_of_committed
        keep: deque[_Waiting] = deque()
        for w in self.waiting:
            if leq(vec(w.bid.resources), free):
                keep.append(w)
            else:
                self.send_offer(w.inbox, w.bid.auction_id, self._waiting(w.bid, 0), 0.0)
        self.waiting = keep

    def prune_waiting(self, now: float) -> None:
        if any(w.until <= now for w in self.waiting):
            self.waiting = deque(w for w in self.waiting if w.until > now)

    def holds_for(self, order_id: str, auction_id: str) -> bool:
        """Is the hold an offer was made for still there (not released meanwhile)?"""
        h = self.ledger.holds.get(order_id)
        return h is not None and h.auction_id == auction_id

    def release(self, order_id: str, auction_id: str = "", abort_commit: bool = False) -> None:
        if abort_commit:
            if order_id in self.committing:
                self.aborts.add(order_id)  # the commit finishing will undo itself
                return
            mid = self.by_order.get(order_id)
            if mid is not None and self.machines[mid].state == "reserved":
                self.aborts.add(order_id)
                self.keeper.spawn(self._abort(self.machines[mid]))
                return
        if self.waiting:
            self.waiting = deque(
                w
                for w in self.waiting
                if w.bid.order_id != order_id or (auction_id and w.bid.auction_id != auction_id)
            )
        if self.ledger.drop(order_id, auction_id) is not None:
            self._freed()

    async def commit(self, c: Commit) -> CommitReply:
        t0 = time.perf_counter()
        if c.worker_id != self.worker_id:
            return Error(
                code="bad_request",
                detail=f"commit for worker {c.worker_id!r} sent to worker {self.worker_id!r}",
            )
        existing = self.by_order.get(c.order_id)
        if existing is not None:
            return self._placed(self.machines[existing], t0, existing=True)
        pending = self.committing.get(c.order_id)
        if pending is not None:
            return await asyncio.shield(pending)
        if self.draining:
            return self._rejected(c, "draining", self.drain_reason)
        self.expire_holds()
        h = self.ledger.holds.get(c.order_id)
        if h is None:
            if c.order_id in self.ledger.recently_expired:
                return self._rejected(c, "hold_expired", "the hold's TTL passed before the commit")
            return self._rejected(c, "no_hold", "no hold for this order on this worker")
        want = vec(c.resources)
        if not leq(want, h.want):
            return self._rejected(
                c, "insufficient", f"commit asks for {want} but the hold is for {h.want}"
            )
        return await self._commit_hold(c, h, want, t0)

    async def _commit_hold(self, c: Commit, h: Hold, want: Vec, t0: float) -> CommitReply:
        h.committing = True
        fut: asyncio.Future[CommitReply] = asyncio.get_running_loop().create_future()
        self.committing[c.order_id] = fut
        at = now_ms()
        machine = Machine(
            machine_id=new_machine_id(self.worker_id),
            order_id=c.order_id,
            worker_id=self.worker_id,
            region=self.region,
            state="reserved",
            resources=c.resources,
            image=c.image,
            metadata=dict(c.metadata),
            score=h.score,
            created_at_ms=at,
            updated_at_ms=at,
        )
        result: CommitReply
        try:
            await self.store.write(Op("place", machine))
        except StoreError as exc:
            self.ledger.unpin(h)
            self.store_failed(str(exc))
            result = Error(code="internal", detail=f"worker {self.worker_id} cannot store: {exc}")
        else:
            self.ledger.convert(h, want)
            if want != h.want:
                self._freed()
            elif self.waiting:
                self._withdraw_hopeless()
            self.keeper.added(machine)
            result = self._placed(machine, t0, subscores=h.subscores)
            self.log.info(
                "machine_placed", order_id=c.order_id, machine_id=machine.machine_id, score=h.score
            )
            self._event("placed", c.order_id, machine.machine_id)
        finally:
            del self.committing[c.order_id]
        fut.set_result(result)
        if c.order_id in self.aborts and isinstance(result, Placed):
            await self._abort(machine)
        return result

    async def _abort(self, m: Machine) -> None:
        self.aborts.discard(m.order_id)
        await self.keeper.abort(m)

    def _placed(
        self,
        m: Machine,
        t0: float,
        existing: bool = False,
        subscores: dict[str, float] | None = None,
    ) -> Placed:
        return Placed(
            order_id=m.order_id,
            machine_id=m.machine_id,
            worker_id=self.worker_id,
            region=self.region,
            score=m.score,
            image_cached=m.image in self.images,
            elapsed_ms=round((time.perf_counter() - t0) * 1000.0, 3),
            subscores=subscores or {},
            existing=existing,
        )

    def _rejected(self, c: Commit, reason: str, detail: str) -> Rejected:
        self.log.info("commit_rejected", order_id=c.order_id, reason=reason)
        return Rejected(order_id=c.order_id, worker_id=self.worker_id, reason=reason, detail=detail)  # type: ignore[arg-type]

    # -- status and machines --------------------------------------------------------------------
    def status(self) -> WorkerStatus:
        self.expire_holds()
        return WorkerStatus(
            worker_id=self.worker_id,
            region=self.region,
            labels=self.labels,
            capacity=amount(self.ledger.capacity),
            committed=amount(self.ledger.committed),
            held=amount(self.ledger.held),
            images=sorted(self.images),
            machines=self.live_machines(),
            draining=self.draining,
            holds=len(self.ledger.holds),
            drain_reason=self.drain_reason,
        )

    def list_machines(self, include_destroyed: bool) -> MachineList:
        ms = [m for m in self.machines.values() if include_destroyed or m.state != "destroyed"]
        return MachineList(worker_id=self.worker_id, machines=ms)

    def get_machine(self, machine_id: str) -> Machine | Error:
        return self.keeper.get(machine_id)

    async def transition(self, verb: str, machine_id: str) -> MachineReply:
        """start / stop / destroy, written to the op log before it is reported."""
        return await self.keeper.transition(verb, machine_id)

    async def logs(self, machine_id: str, tail: int) -> MachineReply:
        return await self.keeper.logs(machine_id, tail)
