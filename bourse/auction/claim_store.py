"""The order claims' KV shell: ``ClaimStore`` (the requests on the claims bucket of one
subject prefix: read, revision-checked write, remove, wait for a change, a reclaim
verdict written) and ``ClaimBucket`` (a connection's bucket, opened at the first need and
looked for again while the server has no JetStream; whether it takes new orders).

What a claim is and what to do about one are the pure parts (``bourse.auction.claims``,
``bourse.auction.claiming``, ``bourse.auction.verdicts``); the auctioneer and the
exchange's reclaim desk perform them through this.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from bourse.auction.claims import KV_TIMEOUT_S, Claim, key_of
from bourse.auction.room import FULL, ROOM_LOOK_S, ClaimLimits, Room
from bourse.auction.verdicts import WAIT, Verdict, judge
from bourse.nats.jetstream import DETECT_TIMEOUT_S, claims_bucket_name, replicas_for, says_none
from bourse.runtime.tasks import TaskSet
from bourse.wire.codec import encode
from bourse.wire.messages import Placed, now_ms
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.claims")

# A duplicate waiting for a live auction's outcome reads the claim this often, doubling up to
# the max (ClaimStore.changed).
CHANGED_POLL_S = 0.005
CHANGED_POLL_MAX_S = 0.05
# A bucket that could not be opened (no JetStream yet: a cluster electing its leader, a
# server restarted without it) is looked for again this often, with a short detection
# timeout (ClaimBucket).
CLAIMS_RETRY_S = 30.0
CLAIMS_RETRY_DETECT_S = 0.25
# A KV request that failed: a timeout, no JetStream responder, an API error.
KV_ERRORS = (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError)

# Why a worker's word for its machine does not hold against the order's claim ("": it
# does): ``vouched`` over what the machine's region lists (the exchange's reclaim desk).
Vouch = Callable[[Claim, Placed], Awaitable[str]]

_decoder = msgspec.json.Decoder(Claim)


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    """JetStream's answer to a publish (a KV write): the new sequence, or an error."""

    seq: int = 0
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)
# JetStream's "wrong last sequence" errors: the key moved past the revision named.
WRONG_LAST_SEQUENCE = (10071, 10164)


