"""The immediate-or-cancel auction as a pure state machine (sans-I/O, like h11).

One ``Auction`` per run of an order. It never touches NATS, a timer or a clock: the
auctioneer (``bourse/auction/auctioneer.py``, its NATS shell) feeds it events with the
current monotonic time and performs the decisions it returns, in order.

Events in (methods):

- ``start()``: the bid to send (``SendBid``).
- ``bid_published(now)``: a bid (first or fallback) went out; the quiet window counts from it.
- ``bid_reply(data, now, no_responders=...)``: one message on the auction's inbox (an
  ``Offers`` message is taken as its offers one by one, in order).
- ``poll(now)``: every queued reply has been fed; what next? (commit, or wake me at t).
- ``timer(now)``: the wake time came and no reply did.
- ``commit_outcome(outcome, now)``: how the commit of ``SendCommit`` ended.
- ``machine_shown(machine, now)``: what the worker showed for ``VerifyMachine``.

Decisions out: ``SendBid``, ``BroadcastBid`` (sampled fallback), ``SendCommit``,
``VerifyMachine`` (show me the machine of an existing-machine offer), ``Refuse`` (the order
id names a different order: the auctioneer raises ConflictingOrder), ``PublishAbort`` (Release
abort_commit), ``Log`` (a structlog event the auctioneer emits with
``order_id`` and ``region`` bound), ``WakeAt`` and ``Finish`` (Placed or Unfilled). The
auctioneer stops at ``Finish``.

Not a decision: the region-wide ``Release{order_id, auction_id}`` on the way out. It must
go out whatever happens, exceptions included, so it is the auctioneer's ``finally``
(docs/protocol.md §5.2 step 8).

The steps, reasons and details are those of docs/protocol.md §5.2-§5.4.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from bourse.auction.content import CATALOG, ImageContent
from bourse.errors import BourseError
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import (
    Bid,
    BidReply,
    Commit,
    Error,
    Machine,
    Offer,
    Offers,
    Placed,
    PlaceOrder,
    Rejected,
    Release,
    Resources,
    Unfilled,
    UnfilledReason,
    Waiting,
    worker_of_machine,
)
from bourse.wire.resources import format_cpus, millis_of, vec
from bourse.wire.subjects import Subjects, sampled_shards

# The signature check of an offer: None if it is trusted, else why not (a reason constant
# of bourse/wire/signing.py). ``TrustStore.check`` is one.
TrustCheck = Callable[[Offer], str | None]

DEADLINE_BEFORE_COMMIT = "the deadline passed before a commit could start"

# Why an existing-machine offer was dropped (counted with the signature reasons in
# ``Tally.unverified``): its machine id names another worker, or the machine its worker
# reports is not this order's (or the worker could not show it).
FOREIGN_MACHINE = "foreign_machine"
NOT_THIS_ORDER = "machine_not_this_order"
MACHINE_UNSHOWN = "machine_not_shown"


@dataclass(frozen=True, slots=True)
class AuctionConfig:
    """The auction's knobs (docs/protocol.md §5.1)."""

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
    # How long a worker has to show the machine of its existing-machine offer (machine.get)
    # before the offer is dropped; bounded by the order's deadline.
    verify_timeout_ms: float = 1000.0
    # Bids say the auction takes Offers messages (several offers in one reply, §4.4.2), so a
    # supplier process answers a bid with one message instead of one per worker.
    batch_offers: bool = True
    # With batch_offers: bids ask for prompt answers (§4.4.3). Suppliers skip their
    # score-spread delays and say who they are; the auction ranks the offers itself and
    # commits the best once every process it knows in the region has answered.
    prompt_offers: bool = True
    # With prompt_offers: bids and region releases to a region whose every known supplier
    # process takes Batch messages are sent together, one loop turn later (§4.4.4).
    batch_bids: bool = True


class AuctionStateError(BourseError, RuntimeError):
    """An event the auction cannot take in its current state (an auctioneer bug)."""


# -- decisions -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendBid:
    """Publish ``bid`` to each subject (the region's, or the sampled shards'), replies to
    the auction's inbox; a sampled bid's replies to one reply subject per shard
    (``shards``, in the order of ``subjects``), so the auction knows which shard answered."""

    subjects: tuple[str, ...]
    bid: Bid
    shards: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BroadcastBid:
    """Sampled bidding found nothing: publish the same bid to the whole region."""

    subject: str
    bid: Bid


