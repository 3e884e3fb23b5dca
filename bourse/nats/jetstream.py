"""JetStream for Bourse: whether a program may run (JetStream is required unless it was
started with ``--no-jetstream``), the names of the market's streams and buckets, and the
durable event stream (docs/protocol.md §8, §8.1).

Events of committed state changes are stored in one stream per subject prefix,
``<PREFIX>_EVENTS`` over ``<prefix>.v1.event.>``, limited by age and size (oldest dropped
first). The exchange makes it at its start (or the operator, ``bourse jetstream init``);
suppliers only publish into it, from their SQLite outbox with a ``Nats-Msg-Id`` header; the
stream's duplicate window drops a message id it has already stored, which is what makes a
republish after a crash harmless.

Everything here is one request to the server per call: start-up work, never the hot path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from bourse.errors import BourseError
from bourse.nats.names import DEGRADED, NO_JETSTREAM_FLAG, prefix_token
from bourse.runtime import logs
from bourse.wire.subjects import Subjects

log = logs.get_logger("bourse.jetstream")  # structlog imported at its first line

# The event stream's sizing rule (docs/operations.md): what it must hold is the bytes of one
# stored event x events per order x orders per second x the window it keeps them.
# One event as stored: ~230 B of JSON plus its subject, its Nats-Msg-Id header and the
# store's record (335 B measured for placed/started/stopped/destroyed of a catalog image),
# and room for an image's digest (~90 B more on an event of a pushed image).
EVENT_BYTES = 420
EVENTS_PER_ORDER = 4  # a machine's life: placed, started, stopped, destroyed
GIB = 1024**3


def event_stream_bytes(orders_per_s: float, window_s: float) -> int:
    """The sizing rule: the bytes a window of ``window_s`` holds at ``orders_per_s``."""
    return math.ceil(EVENT_BYTES * EVENTS_PER_ORDER * orders_per_s * window_s)


# The defaults (docs/protocol.md §8.1): the rule for a week at one order a second (1.02 GB),
# rounded up to a GiB; oldest dropped first past either limit.
DEFAULT_ORDERS_PER_S = 1.0
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0
DEFAULT_MAX_BYTES = (
    math.ceil(event_stream_bytes(DEFAULT_ORDERS_PER_S, DEFAULT_MAX_AGE_S) / GIB) * GIB
)
# How long the server remembers a message id. It must cover the outbox's retry horizon: a
# supplier that died between the ack and the delete of an outbox row republishes that row
# when it restarts; within the window the server drops it. 10 minutes covers a restart by
# hand or by a supervisor; a supplier down longer may publish such a row once more
# (at-least-once beyond the window, documented).
DEFAULT_DUPLICATE_WINDOW_S = 600.0
# How long start-up waits for the server to answer "is JetStream there?".
DETECT_TIMEOUT_S = 2.0
# While JetStream's answer is unclear at a program's start (a timeout, a cluster still
# electing its meta leader), the program asks on, and says so this often.
REQUIRE_WITHIN_S = 15.0
ASK_AGAIN_S = 0.25
HEADER_MSG_ID = "Nats-Msg-Id"
HOW_TO_TURN_ON = (
    "start nats-server with -js -sd DIR (or put jetstream { store_dir: DIR } in its config)"
)
# JetStream's error codes for "not enabled" (a server or an account without it).
NOT_ENABLED = frozenset({10039, 10076})


def says_none(exc: nats.js.errors.APIError) -> bool:
    """Whether a JetStream API error says there is no JetStream here: "not enabled" (for
    the server or the account), or a bare 503 status (nothing serves the JetStream API: a
    core-only server). Any other error (a timeout, "temporarily unavailable" while a
    cluster elects its leader) is an outage, not an absence."""
    if exc.err_code in NOT_ENABLED:
        return True
    return isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.err_code is None


class JetStreamMissing(BourseError, RuntimeError):
    """The NATS server has no JetStream and the program was not started without it."""


class StreamUnavailable(BourseError, RuntimeError):
    """The event stream is not there and could not be made (or takes other subjects)."""


def stream_name(prefix: str) -> str:
    """The event stream of a subject prefix: ``bourse`` -> ``BOURSE_EVENTS``."""
    return prefix_token(prefix) + "_EVENTS"


def claims_bucket_name(prefix: str) -> str:
    """The order-claims KV bucket of a subject prefix: ``bourse`` -> ``BOURSE_ORDERS``,
    whose stream is ``KV_BOURSE_ORDERS``."""
    return prefix_token(prefix) + "_ORDERS"


@dataclass(frozen=True, slots=True)
class EventStream:
    """The event stream's name, subjects, limits and replicas."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float = DEFAULT_MAX_AGE_S
    max_bytes: int = DEFAULT_MAX_BYTES
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S
    replicas: int = 1

    @classmethod
    def of(cls, subjects: Subjects, *, replicas: int = 1, **limits: float) -> EventStream:
        """The stream of ``subjects``' prefix, with the given limits (else the defaults)."""
        return cls(
            name=stream_name(subjects.prefix),
            subjects=(f"{subjects.root}.event.>",),
            max_age_s=float(limits.get("max_age_s", DEFAULT_MAX_AGE_S)),
            max_bytes=int(limits.get("max_bytes", DEFAULT_MAX_BYTES)),
            duplicate_window_s=float(limits.get("duplicate_window_s", DEFAULT_DUPLICATE_WINDOW_S)),
            replicas=replicas,
        )

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            storage=StorageType.FILE,
            max_age=self.max_age_s,
            max_bytes=self.max_bytes,
            discard=DiscardPolicy.OLD,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )


