"""The exchange's order desk: ``<root>.order.<region>`` and a tenant's
``<root>.tenant.<name>.order.<region>`` (PlaceOrder -> Placed | Unfilled | Error).

Each order is checked (a reply subject, its region the subject's and one this exchange
serves), refused at once while the exchange stops or its backlog is past the bound, and
otherwise placed by the broker (its image resolved, an admission slot, the auction) in a
task of the responder. A tenant's order id is scoped ``<name>:<id>`` on the way in and
unscoped in its answer (bourse/wire/tenancy.py). An order answered ``Unfilled`` is said on
the event subjects too, at most once (the worker of a placed one says ``placed``).
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.auction.broker import Broker, Refused
from bourse.nats.responder import Responder, subject_region_mismatch
from bourse.runtime.metrics import ExchangeMetrics
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    EXCHANGE_EVENT_WORKER,
    UNFILLED_EVENT,
    Event,
    Placed,
    PlaceOrder,
    Unfilled,
    now_ms,
)
from bourse.wire.subjects import EXCHANGE_QUEUE, Subjects
from bourse.wire.tenancy import scoped_order, unscoped

log = structlog.get_logger("bourse.exchange")


class OrderDesk:
    """Answers the orders one exchange instance takes from its queue group."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        broker: Broker,
        responder: Responder,
        *,
        regions: set[str] | None,
        max_order_backlog: int,
        metrics: ExchangeMetrics | None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.broker = broker
        self.responder = responder
        self.regions = regions  # None: every region
        self.max_order_backlog = max_order_backlog
        self.metrics = metrics
        self._orders: Subscription | None = None  # its backlog refuses orders past the bound

    async def subscribe(self) -> list[Subscription]:
        """Subscribe the order subjects (a buyer's and the tenants') in the queue group;
        the subscriptions, for the stop to drain."""
        g = self.responder.guard
        s = self.subjects
        self._orders = await self.nc.subscribe(
            s.order_all, queue=EXCHANGE_QUEUE, cb=g(self.on_order)
        )
        tenants = await self.nc.subscribe(
            s.tenant_order_all, queue=EXCHANGE_QUEUE, cb=g(self.on_tenant_order)
        )
        return [self._orders, tenants]

    async def on_order(self, msg: Msg) -> None:
        region = self.subjects.tail(msg.subject, 1)[0]
        await self._order(msg, region, decode(msg.data, PlaceOrder))

    async def on_tenant_order(self, msg: Msg) -> None:
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
