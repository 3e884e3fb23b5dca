"""What the desk decided for one bid and how its replies go out, pure.

An ``Answer`` holds the bid's replies, each a ``Send`` (a reply, its inbox and its delay),
and the replies to other bids its capacity changes caused; ``plan`` turns it into a
``Plan`` of ``Post``s for the host to perform (supplier/replies.py): prompt answers at once
(§4.4.3), batched offers in ``Offers`` messages (§4.4.2), a lone offer and ``Waiting`` notes
alone, late replies to other bids first. ``due`` says, when a post goes, which of its
replies are still worth sending.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, Literal

from bourse.wire.limits import MAX_BATCH_OFFERS
from bourse.wire.messages import Bid, Offer, Waiting
from supplier.ledger import Hold
from supplier.seat import S


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


def plan(bid: Bid, inbox: str, ans: Answer[S]) -> Plan[S]:
    """How the replies of ``ans`` go out: prompt answers at once; else, with batched
    offers (§4.4.2), a bid's offers in Offers messages of at most MAX_BATCH_OFFERS; a
    lone offer and Waiting notes alone; late replies to other bids first."""
    if ans.ignored:
        return Plan()
    plan = Plan(posts=late(ans.late))
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


def late(sends: Iterable[Send[S]]) -> list[Post[S]]:
    """Replies to waiting bids (:meth:`freed`, :meth:`withdraw_hopeless`), each alone
    at its delay; a prompt bid's offer at once, as a prompt answer."""
    return [
        Post(0.0, s.inbox, s.auction_id, "answer", (s,))
        if s.prompt
        else Post(s.delay_s, s.inbox, s.auction_id, "one", (s,))
        for s in sends
    ]


def due(post: Post[S]) -> list[Send[S]] | None:
    """The replies of ``post`` still worth sending now that it goes (an offer whose hold
    was released meanwhile is dropped), or None when nothing goes; a prompt answer
    planned empty goes all the same (it tells the auction this process answered)."""
    due = [s for s in post.sends if still_due(s)]
    if due or (post.shape == "answer" and not post.sends):
        return due
    return None


def still_due(send: Send[S]) -> bool:
    """Is a delayed reply still worth sending? An offer whose hold was released (or
    replaced by another auction's) in the meantime is dropped."""
    reply = send.reply
    if isinstance(reply, Waiting) or reply.machine_id:
        return True
    h = send.worker.ledger.holds.get(reply.order_id)
    return h is not None and h.auction_id == send.auction_id


def _chunks(sends: list[Send[S]], size: int) -> list[tuple[Send[S], ...]]:
    """``sends`` in runs of at most ``size``; one empty run when there are none."""
    return [tuple(sends[i : i + size]) for i in range(0, max(1, len(sends)), size)]
