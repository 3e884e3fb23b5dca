"""One worker: its capacity ledger, its machines, its commits, releases, drain.

No NATS here: the host (supplier/host.py) decodes messages and calls these methods, so
the same code serves a real worker and a thousand virtual ones in a load test. How a bid
is answered is the desk's business (supplier/desk.py); the worker holds the state the
desk works on (ledger, pricer, waiting bids) and tells it, through ``on_freed`` and
``on_grew``, when its capacity changes outside a bid. How a commit is answered is its
commit desk's (supplier/commits.py, ``Worker.commits``), which reaches the worker through
the one interface it needs (``CommitWorker``: the worker's ledger, machines and store, its
drain, and what a commit tells it). Its status and metrics sample are assembled in
supplier/status.py, the driver its config asks for made in supplier/drivers.py.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from bourse.wire.listing import cursor_page, listed, machine_pages, matches
from bourse.wire.messages import (
    Error,
    Event,
    Health,
    ListMachines,
    Machine,
    MachineList,
    MachinePage,
    MachineReply,
    WorkerRow,
    WorkerState,
    now_ms,
)
from bourse.wire.resources import amount, format_vec, leq, sub, vec
from bourse.wire.tenancy import SEPARATOR
from supplier.commits import CommitDesk
from supplier.config import DEFAULT_TENANT_IMAGES, WorkerConfig
from supplier.drivers import make_driver
from supplier.feasible import OrderLike, tenant_refusal
from supplier.images import MIB, ImageListener, StoreSource, WorkerImages, open_content
from supplier.ledger import Hold, Ledger
from supplier.machines.api import Driver, Mechanism
from supplier.machines.keeper import Machines
from supplier.ports import PortRange, WorkerPorts, default_host
from supplier.pricing import ImageCost, Pricer
from supplier.reclaim import DEFAULT_AFTER_S as DEFAULT_RECLAIM_AFTER_S
from supplier.reclaim import Reclaims
from supplier.seat import WaitingBids
from supplier.store import Store

log = structlog.get_logger("bourse.supplier")

EmitFn = Callable[[Event], None]
# Told a machine whose change is durable (its row goes to the state stream, supplier/rows.py).
RowFn = Callable[[Machine], None]
# Told about a worker whose capacity changed outside a bid (the host asks the desk).
CapacityFn = Callable[["Worker"], None]
# Drain reasons that a store failure sets start with this; only they are lifted by a probe.
STORE_DRAIN = "store: "
# The operator's drain (docs/protocol.md §4.22), and what a stopped worker offers nothing
# as (it answers no bid: its own drain, if it had one, is kept aside until it starts).
OPERATOR_DRAIN = "operator"
STOPPED = "stopped"
# The drains the operator's start lifts: its own, and the configuration's (never a drain
# the store caused, nor one that committed machines beyond capacity caused).
LIFTED_BY_START = (OPERATOR_DRAIN, "configured")


def _unchanged(w: Worker) -> None:
    """No desk listens (a worker driven alone): nothing waits on its capacity."""


def _unpublished(m: Machine) -> None:
    """No state stream (a worker driven alone, or without JetStream)."""


class Worker:
    """One worker of a supplier process. Collaborators are given here, once:

    - ``emit``: told about every Event: a committed change's once it is durable (the host
      publishes those from the store's outbox), others (``hold_expired``) as they happen;
    - ``driver``: runs machines (default: the one ``cfg.driver`` names, supplier/drivers.py);
    - ``on_freed(worker)``: capacity came back (a hold released or expired, a machine
      destroyed, a commit smaller than its hold, a drain lifted): waiting bids may fit;
    - ``on_grew(worker)``: committed machines grew while bids wait: some may be hopeless;
    - ``on_image(image, cached)``: the catalog's image cache gained or lost an image;
    - ``on_row(machine)``: a machine's change is durable (its row goes to the state stream,
      supplier/rows.py; set by the host after the worker is made);
    - ``source``: the market's image store (supplier/images.py), which a process worker's
      content cache pulls from (default: none, a worker driven alone);
    - ``port_range``: its host ports when the config names none (the host's default block,
      supplier/ports.py); ``advertise_host``: the host its addresses name when the config
      names none (default: the host's primary address).
    """

    def __init__(
        self,
        cfg: WorkerConfig,
        store: Store,
        emit: EmitFn,
        *,
        driver: Driver | None = None,
        on_freed: CapacityFn = _unchanged,
        on_grew: CapacityFn = _unchanged,
        on_image: ImageListener | None = None,
        reclaim_after_s: float = DEFAULT_RECLAIM_AFTER_S,
        source: StoreSource | None = None,
        port_range: PortRange | None = None,
        advertise_host: str = "",
    ) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id
        self.region = cfg.region
        self.labels = dict(cfg.labels)
        self.max_hold_ms = cfg.hold_cap_ms  # a bid's hold_ms is capped here (supplier/desk.py)
        # whole: shims, machines and containers run in directories of their own
        data_dir = store.path.parent.absolute()
        self.driver: Driver = driver or make_driver(
            cfg, data_dir, lambda key: self.images.size_mb(key)
        )
        # Why the driver cannot confine a machine of some resources (it declines), or "".
        # Its own method: every bid asks it.
        self.unconfinable = self.driver.refuses
        # Its images: the catalog's LRU and, for a process worker, the content cache.
        source = source or StoreSource()
        content = None
        if self.driver.name in ("process", "oci"):
            directory = data_dir / "images" / cfg.worker_id
            content = open_content(
                directory, cfg.image_budget_mb, source, cfg.worker_id, cfg.max_image_mb
            )
        self.images = WorkerImages(
            cfg.image_budget_mb,
            cfg.images,
            {name: spec.size_mb for name, spec in cfg.catalog.items()},
            content=content,
            source=source,
            sim_bytes_per_s=cfg.pull_mb_per_s * MIB,
            listener=on_image,
        )
        self.pricer = Pricer(cfg.pricing)  # built once from the config
        # Its port range counts as the ledger's 5th resource (a fleet file has no
        # capacity.ports: the range, its own or the host's default one, gives it).
        port_range = port_range or cfg.port_range
        self.ledger = Ledger(vec(cfg.capacity, port_range.size if port_range else 0))
        host = cfg.advertise_host or advertise_host  # looked up only for a worker with ports
        self.ports = WorkerPorts(
            port_range, self.ledger, host or (default_host() if port_range else "")
        )
        self.draining = cfg.draining
        self.drain_reason = "configured" if cfg.draining else ""
        # It answers the market (False: the operator stopped it, §4.22) and, while stopped,
        # the drain it had before (restored when it starts).
        self.serving = True
        self._kept_drain = (False, "")
        self.store = store
        self.emit = emit
        self.on_freed = on_freed
        self.on_grew = on_grew
        self.keeper = Machines(
            self.worker_id,
            store,
            self.driver,
            self.images,
            self.event,
            self.emit,
            self._destroyed,
            self.store_failed,
            self._catalog_policy,
        )
        self.on_row: RowFn = _unpublished
        self.keeper.records.published = self.machine_changed
        self.machines = self.keeper.by_id
        self.by_order = self.keeper.by_order  # order id -> machine id (I3)
        self.waiting = WaitingBids()  # bids kept until a hold goes away (the desk's queue)
        # Orphans: reserved machines asked about a while after their commit (§5.3d).
        self.reclaims = Reclaims(int(reclaim_after_s * 1000))
        self.reclaiming = self.reclaims.orders  # their machines are handed to nobody meanwhile
        # Commits: a hold becomes a durable machine, once per order (supplier/commits.py).
        self.commits = CommitDesk(self)
        self.undoing = self.commits.undoing  # machines an abort destroys: handed to nobody
        self.log = log.bind(worker_id=self.worker_id, region=self.region)

    # -- what the checks and the price read of its images -----------------------------------
    def unrunnable(self, order: OrderLike) -> str:
        """Why this worker cannot run the order's image, or "": a catalog image its driver
        does not know, a content image without a store to pull it from."""
        if SEPARATOR in order.order_id:  # a tenant's (bourse/wire/tenancy.py)
            policy = self.cfg.tenant_images or DEFAULT_TENANT_IMAGES
            refused = tenant_refusal(policy, self.driver.name, self.driver.isolation)
            if refused:
                return refused
        if order.image_digest:
            return self.images.runnable(order)
        if self.driver.can_run(order.image):
            return ""
        return f"the driver cannot run image {order.image!r}"

    def image_too_big(self, order: OrderLike) -> str:
        """Why the order's image could never fit this worker's image cache, or ""."""
        return self.images.too_big(order)

    def image_cost(self, order: OrderLike) -> ImageCost:
        """What starting the order's image costs here (supplier/pricing.py prices it)."""
        return self.images.cost(order)

    def has_image(self, m: Machine) -> bool:
        """Whether ``m``'s image is here (``image_cached`` of its offers and Placed)."""
        return self.images.has(m)

    @property
    def simulated(self) -> bool:
        """It runs nothing (its driver is ``sim``): its machines and Placed say so."""
        return self.driver.name == "sim"

    def _catalog_policy(self, m: Machine) -> str:
        """A catalog image's own restart policy (its machines' default)."""
        spec = self.cfg.catalog.get(m.image)
        return spec.restart if spec is not None and not m.image_digest else "no"

    # -- start-up ---------------------------------------------------------------------------
    def recover(self) -> None:
        """Resume from the store: machines and their committed resources come back."""
        for m in self.keeper.load():
            if m.state != "destroyed":
                self.ledger.load_committed(vec(m.resources, len(m.addresses)))
                self.ports.hold(m.machine_id, m.addresses)
                self.driver.private_address(m.machine_id, m.private_address)
        if not leq(self.ledger.committed, self.ledger.capacity):
            self.set_draining(
                f"committed {format_vec(self.ledger.committed)} exceeds capacity "
                f"{format_vec(self.ledger.capacity)}"
            )
        self.log.info("worker_recovered", machines=self.live_machines())

    def live_machines(self) -> int:
        return self.keeper.live()

    def machine_changed(self, m: Machine) -> None:
        """A change of ``m`` is durable (a commit, every recorded change): its row goes out."""
        self.on_row(m)

    def _destroyed(self, m: Machine) -> None:
        """A machine is gone: its resources go back to the market."""
        self.ledger.free_committed(vec(m.resources, len(m.addresses)))
        self.ports.give_back(m.machine_id)
        self.capacity_freed()

    def set_draining(self, reason: str) -> None:
        if not self.draining:
            self.log.error("worker_draining", reason=reason)
        self.draining = True
        self.drain_reason = reason

    # -- the operator's verbs (docs/protocol.md §4.22; the host does what a stop takes) ------
    def drain(self) -> None:
        """Offer nothing more; its machines run on."""
        if not self.serving:
            self._kept_drain = (True, OPERATOR_DRAIN)
        elif not self.draining or self.drain_reason in LIFTED_BY_START:
            self.set_draining(OPERATOR_DRAIN)

    def undrain(self) -> None:
        """Lift the operator's (or the configuration's) drain; a store's stays."""
        if self.serving and self.draining and self.drain_reason in LIFTED_BY_START:
            self.draining, self.drain_reason = False, ""
            self.log.warning("worker_undrained")
            self.capacity_freed()  # queued bids may be answered now

    def leave(self) -> None:
        """Stopped: it offers nothing (as a draining worker would), its drain kept aside."""
        if self.serving:
            self.serving = False
            self._kept_drain = (self.draining, self.drain_reason)
            self.draining, self.drain_reason = True, STOPPED

    def rejoin(self) -> None:
        """Serving again, with the drain it had (a store's that came meanwhile stays)."""
        if not self.serving:
            self.serving = True
            if self.drain_reason == STOPPED:
                self.draining, self.drain_reason = self._kept_drain

    def state(self) -> WorkerState:
        """What the operator's verbs answer (§4.22)."""
        stopped = not self.serving and self.drain_reason == STOPPED
        draining, why = self._kept_drain if stopped else (self.draining, self.drain_reason)
        return WorkerState(
            worker_id=self.worker_id,
            region=self.region,
            serving=self.serving,
            draining=draining,
            drain_reason=why,
            machines=self.live_machines(),
        )

    def capacity_freed(self) -> None:
        """Capacity came back (a hold released or expired, a machine destroyed, a commit
        smaller than its hold, a drain lifted): waiting bids may fit now."""
        self.on_freed(self)

    def capacity_grew(self) -> None:
        """Committed machines grew: only bids waiting here can have become hopeless."""
        if self.waiting:
            self.on_grew(self)

    def store_failed(self, reason: str) -> None:
        """The store refused a write: offer nothing that could not be committed."""
        if not self.drain_reason.startswith(STORE_DRAIN):
            self.set_draining(f"{STORE_DRAIN}{reason}")

    def store_recovered(self) -> bool:
        """The store takes writes again: record what happened to machines meanwhile, and
        lift a drain that the failure caused (never one the operator configured)."""
        if self.keeper.facts:
            self.keeper.spawn(self.keeper.record_facts())
        if not (self.draining and self.drain_reason.startswith(STORE_DRAIN)):
            return False
        self.draining = False
        self.drain_reason = ""
        self.log.warning("worker_resumed", reason="the store takes writes again")
        self.capacity_freed()  # queued bids may be answered now
        return True

    def event(
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
        private_address: str = "",
    ) -> Event:
        """An event of this worker (not yet announced: a committed change's event is written
        with the change first, supplier/store.py); ``pulled``: a pull's bytes and seconds;
        ``addresses``, ``private_address``: a placed or started machine's; ``health``: a
        check's."""
        return Event(
            kind=kind,
            region=self.region,
            worker_id=self.worker_id,
            at_ms=now_ms(),
            order_id=order_id,
            machine_id=machine_id,
            detail=detail,
            image_digest=image_digest,
            bytes=pulled[0],
            seconds=round(pulled[1], 3),
            addresses=addresses or {},
            health=health,
            private_address=private_address,
        )

    # -- holds and releases -----------------------------------------------------------------
    def expire_holds(self, now: float | None = None) -> None:
        """Drop holds past their TTL, announce them, and hand the capacity back."""
        before = self.ledger.free
        gone = self.ledger.expire(now)
        if gone:
            self.holds_expired(gone)
        if self.ledger.freer_than(before):
            self.capacity_freed()

    def holds_expired(self, holds: list[Hold]) -> None:
        """Announce expired holds (``hold_expired`` events)."""
        for h in holds:
            self.emit(self.event("hold_expired", order_id=h.order_id))

    def prune_waiting(self, now: float) -> None:
        """Forget waiting bids past their ``wait_ms``."""
        self.waiting.prune(now)

    def machine_for(self, order_id: str) -> Machine | None:
        """The machine placed here for the order (not aborted), if any (I3)."""
        mid = self.by_order.get(order_id)
        return None if mid is None else self.machines[mid]

    def hand_out(self, order_id: str) -> None:
        """The order's machine goes to another auction than the one that committed it (its
        existing-machine offer): no abort undoes it from now on."""
        self.commits.give(order_id)

    def release(self, order_id: str, auction_id: str = "", abort_commit: bool = False) -> None:
        """Drop the order's waiting bids and its hold (of ``auction_id`` when given), unless
        ``abort_commit`` finds a commit to undo (the commit desk's business, §6.6)."""
        if abort_commit and self.commits.abort(order_id):
            return
        self.waiting.drop(order_id, auction_id)
        before = self.ledger.free
        self.ledger.drop(order_id, auction_id)
        if self.ledger.freer_than(before):  # a hold put back may want less than the dropped
            self.capacity_freed()

    # -- its row and machines ----------------------------------------------------------------
    def row(self, beat: str, version: str = "") -> WorkerRow:
        """This worker's row of the state stream (§4.21): ``beat``, the heartbeat that
        names it; free is what committed machines leave (holds left out)."""
        cap = self.ledger.capacity
        return WorkerRow(
            worker_id=self.worker_id,
            region=self.region,
            beat=beat,
            labels=self.labels,
            capacity=amount(cap),
            free=amount(sub(cap, self.ledger.committed)),
            machines=self.live_machines(),
            draining=self.draining,
            drain_reason=self.drain_reason,
            driver=self.driver.name,
            runtime=self.driver.runtime_version,
            confinement=self.confinement,
            isolation=self.driver.isolation,
            cache_bytes=self.images.used_bytes(),
            cache_budget_bytes=self.images.budget_bytes,
            advertise_host=self.ports.host,
            port_range=str(self.ports.range) if self.ports.range else "",
            version=version,
            at_ms=now_ms(),
        )

    def row_key(self) -> tuple[object, ...]:
        """What a change of this worker's row shows in at once (its drain), cheap to
        compare: the host compares it every heartbeat."""
        return (self.draining, self.drain_reason)

    def row_counts(self) -> tuple[object, ...]:
        """What a change of this worker's row shows in when its turn comes (committed
        capacity, image cache use: a busy worker's change with every commit), cheap to
        compare."""
        return (self.ledger.committed, self.images.used_bytes())

    @property
    def confinement(self) -> Mechanism:
        """How this worker holds its machines to what was sold (its status says it)."""
        return self.driver.confinement

    def list_machines(
        self, include_destroyed: bool = False, req: ListMachines | None = None
    ) -> MachineList:
        """The reply to ``machine.list``: the machines ``req`` asks for (its filters), the
        whole list or, with ``req.cursor`` set, one page of it (bourse/wire/listing.py)."""
        req = req or ListMachines(include_destroyed=include_destroyed)
        ms = [m for m in self.machines.values() if matches(req, m)]
        if req.cursor is None:
            return MachineList(worker_id=self.worker_id, machines=ms)
        return cursor_page(self.worker_id, ms, req.cursor)

    def machine_pages(self, req: ListMachines) -> list[MachinePage]:
        """The answer to ``machines.<region>`` (§4.17): the machines ``req`` asks for, in
        listing order, as pages under the byte budget (one empty page when none match)."""
        return machine_pages(self.worker_id, self.region, listed(req, self.machines.values()))

    def get_machine(self, machine_id: str) -> Machine | Error:
        return self.keeper.get(machine_id)

    async def transition(self, verb: str, machine_id: str) -> MachineReply:
        """start / stop / destroy, written to the op log before it is reported."""
        return await self.keeper.transition(verb, machine_id)

    async def logs(self, machine_id: str, tail: int, since: int = -1) -> MachineReply:
        return await self.keeper.logs(machine_id, tail, since)
