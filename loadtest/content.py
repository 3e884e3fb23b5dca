"""Orders for an image's content: a bid that carries the image's manifest digest and layers
(docs/protocol.md §4.3a), its offers gathered, the best committed with the digest.

The tools place pushed images this way themselves (the demo's example app, the pulls
scenario): the bid is what an order resolved where it enters looks like, and the auction is
the direct buyer's in miniature: every offer of the region, or those of a window, then the
highest score committed (a rejected commit tries the next).
"""

from __future__ import annotations

import anyio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from ulid import ULID

from bourse.errors import BourseError
from bourse.images import ImageInfo
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    Bid,
    Commit,
    Error,
    Layer,
    Offer,
    Placed,
    PlaceOrder,
    Rejected,
    Release,
    Unfilled,
)
from bourse.wire.subjects import Subjects

COMMIT_TIMEOUT_S = 10.0  # a commit whose worker must make the machine durable first
HOLD_MARGIN_MS = 5000  # the hold outlives the window and the commit


class CommitRefused(BourseError):
    """A worker answered a commit with an Error (not a rejection: the order itself is wrong
    for it)."""


def content_bid(order: PlaceOrder, info: ImageInfo, window_s: float) -> Bid:
    """The bid of ``order`` for the image ``info`` describes: its digest and layers."""
    return Bid(
        order_id=order.order_id,
        region=order.region,
        resources=order.resources,
        image=order.image,
        constraints=order.constraints,
        exclude_workers=order.exclude_workers,
        hold_ms=int(window_s * 1000) + HOLD_MARGIN_MS,
        auction_id=str(ULID()),
        image_digest=info.digest,
        layers=[Layer(digest=x.digest, size=x.size) for x in info.layers],
    )


async def place_content(
    nc: NATS,
    subjects: Subjects,
    order: PlaceOrder,
    info: ImageInfo,
    *,
    workers: int,
    window_s: float = 1.0,
) -> Placed | Unfilled:
    """Place ``order`` on the image ``info``: offers until ``workers`` answered or
    ``window_s`` passed, then the best one committed with the image's digest."""
    started = anyio.current_time()
    bid = content_bid(order, info, window_s)
    offers = await _gather(nc, subjects, bid, workers, window_s)
    for offer in sorted(offers, key=lambda o: o.score, reverse=True):
        if offer.score < order.min_score:
            break
        answer = await _commit(nc, subjects, order, bid, offer)
        if isinstance(answer, Placed):
            await _release(nc, subjects, bid, [o for o in offers if o is not offer])
            return answer
    return Unfilled(
        order_id=order.order_id,
        region=order.region,
        reason="all_commits_rejected" if offers else "no_offers",
        offers=len(offers),
        commits_tried=len(offers) if offers else 0,
        elapsed_ms=(anyio.current_time() - started) * 1000,
        detail=f"{len(offers)} offer(s) for {order.image} ({info.digest})",
    )


async def _gather(
    nc: NATS, subjects: Subjects, bid: Bid, workers: int, window_s: float
) -> list[Offer]:
    offers: list[Offer] = []
    done = anyio.Event()

    async def on_reply(msg: Msg) -> None:
        try:
            offer = decode(msg.data, Offer)
        except BourseError:  # a Waiting, or a reply of another kind: not an offer
            return
        if offer.order_id == bid.order_id:
            offers.append(offer)
            if len(offers) >= workers:
                done.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subjects.bid(bid.region), encode(bid), reply=inbox)
        with anyio.move_on_after(window_s):
            await done.wait()
    finally:
        await sub.unsubscribe()
    return offers


async def _release(nc: NATS, subjects: Subjects, bid: Bid, losers: list[Offer]) -> None:
    """The other offers' holds dropped now rather than at their expiry."""
    for offer in losers:
        release = Release(
            order_id=bid.order_id, worker_id=offer.worker_id, auction_id=bid.auction_id
        )
        await nc.publish(subjects.release(offer.worker_id), encode(release))


async def _commit(
    nc: NATS, subjects: Subjects, order: PlaceOrder, bid: Bid, offer: Offer
) -> Placed | Rejected:
    commit = Commit(
        order_id=order.order_id,
        worker_id=offer.worker_id,
        resources=order.resources,
        image=order.image,
        metadata=order.metadata,
        auction_id=bid.auction_id,
        image_digest=bid.image_digest,
    )
    reply = await nc.request(
        subjects.commit(offer.worker_id), encode(commit), timeout=COMMIT_TIMEOUT_S
    )
    answer: Placed | Rejected | Error = decode(reply.data, Placed | Rejected | Error)
    if isinstance(answer, Error):
        raise CommitRefused(f"worker {offer.worker_id} refused the commit: {answer.detail}")
    return answer
