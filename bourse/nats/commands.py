"""The command stream: lifecycle commands (stop, destroy) kept for a worker that did not
answer, until that worker applies them (docs/protocol.md §4.20).

``<PREFIX>_COMMANDS`` over ``<prefix>.v1.command.*``: work-queue retention (a command is
removed once its worker acknowledges it), no age limit, a byte limit that refuses new
commands when full rather than drop kept ones, and the duplicate window that makes a
command sent twice under one ``Nats-Msg-Id`` one. The exchange makes it at its start (or
the operator, ``bourse jetstream init``); only the operator and the exchange publish into
it; each worker reads its own subject through a durable consumer of its own.

Whoever keeps a command first asks the machine's worker (``probe_or_keep``: the exchange
for a buyer's or tenant's ``queue_if_away`` request, a direct-mode buyer for itself): a
command is kept only for a worker that does not answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from bourse.errors import BourseError
from bourse.nats.jetstream import (
    DEFAULT_DUPLICATE_WINDOW_S,
    HEADER_MSG_ID,
    EventStream,
    create_missing,
    prefix_token,
)
from bourse.wire.codec import encode
from bourse.wire.messages import (
    CommandVerb,
    MachineCommand,
    MachineRequest,
    new_order_id,
    now_ms,
    worker_of_machine,
)
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.commands")

# The sizing rule (docs/operations.md): the stream must hold every command kept at once,
# which is at most two per machine (a stop, then a destroy) of the workers away together.
# One command as stored: ~330 B of JSON, its subject, its Nats-Msg-Id header and the
# store's record, rounded up.
COMMAND_BYTES = 640
COMMANDS_PER_MACHINE = 2
MIB = 1024 * 1024


def command_stream_bytes(workers_away: int, machines_per_worker: int) -> int:
    """The sizing rule: the bytes the stream needs for ``workers_away`` workers away at
    once with ``machines_per_worker`` machines each."""
    return math.ceil(COMMAND_BYTES * COMMANDS_PER_MACHINE * workers_away * machines_per_worker)


# The default: the rule for 1,000 workers away at once with 50 machines each (64 MB),
# rounded up to whole MiB.
DEFAULT_MAX_BYTES = -(-command_stream_bytes(1000, 50) // MIB) * MIB
# A command is well under this; a bigger message is refused by the stream.
MAX_COMMAND_BYTES = 4096
# How long a worker's fetch waits for a command while it runs (a long poll, not a pace).
FETCH_WAIT_S = 5.0
# How long a stop or destroy that may be kept waits for the machine's worker before the
# command is kept (a worker that answers does so in milliseconds; §4.20).
QUEUE_PROBE_S = 2.0


class CommandNotKept(BourseError, RuntimeError):
    """The command stream did not store a command (absent, full, or refused)."""


def command_stream_name(prefix: str) -> str:
    """The command stream of a subject prefix: ``bourse`` -> ``BOURSE_COMMANDS``."""
    return prefix_token(prefix) + "_COMMANDS"


def consumer_name(worker_id: str) -> str:
    """A worker's durable consumer of the command stream."""
    return f"cmd-{worker_id}"


@dataclass(frozen=True, slots=True)
class CommandStream(EventStream):
    """The command stream's name, subjects, byte limit and replicas (no age limit)."""

    @classmethod
    def of(cls, subjects: Subjects, *, replicas: int = 1, **limits: float) -> CommandStream:
        """The stream of ``subjects``' prefix; ``max_bytes`` as given, else the default."""
        return cls(
            name=command_stream_name(subjects.prefix),
            subjects=(subjects.command_all,),
            max_age_s=0.0,
            max_bytes=int(limits.get("max_bytes", DEFAULT_MAX_BYTES)),
            duplicate_window_s=DEFAULT_DUPLICATE_WINDOW_S,
            replicas=replicas,
        )

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_bytes=self.max_bytes,
            max_msg_size=MAX_COMMAND_BYTES,
            discard=DiscardPolicy.NEW,
            duplicate_window=self.duplicate_window_s,
            num_replicas=self.replicas,
        )


