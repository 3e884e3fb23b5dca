"""Reclaiming a worker's reserved machine (docs/protocol.md §5.3d): the order claim's
verdict on it, pure.

A worker asks, for each machine of its own still ``reserved`` a while after its commit,
whether the order's claim names it. ``judge`` is the answer: keep it (the claim names it, or
there is no claim to go by), destroy it as an orphan (the claim names another machine, or
the buyer was told ``unfilled``: the claim then becomes ``reclaimed`` first, so the id is
free and a re-check is idempotent), wait (an auction for the order is live), or adopt it
(the claim's auction died without an outcome: the claim becomes ``placed`` with this
machine, so a retry gets it). A verdict that writes the claim takes the worker's word only
once its region vouches for the machine (``vouched``: listed by that worker in the order's
region, reserved, for the order, of its shape); otherwise it is refused (wait), so no
supplier makes an order adopt a machine it made up. ``ClaimStore.judge``
(``bourse.auction.claim_store``) reads the claim, asks for the vouching and writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from bourse.auction.claims import TAKEOVER_SLACK_MS, Claim, canonical, claim_digest, shape
from bourse.wire.messages import Machine, Placed, ReclaimVerdictKind

# A verdict on a worker's reserved machine (the ReclaimVerdict values, docs/protocol.md §5.3d).
KEEP: ReclaimVerdictKind = "keep"  # the claim names it, or there is none to go by: it stays
ORPHAN: ReclaimVerdictKind = "orphan"  # the order's answer is another machine, or none
WAIT: ReclaimVerdictKind = "wait"  # an auction for the order is live: ask again later


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a worker does with a machine it asked about; ``write``: the claim to store
    first (revision-checked), when the verdict takes effect only once it is written;
    ``refused``: the worker's word for the machine did not hold (``vouched``)."""

    verdict: ReclaimVerdictKind
    detail: str
    write: Claim | None = None
    refused: bool = False


def vouched(claim: Claim, asked: Placed, shown: Machine | None) -> str:
    """Why the worker's word for ``asked`` (its reserved machine, which a verdict would
    make the order's or reclaim) does not hold, or "" when it does. ``shown``: that machine
    as the worker listed it on its region's machines subject (``machines.<asked.region>``,
    which only the suppliers of that region hear), None if it did not. It must be the
    worker's, reserved (the listing asks for no other), for the order, and of the shape
    the claim keeps, in the region it was listed in: a supplier of another region cannot
    answer there, and a machine of another order, size, image or region does not match;
    where the worker records the machine's constraints, they must be the order's too (the
    claim's whole fingerprint). A claim without a shape (an older writer's) has nothing to
    check it against."""
    if not claim.shape:
        return ""
    mid = asked.machine_id
    if shown is None or shown.worker_id != asked.worker_id or shown.machine_id != mid:
        return (
            f"machine {mid} is not listed reserved by worker {asked.worker_id!r} in region "
            f"{asked.region!r}"
        )
    if shown.order_id != asked.order_id:
        return f"machine {mid} was placed for order {shown.order_id!r}"
    if shape(asked.region, shown.resources, shown.image, shown.metadata) != claim.shape:
        return (
            f"machine {mid} in region {asked.region!r} is not the order's (its region, "
            "resources, image or metadata differ)"
        )
    if shown.constraints is not None and claim.fingerprint != claim_digest(
        asked.region, canonical(shown.resources), shown.image, shown.constraints, shown.metadata
    ):  # a worker that records them: the whole order, its constraints too
        return f"machine {mid} in region {asked.region!r} was placed under other constraints"
    return ""


def judge(claim: Claim | None, machine: Placed, now_ms: int) -> Verdict:
    """The verdict on ``machine`` (a worker's reserved machine, as its Placed) given its
    order's claim."""
    mid = machine.machine_id
    if claim is None:
        return Verdict(KEEP, "no claim for the order (no claims, or past the window)")
    if claim.state == "placed" and claim.placed is not None:
        if claim.placed.machine_id == mid:
            return Verdict(KEEP, "the order's machine")
        return Verdict(ORPHAN, f"the order's machine is {claim.placed.machine_id}")
    if claim.state == "reclaimed":
        return Verdict(ORPHAN, "the order was unfilled; its orphan is being reclaimed")
    if claim.state == "unfilled":
        gone = msgspec.structs.replace(claim, state="reclaimed", until_ms=now_ms, reclaimed=mid)
        return Verdict(ORPHAN, "the buyer was told the order is unfilled", gone)
    if now_ms < claim.until_ms + TAKEOVER_SLACK_MS:
        return Verdict(WAIT, "an auction for the order is under way")
    adopted = msgspec.structs.replace(claim, state="placed", until_ms=now_ms, placed=machine)
    return Verdict(KEEP, "the order's auction died without an outcome: adopted", adopted)