def replicas_for(nc: NATS) -> int:
    """The replicas of a stream or bucket the market makes: 3 where the server is one of a
    cluster of 3 or more (it survives a node), else 1 (2 would halt writes when either of
    its nodes is down, and survive no more than 1 does). The cluster's servers are the
    client's pool (the URLs given and those the servers announced since): the connect-time
    INFO lists only the servers up at that moment."""
    info = getattr(nc, "_server_info", {}) or {}
    servers = {(u.hostname, u.port) for u in nc.servers}
    return 3 if info.get("cluster") and len(servers) >= 3 else 1


async def detect(nc: NATS, timeout_s: float = DETECT_TIMEOUT_S) -> bool | None:
    """Whether the server (and this account) has JetStream, by one ``$JS.API.INFO``
    request: True, False when the server says it has none (no responders or a bare 503 on
    a core-only server, "not enabled"), None when the answer is unclear (a timeout, a
    cluster without its meta leader yet)."""
    try:
        await nc.jetstream(timeout=timeout_s).account_info()
    except nats.errors.NoRespondersError:
        return False
    except nats.errors.TimeoutError:
        return None
    except nats.js.errors.APIError as exc:
        if says_none(exc):
            return False
        log.debug("jetstream_info_unclear", error=str(exc))
        return None
    return True


async def jetstream_available(nc: NATS, timeout_s: float = DETECT_TIMEOUT_S) -> bool:
    """Whether the server has JetStream now (an unclear answer counts as no)."""
    return bool(await detect(nc, timeout_s))


async def jetstream_mode(nc: NATS, program: str, *, off: bool) -> bool:
    """Whether ``program`` runs with JetStream. Started with ``--no-jetstream`` (``off``):
    False, and a warning names the degraded mode. Else JetStream is required: True once
    the server says it has it (while the answer is unclear, a cluster still electing its
    leader, it asks on, saying so every REQUIRE_WITHIN_S); JetStreamMissing, one line
    saying how to turn it on, when the server says it has none."""
    if off:
        log.warning(
            "jetstream_off",
            program=program,
            mode=f"degraded ({NO_JETSTREAM_FLAG}): {DEGRADED}",
        )
        return False
    while (found := await settled(nc)) is None:
        log.warning(
            "jetstream_not_ready",
            program=program,
            detail=f"no clear answer from JetStream in {REQUIRE_WITHIN_S:g} s (a cluster "
            "electing its leader?): asking on",
        )
    if not found:
        raise JetStreamMissing(
            f"the NATS server has no JetStream: {program} needs JetStream for order claims "
            f"and durable events; {HOW_TO_TURN_ON}, or pass {NO_JETSTREAM_FLAG} to run "
            f"without it ({DEGRADED})"
        )
    return True


