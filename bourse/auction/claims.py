"""Order claims: one order id, one auction, one machine, across every process (I3).

Before an auction commits anything it claims its order id in a JetStream key-value bucket
(``<PREFIX>_ORDERS``), with create-if-absent; every later change of the claim is
revision-checked. The claim says who is placing the order and, once placed, the ``Placed``
itself. So a duplicate on any exchange, a direct-mode buyer or a retry finds the claim and:

- gets the existing machine at once (``Placed{existing}``) when the claim is placed;
- waits for the live auction when it is still running, then takes its outcome;
- takes the claim over (revision-checked, so one taker wins) when its auction is past its
  end (its process died): that auction runs as a retry, so a machine the dead one may have
  committed is found on its worker (the owner's existing-machine offer) and not placed twice;
- is refused (``ConflictingOrder``) when the claim is for a different order under the same
  id (the id is an idempotency key).

A claim of an unfilled order is deleted, unless a commit was tried: then a worker may hold
a machine whose abort was lost, and the claim says ``unfilled`` (the buyer was told so):
the next attempt takes it over at once as a retry and adopts that machine; if none comes,
the worker reclaims it (``bourse.auction.verdicts``). A placed claim lives for the
bucket's age limit, the documented idempotency window (docs/protocol.md §5.3c); the
bucket's bytes are bounded too, and a full one takes no new order (``bourse.auction.room``).
Without JetStream there are no claims and duplicates are deduplicated as before (per
process, and by the workers).

This module is the claim's value and the pure decision about it (a claim and the time in,
what to do out): ``Claim``, ``fingerprint``, ``key_of``, ``decide``. An order's whole way
through its claim is ``bourse.auction.claiming.Claiming``; the reclaim verdicts are
``bourse.auction.verdicts``; the KV shell the auctioneer and the exchange's reclaim desk
call is ``bourse.auction.claim_store`` (``ClaimStore``, and ``ClaimBucket`` that opens it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import msgspec

from bourse.wire.limits import MILLIS_PER_CPU
from bourse.wire.messages import Placed, PlaceOrder, Resources

# Past a running claim's end, how long a duplicate still waits before taking it over: the
# owner may be writing its outcome right now.
TAKEOVER_SLACK_MS = 250
# KV requests are start-up or per-order work with a bound: never longer than this.
KV_TIMEOUT_S = 2.0

# auctioning: an auction holds the id (until ``until_ms``); placed: ``placed`` is the
# order's machine; unfilled: the buyer was told Unfilled after a commit went out (a worker
# may hold an orphan); reclaimed: a worker destroyed the orphan ``reclaimed``: the id is free.
ClaimState = Literal["auctioning", "placed", "unfilled", "reclaimed"]


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """The value of one order id's key."""

    state: ClaimState
    auction_id: str
    fingerprint: str  # of the order (without `retry`): a different order is a conflict
    until_ms: int  # wall clock: the auction's end, deadline and commit grace included
    placed: Placed | None = None
    reclaimed: str = ""  # state reclaimed: the orphan machine a worker destroyed
    shape: str = ""  # what a machine of the order shows (``shape``): "" from older writers


def fingerprint(order: PlaceOrder) -> str:
    """What makes two orders "the same order": what is placed (region, resources, image,
    constraints, metadata), in one canonical form: maps sorted by key, the CPU amount in
    its one wire form (``cpus: 1`` and ``cpus: 1, cpu_millis: 1000`` are one order). How it
    is auctioned (deadline, min_score, exclude_workers, the retry hint) may differ between
    attempts: a retry that excludes the machine's worker still gets that machine (I3
    outranks exclude_workers, as without claims). An order already in that form (sorted
    maps, ``cpu_millis`` only beside a fraction) has the digest it always had. Its named
    ports (in order: the first is ``PORT``), environment and checks count when it has any;
    an order without them keeps the digest it had before they existed."""
    what: tuple[object, ...] = (
        order.region,
        canonical(order.resources),
        order.image,
        order.constraints,
        order.metadata,
    )
    if order.ports or order.env or order.checks:
        what += (order.ports, order.env, order.checks)
    return claim_digest(*what)


def order_shape(order: PlaceOrder) -> str:
    """The shape of ``order``'s machine (``shape``)."""
    return shape(order.region, order.resources, order.image, order.metadata)


def shape(region: str, resources: Resources, image: str, metadata: dict[str, str]) -> str:
    """What a machine placed for an order shows of it (its region, resources, image and
    metadata: the fingerprint less the constraints, which a machine does not carry), as a
    digest in the fingerprint's canonical form."""
    return claim_digest(region, canonical(resources), image, metadata)


def canonical(r: Resources) -> Resources:
    """``r`` in its one wire form: ``cpu_millis`` only when the CPU amount is not whole."""
    if r.cpu_millis and r.cpu_millis % MILLIS_PER_CPU == 0:
        return msgspec.structs.replace(r, cpu_millis=0)
    return r


def claim_digest(*what: object) -> str:
    """The lowercase hex BLAKE2b digest (12 bytes) of ``what`` as compact JSON, maps
    sorted by key (docs/protocol.md §5.3c)."""
    data = msgspec.json.encode(what, order="deterministic")
    return hashlib.blake2b(data, digest_size=12).hexdigest()


_KEY = str.maketrans({":": "=", ".": "/"})


def key_of(order_id: str) -> str:
    """An order id as a KV key, one to one: ``:`` (allowed in ids, not in keys) becomes
    ``=`` and ``.`` becomes ``/`` (both allowed in keys, not in ids). Dots must go: a key
    may not end with one (``o-1.`` is a valid order id), and each is a subject token
    boundary (``a..b`` would have an empty token)."""
    return order_id.translate(_KEY)


# -- the decision (pure) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Create:
    """No claim: create it and run the auction (no machine can exist for this id)."""


@dataclass(frozen=True, slots=True)
class Adopt:
    """Placed already: answer with its machine at once."""

    placed: Placed


@dataclass(frozen=True, slots=True)
class Wait:
    """Another auction is placing it: wait for the claim to change, until ``until_ms``."""

    until_ms: int


@dataclass(frozen=True, slots=True)
class TakeOver:
    """Its auction is past its end (its process died): take the claim (revision-checked)
    and run as a retry, so a machine that auction committed is found, not doubled."""


@dataclass(frozen=True, slots=True)
class Conflict:
    """The id is claimed by a different order."""

    detail: str


ClaimDecision = Create | Adopt | Wait | TakeOver | Conflict


def decide(claim: Claim | None, order: PlaceOrder, fp: str, now_ms: int) -> ClaimDecision:
    """What an auction for ``order`` (fingerprint ``fp``) does about the claim it found."""
    if claim is None or claim.state == "reclaimed":
        return Create()  # no machine for the id (a reclaimed one is gone): a fresh start
    if claim.fingerprint != fp:
        what = "was placed" if claim.state == "placed" else "is being placed"
        return Conflict(
            f"order id {order.order_id!r} {what} for a different order: an order id names "
            "one order (use a new id for a new order)"
        )
    if claim.state == "placed" and claim.placed is not None:
        return Adopt(claim.placed)
    if claim.state == "auctioning" and now_ms < claim.until_ms + TAKEOVER_SLACK_MS:
        return Wait(claim.until_ms + TAKEOVER_SLACK_MS)
    return TakeOver()  # its auction died, or ended unfilled after a commit: gather as a retry
