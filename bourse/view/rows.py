"""What one message of the state stream means to a view (docs/protocol.md §4.21), pure: its
subject parsed, its body decoded strictly and checked against the subject, the columns the
view's tables keep; or why it is dropped.

A row is dropped (and counted by its reason) when its subject is none of the stream's row
subjects (``unknown_subject``), its body is not the message its subject says
(``malformed``), or body and subject disagree: another worker's or region's machine or
worker, a machine whose order id names another owner than its subject, a heartbeat keyed by
another worker than its first (``foreign``). The grants already keep a supplier's key to its
own workers' subjects (§2.1); these checks keep a row from saying more than its subject.
The stream's epoch (``state.fleet.epoch``) is no row but is known: the view keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from bourse.wire.codec import BadMessage, decode
from bourse.wire.limits import MILLIS_PER_CPU
from bourse.wire.messages import (
    Amount,
    Heartbeat,
    LastExit,
    Machine,
    MachineState,
    StateEpoch,
    WorkerRow,
    worker_of_machine,
)
from bourse.wire.metadata import APP, GEN, ROLE, SLOT
from bourse.wire.resources import millis_of
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import SHARED_OWNER, owner_token

UNKNOWN_SUBJECT = "unknown_subject"
MALFORMED = "malformed"
FOREIGN = "foreign"
DROP_REASONS = (UNKNOWN_SUBJECT, MALFORMED, FOREIGN)


class _Amount(msgspec.Struct, frozen=True, gc=False):
    cpus: int
    memory_mb: int
    disk_mb: int = 0
    gpus: int = 0
    cpu_millis: int = 0


class _Health(msgspec.Struct, frozen=True, gc=False):
    status: str = ""
    since_ms: int = 0


class _Exit(msgspec.Struct, frozen=True, gc=False):
    reason: Literal["exit", "signal", "oom"]
    code: int | None = None
    signal: int | None = None
    at_ms: int = 0


class MachineCols(msgspec.Struct, frozen=True, gc=False, tag="Machine", tag_field="type"):
    """What a view reads of a ``Machine`` row: its columns, types and the closed set of
    states checked (a view builds from 100,000 of them: the wire type's every pattern
    would cost it five times the time; the subject check below is what a row must pass)."""

    machine_id: str
    order_id: str
    worker_id: str
    region: str
    state: MachineState
    resources: _Amount
    image: str
    image_digest: str = ""
    metadata: dict[str, str] = {}
    addresses: dict[str, str] = {}
    health: _Health | None = None
    restarts: int = 0
    last_exit: _Exit | None = None
    simulated: bool = False
    created_at_ms: int = 0
    updated_at_ms: int = 0


_MACHINE_COLS = msgspec.json.Decoder(MachineCols)


@dataclass(frozen=True, slots=True)
class MachineRowOp:
    """A machine's row: the columns of ``machines`` (``row``: the Machine's JSON)."""

    values: tuple[Any, ...]
    machine: MachineCols


@dataclass(frozen=True, slots=True)
class WorkerRowOp:
    values: tuple[Any, ...]
    row: WorkerRow


@dataclass(frozen=True, slots=True)
class BeatOp:
    beat: Heartbeat
    region: str


@dataclass(frozen=True, slots=True)
class EpochOp:
    """The stream's epoch (§4.21): what the view was built from."""

    epoch: str


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: str
    detail: str


Op = MachineRowOp | WorkerRowOp | BeatOp | EpochOp | Dropped

# The columns of ``machines`` a MachineRowOp fills, in order (the view adds
# worker_gone_since_ms, seq and seen_ms).
MACHINE_COLUMNS = (
    "machine_id",
    "order_id",
    "tenant",
    "worker_id",
    "region",
    "state",
    "app",
    "slot",
    "role",
    "generation",
    "image",
    "image_digest",
    "cpu_millis",
    "memory_mb",
    "disk_mb",
    "gpus",
    "addresses",
    "health",
    "health_since_ms",
    "restarts",
    "last_exit",
    "last_exit_at_ms",
    "simulated",
    "created_at_ms",
    "updated_at_ms",
    "row",
)
WORKER_COLUMNS = (
    "worker_id",
    "region",
    "beat",
    "labels",
    "cpu_millis",
    "memory_mb",
    "disk_mb",
    "gpus",
    "ports",
    "free_cpu_millis",
    "free_memory_mb",
    "free_disk_mb",
    "free_gpus",
    "free_ports",
    "machines",
    "draining",
    "drain_reason",
    "driver",
    "runtime",
    "confinement",
    "isolation",
    "cache_bytes",
    "cache_budget_bytes",
    "advertise_host",
    "port_range",
    "version",
    "at_ms",
    "row",
)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def exit_text(e: LastExit | _Exit | None) -> str | None:
    """A last exit as a column: ``exit 1``, ``signal 15``, ``oom``."""
    if e is None:
        return None
    if e.reason == "exit":
        return f"exit {e.code}"
    return "oom" if e.reason == "oom" else f"signal {e.signal}"