@dataclass(frozen=True, slots=True)
class SendCommit:
    """Request ``commit`` from worker ``worker_id``; feed the outcome to ``commit_outcome``."""

    worker_id: str
    subject: str
    commit: Commit
    timeout_s: float


@dataclass(frozen=True, slots=True)
class PublishAbort:
    """Tell a worker whose commit went unanswered to undo it (no reply)."""

    subject: str
    release: Release


@dataclass(frozen=True, slots=True)
class VerifyMachine:
    """Ask worker ``worker_id`` for machine ``machine_id`` (``machine.get`` on the worker's
    own subject, which only its user may serve) before an existing-machine offer is taken;
    feed the answer to ``machine_shown``."""

    worker_id: str
    subject: str
    machine_id: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Refuse:
    """The order id already names a different order (its machine was placed for other
    parameters): refuse the order, naming the mismatch (the id is an idempotency key)."""

    detail: str


@dataclass(frozen=True, slots=True)
class Log:
    """A structlog event to emit (``order_id`` and ``region`` are bound by the auctioneer)."""

    level: Literal["info", "warning"]
    event: str
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Call ``timer`` at monotonic time ``at`` unless a reply comes first."""

    at: float


@dataclass(frozen=True, slots=True)
class Finish:
    """The auction's answer to the buyer."""

    result: Placed | Unfilled


Decision = (
    SendBid
    | BroadcastBid
    | SendCommit
    | VerifyMachine
    | Refuse
    | PublishAbort
    | Log
    | WakeAt
    | Finish
)


# -- commit outcomes (events) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommitAnswered:
    """The worker answered the commit with a decodable reply."""

    reply: Placed | Rejected | Error


@dataclass(frozen=True, slots=True)
class CommitNoResponders:
    """Nobody serves the worker's commit subject (it is gone)."""


@dataclass(frozen=True, slots=True)
class CommitTimedOut:
    """No answer within the commit's timeout."""


@dataclass(frozen=True, slots=True)
class CommitUndecodable:
    """The reply was not a CommitReply; ``detail`` says why."""

    detail: str


CommitOutcome = CommitAnswered | CommitNoResponders | CommitTimedOut | CommitUndecodable

# What a worker showed for an existing-machine offer: its Machine record, or None (an
# Error, no answer in time, nobody serving the worker, an undecodable reply).
MachineShown = Machine | None


# -- the state machine ----------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What happened in one auction, for the Unfilled reply and the logs."""

    offers: int = 0
    below_min: int = 0
    commits: int = 0
    rejections: list[str] = field(default_factory=list)
    waited: int = 0  # workers that said they were waiting for held capacity
    # supplier processes that answered a prompt bid (Offers.responder), and answers that
    # named no process (an older or foreign supplier): the auctioneer learns the region's
    # processes from them
    responders: set[str] = field(default_factory=set)
    # of them, those that answered a sampled bid, per shard (the auctioneer learns each shard's
    # processes from them, §5.3a)
    shard_responders: dict[int, set[str]] = field(default_factory=dict)
    anonymous: int = 0
    batching: set[str] = field(default_factory=set)  # of them, those that take Batch messages
    fallbacks: int = 0  # sampled bids that went on to the whole region
    unverified: Counter[str] = field(default_factory=Counter)  # dropped offers, by reason


Phase = Literal["new", "collecting", "committing", "done"]