class ClaimStore:
    """The claims bucket of one subject prefix, on one connection."""

    def __init__(self, kv: KeyValue, name: str, nc: NATS) -> None:
        self.kv = kv  # reads and deletes
        self.name = name
        self.nc = nc  # writes (put): one request, answered as put_result reads it

    @classmethod
    async def open(
        cls,
        nc: NATS,
        subjects: Subjects,
        limits: ClaimLimits = ClaimLimits(),
        detect_timeout_s: float = DETECT_TIMEOUT_S,
    ) -> ClaimStore | None:
        """The bucket (created with ``limits`` if missing; R3 on a cluster of 3 or more), or
        None when the server has no JetStream (then there are no claims). A JetStream that
        fails to give the bucket (a cluster electing its leader, no quorum, no room for its
        byte limit) raises: that is an outage of the claims, not their absence. An existing
        bucket keeps its own limits (``ClaimBucket`` says what they are)."""
        if not await _has_jetstream(nc, detect_timeout_s):
            return None
        name = claims_bucket_name(subjects.prefix)
        js = nc.jetstream(timeout=KV_TIMEOUT_S)
        try:
            kv = await js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            config = KeyValueConfig(
                bucket=name,
                history=1,
                ttl=limits.window_s,
                max_bytes=limits.max_bytes,
                storage=StorageType.FILE,
                replicas=replicas_for(nc),
                description="Bourse order claims (docs/protocol.md §5.3c)",
            )
            try:
                kv = await js.create_key_value(config)
            except nats.js.errors.BadRequestError:
                kv = await js.key_value(name)  # another process created it first
            else:
                log.info(
                    "claims_bucket_created",
                    bucket=name,
                    replicas=config.replicas,
                    window_s=limits.window_s,
                    max_bytes=limits.max_bytes,
                )
                if config.replicas > 1:
                    await _leader_elected(js, f"KV_{name}")
        return cls(kv, name, nc)

    async def fill(self) -> tuple[int, int, float]:
        """The bucket's bytes, its byte limit (-1: none) and its age limit in seconds."""
        info = await self.nc.jetstream(timeout=KV_TIMEOUT_S).stream_info(f"KV_{self.name}")
        max_bytes = info.config.max_bytes
        return info.state.bytes, -1 if max_bytes is None else max_bytes, info.config.max_age or 0.0

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

    async def put(
        self, order_id: str, claim: Claim, last: int, timeout_s: float = KV_TIMEOUT_S
    ) -> int | None:
        """Write ``claim`` if the key is still at revision ``last`` (0: absent); its new
        revision, or None when someone else changed it first. One request to the stream's
        subject, read by ``put_result`` (nats-py's ``KeyValue.update`` does the same with
        more Python per write: the create is on every order's path)."""
        subject, headers = self._write(order_id, last)
        msg = await self.nc.request(subject, encode(claim), timeout_s, headers=headers)
        return put_result(msg.data, msg.headers)

    def _write(self, order_id: str, last: int) -> tuple[str, dict[str, str]]:
        """The subject and headers of a write of the key if it is at revision ``last``."""
        headers = {"Nats-Expected-Last-Subject-Sequence": str(last)}
        return f"$KV.{self.name}.{key_of(order_id)}", headers

    async def remove(self, order_id: str, last: int) -> None:
        """Delete the claim if it is still ours (revision ``last``)."""
        # a wrong last revision (400): taken over meanwhile, and the taker owns it now
        with contextlib.suppress(nats.js.errors.BadRequestError):
            await self.kv.delete(key_of(order_id), last=last)

    async def judge(self, machine: Placed, vouch: Vouch, tries: int = 4) -> Verdict:
        """The verdict on a worker's reserved ``machine`` (``judge``), its claim written
        first when the verdict needs it, and only if ``vouch`` finds the worker's word
        holds (else refused: wait); a lost race to the claim reads it again."""
        for _ in range(tries):
            claim, revision = await self.get(machine.order_id)
            verdict = judge(claim, machine, now_ms())
            if claim is None or verdict.write is None:
                return verdict
            why = await vouch(claim, machine)
            if why:
                what = "adopted" if verdict.write.state == "placed" else "reclaimed"
                return Verdict(WAIT, f"not {what}: {why}", refused=True)
            if await self.put(machine.order_id, verdict.write, revision) is not None:
                return verdict
        return Verdict(WAIT, "the order's claim keeps changing")

    async def changed(self, order_id: str, revision: int, within_s: float) -> bool:
        """Wait up to ``within_s`` for the claim to move past ``revision`` (updated or
        deleted); False if it did not. Polled with reads (every 5 ms, backing off to 50 ms),
        not watched: a watch is a JetStream consumer, and a storm of duplicates waiting at
        once hit the server's consumer limit (err_code 10026: ``order_claim_failed`` by the
        hundred in a soak, and orders refused as claims unavailable)."""
        if within_s <= 0:
            return False
        end = time.monotonic() + within_s
        pause = CHANGED_POLL_S
        while True:
            _, now_at = await self.get(order_id)
            if now_at != revision:  # written since, or deleted (a marker, or gone)
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(pause, left))  # the poll's pace, bounded by the wait
            pause = min(2 * pause, CHANGED_POLL_MAX_S)