async def keep(js: JetStreamContext, subjects: Subjects, command: MachineCommand) -> None:
    """Store ``command`` for its worker (acknowledged by the stream; a second copy under the
    same ``command_id`` within the duplicate window is dropped). CommandNotKept says why
    it was not stored."""
    try:
        await js.publish(
            subjects.command(command.worker_id),
            encode(command),
            stream=command_stream_name(subjects.prefix),
            headers={HEADER_MSG_ID: command.command_id},
        )
    except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
        # nats-py says a missing stream either way (no responders; no stream response)
        raise CommandNotKept("the command stream is not there (bourse jetstream init)") from None
    except nats.js.errors.APIError as exc:
        raise CommandNotKept(f"the command stream refused it: {exc.description}") from None
    except nats.errors.TimeoutError:
        raise CommandNotKept("the command stream did not acknowledge it in time") from None


async def make_command_stream(js: JetStreamContext, stream: CommandStream) -> bool:
    """Create the command stream if it is missing (True: made now); an existing one keeps
    its settings (an operator may have changed them)."""
    return await create_missing(js, stream.config(), "command_stream_created")


async def ensure_command_stream(js: JetStreamContext, stream: CommandStream) -> bool:
    """:func:`make_command_stream`, its failure logged (the exchange's start goes on: a
    ``queue_if_away`` request then gets an Error saying the command was not kept)."""
    try:
        await make_command_stream(js, stream)
    except (nats.js.errors.Error, nats.errors.Error) as exc:
        log.error("command_stream_unavailable", stream=stream.name, error=repr(exc))
        return False
    return True


def command_for(verb: str, machine_id: str, requested_by: str) -> MachineCommand:
    """A new command (its own id) to ``verb`` (stop or destroy) ``machine_id``, kept for
    the machine's worker, which did not answer."""
    worker_id = worker_of_machine(machine_id)
    return MachineCommand(
        command_id=new_order_id(),
        machine_id=machine_id,
        worker_id=worker_id,
        verb=msgspec.convert(verb, CommandVerb),
        requested_by=requested_by,
        reason=f"{verb} asked while worker {worker_id} did not answer",
        at_ms=now_ms(),
    )


async def probe_or_keep(
    nc: NATS,
    subjects: Subjects,
    verb: str,
    machine_id: str,
    requested_by: str,
    probe_s: float = QUEUE_PROBE_S,
) -> bytes | MachineCommand:
    """The machine's worker's answer to a ``get`` of it (the reply's bytes: the machine,
    or the worker's Error) when it answers within ``probe_s``; else ``verb`` (stop or
    destroy) kept for that worker in the command stream, and the MachineCommand kept
    (§4.20). CommandNotKept, naming the worker that does not answer, when it was not
    kept."""
    worker_id = worker_of_machine(machine_id)
    subject = subjects.worker_machine(worker_id, "get")
    body = encode(MachineRequest(machine_id=machine_id))
    try:
        return (await nc.request(subject, body, timeout=probe_s)).data
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        pass
    command = command_for(verb, machine_id, requested_by)
    try:
        await keep(nc.jetstream(), subjects, command)
    except CommandNotKept as exc:
        raise CommandNotKept(f"worker {worker_id!r} does not answer, and {exc}") from None
    return command


def consumer_config(subjects: Subjects, worker_id: str) -> ConsumerConfig:
    """A worker's durable consumer: its own subject only, each command acknowledged. Its
    name makes nats-py create it with the filter in the subject
    (``CONSUMER.CREATE.<stream>.cmd-<worker>.<filter>``): the only form a supplier's key may
    use, for its own workers only (bourse/nats/grants.py ``CONSUMERS_OWN``)."""
    return ConsumerConfig(
        name=consumer_name(worker_id),
        durable_name=consumer_name(worker_id),
        filter_subject=subjects.command(worker_id),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
    )