class Auction:
    """One run of the auction for ``order``, started at monotonic time ``now``.

    ``spent_ms``: time the order already waited (admission); the auction's deadline is what
    is left of the order's. ``trust``: with it, only offers it accepts are taken.
    ``responders``: the names of the supplier processes known to answer a bid to the
    whole region (empty: not known); ``shard_responders``: per shard of the region, the
    names of those known to answer a sampled bid to it (a shard not in it: not known). The
    quorum waits for these names: a process it does not know answering does not stand in
    for a known one that has not (that one's hold could outlive a folded release).
    ``content``: what the order's image resolved to where it entered (§4.3a): the bid
    carries its digest and layers, the commit its digest."""

    def __init__(
        self,
        order: PlaceOrder,
        config: AuctionConfig,
        auction_id: str,
        now: float,
        *,
        subjects: Subjects | None = None,
        trust: TrustCheck | None = None,
        spent_ms: float = 0.0,
        responders: Collection[str] = frozenset(),
        shard_responders: Mapping[int, Collection[str]] | None = None,
        content: ImageContent = CATALOG,
    ) -> None:
        self.order = order
        self.content = content
        self.config = config
        self.auction_id = auction_id
        self.subjects = subjects or Subjects()
        self.trust = trust
        self.tally = Tally()
        self.phase: Phase = "new"
        self.t0 = now
        self.deadline = now + max(1.0, order.deadline_ms - spent_ms) / 1000.0
        # A retry commits a new machine only after this: the worker that placed the order
        # before answers with its machine meanwhile, whatever its offer delay (§5.3).
        gather_ms = min(config.quiet_ms, order.deadline_ms / 2) if order.retry else 0.0
        self.gather_until = now + gather_ms / 1000.0
        self.last_offer = now
        self.sampled = bool(config.bid_shards and config.bid_sample < config.bid_shards)
        self.bid = self._make_bid()
        self._excluded = set(order.exclude_workers)
        self._heap: list[tuple[float, int, Offer]] = []
        self._waiting: dict[str, float] = {}  # worker id -> until when it may still offer
        self._targets = 0  # subjects the bid went to
        self._empty = 0  # of them, answered 503: nobody listens there
        self._committing: Offer | None = None
        self._verifying: Offer | None = None
        # Prompt answers (§4.4.3): the supplier processes expected to answer a region-wide
        # bid (learned by the auctioneer; 0: unknown) and, per kept offer, when it would have
        # arrived with its supplier's delay.
        self.responders: Collection[str] = responders if self.bid.prompt_offers else ()
        # A sampled bid's shards. Per reply subject (a shard, or None: the region's), the
        # processes expected to answer there (a sampled bid's shards: none unless every
        # shard's are known), how many of them have not yet, and the processes heard there,
        # so a fallback broadcast waits for the region's anew.
        self.shards: tuple[int, ...] = ()
        self._expected: dict[int | None, Collection[str]] = {}
        if self.responders:
            self._expected[None] = self.responders
        if self.sampled:
            n = config.bid_shards
            self.shards = tuple(sampled_shards(order.order_id, order.image, n, config.bid_sample))
            # looked up per shard: never len() or bool() of the auctioneer's lazy mapping
            if shard_responders is not None and self.bid.prompt_offers:
                expected: dict[int | None, Collection[str]] = {
                    k: shard_responders.get(k, ()) for k in self.shards
                }
                if all(expected.values()):
                    self._expected.update(expected)
        self._missing: dict[int | None, int] = {k: len(v) for k, v in self._expected.items()}
        self._heard: dict[int | None, set[str]] = {}
        self._ready: dict[int, float] = {}
        # Who offered (named prompt answers): worker id -> its process, and the processes
        # that offered anything. A commit may then ask the winner's process to drop the
        # other holds itself (Commit.release_others) and the region release is not needed.
        self._process_of: dict[str, str] = {}
        self._offering: set[str] = set()
        self._release_folded = False
        # what the commit under way asked of its process (Commit.release_others)
        self._commit_releases = False

    # -- events ----------------------------------------------------------------------------

    def start(self) -> list[Decision]:
        """The bid: to the whole region, or (sampled bidding) to ``bid_sample`` of its
        ``bid_shards`` shards, drawn from the ORDER id so a retry asks the same shards and
        the worker that already placed it is asked again (I3)."""
        self._expect("new")
        self.phase = "collecting"
        region = self.order.region
        if self.sampled:
            subjects = tuple(self.subjects.bid_shard(region, k) for k in self.shards)
        else:
            subjects = (self.subjects.bid(region),)
        self._targets, self._empty = len(subjects), 0
        return [SendBid(subjects, self.bid, self.shards)]

    def bid_published(self, now: float) -> None:
        """A bid went out: the quiet window counts from here."""
        self.last_offer = now

    def bid_reply(
        self, data: bytes, now: float, *, no_responders: bool = False, shard: int | None = None
    ) -> list[Decision]:
        """One reply on the auction's inbox (``no_responders``: a 503 status); ``shard``:
        it came on the reply subject of that shard of a sampled bid."""
        self._expect("collecting")
        if no_responders:
            return self._no_responders(now)
        try:
            reply: Offer | Offers | Waiting = decode(data, BidReply)
        except BadMessage as exc:
            return [Log("warning", "bad_offer", {"error": str(exc)})]
        if isinstance(reply, Offers):
            return self.offers(reply, now, shard)
        if isinstance(reply, Offer) and self.bid.prompt_offers:
            self.tally.anonymous += 1  # a supplier that does not answer promptly
        return self._reply(reply, now)

    def offers(self, reply: Offers, now: float, shard: int | None = None) -> list[Decision]:
        """One process's Offers (on the inbox, or out of an Answers message, §4.4.4): each
        offer as if it came alone. ``shard``: it answered the bid to that shard."""
        self._expect("collecting")
        if reply.responder:
            self.tally.responders.add(reply.responder)
            heard = self._heard.get(shard)
            if heard is None:
                heard = self._heard[shard] = set()
            if reply.responder not in heard:
                heard.add(reply.responder)
                if reply.responder in self._expected.get(shard, ()):
                    self._missing[shard] -= 1
            if shard is not None:
                self.tally.shard_responders[shard] = heard  # the same set
            if reply.batches:
                self.tally.batching.add(reply.responder)
            if reply.offers:
                self._offering.add(reply.responder)
            for offer in reply.offers:
                self._process_of[offer.worker_id] = reply.responder
        elif self.bid.prompt_offers:
            self.tally.anonymous += 1
        decisions: list[Decision] = []
        for offer in reply.offers:
            decisions += self._reply(offer, now)
        return decisions

    def _reply(self, reply: Offer | Waiting, now: float) -> list[Decision]:
        """One offer or waiting note, checked on its own (region, order, signature, owner)."""
        if reply.order_id != self.order.order_id or reply.region != self.order.region:
            return [self._foreign(reply)]  # I5: never taken
        if isinstance(reply, Offer):
            why = self.trust(reply) if self.trust is not None else None
            if why is not None:
                return [self._unverified(reply, why)]
            if reply.machine_id:  # I3 outranks exclude_workers and min_score
                return self._existing(reply, now)
        if reply.worker_id in self._excluded:
            return []
        if isinstance(reply, Waiting):
            self._note_waiting(reply, now)
        else:
            self._take(reply, now)
        return []

    def poll(self, now: float) -> list[Decision]:
        """Every queued reply was fed: commit the best offer, or say when to wake."""
        self._expect("collecting")
        if self._heap:
            at = self._commit_at()
            if now >= at:
                return self._commit_best(now)
            return [WakeAt(min(self.deadline, at))]
        if self.sampled and not self.tally.offers and not self._waiting and self._all_answered():
            return self._broadcast()  # every process of the shards answered, with nothing
        return [WakeAt(min(self.deadline, self._horizon()))]

    def _commit_at(self) -> float:
        """When the offers in hand may be committed: after a retry's gathering, and once
        every expected process has answered or the earliest offer's supplier delay has
        passed (as if the suppliers had waited it out themselves, §4.4.3)."""
        at = self.gather_until
        if self._ready and not self._all_answered():
            at = max(at, min(self._ready.get(n, -math.inf) for _, n, _ in self._heap))
        return at

    def _alone(self, offer: Offer) -> bool:
        """Did every offer come from ``offer``'s process, with every known process heard
        and nobody waiting? Then that process can drop the order's other holds itself."""
        process = self._process_of.get(offer.worker_id)
        return (
            process is not None
            and self._offering == {process}
            and self._all_answered()
            and not self.tally.anonymous
            and not self.tally.waited
            and not self.tally.fallbacks
        )

    @property
    def release_needed(self) -> bool:
        """Must the auctioneer publish the region release on the way out? Not after a Placed
        whose commit asked its process to drop the other holds (§4.6 ``release_others``)."""
        return not self._release_folded

    def _all_answered(self) -> bool:
        """Has every process known to have got the bid answered it: on the shards of a
        sampled bid, every one known in each shard; else every one known in the region
        (answers to the sampled bid before a fallback broadcast do not count)."""
        missing = self._missing
        if self.sampled:
            return bool(self.shards) and all(missing.get(k, 1) == 0 for k in self.shards)
        return missing.get(None, 1) == 0

    def timer(self, now: float) -> list[Decision]:
        """The wake time came with no reply: commit (a retry's gathering is over), ask the
        whole region (sampled shards had nothing), or end with the §5.4 reason."""
        self._expect("collecting")
        if self._heap and now < self.deadline:
            return self.poll(now)
        if self.sampled and not self.tally.offers and now < self.deadline:
            return self._broadcast()
        return self._unfilled(self._reason(), self._detail(), now)

    def machine_shown(self, machine: MachineShown, now: float) -> list[Decision]:
        """The answer to the last ``VerifyMachine``: the existing machine is taken only if
        its worker shows it placed for this order id with this order's parameters; one
        placed for other parameters refuses the order; anything else drops the offer (counted
        like an unverified one) and the auction goes on."""
        self._expect("collecting")
        offer = self._verifying
        if offer is None:
            raise AuctionStateError(f"auction {self.auction_id}: no machine is being verified")
        self._verifying = None
        order = self.order
        if (
            machine is None
            or machine.machine_id != offer.machine_id
            or machine.worker_id != offer.worker_id
        ):
            return [self._unverified(offer, MACHINE_UNSHOWN)]
        if machine.order_id != order.order_id:
            return [self._unverified(offer, NOT_THIS_ORDER)]
        mismatch = order_mismatch(order, machine)
        if mismatch:
            return [
                Log("warning", "order_id_reused", {"machine_id": machine.machine_id}),
                Refuse(
                    f"order id {order.order_id!r} was placed as machine {machine.machine_id} "
                    f"for a different order ({mismatch}): an order id names one order (use a "
                    "new id for a new order)"
                ),
            ]
        placed = Placed.of_offer(
            offer, elapsed_ms=self._elapsed(now), image_digest=machine.image_digest
        )
        return self._finish(placed)

    def commit_outcome(self, outcome: CommitOutcome, now: float) -> list[Decision]:
        """The commit of the last ``SendCommit`` ended (§5.2 step 6 table). An empty list
        (or logs only): go on collecting and try the next best offer."""
        self._expect("committing")
        offer = self._committing
        assert offer is not None  # set with the "committing" phase
        self._committing = None
        self.phase = "collecting"
        worker = offer.worker_id
        if isinstance(outcome, CommitAnswered):
            return self._answered(offer, outcome.reply, now)
        if isinstance(outcome, CommitNoResponders):
            self.tally.rejections.append(f"{worker}: gone")
            return []
        if isinstance(outcome, CommitUndecodable):
            self.tally.rejections.append(f"{worker}: bad reply ({outcome.detail})")
            return []
        abort = Release(order_id=self.order.order_id, worker_id=worker, abort_commit=True)
        detail = f"worker {worker} did not answer the commit in time; it was told to undo it"
        return [
            PublishAbort(self.subjects.release(worker), abort),
            Log("warning", "commit_unanswered", {"worker_id": worker}),
            *self._unfilled("deadline", detail, now),
        ]

    # -- steps -----------------------------------------------------------------------------

    def _make_bid(self) -> Bid:
        order, cfg = self.order, self.config
        return Bid(
            order_id=order.order_id,
            region=order.region,
            resources=order.resources,
            image=order.image,
            constraints=order.constraints,
            exclude_workers=order.exclude_workers,
            hold_ms=order.deadline_ms + int(cfg.commit_grace_ms) + cfg.hold_margin_ms,
            auction_id=self.auction_id,
            wait_ms=int(order.deadline_ms * cfg.wait_ratio),
            batch_offers=cfg.batch_offers,
            prompt_offers=cfg.batch_offers and cfg.prompt_offers,
            image_digest=self.content.digest,
            layers=self.content.layers,
            ports=order.ports,
        )

    def _no_responders(self, now: float) -> list[Decision]:
        """A 503: that subject has no listener. Once every target said so, a sampled bid
        goes to the whole region; a region without listeners is no_workers."""
        self._empty += 1
        if self._empty < self._targets:
            return []
        if self.sampled:
            return self._broadcast()
        return self._unfilled("no_workers", f"no worker listens in {self.order.region!r}", now)

    def _broadcast(self) -> list[Decision]:
        self.sampled = False
        self.tally.fallbacks += 1
        self._targets, self._empty = 1, 0
        return [BroadcastBid(self.subjects.bid(self.order.region), self.bid)]

    def _foreign(self, reply: Offer | Waiting) -> Log:
        fields: dict[str, object] = {
            "worker_id": reply.worker_id,
            "offer_region": reply.region,
            "offer_order": reply.order_id,
        }
        return Log("warning", "foreign_offer", fields)

    def _unverified(self, offer: Offer, why: str) -> Log:
        """Signed for another key (or altered), or claiming a machine that is not its
        worker's or not this order's: never taken (a machine_id claim skips the commit)."""
        self.tally.unverified[why] += 1
        fields: dict[str, object] = {
            "worker_id": offer.worker_id,
            "reason": why,
            "signer": offer.signer,
        }
        if offer.machine_id:
            fields["machine_id"] = offer.machine_id
        return Log("warning", "offer_unverified", fields)

    def _existing(self, offer: Offer, now: float) -> list[Decision]:
        """An offer claiming the order already runs on the offer's worker. Its machine id
        must name that worker (a supplier may not hand out another worker's machine); then
        the worker is asked to show the machine, and only a machine of this order is taken."""
        machine_id = offer.machine_id or ""
        if worker_of_machine(machine_id) != offer.worker_id:
            return [self._unverified(offer, FOREIGN_MACHINE)]
        if self._verifying is not None:
            return []  # one at a time; the worker that placed it offers again on a retry
        self._verifying = offer
        timeout = max(0.0, min(self.deadline - now, self.config.verify_timeout_ms / 1000.0))
        subject = self.subjects.worker_machine(offer.worker_id, "get")
        return [VerifyMachine(offer.worker_id, subject, machine_id, timeout)]

    def _note_waiting(self, reply: Waiting, now: float) -> None:
        if reply.wait_ms:
            self.tally.waited += 1
            self._waiting[reply.worker_id] = now + reply.wait_ms / 1000.0
        else:
            self._waiting.pop(reply.worker_id, None)

    def _take(self, offer: Offer, now: float) -> None:
        """Count the offer; keep it for a commit unless it is below min_score."""
        self._waiting.pop(offer.worker_id, None)
        self.tally.offers += 1
        if offer.score < self.order.min_score:
            self.tally.below_min += 1
            return
        heapq.heappush(self._heap, (-offer.score, self.tally.offers, offer))
        if offer.delay_ms:  # a prompt answer: it counts from its supplier's delay
            self._ready[self.tally.offers] = now + offer.delay_ms / 1000.0
        self.last_offer = now

    def _horizon(self) -> float:
        """Until when to listen: the quiet window after the last offer, longer while a
        worker waits for capacity; a retry with offers in hand listens to its gather end."""
        if self._heap:
            return self.gather_until
        horizon = self.last_offer + self.config.quiet_ms / 1000.0
        if self._waiting:
            horizon = max(horizon, max(self._waiting.values()))
        return horizon

    def _commit_best(self, now: float) -> list[Decision]:
        _, n, offer = heapq.heappop(self._heap)
        self._ready.pop(n, None)
        remaining = self.deadline - now
        if remaining <= 0:
            return self._unfilled("deadline", DEADLINE_BEFORE_COMMIT, now)
        self.tally.commits += 1
        self.phase = "committing"
        self._committing = offer
        self._commit_releases = self._alone(offer)
        commit = Commit(
            order_id=self.order.order_id,
            worker_id=offer.worker_id,
            resources=self.order.resources,
            image=self.order.image,
            metadata=self.order.metadata,
            auction_id=self.auction_id,
            release_others=self._commit_releases,
            image_digest=self.content.digest,
            ports=self.order.ports,
            env=self.order.env,
            checks=self.order.checks,
            restart=self.order.restart,
        )
        timeout = remaining + self.config.commit_grace_ms / 1000.0
        return [SendCommit(offer.worker_id, self.subjects.commit(offer.worker_id), commit, timeout)]

    def _answered(
        self, offer: Offer, reply: Placed | Rejected | Error, now: float
    ) -> list[Decision]:
        worker = offer.worker_id
        if isinstance(reply, Placed):
            if reply.region != self.order.region or reply.order_id != self.order.order_id:
                self.tally.rejections.append(f"{worker}: placed in the wrong region/order")
                return []
            if reply.worker_id != worker or worker_of_machine(reply.machine_id) != worker:
                # only worker's own user may answer its commit: a reply naming another
                # worker's machine is not believed (a forged reply in the auction's inbox)
                self.tally.rejections.append(f"{worker}: placed a machine not its own")
                return []
            placed = Placed.of_commit(reply, offer, elapsed_ms=self._elapsed(now))
            # the region release is folded only if the commit asked for it, whatever the
            # auction has heard since
            self._release_folded = self._commit_releases
            fields: dict[str, object] = {
                "worker_id": placed.worker_id,
                "machine_id": placed.machine_id,
                "score": offer.score,
                "offers": self.tally.offers,
                "elapsed_ms": placed.elapsed_ms,
            }
            return [Log("info", "order_placed", fields), *self._finish(placed)]
        what = reply.reason if isinstance(reply, Rejected) else f"error {reply.code}"
        self.tally.rejections.append(f"{worker}: {what}")
        return [Log("info", "commit_rejected", {"worker_id": worker, "reason": what})]

    def _reason(self) -> UnfilledReason:
        t = self.tally
        if t.commits:
            return "all_commits_rejected"
        if t.offers == 0:
            return "no_offers"
        if t.below_min == t.offers:
            return "below_min_score"
        return "deadline"

    def _detail(self) -> str:
        t, order = self.tally, self.order
        if t.commits:
            return "commits rejected: " + ", ".join(t.rejections)
        if t.offers == 0 and t.waited:
            return (
                f"no worker in {order.region!r} could take {describe(order)} in time: "
                f"{t.waited} waited for capacity held by other orders"
            )
        unverified = sum(t.unverified.values())
        if t.offers == 0 and unverified:
            owned = sum(t.unverified[r] for r in OWNERSHIP_REASONS)
            what = (
                "the signature check"
                if not owned
                else f"the ownership check ({owned} claimed a machine not theirs)"
                if owned == unverified
                else f"the signature or ownership check ({owned} claimed a machine not theirs)"
            )
            return (
                f"no worker in {order.region!r} can take {describe(order)}: "
                f"{unverified} offer(s) failed {what}"
            )
        if t.offers == 0:
            # What the auction knows is that nobody offered; why not is the workers' to say
            # (an explain of the order, which a client asks for on no_offers, §4.15).
            return (
                f"no worker in {order.region!r} offered {describe(order)} of image {order.image!r}"
            )
        if t.below_min == t.offers:
            return f"{t.offers} offer(s), all below min_score {order.min_score}"
        return "the deadline passed"

    def _unfilled(self, reason: UnfilledReason, detail: str, now: float) -> list[Decision]:
        t = self.tally
        unfilled = Unfilled(
            order_id=self.order.order_id,
            region=self.order.region,
            reason=reason,
            offers=t.offers,
            commits_tried=t.commits,
            elapsed_ms=self._elapsed(now),
            detail=detail,
        )
        fields: dict[str, object] = {
            "reason": reason,
            "offers": t.offers,
            "commits_tried": t.commits,
            "elapsed_ms": unfilled.elapsed_ms,
        }
        return [Log("info", "order_unfilled", fields), *self._finish(unfilled)]

    def _finish(self, result: Placed | Unfilled) -> list[Decision]:
        self.phase = "done"
        return [Finish(result)]

    def _elapsed(self, now: float) -> float:
        return round((now - self.t0) * 1000.0, 3)

    def _expect(self, phase: Phase) -> None:
        if self.phase != phase:
            raise AuctionStateError(f"auction {self.auction_id} is {self.phase}, not {phase}")


