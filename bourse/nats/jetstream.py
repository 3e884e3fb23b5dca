"""JetStream for Bourse: the durable event stream (docs/protocol.md §8, §8.1).

Events of committed state changes are stored in one stream per subject prefix,
``<PREFIX>_EVENTS`` over ``<prefix>.v1.event.>``, limited by age and size (oldest dropped
first). Suppliers publish into it from their SQLite outbox with a ``Nats-Msg-Id`` header;
the stream's duplicate window drops a message id it has already stored, which is what makes
a republish after a crash harmless.

Everything here is one request to the server per call: start-up work, never the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.jetstream")

# Documented defaults (docs/protocol.md §8.1): a week of events, at most 1 GiB.
DEFAULT_MAX_AGE_S = 7 * 24 * 3600.0
DEFAULT_MAX_BYTES = 1024**3
# How long the server remembers a message id. It must cover the outbox's retry horizon: a
# supplier that died between the ack and the delete of an outbox row republishes that row
# when it restarts; within the window the server drops it. 10 minutes covers a restart by
# hand or by a supervisor; a supplier down longer may publish such a row once more
# (at-least-once beyond the window, documented).
DEFAULT_DUPLICATE_WINDOW_S = 600.0
# How long start-up waits for the server to answer "is JetStream there?".
DETECT_TIMEOUT_S = 2.0
HEADER_MSG_ID = "Nats-Msg-Id"


def prefix_token(prefix: str) -> str:
    """The subject prefix as it appears in stream and bucket names (which allow only
    ``[A-Za-z0-9_-]``), one to one, so two markets never share a stream or a bucket:
    ``bourse`` -> ``BOURSE``, ``t.x`` -> ``T_X``. Lower-case letters are upper-cased,
    digits and ``-`` kept, ``.`` becomes ``_``; any other character (an upper-case letter,
    ``_``) is written ``_x`` and its two hex digits (``Bourse`` -> ``_x42OURSE``,
    ``a_b`` -> ``A_x5fB``). A lower-case ``x`` or hex digit appears only in such an escape,
    so no two prefixes give one token."""
    out: list[str] = []
    for c in prefix:
        if "a" <= c <= "z":
            out.append(c.upper())
        elif c.isdigit() or c == "-":
            out.append(c)
        elif c == ".":
            out.append("_")
        else:
            out.append(f"_x{ord(c):02x}")
    return "".join(out)


def stream_name(prefix: str) -> str:
    """The event stream of a subject prefix: ``bourse`` -> ``BOURSE_EVENTS``."""
    return prefix_token(prefix) + "_EVENTS"


def claims_bucket_name(prefix: str) -> str:
    """The order-claims KV bucket of a subject prefix: ``bourse`` -> ``BOURSE_ORDERS``,
    whose stream is ``KV_BOURSE_ORDERS``."""
    return prefix_token(prefix) + "_ORDERS"


@dataclass(frozen=True, slots=True)
class EventStream:
    """The event stream's name, subjects and limits."""

    name: str
    subjects: tuple[str, ...]
    max_age_s: float = DEFAULT_MAX_AGE_S
    max_bytes: int = DEFAULT_MAX_BYTES
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S

    @classmethod
    def of(cls, subjects: Subjects, **limits: float) -> EventStream:
        """The stream of ``subjects``' prefix, with the given limits (else the defaults)."""
        return cls(
            name=stream_name(subjects.prefix),
            subjects=(f"{subjects.root}.event.>",),
            max_age_s=float(limits.get("max_age_s", DEFAULT_MAX_AGE_S)),
            max_bytes=int(limits.get("max_bytes", DEFAULT_MAX_BYTES)),
            duplicate_window_s=float(limits.get("duplicate_window_s", DEFAULT_DUPLICATE_WINDOW_S)),
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
        )


async def jetstream_available(nc: NATS, timeout_s: float = DETECT_TIMEOUT_S) -> bool:
    """Whether the server (and this account) has JetStream: one ``$JS.API.INFO`` request.
    A core-only server answers it with no responders, at once."""
    try:
        await nc.jetstream(timeout=timeout_s).account_info()
    except (
        nats.errors.NoRespondersError,
        nats.errors.TimeoutError,
        nats.js.errors.ServiceUnavailableError,
        nats.js.errors.NoStreamResponseError,
    ):
        return False
    except nats.js.errors.APIError as exc:  # e.g. 503 "jetstream not enabled for account"
        log.debug("jetstream_info_refused", error=str(exc))
        return False
    return True


async def ensure_stream(js: JetStreamContext, stream: EventStream) -> bool:
    """Create the event stream if it does not exist; idempotent. An existing stream keeps
    its own limits (an operator may have changed them): it is only checked to cover our
    subjects. Returns True when the stream is there and takes our subjects."""
    try:
        return await _ensure(js, stream)
    except nats.js.errors.APIError as exc:  # e.g. "insufficient storage resources available"
        log.error("event_stream_unavailable", stream=stream.name, error=exc.description or "")
        return False


async def _ensure(js: JetStreamContext, stream: EventStream) -> bool:
    try:
        info = await js.stream_info(stream.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(stream.config())
            log.info(
                "event_stream_created",
                stream=stream.name,
                subjects=list(stream.subjects),
                max_age_s=stream.max_age_s,
                max_bytes=stream.max_bytes,
                duplicate_window_s=stream.duplicate_window_s,
            )
            return True
        except nats.js.errors.BadRequestError:
            info = await js.stream_info(stream.name)  # created meanwhile by another process
    have = set(info.config.subjects or ())
    missing = [s for s in stream.subjects if s not in have]
    if missing:
        log.error(
            "event_stream_mismatch",
            stream=stream.name,
            subjects=sorted(have),
            missing=missing,
            fix=f"add {missing} to the stream's subjects, or delete the stream",
        )
        return False
    return True
