"""The supplier's desk: how a process answers a bid, as a pure core over its workers' ledgers.

No NATS, no timer, no task: every entry point takes the monotonic ``now`` (and the desk a
wall clock for ``hold_expires_at_ms``) and returns what to send: a bid's replies, each with
its inbox and delay, and how they go out, as a :class:`Plan` of :class:`Post` s (prompt
answers, batched offers, replies alone: supplier/plans.py); the host (supplier/host.py,
supplier/replies.py) only decodes, asks the desk and performs the plan. What a worker is,
for the desk, is a :class:`Seat` (supplier/seat.py): its ledger, pricer, labels, images,
drain flag, machines by order and the queue of bids waiting for its held capacity. The
desk also keeps what its process's auctions told it: who placed each order (a retry must
price that worker: I3), which auctions were released (a bid that comes after its release
is ignored) and which workers each auction asked (its release reaches those).

Answering one bid (docs/protocol.md §6.2), per candidate worker: first what a bid changes,
then the chain of checks (supplier/feasible.py), once:

    an earlier hold for the order    -> dropped (a re-bid replaces it; bids waiting on the
                                        worker may take that capacity first), unless its
                                        commit is under way
    expired holds                    -> dropped (their hold_expired events are returned)
    the order's machine is here      -> Offer{machine_id}, at once, no hold (EXISTING),
                                        unless it is being reclaimed (RECLAIMING) or
                                        destroyed by an abort (UNDOING): silent
    any other reason in the chain    -> silent with it (COMMITTING, DRAINING, EXCLUDED,
                                        CONSTRAINT_MISMATCH, INSUFFICIENT, BLOCKED when
                                        only holds are in the way, CANNOT_RUN, TOO_SMALL,
                                        IMAGE_TOO_BIG)
    otherwise                        -> a Quote (a score; nothing held yet)

then across the candidates: the best ``max_offers`` quotes hold and offer (delay
``(1 - score) * spread_ms``; the rest OUTRANKED); only when no candidate offers at all,
up to ``max_offers`` BLOCKED workers keep the bid and answer ``Waiting`` (§6.3). A hold
lasts the bid's ``hold_ms``, capped at the worker's ``max_hold_ms`` (its config, default
5 s): a bid cannot lock a worker's capacity longer than its supplier allows.

Explaining an order ("why not", §4.15) runs the same chain on EVERY worker it is given,
read-only (supplier/explain.py): :meth:`Desk.explain` returns one ``WorkerVerdict`` per
worker with all its reasons and their numbers, or the score and subscores it would offer
with; :func:`explanation_pages` cuts them into reply pages.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from bourse.wire.limits import MAX_HOLD_MS
from bourse.wire.messages import (
    Bid,
    Offer,
    Waiting,
    WorkerVerdict,
    now_ms,
)
from bourse.wire.resources import Vec, leq
from supplier.candidates import DEFAULT_QUOTE_SAMPLE, BidGroup
from supplier.explain import IMAGE_NOT_CACHED, explanation_pages, verdict
from supplier.feasible import (
    BLOCKED,
    CHECKS,
    EXISTING,
    FEASIBLE,
    INSUFFICIENT,
    Check,
    OrderLike,
    first_failure,
    wanted,
)
from supplier.ledger import Hold
from supplier.plans import Answer, Plan, Post, Send, Shape, due, late, plan, prompt, still_due
from supplier.pricing import ImageCost
from supplier.seat import MAX_WAITING, S, Seat, WaitingBid, WaitingBids

# The desk's face: what the host and the supplier's other modules use of it, wherever it
# lives (the seat, the plans, the explanations: supplier/seat.py, plans.py, explain.py).
__all__ = [
    "DEFAULT_MAX_OFFERS",
    "IMAGE_NOT_CACHED",
    "MAX_WAITING",
    "OUTRANKED",
    "TOMBSTONE_TTL_S",
    "Answer",
    "Desk",
    "Plan",
    "Post",
    "Quote",
    "Seat",
    "Send",
    "Shape",
    "WaitingBid",
    "WaitingBids",
    "explanation_pages",
    "prompt",
]

# Beside the chain's reasons (supplier/feasible.py): a worker that could offer, silent
# because the process offered its best max_offers only.
OUTRANKED = "outranked"

# A process offers at most this many of its workers per bid (the best-scoring); 0: all.
DEFAULT_MAX_OFFERS = 3
# A region release can overtake its own bid (they travel on two subscriptions): released
# (order, auction) pairs are remembered this long, and such late bids ignored.
TOMBSTONE_TTL_S = 5.0


class Quote:
    """A worker's price for a bid, before anything is held."""

    __slots__ = ("image", "score", "want")

    def __init__(self, score: float, image: ImageCost, want: Vec) -> None:
        self.score = score
        self.image = image
        self.want = want