OWNERSHIP_REASONS = (FOREIGN_MACHINE, NOT_THIS_ORDER, MACHINE_UNSHOWN)


def late_releases(data: bytes | Offers, order_id: str, auction_id: str) -> list[Release]:
    """A reply that came after its auction ended with the region release folded into the
    commit (§4.6 ``release_others``): a supplier process the auction did not know took a
    hold, or parked a waiting bid, that nothing else would drop before its TTL. One
    worker-form ``Release`` of ``(order_id, auction_id)`` per worker it names for this
    order (§4.11); none for an existing machine's offer (it holds nothing), a foreign or
    undecodable reply, or an empty answer."""
    if isinstance(data, Offers):
        reply: Offer | Offers | Waiting = data
    else:
        try:
            reply = decode(data, BidReply)
        except BadMessage:
            return []
    named = reply.offers if isinstance(reply, Offers) else [reply]
    workers = dict.fromkeys(
        r.worker_id
        for r in named
        if r.order_id == order_id and not (isinstance(r, Offer) and r.machine_id)
    )
    return [Release(order_id=order_id, worker_id=w, auction_id=auction_id) for w in workers]


# How much longer than its bid's hold_ms an auction that folded its release is remembered
# for a late reply (a process may get the bid late; it holds for hold_ms from then).
FOLDED_MARGIN_S = 5.0


