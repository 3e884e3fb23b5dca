"""Why not, for an order (§4.15): each worker's verdict, as a bid would find it but read-only
and with every reason, and the verdicts cut into reply pages. Pure.

The same chain of checks a bid runs (supplier/feasible.py) runs on EVERY worker given
(nothing held, dropped or expired: the order's own hold and expired holds are left out of
what is free instead), collecting every reason: ``verdict`` is one worker's, with all its
reasons and their numbers, or the score and subscores it would offer with;
``explanation_pages`` cuts a process's verdicts into pages (bourse/wire/paging.py ``cut``).
"""

from __future__ import annotations

from collections.abc import Sequence

from bourse.wire.codec import encode
from bourse.wire.messages import EXPLAIN_PAGE_BYTES, Explanation, Reason, WorkerVerdict
from bourse.wire.paging import cut
from bourse.wire.resources import ZERO, sub
from supplier.feasible import (
    BLOCKED,
    EXISTING,
    FEASIBLE,
    STANDING,
    OrderLike,
    every_failure,
    first_failure,
    wanted,
)
from supplier.pricing import ImageCost, Pricer
from supplier.seat import Seat

# Not a decline: a price note in an explanation (the image term it forgoes).
IMAGE_NOT_CACHED = "image_not_cached"


def verdict(w: Seat, order: OrderLike, now: float) -> WorkerVerdict:
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