async def settled(nc: NATS, within_s: float = REQUIRE_WITHIN_S) -> bool | None:
    """:func:`detect`, asked again while the answer is unclear, for up to ``within_s``."""
    until = time.monotonic() + within_s
    while True:
        found = await detect(nc)
        if found is not None or time.monotonic() >= until:
            return found
        await anyio.sleep(ASK_AGAIN_S)  # the pace of asking again, not a wait for an event


def degraded(jetstream: bool) -> str:
    """What a program's ready line adds in the degraded mode ("" with JetStream)."""
    return "" if jetstream else f"; without JetStream ({NO_JETSTREAM_FLAG}: {DEGRADED})"


async def ensure_stream(js: JetStreamContext, stream: EventStream) -> bool:
    """:func:`make_stream`, its failure logged: True when the stream is there and takes our
    subjects, False when it is not (no JetStream, refused, full, other subjects)."""
    try:
        await make_stream(js, stream)
    except StreamUnavailable as exc:
        log.error("event_stream_unavailable", stream=stream.name, error=str(exc))
        return False
    return True


async def make_stream(js: JetStreamContext, stream: EventStream) -> bool:
    """Create the event stream if it does not exist (True: made now); idempotent. An
    existing stream keeps its own limits (an operator may have changed them): it is only
    checked to take our subjects. StreamUnavailable says why it is not there."""
    try:
        return await _make(js, stream)
    except nats.js.errors.APIError as exc:  # e.g. "insufficient storage resources available"
        raise StreamUnavailable(f"{stream.name}: {exc.description or exc!r}") from None
    except nats.errors.NoRespondersError:
        raise StreamUnavailable(f"{stream.name}: the server has no JetStream") from None
    except nats.errors.TimeoutError:
        raise StreamUnavailable(
            f"{stream.name}: no answer (a key without the right is refused without one: the "
            "exchange's and the operator's keys may make it)"
        ) from None


async def _make(js: JetStreamContext, stream: EventStream) -> bool:
    try:
        info = await js.stream_info(stream.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(stream.config())
        except nats.js.errors.BadRequestError:
            info = await js.stream_info(stream.name)  # created meanwhile by another process
        else:
            log.info(
                "event_stream_created",
                stream=stream.name,
                subjects=list(stream.subjects),
                max_age_s=stream.max_age_s,
                max_bytes=stream.max_bytes,
                duplicate_window_s=stream.duplicate_window_s,
                replicas=stream.replicas,
            )
            return True
    have = set(info.config.subjects or ())
    missing = [s for s in stream.subjects if s not in have]
    if missing:
        raise StreamUnavailable(
            f"{stream.name} does not take {missing} (it takes {sorted(have)}): add them to "
            "its subjects, or delete it to have it made again"
        )
    return False


async def create_missing(js: JetStreamContext, config: StreamConfig, event: str) -> bool:
    """Create the stream ``config`` names if it is missing (True: made now, logged as
    ``event``); False when it is there already, made meanwhile by another process included.
    An existing stream keeps its settings (an operator may have changed them)."""
    try:
        await js.stream_info(config.name or "")
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            return False  # made meanwhile by another process
        log.info(
            event,
            stream=config.name,
            subjects=config.subjects,
            max_bytes=config.max_bytes,
            replicas=config.num_replicas,
        )
        return True
    return False


def apps_bucket_name(prefix: str) -> str:
    """The apps' KV bucket (each app's applied spec, generation and slots):
    ``bourse`` -> ``BOURSE_APPS``."""
    return prefix_token(prefix) + "_APPS"


def secrets_bucket_name(prefix: str) -> str:
    """The apps' secrets KV bucket (one key per app and name): ``BOURSE_APP_SECRETS``."""
    return prefix_token(prefix) + "_APP_SECRETS"