class FoldedAuctions:
    """The auctions that folded their region release into the commit (§4.6), each
    remembered while a hold taken for its bid can live: until ``hold_ms`` +
    ``FOLDED_MARGIN_S`` after it ended. A reply that reaches an auction past its end asks
    :meth:`order_of`; a remembered auction's reply gets its workers a release
    (:func:`late_releases`). Each :meth:`fold` forgets expired auctions from the oldest
    on, up to the first one still live: with one ``hold_ms`` (an exchange's usual case) it
    holds what the last ``hold_ms`` + margin folded; an auction with a longer hold keeps
    those folded after it until it expires too (:meth:`order_of` still says no for them)."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        # auction id -> (order id, until when), in the order folded: an OrderedDict, so
        # that forgetting the oldest is O(1) (a dict's first key is found by a scan)
        self._until: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def fold(self, auction_id: str, order_id: str, hold_ms: int, now: float) -> None:
        until = self._until
        while until and next(iter(until.values()))[1] < now:
            until.popitem(last=False)
        until[auction_id] = (order_id, now + hold_ms / 1000.0 + FOLDED_MARGIN_S)

    def order_of(self, auction_id: str, now: float) -> str | None:
        """The order ``auction_id`` placed, if it folded its release and a hold of its bid
        may still be live at ``now``; else None."""
        entry = self._until.get(auction_id)
        if entry is None or entry[1] < now:
            return None
        return entry[0]


def order_mismatch(order: PlaceOrder, machine: Machine) -> str:
    """How a machine placed under ``order``'s id differs from ``order`` (what it runs and
    where: region, resources, image, metadata, the constraints when its worker recorded
    them; how it was auctioned may differ), or ""."""
    diffs = []
    if machine.region != order.region:
        diffs.append(f"region {machine.region!r}, not {order.region!r}")
    if vec(machine.resources) != vec(order.resources):  # 2 CPUs, with or without cpu_millis
        diffs.append(f"{_res(machine.resources)}, not {_res(order.resources)}")
    if machine.image != order.image:
        diffs.append(f"image {machine.image!r}, not {order.image!r}")
    if dict(machine.metadata) != dict(order.metadata):
        diffs.append("other metadata")
    if machine.constraints is not None and dict(machine.constraints) != dict(order.constraints):
        diffs.append(
            f"constraints {_labels(machine.constraints)}, not {_labels(order.constraints)}"
        )
    return "; ".join(diffs)


def _labels(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"


def _res(r: Resources) -> str:
    parts = [f"{format_cpus(millis_of(r))} cpus", f"{r.memory_mb} MiB"]
    if r.disk_mb:
        parts.append(f"{r.disk_mb} MiB disk")
    if r.gpus:
        parts.append(f"{r.gpus} gpus")
    return " + ".join(parts)


def describe(order: PlaceOrder) -> str:
    """The order's request in words, for Unfilled details: ``2 cpus + 512 MiB + ...``."""
    parts = [_res(order.resources)]
    if order.constraints:
        parts.append("constraints " + ",".join(f"{k}={v}" for k, v in order.constraints.items()))
    return " + ".join(parts)
