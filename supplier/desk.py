"""The supplier's desk: how a process answers a bid, as a pure core over its workers' ledgers.

No NATS, no timer, no task: every entry point takes the monotonic ``now`` (and the desk a
wall clock for ``hold_expires_at_ms``) and returns what to send: a bid's replies, each with
its inbox and delay, and how they go out, as a :class:`Plan` of :class:`Post` s (prompt
answers, batched offers, replies alone); the host (supplier/host.py, supplier/replies.py)
only decodes, asks the desk and performs the plan. What a worker is, for the desk, is a
:class:`Seat`: its ledger, pricer, labels, images, drain flag, machines by order and the
queue of bids waiting for its held capacity. The desk also keeps what its process's
auctions told it: who placed each order (a retry must price that worker: I3), which
auctions were released (a bid that comes after its release is ignored) and which workers
each auction asked (its release reaches those).

Answering one bid (docs/protocol.md §6.2), per candidate worker: first what a bid changes,
then the chain of checks (supplier/feasible.py), once:

    an earlier hold for the order    -> dropped (a re-bid replaces it; bids waiting on the
                                        worker may take that capacity first), unless its
                                        commit is under way
    expired holds                    -> dropped (their hold_expired events are returned)
    the order's machine is here      -> Offer{machine_id}, at once, no hold (EXISTING),
                                        unless it is being reclaimed (RECLAIMING)
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
read-only (nothing held, dropped or expired: the order's own hold and expired holds are left
out of what is free instead), collecting every reason: :meth:`Desk.explain` returns one
``WorkerVerdict`` per worker with all its reasons and their numbers, or the score and
subscores it would offer with; :func:`explanation_pages` cuts them into reply pages.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from bourse.wire.codec import encode
from bourse.wire.limits import MAX_BATCH_OFFERS, MAX_HOLD_MS
from bourse.wire.messages import (
    EXPLAIN_PAGE_BYTES,
    Bid,
    Explanation,
    Machine,
    Offer,
    Reason,
    Waiting,
    WorkerVerdict,
    now_ms,
)
from bourse.wire.paging import cut
from bourse.wire.resources import ZERO, Vec, leq, sub
from supplier.candidates import DEFAULT_QUOTE_SAMPLE, BidGroup
from supplier.feasible import (
    BLOCKED,
    CHECKS,
    EXISTING,
    FEASIBLE,
    INSUFFICIENT,
    STANDING,
    Check,
    OrderLike,
    WorkerView,
    every_failure,
    first_failure,
    wanted,
)
from supplier.ledger import Hold
from supplier.pricing import ImageCost, Pricer

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
# Not a decline: a price note in an explanation (the image term it forgoes).
IMAGE_NOT_CACHED = "image_not_cached"

# A process offers at most this many of its workers per bid (the best-scoring); 0: all.
DEFAULT_MAX_OFFERS = 3
# At most this many bids wait for held capacity on one worker; more are not answered.
MAX_WAITING = 1024
# A region release can overtake its own bid (they travel on two subscriptions): released
# (order, auction) pairs are remembered this long, and such late bids ignored.
TOMBSTONE_TTL_S = 5.0


class WaitingBid:
    """A bid kept by a worker until ``until`` (monotonic s), blocked only by holds."""

    __slots__ = ("bid", "inbox", "until")

    def __init__(self, bid: Bid, inbox: str, until: float) -> None:
        self.bid = bid
        self.inbox = inbox
        self.until = until


class WaitingBids:
    """One worker's waiting bids, oldest first (first come, first served)."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[WaitingBid] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[WaitingBid]:
        return iter(self._q)

    def append(self, w: WaitingBid) -> None:
        self._q.append(w)

    def take_all(self) -> deque[WaitingBid]:
        """Empty the queue; returns what it held (the caller puts back what still waits)."""
        q, self._q = self._q, deque()
        return q

    def drop(self, order_id: str, auction_id: str = "") -> None:
        """A release: forget the order's waiting bids (of that auction, if given)."""
        if self._q:
            self._q = deque(
                w
                for w in self._q
                if w.bid.order_id != order_id or (auction_id and w.bid.auction_id != auction_id)
            )

    def prune(self, now: float) -> None:
        """Forget bids past their ``wait_ms`` (their auctions have moved on)."""
        if any(w.until <= now for w in self._q):
            self._q = deque(w for w in self._q if w.until > now)