def machine_values(m: Machine | MachineCols, data: bytes) -> tuple[Any, ...]:
    """The ``machines`` columns of ``m`` (``data``: its JSON as the stream holds it)."""
    meta = m.metadata
    r = m.resources
    return (
        m.machine_id,
        m.order_id,
        "" if owner_token(m.order_id) == SHARED_OWNER else owner_token(m.order_id),
        m.worker_id,
        m.region,
        m.state,
        meta.get(APP),
        _int(meta.get(SLOT)),
        meta.get(ROLE),
        _int(meta.get(GEN)),
        m.image,
        m.image_digest,
        r.cpu_millis or r.cpus * MILLIS_PER_CPU,
        r.memory_mb,
        r.disk_mb,
        r.gpus,
        msgspec.json.encode(m.addresses).decode(),
        m.health.status if m.health is not None and m.health.status else None,
        m.health.since_ms if m.health is not None and m.health.status else None,
        m.restarts,
        exit_text(m.last_exit),
        m.last_exit.at_ms if m.last_exit is not None else None,
        int(m.simulated),
        m.created_at_ms,
        m.updated_at_ms,
        data.decode(),
    )


def _amount(a: Amount) -> tuple[int, int, int, int, int]:
    return (millis_of(a), a.memory_mb, a.disk_mb, a.gpus, a.ports)


def worker_values(w: WorkerRow, data: bytes) -> tuple[Any, ...]:
    return (
        w.worker_id,
        w.region,
        w.beat,
        msgspec.json.encode(w.labels).decode(),
        *_amount(w.capacity),
        *_amount(w.free),
        w.machines,
        int(w.draining),
        w.drain_reason,
        w.driver,
        w.runtime,
        w.confinement,
        w.isolation,
        w.cache_bytes,
        w.cache_budget_bytes,
        w.advertise_host,
        w.port_range,
        w.version,
        w.at_ms,
        data.decode(),
    )


class Reader:
    """Reads the state stream's messages of one market (``subjects``), for a view of every
    row or of one tenant's (``tenant``: then a machine row of another owner is foreign)."""

    def __init__(self, subjects: Subjects, tenant: str = "") -> None:
        self.state = f"{subjects.root}.state."
        self.tenant = tenant

    def read(self, subject: str, data: bytes) -> Op:
        """What the message on ``subject`` with body ``data`` is, or why it is dropped."""
        if not subject.startswith(self.state):
            return Dropped(UNKNOWN_SUBJECT, subject)
        t = subject[len(self.state) :].split(".")
        try:
            if t[0] == "machine" and len(t) == 5:
                return self._machine(t[1], t[2], t[3], t[4], data)
            if t[0] == "fleet" and len(t) == 4 and t[1] == "worker":
                return self._worker(t[2], t[3], data)
            if t[0] == "fleet" and len(t) == 4 and t[1] == "beat":
                return self._beat(t[2], t[3], data)
            if t == ["fleet", "epoch"]:
                return EpochOp(decode(data, StateEpoch).epoch)
        except BadMessage as exc:
            return Dropped(MALFORMED, f"{subject}: {exc}")
        return Dropped(UNKNOWN_SUBJECT, subject)

    def _machine(self, owner: str, region: str, worker: str, mid: str, data: bytes) -> Op:
        try:
            m = _MACHINE_COLS.decode(data)
        except msgspec.ValidationError as exc:
            raise BadMessage(f"invalid Machine: {exc}") from None
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
            raise BadMessage(f"malformed JSON: {exc}") from None
        said = (m.machine_id, m.worker_id, worker_of_machine(m.machine_id), m.region)
        if said != (mid, worker, worker, region):
            return Dropped(FOREIGN, f"machine row of {m.machine_id} on {worker}'s subject")
        if owner_token(m.order_id) != owner or (self.tenant and owner != self.tenant):
            return Dropped(FOREIGN, f"machine {m.machine_id} of order {m.order_id!r} as {owner}'s")
        return MachineRowOp(machine_values(m, data), m)

    def _worker(self, region: str, worker: str, data: bytes) -> Op:
        w = decode(data, WorkerRow)
        if (w.worker_id, w.region) != (worker, region):
            return Dropped(FOREIGN, f"worker row of {w.worker_id} on {worker}'s subject")
        return WorkerRowOp(worker_values(w, data), w)

    def _beat(self, region: str, beat: str, data: bytes) -> Op:
        hb = decode(data, Heartbeat)
        if hb.beat != beat or not hb.workers or hb.workers[0] != beat:
            return Dropped(FOREIGN, f"heartbeat {hb.beat} on {beat}'s subject")
        return BeatOp(hb, region)
