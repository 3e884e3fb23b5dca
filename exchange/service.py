"""The exchange: a stateless broker. Any number of instances share the queue group
``exchange``; each request is handled by one of them.

``ExchangeService`` runs one instance: it makes the market's event and command streams
(with JetStream), opens the image store, subscribes its subject families in the queue
group and stops within its bound. Each family is answered by the module that holds it:

- ``<root>.order.<region>`` and a tenant's ``<root>.tenant.<name>.order.<region>``:
  PlaceOrder -> the broker (image resolved, admission, auction) -> Placed | Unfilled |
  Error (exchange/orders.py ``OrderDesk``);
- ``<root>.machine.<verb>`` and a tenant's ``<root>.tenant.<name>.machine.<verb>``: relayed
  to the machine's worker; a ``queue_if_away`` stop or destroy kept for a worker that does
  not answer (exchange/machines.py ``MachineRelay``);
- ``<root>.reclaim.<worker_id>``: ReclaimCheck -> the order claims' verdict on each of the
  worker's reserved machines -> ReclaimVerdicts (docs/protocol.md §5.3d;
  exchange/reclaim.py ``ReclaimDesk``);
- ``<root>.tenant.<name>.image.<verb>``: a tenant's image push, tag and untag, under its
  own names only (exchange/images.py ``ExchangeImages``), which also keeps the watched copy
  of the tags that every order's image reference is resolved against (§4.3a).

A tenant (only its user may publish under ``<root>.tenant.<name>.``) has its order ids
scoped ``<name>:<id>``, its verbs reach only its machines, its listings show only them
(bourse/wire/tenancy.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import anyio
import anyio.abc
import structlog
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from bourse.auction.admission import DEFAULT_TARGET_MS, adaptive_limit
from bourse.auction.auctioneer import Auctioneer
from bourse.auction.broker import Broker
from bourse.auction.claim_store import ClaimStore
from bourse.auction.core import AuctionConfig
from bourse.auction.room import ClaimLimits
from bourse.images.bounds import Bounds
from bourse.nats.commands import CommandStream, ensure_command_stream
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import EventStream, ensure_stream, replicas_for
from bourse.nats.responder import Responder
from bourse.nats.state import StateStream, ensure_state_stream
from bourse.runtime.collectors import AdmissionView, ClaimsView
from bourse.runtime.metrics import ExchangeMetrics
from bourse.runtime.supervise import cleanup_scope
from bourse.wire.signing import TrustStore
from bourse.wire.subjects import EXCHANGE_QUEUE, Subjects
from exchange.images import ExchangeImages
from exchange.machines import MachineRelay
from exchange.orders import OrderDesk
from exchange.reclaim import ReclaimDesk

log = structlog.get_logger("bourse.exchange")

# A stop's bounds: the auctions under way (most end by their deadline, 500 ms by default),
# and the whole stop, so SIGTERM ends the process within 2 s.
HANDLERS_S = 0.8
STOP_S = 1.5
# How long the stop waits for the orders queued here to be answered (a round trip to the
# server, then the queue refused: a NATS that does not answer must not eat the stop).
DRAIN_S = 0.2


class ExchangeService:
    """One exchange instance: its broker and the desks that answer its subject families."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects | None = None,
        *,
        auction: AuctionConfig | None = None,
        regions: set[str] | None = None,
        max_inflight: int = 10_000,
        max_order_backlog: int = 256,
        trust: TrustStore | None = None,
        target_auction_ms: float = DEFAULT_TARGET_MS,
        metrics: ExchangeMetrics | None = None,
        claims: bool = True,
        claim_store: ClaimStore | None = None,
        claim_limits: ClaimLimits = ClaimLimits(),
        jetstream: bool = True,
        image_bounds: Bounds | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects or Subjects()
        # ``jetstream`` False: the degraded mode (--no-jetstream): no claims, no event stream.
        self.jetstream = jetstream
        # ``claim_store``: an open claims bucket to use instead of opening one (embedding,
        # and tests that put a faulty bucket under the exchange); ``claim_limits``: those
        # of the bucket, if this exchange creates it (docs/operations.md)
        self.auctioneer = Auctioneer(
            nc,
            self.subjects,
            auction,
            trust,
            claims=claims and jetstream,
            claim_store=claim_store,
            claim_limits=claim_limits,
        )
        self.regions = regions or None
        self.max_order_backlog = max_order_backlog
        # How many auctions run at once: adaptive (bourse/auction/admission.py), at most
        # max_inflight; target_auction_ms=0 makes it a fixed cap of max_inflight.
        self.admission = adaptive_limit(max_inflight, target_auction_ms)
        # Every request's answer, counted; the work it starts runs in the responder's tasks.
        self.responder = Responder(nc, "exchange")
        # The image store: orders' references resolved (a watched copy of its tags), and
        # tenants' pushes (within image_bounds); opened by run() (with JetStream).
        self.images = ExchangeImages(nc, self.subjects, self.responder, image_bounds)
        # Resolution + admission + auction: the same broker a direct-mode buyer runs.
        self.broker = Broker(self.auctioneer, self.admission, self.images.resolver)
        self.metrics = metrics
        self.orders = OrderDesk(
            nc,
            self.subjects,
            self.broker,
            self.responder,
            regions=self.regions,
            max_order_backlog=max_order_backlog,
            metrics=metrics,
        )
        self.machines = MachineRelay(nc, self.subjects, self.responder)
        self.reclaims = ReclaimDesk(nc, self.subjects, self.auctioneer.claims, self.responder)
        self._order_subs: list[Subscription] = []  # drained at the stop: every order answered
        self._subs: list[Subscription] = []
        if metrics is not None:
            self.auctioneer.on_finished = metrics.offers
            metrics.watch_admission(self._admission_view)
            metrics.watch_claims(self._claims_view)
            metrics.watch_replies("exchange", self._reply_counts)
            for region in sorted(self.regions or ()):  # their series exist from the start
                metrics.region(region)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled: with JetStream, make the event, command and state streams
        if they are missing and open the image store (its tags watched in this task group);
        subscribe, say ``started``, serve; then, shielded and bounded: unsubscribe, let the
        auctions under way finish (their holds released), close the auctioneer. Auctions and
        relays run in the responder's tasks, which the stop ends."""
        async with anyio.create_task_group() as tasks:
            if self.jetstream:  # the suppliers' events wait in their outboxes until it is there
                replicas = replicas_for(self.nc)
                js = self.nc.jetstream()
                await ensure_stream(js, EventStream.of(self.subjects, replicas=replicas))
                await ensure_command_stream(js, CommandStream.of(self.subjects, replicas=replicas))
                await ensure_state_stream(js, StateStream.of(self.subjects, replicas=replicas))
                await tasks.start(self.images.run)
            try:
                await self._subscribe()
                task_status.started()
                await anyio.sleep_forever()
            finally:
                with cleanup_scope(STOP_S):
                    await self._stop()

    async def _subscribe(self) -> None:
        g = self.responder.guard
        s = self.subjects
        self._order_subs += await self.orders.subscribe()
        for subject, cb in (
            (s.machine_all, self.machines.on_machine),
            (s.reclaim_all, self.reclaims.on_reclaim),
            (s.tenant_machine_all, self.machines.on_tenant_machine),
            (s.tenant_image_all, self.images.on_tenant_image),
        ):
            self._subs.append(await self.nc.subscribe(subject, queue=EXCHANGE_QUEUE, cb=g(cb)))
        await flush_all(self.nc)
        log.info("exchange_started", regions=sorted(self.regions) if self.regions else "any")

    async def _stop(self) -> None:
        """Stop taking orders and answer every one that came: those waiting for a slot or
        still queued here are refused ``shutting_down`` at once (the order subscriptions
        are drained: the server sends the rest to the other exchanges of the queue group),
        the auctions under way may finish within ``HANDLERS_S`` (a stop must not wait for
        a 30 s deadline) and are refused so if cut short (releasing their holds on the way
        out)."""
        self.broker.stop()
        if self.nc.is_connected:  # (nats-py's drain writes to the socket even while away)
            for sub in self._order_subs:
                with anyio.move_on_after(DRAIN_S), contextlib.suppress(Exception):
                    await sub.drain()
        for sub in [*self._order_subs, *self._subs]:
            with contextlib.suppress(Exception):  # a drained one is gone already
                await sub.unsubscribe()
        self._order_subs.clear()
        self._subs.clear()
        await self.responder.finish(HANDLERS_S)
        await self.auctioneer.close()
        log.info(
            "exchange_stopped",
            counts=dict(self.responder.counts),
            unverified_offers=dict(self.auctioneer.unverified),
        )

    def _reply_counts(self) -> Counter[str]:
        return self.responder.counts

    def _admission_view(self) -> AdmissionView:
        a = self.admission
        return AdmissionView(a.limit, a.inflight, a.waiting, a.refused)

    def _claims_view(self) -> ClaimsView:
        room = self.auctioneer.bucket.room
        return ClaimsView(room.stored, room.max_bytes, bool(room.full))
