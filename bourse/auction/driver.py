"""The immediate-or-cancel auction, as a library: the exchange runs it, and so can a buyer
directly against the suppliers ("direct" mode).

    1. publish a Bid to <root>.bid.<region> with a fresh reply inbox
       (a 503 "no responders" status means no worker listens in that region: no_workers)
    2. collect Offers; take the best one received so far whose score >= min_score and
       commit it (<root>.worker.<id>.commit); if rejected, try the next best received
    3. on the way out, ONE publish to <root>.release.<region> drops every other hold
       (received offers and late ones alike) for this auction
    4. nothing committed by the deadline -> Unfilled with an honest reason and counts

The auction stops collecting early when no new offer arrived for ``quiet_ms``: workers send
their offers within ``spread_ms`` of the bid, so a long silence means nobody else will.
A commit started before the deadline may finish up to ``commit_grace_ms`` after it; a commit
that still has not answered is aborted (Release.abort_commit) so the Unfilled stays true.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from ulid import ULID

from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    Bid,
    BidReply,
    Commit,
    CommitReply,
    Offer,
    Placed,
    PlaceOrder,
    Rejected,
    Release,
    Unfilled,
    UnfilledReason,
    Waiting,
)
from bourse.wire.signing import TrustStore
from bourse.wire.subjects import Subjects, sampled_shards

log = structlog.get_logger("bourse.auction")


class AuctionError(RuntimeError):
    """The auction could not run at all (e.g. not connected to NATS)."""


class ConflictingOrder(ValueError):
    """The order id is the idempotency key: reusing it for a different order is an error."""


@dataclass(frozen=True, slots=True)
class AuctionConfig:
    quiet_ms: float = 100.0
    commit_grace_ms: float = 100.0
    # Holds outlive the deadline by the commit grace plus this margin, so a commit sent just
    # before the deadline still finds its hold.
    hold_margin_ms: int = 150
    # Sampled bidding (power of d choices): workers are in bid_shards shards per region; a
    # bid goes to bid_sample random shards, then to the whole region if they had nothing.
    # 0 shards (the default): every bid goes to the whole region. Suppliers must be started
    # with the same --bid-shards.
    bid_shards: int = 0
    bid_sample: int = 2
    # Workers may keep a bid waiting for held capacity this fraction of the deadline (they say
    # so with a Waiting reply, and the auction listens while any worker waits); the rest of
    # the deadline is left for the commit.
    wait_ratio: float = 0.8


class _Mailbox:
    """Replies to one auction's inbox: a deque and at most one waiter (no task per wait)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Msg] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, msg: Msg) -> None:
        self.items.append(msg)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, within_s: float) -> bool:
        """Wait up to ``within_s`` for a reply; False if none came."""
        if self.items:
            return True
        if within_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(within_s, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        return bool(self.items)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(slots=True)
class _Tally:
    """What happened in one auction, for the Unfilled reply and the logs."""

    offers: int = 0
    below_min: int = 0
    commits: int = 0
    rejections: list[str] = field(default_factory=list)
    waited: int = 0  # workers that said they were waiting for held capacity
    sampled: bool = False  # the bid went to sampled shards (not yet to the whole region)
    fallbacks: int = 0
    unverified: int = 0  # offers dropped: not signed by the key trusted for their worker


class Auctioneer:
    """Runs auctions on one NATS connection. Concurrent runs of the same order id share
    one auction (in this process), so a duplicate can never place a second machine.

    With ``trust`` (worker id -> public key), only offers signed by their worker's key are
    taken; the others are logged (``offer_unverified``), counted by reason in
    ``unverified``, and the auction goes on with the rest."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects | None = None,
        config: AuctionConfig | None = None,
        trust: TrustStore | None = None,
    ) -> None:
        self.nc = nc
        self.trust = trust
        # Offers dropped by the signature check, by reason (exchange/signing.py).
        self.unverified: Counter[str] = Counter()
        self.subjects = subjects or Subjects()
        self.config = config or AuctionConfig()
        self._inflight: dict[str, tuple[PlaceOrder, asyncio.Future[Placed | Unfilled]]] = {}
        self._boxes: dict[str, _Mailbox] = {}
        self._sub: Subscription | None = None
        self._prefix = ""

    async def run(self, order: PlaceOrder, spent_ms: float = 0.0) -> Placed | Unfilled:
        """Run the auction for ``order``. Raises ConflictingOrder if an auction for the same
        order id but a different order (region, resources, image...) is under way here.
        ``spent_ms``: time the order already waited (for admission): the auction's deadline
        is what is left of the order's."""
        running = self._inflight.get(order.order_id)
        if running is not None:
            first, fut = running
            if msgspec.structs.replace(first, retry=order.retry) != order:  # retry: a hint
                raise ConflictingOrder(
                    f"order id {order.order_id!r} is already in use by a different order "
                    f"(region {first.region!r}) that is being placed now"
                )
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[order.order_id] = (order, fut)
        try:
            result = await self._run(order, spent_ms)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: a lone failed duplicate-free run logs nothing extra
            raise
        finally:
            del self._inflight[order.order_id]
        fut.set_result(result)
        return result

    async def _inbox(self) -> str:
        """One wildcard inbox subscription per Auctioneer; each auction gets a token under it."""
        if self._sub is None:
            prefix = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(prefix + ".*", cb=self._route)
            self._prefix = prefix
        return self._prefix

    async def _route(self, msg: Msg) -> None:
        box = self._boxes.get(msg.subject[len(self._prefix) + 1 :])
        if box is not None:
            box.put(msg)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _run(self, order: PlaceOrder, spent_ms: float = 0.0) -> Placed | Unfilled:
        if not self.nc.is_connected:
            raise AuctionError("not connected to NATS: refusing to send a bid that may go stale")
        t0 = time.monotonic()
        deadline = t0 + max(1.0, order.deadline_ms - spent_ms) / 1000.0
        cfg = self.config
        auction_id = str(ULID())
        tally = _Tally()
        olog = log.bind(order_id=order.order_id, region=order.region)
        prefix = await self._inbox()
        box = self._boxes[auction_id] = _Mailbox()
        bid = Bid(
            order_id=order.order_id,
            region=order.region,
            resources=order.resources,
            image=order.image,
            constraints=order.constraints,
            exclude_workers=order.exclude_workers,
            hold_ms=order.deadline_ms + int(cfg.commit_grace_ms) + cfg.hold_margin_ms,
            auction_id=auction_id,
            wait_ms=int(order.deadline_ms * cfg.wait_ratio),
        )
        heap: list[tuple[float, int, Offer]] = []
        waiting: dict[str, float] = {}  # worker id -> until when it may still offer
        tally.sampled = bool(cfg.bid_shards and cfg.bid_sample < cfg.bid_shards)
        excluded = set(order.exclude_workers)
        reply = f"{prefix}.{auction_id}"
        data = encode(bid)
        try:
            targets = await self._publish_bid(order, data, reply)
            empty = 0  # targets that answered 503: nobody listens there
            last_offer = t0
            # A retry commits a new machine only after this: the worker that placed the
            # order before answers with its machine meanwhile, whatever its offer delay.
            gather_s = min(cfg.quiet_ms, order.deadline_ms / 2) / 1000.0 if order.retry else 0
            gather_until = t0 + gather_s
            while True:
                # Take every offer already queued, so we commit the best of them.
                while box.items:
                    msg = box.items.popleft()
                    if msg.headers and msg.headers.get("Status") == "503":
                        empty += 1
                        if empty < targets:
                            continue
                        if tally.sampled:  # the sampled shards are empty: ask the region
                            targets, empty = await self._broadcast(order, data, reply, tally)
                            continue
                        return self._unfilled(
                            order, "no_workers", tally, t0, f"no worker listens in {order.region!r}"
                        )
                    offer = self._accept(order, msg.data, excluded, tally, waiting)
                    if offer is None:
                        continue
                    if offer.machine_id:
                        return self._existing(order, offer, t0)
                    heapq.heappush(heap, (-offer.score, tally.offers, offer))
                    last_offer = time.monotonic()
                if heap and time.monotonic() >= gather_until:
                    _, _, offer = heapq.heappop(heap)
                    result = await self._commit(order, offer, deadline, tally, t0, olog)
                    if result is not None:
                        return result
                    continue
                horizon = last_offer + cfg.quiet_ms / 1000.0
                if waiting:
                    horizon = max(horizon, max(waiting.values()))
                if heap:  # a retry still gathering
                    horizon = gather_until
                wait = min(deadline, horizon) - time.monotonic()
                if not await box.wait(wait):
                    if heap and time.monotonic() < deadline:
                        continue  # a retry's gathering is over: commit the best offer
                    if tally.sampled and not tally.offers and time.monotonic() < deadline:
                        # the sampled shards had nothing: ask the whole region before giving up
                        targets, empty = await self._broadcast(order, data, reply, tally)
                        last_offer = time.monotonic()
                        continue
                    break
            return self._unfilled(order, self._reason(tally), tally, t0, self._detail(order, tally))
        finally:
            del self._boxes[auction_id]
            await self._release(order, auction_id)

    async def _publish_bid(self, order: PlaceOrder, data: bytes, reply: str) -> int:
        """Send the bid to the whole region, or (sampled bidding) to ``bid_sample`` of its
        ``bid_shards`` shards: the image's home shard and others drawn from the ORDER id
        (subjects.sampled_shards: a retry asks the same shards, so the worker that already
        placed it is asked again, I3). Returns the subjects count."""
        cfg = self.config
        region = order.region
        if not cfg.bid_shards or cfg.bid_sample >= cfg.bid_shards:
            await self.nc.publish(self.subjects.bid(region), data, reply=reply)
            return 1
        shards = sampled_shards(order.order_id, order.image, cfg.bid_shards, cfg.bid_sample)
        for shard in shards:
            await self.nc.publish(self.subjects.bid_shard(region, shard), data, reply=reply)
        return len(shards)

    async def _broadcast(
        self, order: PlaceOrder, data: bytes, reply: str, tally: _Tally
    ) -> tuple[int, int]:
        tally.sampled = False
        tally.fallbacks += 1
        await self.nc.publish(self.subjects.bid(order.region), data, reply=reply)
        return 1, 0

    def _accept(
        self,
        order: PlaceOrder,
        data: bytes,
        excluded: set[str],
        tally: _Tally,
        waiting: dict[str, float],
    ) -> Offer | None:
        """Decode and vet a bid reply; an Offer we may take, else None (a Waiting only
        updates ``waiting``)."""
        try:
            offer = decode(data, BidReply)
        except BadMessage as exc:
            log.warning("bad_offer", order_id=order.order_id, error=str(exc))
            return None
        if offer.order_id != order.order_id or offer.region != order.region:
            # I5: an offer from another region (or for another order) is never taken.
            log.warning(
                "foreign_offer",
                order_id=order.order_id,
                worker_id=offer.worker_id,
                offer_region=offer.region,
                offer_order=offer.order_id,
            )
            return None
        if isinstance(offer, Offer) and not self._verified(order, offer, tally):
            return None
        if isinstance(offer, Offer) and offer.machine_id:
            return offer  # this order already has a machine: I3 outranks exclude_workers
        if offer.worker_id in excluded:
            return None
        if isinstance(offer, Waiting):
            if offer.wait_ms:
                tally.waited += 1
                waiting[offer.worker_id] = time.monotonic() + offer.wait_ms / 1000.0
            else:
                waiting.pop(offer.worker_id, None)
            return None
        waiting.pop(offer.worker_id, None)
        tally.offers += 1
        if offer.score < order.min_score and not offer.machine_id:
            tally.below_min += 1
            return None
        return offer

    def _verified(self, order: PlaceOrder, offer: Offer, tally: _Tally) -> bool:
        """With a trust file: is the offer signed by its worker's key? If not, someone
        answered for a worker without its key (or altered the offer): it is never taken,
        not even a machine_id claim (that would skip the commit)."""
        if self.trust is None:
            return True
        why = self.trust.check(offer)
        if why is None:
            return True
        tally.unverified += 1
        self.unverified[why] += 1
        log.warning(
            "offer_unverified",
            order_id=order.order_id,
            worker_id=offer.worker_id,
            reason=why,
            signer=offer.signer,
        )
        return False

    async def _commit(
        self,
        order: PlaceOrder,
        offer: Offer,
        deadline: float,
        tally: _Tally,
        t0: float,
        olog: structlog.typing.FilteringBoundLogger,
    ) -> Placed | Unfilled | None:
        """Commit one offer: Placed, an Unfilled (unclear commit), or None to try the next."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return self._unfilled(
                order, "deadline", tally, t0, "the deadline passed before a commit could start"
            )
        tally.commits += 1
        commit = Commit(
            order_id=order.order_id,
            worker_id=offer.worker_id,
            resources=order.resources,
            image=order.image,
            metadata=order.metadata,
        )
        subject = self.subjects.commit(offer.worker_id)
        try:
            msg = await self.nc.request(
                subject, encode(commit), timeout=remaining + self.config.commit_grace_ms / 1000.0
            )
            reply = decode(msg.data, CommitReply)
        except nats.errors.NoRespondersError:
            tally.rejections.append(f"{offer.worker_id}: gone")
            return None
        except (TimeoutError, nats.errors.TimeoutError):
            release = Release(order_id=order.order_id, worker_id=offer.worker_id, abort_commit=True)
            await self.nc.publish(self.subjects.release(offer.worker_id), encode(release))
            olog.warning("commit_unanswered", worker_id=offer.worker_id)
            return self._unfilled(
                order,
                "deadline",
                tally,
                t0,
                f"worker {offer.worker_id} did not answer the commit in time; it was told to "
                "undo it",
            )
        except BadMessage as exc:
            tally.rejections.append(f"{offer.worker_id}: bad reply ({exc})")
            return None
        if isinstance(reply, Placed):
            if reply.region != order.region or reply.order_id != order.order_id:
                tally.rejections.append(f"{offer.worker_id}: placed in the wrong region/order")
                return None
            elapsed = round((time.monotonic() - t0) * 1000.0, 3)
            olog.info(
                "order_placed",
                worker_id=reply.worker_id,
                machine_id=reply.machine_id,
                score=offer.score,
                offers=tally.offers,
                elapsed_ms=elapsed,
            )
            return Placed(
                order_id=order.order_id,
                machine_id=reply.machine_id,
                worker_id=reply.worker_id,
                region=reply.region,
                score=offer.score,
                image_cached=offer.image_cached,
                elapsed_ms=elapsed,
                subscores=offer.subscores,
                existing=reply.existing,
            )
        what = reply.reason if isinstance(reply, Rejected) else f"error {reply.code}"
        tally.rejections.append(f"{offer.worker_id}: {what}")
        olog.info("commit_rejected", worker_id=offer.worker_id, reason=what)
        return None

    def _existing(self, order: PlaceOrder, offer: Offer, t0: float) -> Placed:
        """A worker already runs a machine for this order id (a retry): report that one."""
        assert offer.machine_id is not None
        return Placed(
            order_id=order.order_id,
            machine_id=offer.machine_id,
            worker_id=offer.worker_id,
            region=offer.region,
            score=offer.score,
            image_cached=offer.image_cached,
            elapsed_ms=round((time.monotonic() - t0) * 1000.0, 3),
            existing=True,
        )

    async def _release(self, order: PlaceOrder, auction_id: str) -> None:
        try:
            release = Release(order_id=order.order_id, auction_id=auction_id)
            await self.nc.publish(self.subjects.region_release(order.region), encode(release))
        except Exception as exc:  # connection lost: holds fall back to their TTL
            log.warning("release_failed", order_id=order.order_id, error=repr(exc))

    @staticmethod
    def _reason(t: _Tally) -> UnfilledReason:
        if t.commits:
            return "all_commits_rejected"
        if t.offers == 0:
            return "no_offers"
        if t.below_min == t.offers:
            return "below_min_score"
        return "deadline"

    @staticmethod
    def _detail(order: PlaceOrder, t: _Tally) -> str:
        if t.commits:
            return "commits rejected: " + ", ".join(t.rejections)
        if t.offers == 0 and t.waited:
            return (
                f"no worker in {order.region!r} could take {_describe(order)} in time: "
                f"{t.waited} waited for capacity held by other orders"
            )
        if t.offers == 0 and t.unverified:
            return (
                f"no worker in {order.region!r} can take {_describe(order)}: "
                f"{t.unverified} offer(s) failed the signature check"
            )
        if t.offers == 0:
            return f"no worker in {order.region!r} can take {_describe(order)}"
        if t.below_min == t.offers:
            return f"{t.offers} offer(s), all below min_score {order.min_score}"
        return "the deadline passed"

    def _unfilled(
        self, order: PlaceOrder, reason: UnfilledReason, t: _Tally, t0: float, detail: str
    ) -> Unfilled:
        elapsed = round((time.monotonic() - t0) * 1000.0, 3)
        log.info(
            "order_unfilled",
            order_id=order.order_id,
            region=order.region,
            reason=reason,
            offers=t.offers,
            commits_tried=t.commits,
            elapsed_ms=elapsed,
        )
        return Unfilled(
            order_id=order.order_id,
            region=order.region,
            reason=reason,
            offers=t.offers,
            commits_tried=t.commits,
            elapsed_ms=elapsed,
            detail=detail,
        )


def _describe(order: PlaceOrder) -> str:
    r = order.resources
    parts = [f"{r.cpus} cpus", f"{r.memory_mb} MiB"]
    if r.disk_mb:
        parts.append(f"{r.disk_mb} MiB disk")
    if r.gpus:
        parts.append(f"{r.gpus} gpus")
    if order.constraints:
        parts.append("constraints " + ",".join(f"{k}={v}" for k, v in order.constraints.items()))
    return " + ".join(parts)
