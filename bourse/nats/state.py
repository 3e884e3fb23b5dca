"""The state stream: every worker's and machine's row, published by its owner, the last one
kept (docs/protocol.md §4.21).

``<PREFIX>_STATE`` over ``<prefix>.v1.state.>``: one message per subject (a row published
again replaces the one before it), per-message TTL (a destroyed machine's row and a
heartbeat leave after the retention window: nats-server 2.11 or newer), direct gets (a view
asks for the stream's epoch), no age limit, and a byte limit that refuses a new row rather
than drop a live one (``discard: new``; a row that replaces one is always taken). The
exchange makes it at its start (or the operator, ``bourse jetstream init``) and writes its
epoch once, when it has none (:func:`write_epoch`: a view tells a stream made again by it);
each supplier publishes its own workers' rows into it (supplier/rows.py); a view reads it
(bourse/view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from ulid import ULID

from bourse.nats.jetstream import (
    EventStream,
    StreamUnavailable,
    create_missing,
    prefix_token,
)
from bourse.runtime import logs
from bourse.wire.codec import encode
from bourse.wire.messages import StateEpoch, now_ms
from bourse.wire.subjects import Subjects

log = logs.get_logger("bourse.state")  # structlog imported at its first line

# How long a destroyed machine's row (and a heartbeat no process sends any more) stays in
# the stream: a view away longer than this rebuilds (§4.21). The header's value, seconds.
RETENTION_S = 3600
HEADER_TTL = "Nats-TTL"
# A heartbeat every second; a worker whose heartbeat is this many intervals old (and at
# least GONE_AFTER_MS) is gone.
BEAT_INTERVAL_MS = 1000
GONE_INTERVALS = 3
GONE_AFTER_MS = 3000

# The sizing rule (docs/operations.md): the stream holds one row per live machine and per
# worker, the destroyed machines' rows of the retention window, and the heartbeats. One
# row as stored: a machine's JSON (~700 B with an app's metadata, an address and a check),
# its subject, its TTL header and the store's record, rounded up; a worker's row and its
# place in a heartbeat likewise.
MACHINE_ROW_BYTES = 1024
WORKER_ROW_BYTES = 800
MIB = 1024 * 1024

# The epoch is written only while its subject has none: of two exchanges starting at once,
# one writes it and the other is refused with this error code (wrong last sequence).
EXPECT_NO_EPOCH = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071


def state_stream_bytes(
    machines: int, workers: int, destroyed_per_s: float = 0.0, window_s: float = RETENTION_S
) -> int:
    """The sizing rule: the bytes the stream needs for ``machines`` live machines,
    ``workers`` workers and ``destroyed_per_s`` machines destroyed a second (their rows
    kept ``window_s``)."""
    rows = machines + destroyed_per_s * window_s
    return math.ceil(MACHINE_ROW_BYTES * rows + WORKER_ROW_BYTES * workers)


# The default: the rule for 100,000 live machines on 10,000 workers with 10 destroyed a
# second (147 MB), rounded up to whole MiB.
DEFAULT_MAX_BYTES = -(-state_stream_bytes(100_000, 10_000, 10.0) // MIB) * MIB


def state_stream_name(prefix: str) -> str:
    """The state stream of a subject prefix: ``bourse`` -> ``BOURSE_STATE``."""
    return prefix_token(prefix) + "_STATE"


@dataclass(frozen=True, slots=True)
class StateStream(EventStream):
    """The state stream's name, subjects, byte limit and replicas, and its epoch's subject."""

    epoch_subject: str = ""

    @classmethod
    def of(cls, subjects: Subjects, *, replicas: int = 1, **limits: float) -> StateStream:
        """The stream of ``subjects``' prefix; ``max_bytes`` as given, else the default."""
        return cls(
            name=state_stream_name(subjects.prefix),
            subjects=(subjects.state_all,),
            max_age_s=0.0,
            max_bytes=int(limits.get("max_bytes", DEFAULT_MAX_BYTES)),
            duplicate_window_s=0.0,
            replicas=replicas,
            epoch_subject=subjects.state_epoch,
        )

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            max_bytes=self.max_bytes,
            discard=DiscardPolicy.NEW,
            allow_msg_ttl=True,
            allow_direct=True,
            num_replicas=self.replicas,
        )


def unfit(config: StreamConfig) -> str:
    """Why an existing stream cannot be the state stream (a setting a row relies on is not
    as §4.21 says), or ""."""
    if config.max_msgs_per_subject != 1:
        return "it keeps more than one message per subject (max_msgs_per_subject must be 1)"
    if not config.allow_msg_ttl:
        return "it does not allow per-message TTL (allow_msg_ttl; nats-server 2.11+)"
    if not config.allow_direct:
        return "it does not allow direct gets (allow_direct)"
    return ""


async def make_state_stream(js: JetStreamContext, stream: StateStream) -> bool:
    """Create the state stream if it is missing (True: made now); an existing one keeps its
    settings but must be fit to be the state stream (StreamUnavailable says why not). Either
    way its epoch is written if it has none (:func:`write_epoch`)."""
    try:
        made = await create_missing(js, stream.config(), "state_stream_created")
        if not made:
            why = unfit((await js.stream_info(stream.name)).config)
            if why:
                raise StreamUnavailable(
                    f"{stream.name} is there but {why}: delete it to have it made"
                )
        await write_epoch(js, stream)
    except nats.js.errors.APIError as exc:  # e.g. a server older than 2.11: no msg TTL
        raise StreamUnavailable(f"{stream.name}: {exc.description or exc!r}") from None
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise StreamUnavailable(f"{stream.name}: {exc!r}") from None
    return made


async def write_epoch(js: JetStreamContext, stream: StateStream) -> str:
    """Write a new random epoch into the stream if it has none (§4.21): once, never replaced
    and never expiring (no TTL), so a view built from this stream tells it from one made
    again (whose epoch differs). A purged stream has none until its maker's next start.
    Returns the epoch written, or "" when the stream had one (written by another maker
    meanwhile included: the expected last subject sequence 0 lets one write win)."""
    epoch = StateEpoch(epoch=str(ULID()), at_ms=now_ms())
    try:
        await js.publish(
            stream.epoch_subject, encode(epoch), stream=stream.name, headers={EXPECT_NO_EPOCH: "0"}
        )
    except nats.js.errors.APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            return ""
        raise
    log.info("state_epoch_written", stream=stream.name, epoch=epoch.epoch)
    return epoch.epoch


async def ensure_state_stream(js: JetStreamContext, stream: StateStream) -> bool:
    """:func:`make_state_stream`, its failure logged (the exchange's start goes on: the
    suppliers' rows wait until the stream is there)."""
    try:
        await make_state_stream(js, stream)
    except StreamUnavailable as exc:
        log.error("state_stream_unavailable", stream=stream.name, error=str(exc))
        return False
    return True