class ClaimBucket:
    """The claims bucket of one connection, opened at the first need: ``store`` once open;
    None where the server has no JetStream (looked for again every ``CLAIMS_RETRY_S``: a
    JetStream cluster still electing its leader must not turn claims off for good) or
    where claims are off (``enabled`` False: per-process deduplication only).

    ``room`` says whether it takes new orders: its fill is read at most every
    ``ROOM_LOOK_S`` (``look``), and a write refused for room refuses new orders for as
    long (``refused``). ``close`` ends the look under way."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        enabled: bool = True,
        store: ClaimStore | None = None,
        limits: ClaimLimits = ClaimLimits(),
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.enabled = enabled
        self.store = store  # an open bucket to use (tests inject a faulty one)
        self.limits = limits  # of a bucket this process creates
        self.room = Room()
        self._checked = store is not None  # tried once (and said so if there are none)
        self._next_try = 0.0  # monotonic: when to try to open the bucket again
        self._lock = asyncio.Lock()
        self._looks = TaskSet("claims.room")
        self._limits_said = False  # what the bucket's limits hold: said once

    async def look(self) -> None:
        """Read the open bucket's fill if it is time (one look at a time): in the
        background while it takes new orders (they go on with what the last look found);
        at once while it is full, so the first order after room came back is taken."""
        store, now = self.store, time.monotonic()
        if store is None or not self.room.due(now):
            return
        self.room.next_look = now + ROOM_LOOK_S  # one look at a time
        if self.room.full:
            await self._look(store)
        else:
            self._looks.spawn(self._look(store))

    def admit(self) -> str:
        """A new order asks to create its claim: why the bucket takes it not ("": it does,
        and it is counted until ``ended``)."""
        self._said(self.room.admit(time.monotonic()))
        return self.room.full

    def ended(self) -> None:
        """An order ``admit`` took ended."""
        self.room.ended()

    def refused(self, why: str) -> None:
        """JetStream refused a claim's write (or the bucket) for room: ``why``."""
        self._said(self.room.refused(why, time.monotonic()))

    async def close(self) -> None:
        """End the look under way, if any."""
        await self._looks.finish(0)

    async def _look(self, store: ClaimStore) -> None:
        try:
            stored, max_bytes, max_age_s = await store.fill()
        except KV_ERRORS as exc:  # the next look tries again
            log.debug("claims_fill_unknown", bucket=store.name, error=str(exc))
            return
        if not self._limits_said:
            self._limits_said = True
            self._say_limits(store.name, max_bytes, max_age_s)
        self._said(self.room.looked(stored, max_bytes, time.monotonic()))

    def _say_limits(self, bucket: str, max_bytes: int, max_age_s: float) -> None:
        """Say once what the bucket's limits hold; warn about a bucket without them (made
        before they were set), with the command that sets this process's."""
        if max_bytes > 0 and max_age_s > 0:
            rate = round(ClaimLimits(max_age_s, max_bytes).covers())
            log.info(
                "claims_limits",
                bucket=bucket,
                window_s=max_age_s,
                max_bytes=max_bytes,
                orders_per_s=rate,
            )
            return
        want = self.limits
        log.warning(
            "claims_bucket_unbounded",
            bucket=bucket,
            window_s=max_age_s,
            max_bytes=max_bytes,
            fix=f"nats stream edit KV_{bucket} --max-age {want.window_s:g}s "
            f"--max-bytes {want.max_bytes} (docs/operations.md)",
        )

    def _said(self, event: str | None) -> None:
        if event == FULL:
            log.error(event, detail=self.room.full, stored=self.room.stored)
        elif event is not None:
            log.info(event, stored=self.room.stored, max_bytes=self.room.max_bytes)

    async def open(self) -> ClaimStore | None:
        """The bucket, opened if it is time to try (None: no JetStream, or off). Raises a
        KV error when JetStream is there but the bucket could not be opened."""
        if self.store is None and time.monotonic() >= self._next_try:
            async with self._lock:
                if self.store is None and time.monotonic() >= self._next_try:
                    await self._open()
        return self.store

    async def _open(self) -> None:
        if not self.enabled:
            self._next_try = math.inf
            return
        if not self.nc.is_connected:
            return
        # the first look may take the full detection time; a retry (on an order's path)
        # is kept short: a core-only server answers at once anyway
        wait_s = CLAIMS_RETRY_DETECT_S if self._checked else DETECT_TIMEOUT_S
        try:
            self.store = await ClaimStore.open(
                self.nc, self.subjects, self.limits, detect_timeout_s=wait_s
            )
        except KV_ERRORS:
            self._checked = True  # JetStream is there: the bucket failed, try again
            raise
        if self.store is not None:
            if self._checked:  # they were off: say they are back
                log.info("order_claims_on", bucket=self.store.name)
        else:
            self._next_try = time.monotonic() + CLAIMS_RETRY_S
            if not self._checked:
                log.warning(
                    "order_claims_off",
                    detail="no JetStream: duplicates of one order id in different "
                    "processes are not deduplicated (docs/protocol.md §8)",
                )
        self._checked = True


def put_result(data: bytes, headers: dict[str, str] | None) -> int | None:
    """The answer to a ``put``'s write: the claim's new revision, or None when someone else
    changed it first; raises as ``put`` does (no JetStream responder, an API error)."""
    if headers is not None and headers.get("Status") == "503":
        raise nats.js.errors.NoStreamResponseError
    try:
        ack = _ack_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise nats.js.errors.Error(f"undecodable JetStream answer: {exc}") from exc
    if ack.error is not None:
        if ack.error.err_code in WRONG_LAST_SEQUENCE:
            return None
        raise nats.js.errors.APIError(
            code=ack.error.code, err_code=ack.error.err_code, description=ack.error.description
        )
    return ack.seq


async def _has_jetstream(nc: NATS, timeout_s: float) -> bool:
    """Whether the server has JetStream for this account: False only when it says so (no
    responders or a bare 503 on a core-only server, or "not enabled"); an unclear answer
    (a timeout, "temporarily unavailable") raises. A
    timeout read as "no JetStream" would run auctions without claims (I3) for as long as
    that conclusion stands."""
    try:
        await nc.jetstream(timeout=timeout_s).account_info()
    except nats.errors.NoRespondersError:
        return False
    except nats.js.errors.APIError as exc:
        if says_none(exc):
            return False
        raise
    return True


async def _leader_elected(js: JetStreamContext, stream: str, within_s: float = 5.0) -> None:
    """Until a new replicated bucket's stream has its leader (its first writes would
    otherwise fail while the cluster elects one); bounded, then the callers' retries."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        info = await js.stream_info(stream)
        if info.cluster is not None and info.cluster.leader:
            return
        await asyncio.sleep(0.05)  # polling the server's own view, bounded above