class Seat(WorkerView, Protocol):
    """What the desk reads (and, through the ledger and queue, changes) of one worker:
    beside what the checks read, its price, images, waiting bids and hold cap."""

    @property
    def region(self) -> str: ...
    @property
    def pricer(self) -> Pricer: ...
    @property
    def waiting(self) -> WaitingBids: ...
    @property
    def max_hold_ms(self) -> int:
        """The longest this worker holds capacity for one bid, whatever it asks."""
        ...

    def machine_for(self, order_id: str) -> Machine | None:
        """The machine this worker placed for the order (not aborted), if any."""
        ...

    def image_cost(self, order: OrderLike) -> ImageCost:
        """What starting the order's image costs this worker (supplier/images.py)."""
        ...

    def has_image(self, m: Machine) -> bool:
        """Whether ``m``'s image is here (an offer's and a Placed's ``image_cached``)."""
        ...

    def hand_out(self, order_id: str) -> None:
        """The order's machine goes to an auction that may not be the one that committed it:
        from now on no abort undoes it (docs/protocol.md §6.6)."""
        ...

    def release(self, order_id: str, auction_id: str = "") -> None:
        """Drop the order's waiting bids and its hold (of ``auction_id`` when given)."""
        ...


S = TypeVar("S", bound=Seat)


class Quote:
    """A worker's price for a bid, before anything is held."""

    __slots__ = ("image", "score", "want")

    def __init__(self, score: float, image: ImageCost, want: Vec) -> None:
        self.score = score
        self.image = image
        self.want = want


@dataclass(slots=True, frozen=True)
class Send(Generic[S]):
    """One bid reply to send to ``inbox`` after ``delay_s`` (from the decision's ``now``)."""

    delay_s: float
    inbox: str
    auction_id: str
    reply: Offer | Waiting
    worker: S
    # The bid asked for prompt answers (§4.4.3): an offer goes out at once, in an Offers
    # naming this process, with ``delay_s`` as its ``delay_ms``.
    prompt: bool = False


def prompt(bid: Bid) -> bool:
    """Whether the bid's auction ranks the offers itself (§4.4.3): answered at once, in
    Offers naming this process (prompt offers come only with batched ones)."""
    return bid.prompt_offers and bid.batch_offers


# How a Post goes out (see Post).
Shape = Literal["one", "offers", "answer"]


@dataclass(slots=True, frozen=True)
class Post(Generic[S]):
    """One message for the host to send to ``inbox``, ``delay_s`` after the decision:

    - ``one``: the reply alone (an Offer, signed when the host signs; a Waiting);
    - ``offers``: one process's offers for one bid in one ``Offers`` (§4.4.2), at its best
      offer's delay, so the spread still ranks processes by their best offer;
    - ``answer``: a prompt answer (§4.4.3): an ``Offers`` naming this process and the
      auction, each offer with the delay it would have waited as ``delay_ms``.

    What goes is what is still due then (:meth:`Desk.due`)."""

    delay_s: float
    inbox: str
    auction_id: str
    shape: Shape
    sends: tuple[Send[S], ...]


@dataclass(slots=True)
class Plan(Generic[S]):
    """How the replies a bid caused go out, for the host to perform."""

    # Prompt answers (§4.4.3), at once: to the bid's inbox, or in its Batch's Answers. A
    # prompt bid always gets one, empty if this process offers nothing: the auction then
    # knows not to wait for it.
    answers: list[Post[S]] = field(default_factory=list)
    # The rest, each at its delay, in this order: replies to other bids that capacity this
    # one freed went to first, then this bid's, best first.
    posts: list[Post[S]] = field(default_factory=list)


