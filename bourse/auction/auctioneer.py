"""The auction's NATS shell: runs the pure cores (the decisions) on one connection (the
messages). The exchange runs it, and so can a buyer directly against the suppliers
("direct" mode).

The auctioneer only moves messages, in two loops. The claim's (``_claimed``) performs what
``bourse.auction.claiming.Claiming`` decides about the order id's claim: the KV requests
and their answers, pauses, the auction to run and the order's end. The auction's
(``_drive``) feeds the replies the inbox (``bourse.auction.inbox``) routed to its mailbox to
``bourse.auction.core.Auction``, performs what it decides (publish the bid, request a
commit, publish an abort, log), sleeps until the core's wake time or the next reply, and
feeds the clock. On the way out, whatever happened, ONE publish to
``<root>.release.<region>`` drops every other hold of the auction (docs/protocol.md §5.2
step 8), after the claim's outcome is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from ulid import ULID

from bourse.auction.batches import BatchSender
from bourse.auction.claim_steps import (
    BackOff,
    ClaimRequest,
    ClaimStep,
    NoRoom,
    OpenClaims,
    ReadClaim,
    RemoveClaim,
    RunAuction,
    RunUnclaimed,
    Unavailable,
    Unrecorded,
    WriteClaim,
)
from bourse.auction.claim_store import KV_ERRORS, ClaimBucket, ClaimStore
from bourse.auction.claiming import Claiming
from bourse.auction.claims import fingerprint
from bourse.auction.content import CATALOG, ImageContent
from bourse.auction.core import (
    Auction,
    AuctionConfig,
    BroadcastBid,
    CommitAnswered,
    CommitNoResponders,
    CommitOutcome,
    CommitTimedOut,
    CommitUndecodable,
    Decision,
    Finish,
    Log,
    MachineShown,
    PublishAbort,
    Refuse,
    SendBid,
    SendCommit,
    VerifyMachine,
    WakeAt,
)
from bourse.auction.errors import AuctionError, ConflictingOrder, StoreFull, UnrecordedPlacement
from bourse.auction.inbox import Inbox, Mailbox, reply_shard, shard_token
from bourse.auction.responders import Responders
from bourse.auction.room import ClaimLimits, no_room, store_full_detail
from bourse.errors import BourseError
from bourse.nats.scatter import no_responders
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import (
    BatchBid,
    CommitReply,
    Error,
    Machine,
    MachineRequest,
    Offers,
    Placed,
    PlaceOrder,
    Rejected,
    Release,
    Unfilled,
)
from bourse.wire.signing import TrustStore
from bourse.wire.subjects import Subjects

__all__ = [
    "AuctionConfig",
    "AuctionError",
    "Auctioneer",
    "ConflictingOrder",
    "StoreFull",
    "UnrecordedPlacement",
]

log = structlog.get_logger("bourse.auction")
BoundLogger = structlog.typing.FilteringBoundLogger


NOT_CONNECTED = "not connected to NATS: refusing to send a bid that may go stale"


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
        claims: bool = True,
        claim_store: ClaimStore | None = None,
        claim_limits: ClaimLimits = ClaimLimits(),
    ) -> None:
        self.nc = nc
        self.trust = trust
        # Offers dropped by the signature check, by reason (bourse/wire/signing.py).
        self.unverified: Counter[str] = Counter()
        self.subjects = subjects or Subjects()
        self.config = config or AuctionConfig()
        # Order claims in JetStream KV: on when the server has JetStream, found out at the
        # first order; ``claims`` False: never (per-process deduplication only).
        # ``claim_store``: an open bucket to use (tests put a faulty one under it);
        # ``claim_limits``: the limits of a bucket this process creates.
        self.bucket = ClaimBucket(nc, self.subjects, claims, claim_store, claim_limits)
        self._inflight: dict[str, tuple[PlaceOrder, asyncio.Future[Placed | Unfilled]]] = {}
        self.inbox = Inbox(nc, self.subjects)
        # Told (region, offers received) as each auction ends: the exchange's metrics.
        self.on_finished: Callable[[str, int], None] | None = None
        # Who answers each region's bids: the quorum of prompt answers (§4.4.3, §5.3a)
        # and whether bids go in batches there (§4.4.4).
        self.responders = Responders()
        # The batches' sender: its flusher starts with the inbox and ends with close.
        self.batches = BatchSender(nc, self.subjects)

    async def run(
        self, order: PlaceOrder, spent_ms: float = 0.0, content: ImageContent = CATALOG
    ) -> Placed | Unfilled:
        """Run the auction for ``order``. Raises ConflictingOrder if an auction for the same
        order id but a different order (region, resources, image...) is under way here,
        AuctionError if it cannot run (not connected, or the order's claim could not be
        written in its time), UnrecordedPlacement if it placed a
        machine that its claim could not be made to name. A ``Placed`` is returned only
        once the claim names its machine (acknowledged by the server).
        ``spent_ms``: time the order already waited (for admission): the auction's deadline
        is what is left of the order's. ``content``: what the order's image resolved to
        where it entered (§4.3a), which its bid and commit carry."""
        running = self._inflight.get(order.order_id)
        if running is not None:
            first, fut = running
            # the same order is what claims call the same (its fingerprint: what is placed);
            # deadline, min_score, exclude_workers and retry may differ between attempts
            if fingerprint(first) != fingerprint(order):
                raise ConflictingOrder(
                    f"order id {order.order_id!r} is already in use by a different order "
                    f"(region {first.region!r}) that is being placed now"
                )
            joined = await asyncio.shield(fut)
            if isinstance(joined, Placed) and not joined.existing:  # the other attempt's
                return msgspec.structs.replace(joined, existing=True)
            return joined
        fut = asyncio.get_running_loop().create_future()
        self._inflight[order.order_id] = (order, fut)
        try:
            result = await self._claimed(order, spent_ms, content)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: a lone failed duplicate-free run logs nothing extra
            raise
        finally:
            del self._inflight[order.order_id]
        fut.set_result(result)
        return result

    async def close(self) -> None:
        await self.batches.close()
        await self.inbox.close()
        await self.bucket.close()

    def batching(self, region: str) -> bool:
        """Bids and releases to ``region`` go in batches (§4.4.4): every supplier process
        known there takes them (and none answers without a name)."""
        return (
            self.config.batch_bids
            and self.config.prompt_offers
            and self.responders.take_batches(region, time.monotonic())
        )

    def expected_responders(self, region: str) -> frozenset[str]:
        """The supplier processes that answer a bid in ``region`` (empty: not known, or
        some supplier there does not answer promptly)."""
        return self.responders.expected(region, time.monotonic())

    def expected_shard_responders(self, region: str) -> Mapping[int, frozenset[str]] | None:
        """Per shard of ``region``, the supplier processes that answer a sampled bid there;
        None where no bid is sampled, or none is known."""
        if not self.config.bid_shards:
            return None
        return self.responders.expected_per_shard(region, time.monotonic())

    async def claims(self) -> ClaimStore | None:
        """The claims bucket, opened at the first call (None: no JetStream, or off)."""
        return await self.bucket.open()

    async def _claimed(
        self, order: PlaceOrder, spent_ms: float, content: ImageContent
    ) -> Placed | Unfilled:
        """The auction under the order id's claim (docs/protocol.md §5.3c): what
        ``Claiming`` decides, performed, until the order's end."""
        if not self.nc.is_connected:
            raise AuctionError(NOT_CONNECTED)
        # Opening the bucket (once per process, creating it the first time) is not the
        # order's time: the deadline starts after it. An open that failed is tried again
        # within the deadline (OpenClaims).
        if self.bucket.store is None:
            with contextlib.suppress(*KV_ERRORS):
                await self.bucket.open()
        opened = self.bucket.store is not None
        await self.bucket.look()
        olog = log.bind(order_id=order.order_id, region=order.region)
        later: list[str] = []  # the auction's region release, once the outcome is recorded
        full = self.bucket.admit()
        try:
            claim = Claiming(
                order, self.config, str(ULID()), spent_ms=spent_ms, opened=opened, full=full
            )
            todo = deque(claim.start())
            while True:  # the most frequent steps first: this runs for every order
                d = todo.popleft()
                if isinstance(d, ClaimRequest):
                    todo.extend(await self._request(d, claim))
                elif isinstance(d, RunAuction):
                    todo.extend(await self._auction(d, claim, content, olog, later))
                elif isinstance(d, Finish):
                    return d.result
                elif isinstance(d, Log):
                    getattr(olog, d.level)(d.event, **d.fields)
                elif isinstance(d, BackOff):
                    await asyncio.sleep(d.until - time.monotonic())  # a failed request's pause
                    todo.extend(claim.woke())
                elif isinstance(d, RunUnclaimed):  # no claims on this server
                    return await self._run(order, d.spent_ms, content, olog=olog)
                elif isinstance(d, NoRoom):
                    if d.refused:
                        self.bucket.refused(d.why)
                    raise StoreFull(store_full_detail(d.why))
                else:
                    raise _refusal(d)
        finally:
            if not full:
                self.bucket.ended()
            while later:
                await self._release(order, later.pop())

    async def _auction(
        self,
        d: RunAuction,
        claim: Claiming,
        content: ImageContent,
        olog: BoundLogger,
        later: list[str],
    ) -> list[ClaimStep]:
        """The auction under the claim; what the claim decides of its end."""
        try:
            result = await self._run(d.order, d.spent_ms, content, claim.auction_id, olog, later)
        except ConflictingOrder as exc:
            return claim.refused(str(exc))
        return claim.ended(result)

    async def _request(self, d: ClaimRequest, claim: Claiming) -> list[ClaimStep]:
        """One KV request of the claim's; what the claim decides of its answer."""
        store, order_id = self.bucket.store, claim.order.order_id
        try:
            if isinstance(d, OpenClaims):
                return claim.opened(await self.bucket.open() is not None)
            assert store is not None  # asked for only once the bucket is open
            if isinstance(d, WriteClaim):
                return claim.written(await store.put(order_id, d.claim, d.revision, d.timeout_s))
            if isinstance(d, ReadClaim):
                return claim.read(*await store.get(order_id))
            if isinstance(d, RemoveClaim):
                await store.remove(order_id, d.revision)
                return claim.removed()
            await store.changed(order_id, d.revision, d.until - time.monotonic())
            return claim.changed()
        except KV_ERRORS as exc:
            return claim.failed(str(exc) or type(exc).__name__, no_room(exc))

    async def _run(
        self,
        order: PlaceOrder,
        spent_ms: float,
        content: ImageContent,
        auction_id: str | None = None,
        olog: BoundLogger | None = None,
        later: list[str] | None = None,
    ) -> Placed | Unfilled:
        """One auction. Its region release (when needed) is published on the way out, or,
        with ``later``, for an auction that ended with an outcome, left to the caller
        (its auction id appended): the claim's write is then not queued behind every
        supplier process of the region handling the release (one process per worker on
        a few cores: ~2 ms at idle), and the holds it drops live one KV round trip more."""
        if not self.nc.is_connected:
            raise AuctionError(NOT_CONNECTED)
        auction_id = auction_id or str(ULID())
        check = self.trust.check if self.trust is not None else None
        core = Auction(
            order,
            self.config,
            auction_id,
            time.monotonic(),
            subjects=self.subjects,
            trust=check,
            spent_ms=spent_ms,
            responders=self.expected_responders(order.region),
            shard_responders=self.expected_shard_responders(order.region),
            content=content,
        )
        if not self.inbox.prefix:
            await self.inbox.open()
            self.batches.start(self.inbox.answers_to)
        box, reply_to = self.inbox.box(auction_id, core.shards)
        if olog is None:  # bound once per order: a bind costs a fresh logger each time
            olog = log.bind(order_id=order.order_id, region=order.region)
        ended = False
        try:
            result = await self._drive(core, box, reply_to, olog)
            ended = True
            return result
        finally:
            self.inbox.drop(auction_id, core.shards)
            self.responders.learn(order.region, core.tally, time.monotonic())
            self.unverified.update(core.tally.unverified)
            if self.on_finished is not None:
                self.on_finished(order.region, core.tally.offers)
            if not core.release_needed:  # the winner's process dropped the others itself
                await self.inbox.fold(auction_id, order.order_id, core.bid.hold_ms, box.items)
            elif ended and later is not None:
                later.append(auction_id)
            else:
                await self._release(order, auction_id)

    async def _drive(
        self, core: Auction, box: Mailbox, reply_to: str, olog: BoundLogger
    ) -> Placed | Unfilled:
        """Feed the core until it finishes, doing what it decides in order."""
        todo: deque[Decision] = deque(core.start())
        while True:
            if not todo:
                todo.extend(self._feed(core, box))
                continue
            d = todo.popleft()
            if isinstance(d, Finish):
                return d.result
            todo.extend(await self._perform(d, core, box, reply_to, olog))

    @staticmethod
    def _feed(core: Auction, box: Mailbox) -> list[Decision]:
        """The next queued reply; with none queued, ask what next. Queued replies go first,
        so a commit takes the best offer received so far."""
        if box.items:
            msg = box.items.popleft()
            if isinstance(msg, Offers):  # out of an Answers message
                return core.offers(msg, time.monotonic())
            shard = reply_shard(msg.subject) if core.shards else None
            return core.bid_reply(
                msg.data, time.monotonic(), no_responders=no_responders(msg), shard=shard
            )
        return core.poll(time.monotonic())

    async def _perform(
        self, d: Decision, core: Auction, box: Mailbox, reply_to: str, olog: BoundLogger
    ) -> list[Decision]:
        """Do one decision; what the core decides next, if the decision fed it an event."""
        if isinstance(d, Log):
            getattr(olog, d.level)(d.event, **d.fields)
        elif isinstance(d, SendBid | BroadcastBid):
            subjects = d.subjects if isinstance(d, SendBid) else (d.subject,)
            region = core.order.region
            if subjects == (self.subjects.bid(region),) and self.batching(region):
                self.batches.queue(region, bid=BatchBid(reply=reply_to, bid=d.bid))
            elif isinstance(d, SendBid) and d.shards:  # one reply subject per shard
                data = encode(d.bid)
                for subject, k in zip(subjects, d.shards, strict=True):
                    await self.nc.publish(subject, data, reply=shard_token(reply_to, k))
            else:
                data = encode(d.bid)
                for subject in subjects:
                    await self.nc.publish(subject, data, reply=reply_to)
            core.bid_published(time.monotonic())
        elif isinstance(d, SendCommit):
            outcome = await self._commit(d)
            return core.commit_outcome(outcome, time.monotonic())
        elif isinstance(d, PublishAbort):
            await self.nc.publish(d.subject, encode(d.release))
        elif isinstance(d, VerifyMachine):
            return core.machine_shown(await self._show(d), time.monotonic())
        elif isinstance(d, Refuse):
            raise ConflictingOrder(d.detail)
        elif isinstance(d, WakeAt) and not await self._replied(core, box, d.at):
            return core.timer(time.monotonic())  # a reply instead: _feed takes it
        return []

    @staticmethod
    async def _replied(core: Auction, box: Mailbox, at: float) -> bool:
        """Did a reply come by the wake time ``at``? With no offer in hand a late wake
        would end the auction no_offers: first, the replies a stall of this process held
        up (§5.2 step 7)."""
        if await box.wait(at - time.monotonic()):
            return True
        return not core.tally.offers and await box.wait_after_stall(at, core.deadline)

    async def _commit(self, d: SendCommit) -> CommitOutcome:
        """Request the commit; what came back, as the core's event."""
        try:
            msg = await self.nc.request(d.subject, encode(d.commit), timeout=d.timeout_s)
        except nats.errors.NoRespondersError:
            return CommitNoResponders()
        except (TimeoutError, nats.errors.TimeoutError):
            return CommitTimedOut()
        try:
            reply: Placed | Rejected | Error = decode(msg.data, CommitReply)
            return CommitAnswered(reply)
        except BadMessage as exc:
            return CommitUndecodable(str(exc))

    async def _show(self, d: VerifyMachine) -> MachineShown:
        """The worker's record of the machine of an existing-machine offer, or None."""
        try:
            req = encode(MachineRequest(machine_id=d.machine_id))
            msg = await self.nc.request(d.subject, req, timeout=d.timeout_s)
            return decode(msg.data, Machine)
        except (nats.errors.Error, TimeoutError, BadMessage):
            return None

    async def _release(self, order: PlaceOrder, auction_id: str) -> None:
        try:
            release = Release(order_id=order.order_id, auction_id=auction_id)
            if self.batching(order.region):
                self.batches.queue(order.region, release=release)
                return
            await self.nc.publish(self.subjects.region_release(order.region), encode(release))
        except Exception as exc:  # connection lost: holds fall back to their TTL
            log.warning("release_failed", order_id=order.order_id, error=repr(exc))


def _refusal(d: Refuse | Unavailable | Unrecorded) -> BourseError:
    """The error a claim's refusal is raised as."""
    if isinstance(d, Refuse):
        return ConflictingOrder(d.detail)
    if isinstance(d, Unavailable):
        return AuctionError(d.detail)
    return UnrecordedPlacement(d.placed, d.why)
