"""The exchange: a stateless broker. Any number of instances share the queue group
``exchange``; each order is handled by one of them.

- ``<root>.order.<region>``: PlaceOrder -> runs the auction -> Placed | Unfilled | Error
- ``<root>.machine.<verb>``: routes to ``<root>.worker.<id>.machine.<verb>`` by the worker
  id embedded in the machine id (or ListMachines.worker_id) and relays the worker's reply.
- ``<root>.reclaim.<worker_id>``: ReclaimCheck -> the order claims' verdict on each of the
  worker's reserved machines (keep, orphan, wait) -> ReclaimVerdicts (docs/protocol.md §5.3d;
  exchange/reclaim.py).
- ``<root>.tenant.<name>.order.<region>`` and ``<root>.tenant.<name>.machine.<verb>``: the
  same for tenant ``name`` (only its user may publish there): its order ids are scoped
  ``<name>:<id>``, its verbs reach only its machines, its listings show only them
  (bourse/wire/tenancy.py).
- A ``queue_if_away`` stop or destroy (a buyer's or a tenant's) whose worker does not
  answer is kept for it in the command stream (bourse/nats/commands.py, §4.20) and answered
  with the MachineCommand kept; a tenant's is checked against its machines by the worker.
- ``<root>.tenant.<name>.image.<verb>``: a tenant's image push, tag and untag, under its
  own names only (exchange/images.py).

Every order's image reference is resolved here, where the order enters, against a watched
copy of the image store's tags (docs/protocol.md §4.3a; exchange/images.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import anyio
import anyio.abc
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.auction.admission import DEFAULT_TARGET_MS, adaptive_limit
from bourse.auction.auctioneer import Auctioneer
from bourse.auction.broker import Broker, Refused
from bourse.auction.claim_store import ClaimStore
from bourse.auction.core import AuctionConfig
from bourse.auction.room import ClaimLimits
from bourse.images.errors import ImageError
from bourse.nats.commands import (
    CommandNotKept,
    CommandStream,
    ensure_command_stream,
    probe_or_keep,
)
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import EventStream, ensure_stream, replicas_for
from bourse.nats.responder import Responder, subject_region_mismatch
from bourse.runtime.metrics import AdmissionView, ClaimsView, ExchangeMetrics
from bourse.runtime.supervise import cleanup_scope
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    COMMAND_VERBS,
    EXCHANGE_EVENT_WORKER,
    EXCHANGE_REQUESTER,
    MACHINE_VERBS,
    SHUTTING_DOWN_REASON,
    TENANT_REQUESTER,
    UNFILLED_EVENT,
    Error,
    Event,
    ImagePush,
    ImageTag,
    ImageTagged,
    ImageUntag,
    ListMachines,
    Machine,
    MachineList,
    MachineRequest,
    Placed,
    PlaceOrder,
    ReclaimCheck,
    Unfilled,
    now_ms,
    worker_of_machine,
)
from bourse.wire.signing import TrustStore
from bourse.wire.subjects import EXCHANGE_QUEUE, Subjects
from bourse.wire.tenancy import own_machines, owns, scoped_order, unscoped
from exchange.images import REQUEST_ERRORS, ExchangeImages
from exchange.reclaim import ReclaimDesk

log = structlog.get_logger("bourse.exchange")

MACHINE_TIMEOUT_S = 55.0  # a stop may wait its grace, a start an image pull
# A stop's bounds: the auctions under way (most end by their deadline, 500 ms by default),
# and the whole stop, so SIGTERM ends the process within 2 s.
HANDLERS_S = 0.8
STOP_S = 1.5
# How long the stop waits for the orders queued here to be answered (a round trip to the
# server, then the queue refused: a NATS that does not answer must not eat the stop).
DRAIN_S = 0.2
# A tenant's image requests, by verb (the subject's last token).
IMAGE_VERBS: dict[str, type[ImagePush | ImageTag | ImageUntag]] = {
    "push": ImagePush,
    "tag": ImageTag,
    "untag": ImageUntag,
}


class ExchangeService:
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
        # The image store: orders' references resolved (a watched copy of its tags), and
        # tenants' pushes; opened by run() (with JetStream).
        self.images = ExchangeImages(nc, self.subjects)
        # Resolution + admission + auction: the same broker a direct-mode buyer runs.
        self.broker = Broker(self.auctioneer, self.admission, self.images.resolver)
        self.reclaims = ReclaimDesk(nc, self.subjects, self.auctioneer.claims)
        self._orders: Subscription | None = None
        self._order_subs: list[Subscription] = []  # drained at the stop: every order answered
        self._subs: list[Subscription] = []
        self.metrics = metrics
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
        """Serve until cancelled: with JetStream, make the event stream if it is missing and
        open the image store (its tags watched in this task group); subscribe, say
        ``started``, serve; then, shielded and bounded: unsubscribe, let the auctions under
        way finish (their holds released), close the auctioneer. Auctions and relays run in
        the responder's tasks, which the stop ends."""
        self.responder = Responder(self.nc, "exchange")
        async with anyio.create_task_group() as tasks:
            if self.jetstream:  # the suppliers' events wait in their outboxes until it is there
                replicas = replicas_for(self.nc)
                js = self.nc.jetstream()
                await ensure_stream(js, EventStream.of(self.subjects, replicas=replicas))
                await ensure_command_stream(js, CommandStream.of(self.subjects, replicas=replicas))
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
        self._orders = await self.nc.subscribe(
            s.order_all, queue=EXCHANGE_QUEUE, cb=g(self._on_order)
        )
        self._order_subs.append(self._orders)
        self._order_subs.append(
            await self.nc.subscribe(
                s.tenant_order_all, queue=EXCHANGE_QUEUE, cb=g(self._on_tenant_order)
            )
        )
        for subject, cb in (
            (s.machine_all, self._on_machine),
            (s.reclaim_all, self._on_reclaim),
            (s.tenant_machine_all, self._on_tenant_machine),
            (s.tenant_image_all, self._on_tenant_image),
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

    async def _on_order(self, msg: Msg) -> None:
        region = self.subjects.tail(msg.subject, 1)[0]
        await self._order(msg, region, decode(msg.data, PlaceOrder))

    async def _on_tenant_order(self, msg: Msg) -> None:
        tenant, _, region = self.subjects.tail(msg.subject, 1)
        await self._order(msg, region, decode(msg.data, PlaceOrder), tenant)

    async def _order(
        self, msg: Msg, region: str, order: PlaceOrder, tenant: str | None = None
    ) -> None:
        if not msg.reply:
            # Nobody would learn the outcome: placing would only leak a machine.
            self.responder.counts["order_without_reply"] += 1
            log.warning("order_without_reply_ignored", order_id=order.order_id, region=region)
            return
        if order.region != region:
            raise subject_region_mismatch("order", order.region, region)
        if self.regions is not None and region not in self.regions:
            raise BadMessage(
                f"unknown region {region!r}: this exchange serves {sorted(self.regions)}"
            )
        if self.broker.stopping:  # queued when the stop came: answered, not dropped
            await self._refuse(msg, region, self.broker.shutting_down())
            return
        backlog = self._orders.pending_msgs if self._orders is not None else 0
        if backlog > self.max_order_backlog:
            # Refusing at once is the cheap, honest answer: an auction started now would
            # run on an order that has already waited behind the queue.
            await self._refuse(msg, region, self.broker.overloaded(backlog))
            return
        if tenant is not None:
            order = scoped_order(tenant, order)
        self.responder.spawn(msg, self._place(msg, order, tenant))

    async def _refuse(self, msg: Msg, region: str, refusal: Refused) -> None:
        if self.metrics is not None:
            self.metrics.refused(region, refusal.kind)
        if refusal.kind == "overloaded":
            self.responder.counts["shed"] += 1
        err = refusal.error()
        await self.responder.error(msg, err.code, err.detail, reason=err.reason)

    async def _place(self, msg: Msg, order: PlaceOrder, tenant: str | None = None) -> None:
        try:
            outcome = await self.broker.place(order)
        except asyncio.CancelledError:  # the stop cut its auction short: say so, then go
            with contextlib.suppress(Exception):
                await self._refuse(msg, order.region, self.broker.shutting_down())
            raise
        if isinstance(outcome, Refused):
            await self._refuse(msg, order.region, outcome)
        else:
            await self._answer(msg, order, outcome, tenant)

    async def _answer(
        self, msg: Msg, order: PlaceOrder, outcome: Placed | Unfilled, tenant: str | None
    ) -> None:
        m = self.metrics
        if m is not None:
            if isinstance(outcome, Placed):
                m.placed(order.region, outcome.elapsed_ms / 1000.0)
            else:
                m.unfilled(order.region, outcome.reason, outcome.elapsed_ms / 1000.0)
        self.responder.counts[type(outcome).__name__] += 1
        if tenant is not None:
            outcome = unscoped(tenant, outcome)
        with contextlib.suppress(Exception):
            await self.responder.reply(msg, outcome)
        if isinstance(outcome, Unfilled):
            await self._unfilled_event(outcome)

    async def _unfilled_event(self, u: Unfilled) -> None:
        """Order outcomes on the event subjects (§6.9): a placed order is the worker's
        ``placed`` event; an unfilled one has no worker, so the exchange says it, once,
        at most once (a plain publish, stored by the event stream where there is one)."""
        event = Event(
            kind=UNFILLED_EVENT,
            region=u.region,
            worker_id=EXCHANGE_EVENT_WORKER,
            at_ms=now_ms(),
            order_id=u.order_id,
            detail=f"{u.reason}: {u.detail}" if u.detail else u.reason,
        )
        subject = self.subjects.event(u.region, EXCHANGE_EVENT_WORKER, UNFILLED_EVENT)
        with contextlib.suppress(Exception):  # an event is never worth failing an order for
            await self.nc.publish(subject, encode(event))

    def _reply_counts(self) -> Counter[str]:
        responder = getattr(self, "responder", None)  # made by run()
        return responder.counts if responder is not None else Counter()

    def _admission_view(self) -> AdmissionView:
        a = self.admission
        return AdmissionView(a.limit, a.inflight, a.waiting, a.refused)

    def _claims_view(self) -> ClaimsView:
        room = self.auctioneer.bucket.room
        return ClaimsView(room.stored, room.max_bytes, bool(room.full))

    async def _on_machine(self, msg: Msg) -> None:
        verb = self.subjects.tail(msg.subject, 1)[0]
        if not await self._known_verb(msg, verb):
            return
        if verb == "list":
            self.responder.spawn(msg, self._relay(msg, _list_worker(msg), verb))
            return
        req = decode(msg.data, MachineRequest)
        self.responder.spawn(msg, self._machine_verb(msg, req, verb))

    async def _machine_verb(self, msg: Msg, req: MachineRequest, verb: str) -> None:
        """Relay to the machine's worker; a ``queue_if_away`` stop or destroy is kept for a
        worker that does not answer."""
        if _keeps(req, verb) and await self._or_keep(msg, req, verb, EXCHANGE_REQUESTER) is None:
            return
        await self._relay(msg, worker_of_machine(req.machine_id), verb)

    async def _or_keep(
        self, msg: Msg, req: MachineRequest, verb: str, requester: str
    ) -> bytes | None:
        """The worker's answer to a ``get`` of the machine when it answers in time; else
        None once the command is kept for the worker in the command stream and ``msg``
        answered with it (or with why it could not be kept, §4.20)."""
        try:
            shown = await probe_or_keep(self.nc, self.subjects, verb, req.machine_id, requester)
        except CommandNotKept as exc:
            await self.responder.error(msg, "internal", str(exc))
            return None
        if isinstance(shown, bytes):
            return shown
        self.responder.counts["command_kept"] += 1
        log.info(
            "command_kept",
            worker_id=shown.worker_id,
            machine_id=req.machine_id,
            verb=verb,
            command_id=shown.command_id,
            requested_by=requester,
        )
        await self.responder.reply(msg, shown)
        return None

    async def _known_verb(self, msg: Msg, verb: str) -> bool:
        """A machine verb the workers serve; else the request is answered with why not."""
        if verb in MACHINE_VERBS:
            return True
        await self.responder.error(
            msg,
            "unknown_subject",
            f"unknown machine verb {verb!r}: use one of {', '.join(MACHINE_VERBS)}",
        )
        return False

    async def _relay(self, msg: Msg, worker_id: str, verb: str) -> None:
        data = await self._ask(msg, worker_id, verb, msg.data)
        if data is not None:
            await self.responder.forward(msg, data)

    async def _ask(self, msg: Msg, worker_id: str, verb: str, data: bytes) -> bytes | None:
        """The worker's reply to ``verb``, or None once ``msg`` was answered with why not."""
        subject = self.subjects.worker_machine(worker_id, verb)
        try:
            reply = await self.nc.request(subject, data, timeout=MACHINE_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            await self.responder.error(
                msg, "bad_request", f"worker {worker_id!r} is not reachable: no supplier serves it"
            )
            return None
        except nats.errors.TimeoutError:
            await self.responder.error(
                msg, "internal", f"worker {worker_id!r} did not answer {verb} in time"
            )
            return None
        return reply.data

    async def _on_tenant_machine(self, msg: Msg) -> None:
        """A tenant's machine request: only its own machines, whatever it names."""
        tenant, _, verb = self.subjects.tail(msg.subject, 1)
        if not await self._known_verb(msg, verb):
            return
        if verb == "list":
            self.responder.spawn(msg, self._tenant_list(msg, tenant, _list_worker(msg)))
            return
        machine_id = decode(msg.data, MachineRequest).machine_id
        self.responder.spawn(msg, self._tenant_verb(msg, tenant, machine_id, verb))

    async def _tenant_list(self, msg: Msg, tenant: str, worker_id: str) -> None:
        data = await self._ask(msg, worker_id, "list", msg.data)
        if data is None:
            return
        reply: MachineList | Error = decode(data, MachineList | Error)
        if isinstance(reply, MachineList):
            reply = own_machines(tenant, reply)
        await self.responder.reply(msg, reply)

    async def _tenant_verb(self, msg: Msg, tenant: str, machine_id: str, verb: str) -> None:
        """Ask the worker for the machine first; act only if it is the tenant's."""
        worker_id = worker_of_machine(machine_id)
        if _keeps(req := decode(msg.data, MachineRequest), verb):  # else the worker checks
            shown = await self._or_keep(msg, req, verb, TENANT_REQUESTER + tenant)
        else:
            shown = await self._ask(
                msg, worker_id, "get", encode(MachineRequest(machine_id=machine_id))
            )
        if shown is None:
            return
        machine: Machine | Error = decode(shown, Machine | Error)
        if isinstance(machine, Error):
            await self.responder.forward(msg, shown)
            return
        if not owns(tenant, machine.order_id):
            self.responder.counts["not_owner"] += 1
            log.warning(
                "machine_request_not_owner", tenant=tenant, machine_id=machine_id, verb=verb
            )
            await self.responder.error(
                msg, "bad_request", f"machine {machine_id} is not one of {tenant!r}'s machines"
            )
            return
        if verb == "get":
            await self.responder.reply(msg, unscoped(tenant, machine))
            return
        data = await self._ask(msg, worker_id, verb, msg.data)
        if data is None:
            return
        try:
            await self.responder.reply(msg, unscoped(tenant, decode(data, Machine)))
        except BadMessage:  # logs, or an Error: as the worker sent it
            await self.responder.forward(msg, data)

    async def _on_tenant_image(self, msg: Msg) -> None:
        """A tenant's image push, tag or untag (exchange/images.py): its own names only."""
        tenant, _, verb = self.subjects.tail(msg.subject, 1)
        kind = IMAGE_VERBS.get(verb)
        if kind is None:
            await self.responder.error(
                msg,
                "unknown_subject",
                f"unknown image verb {verb!r}: use one of {', '.join(IMAGE_VERBS)}",
            )
            return
        self.responder.spawn(msg, self._image(msg, tenant, decode(msg.data, kind)))

    async def _image(self, msg: Msg, tenant: str, req: ImagePush | ImageTag | ImageUntag) -> None:
        images = self.images
        try:
            if isinstance(req, ImagePush):
                done: ImageTagged = await images.push(tenant, req)
            elif isinstance(req, ImageTag):
                done = await images.tag(tenant, req)
            else:
                done = await images.untag(tenant, req)
        except asyncio.CancelledError:  # the stop cut it short: say so, then go
            with contextlib.suppress(Exception):
                detail = "the exchange is stopping: send the image request again"
                await self.responder.error(msg, "internal", detail, SHUTTING_DOWN_REASON)
            raise
        except REQUEST_ERRORS as exc:
            log.warning("image_request_refused", tenant=tenant, error=str(exc))
            await self.responder.error(msg, "bad_request", str(exc))
            return
        except (ImageError, nats.errors.Error, TimeoutError) as exc:
            await self.responder.error(msg, "internal", str(exc) or type(exc).__name__)
            return
        await self.responder.reply(msg, done)

    async def _on_reclaim(self, msg: Msg) -> None:
        """A worker asks about its reserved machines (docs/protocol.md §5.3d). Only its own:
        the subject names the worker (a supplier key may publish only its workers'), and
        every machine must be that worker's."""
        worker_id = self.subjects.tail(msg.subject, 1)[0]
        check = decode(msg.data, ReclaimCheck)
        if check.worker_id != worker_id:
            raise BadMessage(f"reclaim for worker {check.worker_id!r} sent as {worker_id!r}")
        for m in check.machines:
            if m.worker_id != worker_id or worker_of_machine(m.machine_id) != worker_id:
                raise BadMessage(f"machine {m.machine_id} is not worker {worker_id!r}'s")
        self.responder.spawn(msg, self._reclaim(msg, check))

    async def _reclaim(self, msg: Msg, check: ReclaimCheck) -> None:
        verdicts = await self.reclaims.verdicts(check)
        self.responder.counts["reclaim_checks"] += 1
        await self.responder.reply(msg, verdicts)


def _keeps(req: MachineRequest, verb: str) -> bool:
    """Whether the request is kept as a command when its worker does not answer."""
    return req.queue_if_away and verb in COMMAND_VERBS


def _list_worker(msg: Msg) -> str:
    """The worker a machine.list through the exchange names (it must name one)."""
    worker_id = decode(msg.data, ListMachines).worker_id
    if not worker_id:
        raise BadMessage("machine.list through the exchange needs worker_id")
    return worker_id