@dataclass(slots=True)
class Answer(Generic[S]):
    """The desk's decisions for one bid."""

    # Replies to this bid, best first (ascending delay): offers, existing-machine offers,
    # Waiting notes.
    replies: list[Send[S]] = field(default_factory=list)
    # Replies to OTHER bids that were waiting: capacity this bid freed (a re-bid's old
    # hold, expired holds) went to them first.
    late: list[Send[S]] = field(default_factory=list)
    # worker id -> why it stays silent (a named reason above or pricing's)
    silent: dict[str, str] = field(default_factory=dict)
    # holds found expired while answering, to announce (hold_expired events)
    expired: list[tuple[S, list[Hold]]] = field(default_factory=list)
    # worker id -> (worker, another auction's live hold for this order that this bid took
    # the place of: a concurrent duplicate's); a new hold there keeps it (Hold.replaced),
    # and where this bid holds nothing it is put back
    replaced: dict[str, tuple[S, Hold]] = field(default_factory=dict)
    # The bid came after its auction's release (they travel on two subscriptions): it is
    # not answered at all.
    ignored: bool = False


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

    def _asked(self, key: tuple[str, str], now: float, replies: list[Send[S]]) -> None:
        """Remember the workers that hold or wait for the auction: its release goes there."""
        if not replies:
            return
        asked = self.asked.get(key)
        if asked is None:
            asked = self.asked[key] = (now, [])
        asked[1].extend(r.worker for r in replies)

    def plan(self, bid: Bid, inbox: str, ans: Answer[S]) -> Plan[S]:
        """How the replies of ``ans`` go out: prompt answers at once; else, with batched
        offers (§4.4.2), a bid's offers in Offers messages of at most MAX_BATCH_OFFERS; a
        lone offer and Waiting notes alone; late replies to other bids first."""
        if ans.ignored:
            return Plan()
        plan = Plan(posts=self.late(ans.late))
        offers = [r for r in ans.replies if isinstance(r.reply, Offer)]
        alone = [r for r in ans.replies if not isinstance(r.reply, Offer)]  # Waiting notes
        if prompt(bid):
            plan.answers = [
                Post(0.0, inbox, bid.auction_id, "answer", chunk)
                for chunk in _chunks(offers, MAX_BATCH_OFFERS)
            ]
        elif bid.batch_offers and len(offers) > 1:
            plan.posts += [
                Post(chunk[0].delay_s, inbox, bid.auction_id, "offers", chunk)
                for chunk in _chunks(offers, MAX_BATCH_OFFERS)
            ]
        else:
            alone = ans.replies
        plan.posts += [Post(r.delay_s, r.inbox, r.auction_id, "one", (r,)) for r in alone]
        return plan

    @staticmethod
    def late(sends: Iterable[Send[S]]) -> list[Post[S]]:
        """Replies to waiting bids (:meth:`freed`, :meth:`withdraw_hopeless`), each alone
        at its delay; a prompt bid's offer at once, as a prompt answer."""
        return [
            Post(0.0, s.inbox, s.auction_id, "answer", (s,))
            if s.prompt
            else Post(s.delay_s, s.inbox, s.auction_id, "one", (s,))
            for s in sends
        ]

    def due(self, post: Post[S]) -> list[Send[S]] | None:
        """The replies of ``post`` still worth sending now that it goes (an offer whose hold
        was released meanwhile is dropped), or None when nothing goes; a prompt answer
        planned empty goes all the same (it tells the auction this process answered)."""
        due = [s for s in post.sends if self.still_due(s)]
        if due or (post.shape == "answer" and not post.sends):
            return due
        return None

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
    def explain(self, order: OrderLike, now: float, workers: Iterable[S]) -> list[WorkerVerdict]:
        """Each worker's verdict on the order, as :meth:`answer` would decide it at ``now``
        but for every worker (no sample, no ``max_offers``) and read-only: what is free is
        what a bid would find (``Ledger.free_for``: the order's own hold and expired holds
        left out); nothing is held, dropped or expired. Waiting bids that a bid's drops
        would answer first are not foreseen."""
        return [self.verdict(w, order, now) for w in workers]

    @staticmethod
    def verdict(w: S, order: OrderLike, now: float) -> WorkerVerdict:
        """One worker's verdict: ``existing`` (a machine for the order is there), ``offer``
        (score and subscores as the Offer would carry them; an image not here is noted with
        what the image term costs: for a content image, the bytes and seconds of its pull),
        ``wait`` (only other orders' holds are in the way) or ``decline`` with every reason,
        in the chain's order, numbers in each ``detail``."""
        wid = w.worker_id
        want = wanted(order)
        why: list[Reason] = []
        reason = first_failure(STANDING, w, order, want, ZERO, why)  # they read no capacity
        if reason == EXISTING:
            m = w.machine_for(order.order_id)
            assert m is not None, "the chain said EXISTING"
            return WorkerVerdict(
                worker_id=wid,
                verdict="existing",
                score=m.score,
                image_cached=w.has_image(m),
                machine_id=m.machine_id,
            )
        if reason is not None:
            return WorkerVerdict(worker_id=wid, verdict="decline", reasons=why)
        ledger = w.ledger
        free = ledger.free_for(order.order_id, now)
        reasons = every_failure(FEASIBLE, w, order, want, free)
        if any(r.code != BLOCKED for r in reasons):
            return WorkerVerdict(worker_id=wid, verdict="decline", reasons=reasons)
        image = w.image_cost(order)
        # a worker that would wait is priced as once the holds in its way are gone
        used = sub(ledger.capacity, free) if not reasons else ledger.committed
        score, subscores = w.pricer.price(ledger.capacity, used, want, image)
        if not image.cached:
            reasons.append(_not_cached(w.pricer, order.image, image, score))
        return WorkerVerdict(
            worker_id=wid,
            verdict="wait" if reasons and reasons[0].code == BLOCKED else "offer",
            score=score,
            subscores=subscores,
            image_cached=image.cached,
            reasons=reasons,
        )

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

    @staticmethod
    def still_due(send: Send[S]) -> bool:
        """Is a delayed reply still worth sending? An offer whose hold was released (or
        replaced by another auction's) in the meantime is dropped."""
        reply = send.reply
        if isinstance(reply, Waiting) or reply.machine_id:
            return True
        h = send.worker.ledger.holds.get(reply.order_id)
        return h is not None and h.auction_id == send.auction_id