class Desk(Generic[S]):
    """Answers bids for the workers of one process (see the module doc)."""

    def __init__(
        self,
        max_offers: int = DEFAULT_MAX_OFFERS,
        quote_sample: int = DEFAULT_QUOTE_SAMPLE,
        wall_ms: Callable[[], int] = now_ms,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        # The best this many quotes hold and offer per bid (0: every worker that fits).
        self.max_offers = max_offers
        # Past 2 x this many workers in a bid group, price a sample (supplier/candidates.py).
        self.quote_sample = quote_sample
        self.wall_ms = wall_ms  # for hold_expires_at_ms (the buyer's clock is wall time)
        self.max_waiting = max_waiting
        # order id -> the worker here that placed it (a retry must price that one: I3)
        self.owners: dict[str, S] = {}
        # (order, auction) -> when it was released: a bid of it that comes later is late
        self.released: OrderedDict[tuple[str, str], float] = OrderedDict()
        # (order, auction) -> (when, the workers asked to hold or wait for it): a release of
        # the auction touches those, not every worker of the region in this process
        self.asked: OrderedDict[tuple[str, str], tuple[float, list[S]]] = OrderedDict()

    # -- one bid ----------------------------------------------------------------------------
    def answer(self, bid: Bid, inbox: str, now: float, group: BidGroup[S]) -> Answer[S]:
        """Price the bid on the group's candidates (all of a small group, a sample of a big
        one, then all if the sample had nothing to offer at once; the worker that placed the
        order among them: I3), then hold and offer only the best ``max_offers`` (holding on
        every worker of a big process would only lock capacity and flood the auction).
        Workers blocked only by holds wait, but only when no worker here can offer at once.
        A bid whose auction was released already is ignored."""
        key = (bid.order_id, bid.auction_id)
        if key in self.released:
            return Answer(ignored=True)
        ans: Answer[S] = Answer()
        quotes: list[tuple[float, int, S, Quote]] = []
        blocked: list[S] = []
        image = bid.image_digest or bid.image  # the image index's key (supplier/images.py)
        workers = group.candidates(
            bid.order_id, image, self.owners.get(bid.order_id), self.quote_sample
        )
        want = wanted(bid)
        self._quote_all(bid, want, inbox, now, workers, quotes, blocked, ans)
        if not quotes and not ans.replies and workers is not group.workers:
            blocked.clear()  # the sample had nothing to offer at once: ask everyone here
            ans.silent.clear()
            self._quote_all(bid, want, inbox, now, group.workers, quotes, blocked, ans)
        if quotes:
            quotes.sort(key=lambda x: (x[0], x[1]))
            best = quotes[: self.max_offers or None]
            for _, _, w, q in best:
                self._hold(w, bid, inbox, now, q, ans)
            for _, _, w, _ in quotes[len(best) :]:
                ans.silent[w.worker_id] = OUTRANKED
        elif not ans.replies:
            for w in blocked[: self.max_offers or None]:
                waiting = self._wait(w, bid, inbox, now)
                if waiting is None:
                    continue
                ans.replies.append(Send(0.0, inbox, bid.auction_id, waiting, w))
                del ans.silent[w.worker_id]
        for w, old in ans.replaced.values():  # not held again for this bid: put back
            if bid.order_id not in w.ledger.holds:
                w.ledger.hold(old)  # unless waiting bids took the capacity meanwhile
        ans.replies.sort(key=_by_delay)
        self._asked(key, now, ans.replies)
        return ans

    def plan(self, bid: Bid, inbox: str, ans: Answer[S]) -> Plan[S]:
        """How the replies of ``ans`` go out (supplier/plans.py ``plan``)."""
        return plan(bid, inbox, ans)

    @staticmethod
    def late(sends: Iterable[Send[S]]) -> list[Post[S]]:
        """Replies to waiting bids, each alone at its delay (supplier/plans.py ``late``)."""
        return late(sends)

    @staticmethod
    def due(post: Post[S]) -> list[Send[S]] | None:
        """The replies of ``post`` still worth sending now (supplier/plans.py ``due``)."""
        return due(post)

    @staticmethod
    def still_due(send: Send[S]) -> bool:
        """Is a delayed reply still worth sending (supplier/plans.py ``still_due``)?"""
        return still_due(send)

    def _asked(self, key: tuple[str, str], now: float, replies: list[Send[S]]) -> None:
        """Remember the workers that hold or wait for the auction: its release goes there."""
        if not replies:
            return
        asked = self.asked.get(key)
        if asked is None:
            asked = self.asked[key] = (now, [])
        asked[1].extend(r.worker for r in replies)

    # -- what the process's auctions told it -----------------------------------------------------
    def placed(self, order_id: str, w: S) -> None:
        """``w`` placed the order's machine (a commit, or one found at start)."""
        self.owners[order_id] = w

    def release(self, order_id: str, auction_id: str, now: float, region: Iterable[S]) -> None:
        """A region release (§6.6): remembered a while (a late bid of that auction is
        ignored); the workers asked to hold or wait for the auction drop it, or every
        worker of ``region`` here for a release of any auction of the order."""
        key = (order_id, auction_id)
        self.released[key] = now
        asked = self.asked.pop(key, None)
        workers = (asked[1] if asked else ()) if auction_id else region
        for w in workers:
            w.release(order_id, auction_id)

    def forget(self, now: float) -> None:
        """Forget releases older than TOMBSTONE_TTL_S, and the workers asked by auctions
        that never released (their exchange died) once no hold of theirs can be alive."""
        _forget(self.released, now - TOMBSTONE_TTL_S, float)
        _forget(self.asked, now - MAX_HOLD_MS / 1000.0, lambda a: a[0])

    def _quote_all(
        self,
        bid: Bid,
        want: Vec,
        inbox: str,
        now: float,
        workers: list[S],
        quotes: list[tuple[float, int, S, Quote]],
        blocked: list[S],
        ans: Answer[S],
    ) -> None:
        for i, w in enumerate(workers):
            q = self.quote(w, bid, now, ans, want)
            if isinstance(q, Quote):
                quotes.append((-q.score, i, w, q))
            elif isinstance(q, Offer):  # this order already has a machine there
                ans.replies.append(Send(0.0, inbox, bid.auction_id, q, w))
            else:
                ans.silent[w.worker_id] = q
                if q == BLOCKED:
                    blocked.append(w)

    def quote(self, w: S, bid: Bid, now: float, ans: Answer[S], want: Vec) -> Offer | Quote | str:
        """One worker's price for a bid, nothing held: an Offer for a machine the order
        already has there, a Quote, or the reason it stays silent. First, what a bid
        changes: the order's earlier hold is dropped (a re-bid) and so are expired holds,
        what that causes recorded in ``ans``; then the whole chain of checks, once."""
        ledger = w.ledger
        old = ledger.holds.get(bid.order_id)
        if old is not None and not old.committing:  # (a commit under way: the chain says)
            ledger.drop(bid.order_id)  # a re-bid replaces the earlier hold...
            if old.auction_id != bid.auction_id and old.expires_at > now:
                ans.replaced[w.worker_id] = (w, old)  # ...kept by the new one (Hold.replaced)
            ans.late += self.freed(w, now)  # ...and waiting bids may take it first
        if ledger.holds:  # (none: nothing to expire; most workers of a big group)
            before = ledger.free
            gone = ledger.expire(now)
            if gone:
                ans.expired.append((w, gone))
            if ledger.freer_than(before):
                ans.late += self.freed(w, now)
        q = self._price(w, bid, want, CHECKS)
        return self._existing(w, bid) if q == EXISTING else q

    @staticmethod
    def _existing(w: S, bid: Bid) -> Offer:
        """The order's machine on ``w``, offered to this bid's auction (handed out: I3)."""
        m = w.machine_for(bid.order_id)
        assert m is not None, "the chain said EXISTING"
        w.hand_out(bid.order_id)
        return Offer(
            order_id=bid.order_id,
            worker_id=w.worker_id,
            region=w.region,
            score=m.score,
            image_cached=w.has_image(m),
            machine_id=m.machine_id,
            auction_id=bid.auction_id,
        )

    @staticmethod
    def _price(w: S, bid: Bid, want: Vec, checks: Sequence[Check] = FEASIBLE) -> Quote | str:
        """The checks on what is free now (a waiting bid's: the feasible stage only), then
        the score (no subscores: only the workers offered need them)."""
        ledger = w.ledger
        reason = first_failure(checks, w, bid, want, ledger.free)
        if reason is not None:
            return reason
        image = w.image_cost(bid)
        score, _ = w.pricer.price(ledger.capacity, ledger.used, want, image, False)
        return Quote(score, image, want)

    def _hold(self, w: S, bid: Bid, inbox: str, now: float, q: Quote, ans: Answer[S]) -> None:
        replaced = ans.replaced.get(w.worker_id)
        offered = self.take(w, bid, now, q, replaced[1] if replaced else None)
        if offered is None:  # cannot happen after a quote at the same now; stay safe (I1)
            ans.silent[w.worker_id] = INSUFFICIENT
        else:
            offer, delay = offered
            ans.replies.append(Send(delay, inbox, bid.auction_id, offer, w))

    def take(
        self, w: S, bid: Bid, now: float, q: Quote, replaced: Hold | None = None
    ) -> tuple[Offer, float] | None:
        """Hold the quoted resources and make the Offer and its delay. Only now, for the
        workers actually offered, are the subscores worked out. ``replaced``: another
        auction's live hold for the order that this bid took the place of."""
        ledger = w.ledger
        _, subscores = w.pricer.price(ledger.capacity, ledger.used, q.want, q.image)
        hold_ms = min(bid.hold_ms, w.max_hold_ms)  # the supplier bounds holds, not the bid
        hold = Hold(
            bid.order_id,
            q.want,
            now + hold_ms / 1000.0,
            q.score,
            subscores,
            q.image.cached,
            bid.auction_id,
            replaced,
            bid.constraints,
        )
        if not ledger.hold(hold):
            return None
        offer = Offer(
            order_id=bid.order_id,
            worker_id=w.worker_id,
            region=w.region,
            score=q.score,
            subscores=subscores,
            image_cached=q.image.cached,
            hold_expires_at_ms=self.wall_ms() + hold_ms,
            auction_id=bid.auction_id,
        )
        return offer, w.pricer.delay_s(q.score)

    def _wait(self, w: S, bid: Bid, inbox: str, now: float) -> Waiting | None:
        """Keep a bid blocked only by holds, if the bidder allows waiting."""
        if bid.wait_ms and inbox and len(w.waiting) < self.max_waiting:
            w.waiting.append(WaitingBid(bid, inbox, now + bid.wait_ms / 1000.0))
            return _waiting(w, bid, bid.wait_ms)
        return None

    # -- "why not" ------------------------------------------------------------------------------
    @staticmethod
    def explain(order: OrderLike, now: float, workers: Iterable[S]) -> list[WorkerVerdict]:
        """Each worker's verdict on the order, as :meth:`answer` would decide it at ``now``
        but for every worker (no sample, no ``max_offers``) and read-only
        (supplier/explain.py ``verdict``)."""
        return [verdict(w, order, now) for w in workers]

    # -- capacity changes ---------------------------------------------------------------------
    def freed(self, w: S, now: float) -> list[Send[S]]:
        """Capacity came back on ``w`` (a hold released or expired, a machine destroyed, a
        commit smaller than its hold, a drain lifted): answer its waiting bids that fit now,
        oldest first; withdraw (``Waiting{0}``) those committed machines made hopeless."""
        if not w.waiting:
            return []
        sends: list[Send[S]] = []
        keep: deque[WaitingBid] = deque()
        held = w.ledger.holds
        for wb in w.waiting.take_all():
            bid = wb.bid
            if wb.until <= now or bid.order_id in held:
                continue  # too late, or the order holds here by now (through its own bid)
            q = self._price(w, bid, wanted(bid))
            if q == BLOCKED:
                keep.append(wb)
                continue
            offered = self.take(w, bid, now, q) if isinstance(q, Quote) else None
            if offered is not None:
                sends.append(Send(offered[1], wb.inbox, bid.auction_id, offered[0], w, prompt(bid)))
            else:  # committed machines took the capacity: the auction need not wait
                sends.append(Send(0.0, wb.inbox, bid.auction_id, _waiting(w, bid, 0), w))
        for wb in keep:
            w.waiting.append(wb)
        return sends

    @staticmethod
    def withdraw_hopeless(w: S) -> list[Send[S]]:
        """Committed machines grew on ``w``: bids that could not fit even if every hold went
        away are withdrawn (``Waiting{0}``), so their auctions stop waiting for it."""
        if not w.waiting:
            return []
        free = w.ledger.free_of_committed
        sends: list[Send[S]] = []
        for wb in w.waiting.take_all():
            if leq(wanted(wb.bid), free):
                w.waiting.append(wb)
            else:
                sends.append(Send(0.0, wb.inbox, wb.bid.auction_id, _waiting(w, wb.bid, 0), w))
        return sends


def _waiting(w: Seat, bid: Bid, wait_ms: int) -> Waiting:
    return Waiting(order_id=bid.order_id, worker_id=w.worker_id, region=w.region, wait_ms=wait_ms)


def _by_delay(s: Send[S]) -> float:
    return s.delay_s


V = TypeVar("V")


def _forget(
    memory: OrderedDict[tuple[str, str], V], cutoff: float, at: Callable[[V], float]
) -> None:
    """Drop the entries of ``memory`` from its oldest on while their time (``at``) is at or
    before ``cutoff``."""
    while memory and at(next(iter(memory.values()))) <= cutoff:
        memory.popitem(last=False)
