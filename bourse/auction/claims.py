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

A claim of an unfilled order is deleted, unless a commit was tried (a worker may then hold
a machine whose abort was lost: the claim stays, and the next attempt takes it over as a
retry and adopts that machine); a placed one lives for the bucket's age limit, the
documented idempotency window (docs/protocol.md §5.3c). Without JetStream there are no
claims and duplicates are deduplicated as before (per process, and by the workers).

``decide`` is the pure part (a claim and the time in, what to do out); ``ClaimStore`` is the
thin KV shell the auction driver calls.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue, StopIterSentinel

from bourse.nats.jetstream import claims_bucket_name, jetstream_available
from bourse.wire.codec import encode
from bourse.wire.messages import Placed, PlaceOrder
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.claims")

# The idempotency window: how long a placed order's claim (and so Placed{existing} at once
# for a retry) lives. Past it, a retry is deduplicated by the workers alone, as without
# claims. Documented in docs/protocol.md §5.3c.
DEFAULT_WINDOW_S = 24 * 3600.0
# Past a running claim's end, how long a duplicate still waits before taking it over: the
# owner may be writing its outcome right now.
TAKEOVER_SLACK_MS = 250
# KV requests are start-up or per-order work with a bound: never longer than this.
KV_TIMEOUT_S = 2.0

ClaimState = Literal["auctioning", "placed"]


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """The value of one order id's key."""

    state: ClaimState
    auction_id: str
    fingerprint: str  # of the order (without `retry`): a different order is a conflict
    until_ms: int  # wall clock: the auction's end, deadline and commit grace included
    placed: Placed | None = None


def fingerprint(order: PlaceOrder) -> str:
    """What makes two orders "the same order": what is placed (region, resources, image,
    constraints, metadata). How it is auctioned (deadline, min_score, exclude_workers, the
    retry hint) may differ between attempts: a retry that excludes the machine's worker
    still gets that machine (I3 outranks exclude_workers, as without claims)."""
    what = (order.region, order.resources, order.image, order.constraints, order.metadata)
    return hashlib.blake2b(msgspec.json.encode(what), digest_size=12).hexdigest()


def key_of(order_id: str) -> str:
    """An order id as a KV key: ``:`` (allowed in ids, not in keys) becomes ``=`` (allowed
    in keys, not in ids), so the mapping is one to one."""
    return order_id.replace(":", "=")


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
    if claim is None:
        return Create()
    if claim.fingerprint != fp:
        what = "was placed" if claim.state == "placed" else "is being placed"
        return Conflict(
            f"order id {order.order_id!r} {what} for a different order: an order id names "
            "one order (use a new id for a new order)"
        )
    if claim.state == "placed" and claim.placed is not None:
        return Adopt(claim.placed)
    if now_ms < claim.until_ms + TAKEOVER_SLACK_MS:
        return Wait(claim.until_ms + TAKEOVER_SLACK_MS)
    return TakeOver()


# -- the KV shell --------------------------------------------------------------------------

_decoder = msgspec.json.Decoder(Claim)


class ClaimStore:
    """The claims bucket of one subject prefix, on one connection."""

    def __init__(self, kv: KeyValue, name: str) -> None:
        self.kv = kv
        self.name = name

    @classmethod
    async def open(
        cls, nc: NATS, subjects: Subjects, window_s: float = DEFAULT_WINDOW_S
    ) -> ClaimStore | None:
        """The bucket (created if missing; R3 on a cluster of 3 or more), or None when the
        server has no JetStream or refuses the bucket (then there are no claims)."""
        if not await jetstream_available(nc):
            return None
        name = claims_bucket_name(subjects.prefix)
        js = nc.jetstream(timeout=KV_TIMEOUT_S)
        try:
            try:
                kv = await js.key_value(name)
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(
                    bucket=name,
                    history=1,
                    ttl=window_s,
                    storage=StorageType.FILE,
                    replicas=_replicas(nc),
                    description="Bourse order claims (docs/protocol.md §5.3c)",
                )
                kv = await js.create_key_value(config)
                log.info("claims_bucket_created", bucket=name, replicas=config.replicas)
        except (nats.js.errors.Error, nats.errors.Error) as exc:
            log.warning("claims_unavailable", bucket=name, error=str(exc) or type(exc).__name__)
            return None
        return cls(kv, name)

    async def get(self, order_id: str) -> tuple[Claim | None, int]:
        """The claim and its revision (None, last revision when absent or deleted)."""
        try:
            entry = await self.kv.get(key_of(order_id))
        except nats.js.errors.KeyNotFoundError as exc:
            # a deleted key (nats-py raises not-found with the delete marker's entry): the
            # next write must name the marker's revision
            marker = exc.entry.revision if exc.entry is not None else None
            return None, marker or 0
        if entry.value is None or entry.revision is None:
            return None, entry.revision or 0
        return _decoder.decode(entry.value), entry.revision

    async def put(self, order_id: str, claim: Claim, last: int) -> int | None:
        """Write ``claim`` if the key is still at revision ``last`` (0: absent); its new
        revision, or None when someone else changed it first."""
        try:
            return await self.kv.update(key_of(order_id), encode(claim), last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def remove(self, order_id: str, last: int) -> None:
        """Delete the claim if it is still ours (revision ``last``)."""
        # a wrong last revision (400): taken over meanwhile, and the taker owns it now
        with contextlib.suppress(nats.js.errors.BadRequestError):
            await self.kv.delete(key_of(order_id), last=last)

    async def changed(self, order_id: str, revision: int, within_s: float) -> bool:
        """Wait up to ``within_s`` for the claim to move past ``revision`` (updated or
        deleted); False if it did not."""
        if within_s <= 0:
            return False
        end = time.monotonic() + within_s
        watcher = await self.kv.watch(key_of(order_id), include_history=False)
        try:
            while (left := end - time.monotonic()) > 0:
                try:
                    entry = await watcher.updates(timeout=left)
                except nats.errors.TimeoutError:
                    return False
                if entry is None or isinstance(entry, StopIterSentinel):
                    continue  # the watch's "nothing pending" marker: keep waiting
                if entry.revision is not None and entry.revision > revision:
                    return True
                if entry.operation in (KV_DEL, KV_PURGE):
                    return True
            return False
        finally:
            await watcher.stop()


def _replicas(nc: NATS) -> int:
    """R3 where the server is one of a cluster of 3 or more (a claim survives a node), else 1."""
    info = getattr(nc, "_server_info", {}) or {}
    servers = set(info.get("connect_urls") or [])
    servers.add(f"{info.get('host')}:{info.get('port')}")
    return 3 if info.get("cluster") and len(servers) >= 3 else 1