def _waiting(w: Seat, bid: Bid, wait_ms: int) -> Waiting:
    return Waiting(order_id=bid.order_id, worker_id=w.worker_id, region=w.region, wait_ms=wait_ms)


def _by_delay(s: Send[S]) -> float:
    return s.delay_s


def _chunks(sends: list[Send[S]], size: int) -> list[tuple[Send[S], ...]]:
    """``sends`` in runs of at most ``size``; one empty run when there are none."""
    return [tuple(sends[i : i + size]) for i in range(0, max(1, len(sends)), size)]


V = TypeVar("V")


def _forget(
    memory: OrderedDict[tuple[str, str], V], cutoff: float, at: Callable[[V], float]
) -> None:
    """Drop the entries of ``memory`` from its oldest on while their time (``at``) is at or
    before ``cutoff``."""
    while memory and at(next(iter(memory.values()))) <= cutoff:
        memory.popitem(last=False)


def _not_cached(pricer: Pricer, image: str, cost: ImageCost, score: float) -> Reason:
    """The image term's price effect: what the score forgoes against a cached image
    (``image_weight`` for a catalog image; for a content image, its share lost to the pull,
    whose bytes and expected seconds the detail says)."""
    forgone = round(pricer.image_weight * (1.0 - pricer.image(cost)), 6)
    cached = min(1.0, round(score + forgone, 6))
    if cost.content:
        lacks = f"lacks {cost.pull_bytes} bytes here (a pull of about {cost.pull_s:.3g} s)"
    else:
        lacks = "not cached"
    return Reason(
        code=IMAGE_NOT_CACHED,
        detail=f"image {image!r} {lacks}: the image term costs {forgone:g} "
        f"(score {score:g}, {cached:g} if cached)",
        cost=forgone,
    )


def explanation_pages(
    order_id: str,
    region: str,
    responder: str,
    verdicts: Sequence[WorkerVerdict],
    limit_bytes: int = EXPLAIN_PAGE_BYTES,
) -> list[Explanation]:
    """Cut one process's verdicts into Explanation pages of at most ``limit_bytes`` encoded
    each (at least one verdict per page, and one page when there are none), numbered
    1..n, ``last`` on page n (bourse/wire/paging.py ``cut``)."""
    frame = len(
        encode(Explanation(order_id=order_id, region=region, responder=responder, last=False))
    )
    chunks = cut(verdicts, frame, limit_bytes)
    total = len(chunks)
    return [
        Explanation(
            order_id=order_id,
            region=region,
            responder=responder,
            page=i,
            pages=total,
            last=i == total,
            verdicts=chunk,
        )
        for i, chunk in enumerate(chunks, 1)
    ]
