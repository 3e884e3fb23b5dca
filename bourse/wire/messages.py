"""Wire contract v1: every message Bourse puts on NATS, and its JSON codec.

One module, imported by the supplier, the exchange and the buyer. Messages are msgspec
Structs tagged by a ``type`` field whose value is the class name. Receivers skip fields they
do not know (so a newer peer may add optional fields); types and ranges are checked strictly
on decode (no "2" for 2), and a decode error names the offending field by its JSON path.
See docs/protocol.md for the prose version with an example of every message.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec
from ulid import ULID

from bourse.wire.limits import (
    CHECK_PATH_PATTERN,
    DEFAULT_DEADLINE_MS,
    DEFAULT_EXEC_TIMEOUT_S,
    DIGEST_PATTERN,
    ENV_KEY_PATTERN,
    EXEC_SESSION_PATTERN,
    EXEC_WINDOW_BYTES,
    ID_PATTERN,
    IMAGE_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MACHINE_ID_PATTERN,
    MACHINE_ID_SEPARATOR,
    MAX_BATCH_ITEMS,
    MAX_BATCH_OFFERS,
    MAX_CHECK_PATH,
    MAX_CHECKS,
    MAX_CPU_MILLIS,
    MAX_CPUS,
    MAX_DEADLINE_MS,
    MAX_DISK_MB,
    MAX_ENV,
    MAX_ENV_VALUE,
    MAX_EXEC_ARG,
    MAX_EXEC_ARGS,
    MAX_EXEC_CHUNK,
    MAX_EXEC_TIMEOUT_S,
    MAX_EXEC_WINDOW_BYTES,
    MAX_GPUS,
    MAX_HOLD_MS,
    MAX_LAYER_BYTES,
    MAX_LAYERS,
    MAX_MEMORY_MB,
    MAX_PORTS,
    MAX_SUBJECT,
    MILLIS_PER_CPU,
    ORDER_ID_PATTERN,
    PORT_NAME_PATTERN,
    PRIVATE_ADDRESS_PATTERN,
)
from bourse.wire.metadata import check_restart

Region = Annotated[str, msgspec.Meta(pattern=ID_PATTERN, description="region id")]
WorkerId = Annotated[str, msgspec.Meta(pattern=ID_PATTERN, description="worker id")]
# A worker id, or "" where the subject already says which worker (or "every worker").
OptionalWorkerId = Annotated[str, msgspec.Meta(pattern=r"^([a-z0-9][a-z0-9-]{0,62})?\Z")]
OrderId = Annotated[str, msgspec.Meta(pattern=ORDER_ID_PATTERN)]
MachineId = Annotated[str, msgspec.Meta(pattern=MACHINE_ID_PATTERN)]
Image = Annotated[str, msgspec.Meta(pattern=IMAGE_PATTERN)]
# The manifest digest an image reference resolved to (``sha256:<hex>``), or "" (a name that
# no image store knows: a worker's catalog image).
Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]
LabelKey = Annotated[str, msgspec.Meta(pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, msgspec.Meta(pattern=LABEL_VALUE_PATTERN)]
Labels = Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=64)]
Metadata = Annotated[
    dict[
        Annotated[str, msgspec.Meta(min_length=1, max_length=64)],
        Annotated[str, msgspec.Meta(max_length=1024)],
    ],
    msgspec.Meta(max_length=64),
]
PortName = Annotated[str, msgspec.Meta(pattern=PORT_NAME_PATTERN)]
# A machine's named ports, each given a host port by the worker (distinct names).
Ports = Annotated[list[PortName], msgspec.Meta(max_length=MAX_PORTS)]
EnvKey = Annotated[str, msgspec.Meta(pattern=ENV_KEY_PATTERN)]
Env = Annotated[
    dict[EnvKey, Annotated[str, msgspec.Meta(max_length=MAX_ENV_VALUE)]],
    msgspec.Meta(max_length=MAX_ENV),
]
# A machine's restart policy: "" (none given) or one of RESTART_POLICIES
# (bourse/wire/metadata.py; checked where a message is made or decoded).
RestartField = Annotated[str, msgspec.Meta(max_length=16)]
# A port name -> the "host:port" a machine's named port is reached at.
Addresses = dict[str, str]
# A machine's address in its network of its own (an IPv4 address, no port), reached from its
# worker's host; "" when it shares the host's network (or its worker does not say).
PrivateAddress = Annotated[str, msgspec.Meta(max_length=15, pattern=PRIVATE_ADDRESS_PATTERN)]
Score = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Millis = Annotated[int, msgspec.Meta(ge=0)]

UnfilledReason = Literal[
    "no_workers", "no_offers", "below_min_score", "all_commits_rejected", "deadline"
]
RejectReason = Literal["no_hold", "hold_expired", "insufficient", "draining"]
ErrorCode = Literal["bad_request", "unknown_subject", "internal"]
# "failed": a process killed at its memory limit or by a signal.
MachineState = Literal[
    "reserved", "starting", "started", "stopping", "stopped", "failed", "destroyed"
]
MACHINE_VERBS = ("get", "list", "start", "stop", "destroy", "logs")
# Every kind of event (docs/protocol.md §6.9).
EVENT_KINDS = (
    "placed",
    "started",
    "stopped",
    "failed",
    "restarted",
    "destroyed",
    "hold_expired",
    "pulled",
    "check",
    "command",
    "exec",
)
# How a worker confines its machines (docs/protocol.md §4.12); "" = not said.
Confinement = Literal["", "cgroup2", "cgroup1", "rlimit", "none"]
# What its machines have of their own on the host (§4.12): users (a block of host ids) and a
# network (a namespace with a private address); "" = not said (an older worker).
IsolationLevel = Literal["", "users,network", "users", "none"]
# An order outcome the exchange publishes (no worker has a change to report);
# its Event's worker_id is EXCHANGE_EVENT_WORKER, reserved for it (docs/protocol.md §6.9).
UNFILLED_EVENT = "unfilled"
EXCHANGE_EVENT_WORKER = "exchange"


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch (only for timestamps shown to people)."""
    return time.time_ns() // 1_000_000


def new_order_id() -> str:
    return str(ULID())


def new_machine_id(worker_id: str) -> str:
    return f"{worker_id}{MACHINE_ID_SEPARATOR}{ULID()}"


def worker_of_machine(machine_id: str) -> str:
    """The worker id embedded in a machine id (``<worker_id>~<ulid>``)."""
    return machine_id.split(MACHINE_ID_SEPARATOR, 1)[0]


def check_cpu_millis(cpus: int, cpu_millis: int) -> None:
    """``cpu_millis`` (§4.1), when present (non-zero), is the CPU amount in
    millicores and ``cpus`` must be it rounded up to whole CPUs: a receiver that reads only
    ``cpus`` then never counts less than was asked. A message where the two disagree is
    refused (bad_request naming ``cpu_millis``) rather than read two ways by two peers."""
    if cpu_millis and cpus != -(-cpu_millis // MILLIS_PER_CPU):
        raise ValueError(
            f"cpu_millis {cpu_millis} needs cpus {-(-cpu_millis // MILLIS_PER_CPU)} (the "
            f"millicores rounded up to whole CPUs), not {cpus}"
        )


class Resources(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An amount of every resource a worker sells. Memory and disk in MiB. CPU: ``cpus``
    whole, or ``cpu_millis`` (1000 = one CPU; 0 = absent) beside ``cpus``
    rounded up, e.g. half a CPU is ``cpus: 1, cpu_millis: 500`` (docs/protocol.md §4.1).
    Read it with bourse/wire/resources.py's ``vec``, never ``cpus`` alone."""

    cpus: Annotated[int, msgspec.Meta(ge=1, le=MAX_CPUS)]
    memory_mb: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMORY_MB)]
    disk_mb: Annotated[int, msgspec.Meta(ge=0, le=MAX_DISK_MB)] = 0
    gpus: Annotated[int, msgspec.Meta(ge=0, le=MAX_GPUS)] = 0
    cpu_millis: Annotated[int, msgspec.Meta(ge=0, le=MAX_CPU_MILLIS)] = 0

    def __post_init__(self) -> None:
        if self.cpu_millis:
            check_cpu_millis(self.cpus, self.cpu_millis)


class Amount(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Like Resources but may be zero everywhere: committed or held totals, capacities.
    ``cpu_millis`` as in Resources (present when the amount is not whole)."""

    cpus: Annotated[int, msgspec.Meta(ge=0)] = 0
    memory_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    disk_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    gpus: Annotated[int, msgspec.Meta(ge=0)] = 0
    cpu_millis: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Host ports (a worker's port range, counted like any resource): 0 from a worker
    # without one.
    ports: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.cpu_millis:
            check_cpu_millis(self.cpus, self.cpu_millis)


class Check(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """A health check the worker runs on one of the machine's named ports: ``http`` (a GET
    of ``path``, passing on a 2xx or 3xx status) or ``tcp`` (a connection is accepted)."""

    port: PortName
    kind: Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9]{0,15}\Z")]
    path: Annotated[str, msgspec.Meta(max_length=MAX_CHECK_PATH, pattern=CHECK_PATH_PATTERN)] = ""
    interval_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = 10.0
    timeout_s: Annotated[float, msgspec.Meta(ge=0.01, le=600)] = 2.0


Checks = Annotated[list[Check], msgspec.Meta(max_length=MAX_CHECKS)]


class Health(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """What a machine's checks say: ``passing`` (every check passed its last run),
    ``critical`` (one failed), or ``""`` (not checked yet); since when, how many runs in a
    row the failing check failed, and what the last failure said."""

    status: Annotated[str, msgspec.Meta(max_length=16)] = ""
    since_ms: Millis = 0
    failures: Annotated[int, msgspec.Meta(ge=0)] = 0
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Layer(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One layer of an image, as its manifest lists it: what a worker lacking it pulls."""

    digest: Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}\Z")]
    size: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYER_BYTES)]


Layers = Annotated[list[Layer], msgspec.Meta(max_length=MAX_LAYERS)]


class Message(msgspec.Struct, tag_field="type", tag=True, kw_only=True, gc=False):
    """Base of every wire message: tagged by ``type`` = class name.

    ``gc=False`` (inherited): messages are plain data that never refer back to themselves,
    so the cyclic GC need not track the thousands decoded per second, nor every machine a
    supplier keeps."""


class PlaceOrder(Message, kw_only=True):
    order_id: OrderId = msgspec.field(default_factory=new_order_id)
    region: Region
    resources: Resources
    image: Image
    constraints: Labels = {}
    exclude_workers: Annotated[list[WorkerId], msgspec.Meta(max_length=1024)] = []
    min_score: Score = 0.0
    deadline_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_DEADLINE_MS)] = DEFAULT_DEADLINE_MS
    metadata: Metadata = {}
    # This order id may have been placed before (a retry after an error or a
    # lost reply). The auction then gathers offers for its quiet window before committing a
    # NEW machine, so the worker that already has one can answer first (I3).
    retry: bool = False
    # The machine's named ports (the worker gives each a host port: PORT, BOURSE_PORT_<NAME>,
    # BOURSE_ADDR_<NAME>), its environment (beside the image's and Bourse's own), and the
    # health checks the worker runs on its ports.
    ports: Ports = []
    env: Env = {}
    checks: Checks = []
    # The machine's restart policy (bourse/wire/metadata.py): "", "no", "on-failure" or
    # "always"; v1's metadata["restart"] says the same, and this wins where both are.
    restart: RestartField = ""

    def __post_init__(self) -> None:
        check_ports(self.ports, self.checks)
        check_restart(self.restart)


# The kinds of check a worker runs (protocol §4.2a).
CHECK_KINDS = ("http", "tcp")


def check_ports(ports: list[str], checks: list[Check]) -> None:
    """Named ports are distinct, even upper-cased (each names the variables
    ``BOURSE_PORT_<NAME>``), every check is on one of them, of a known kind, an http one
    with a path from ``/`` (protocol §4.2a): a message that breaks one is refused
    (bad_request naming it)."""
    upper = [p.upper() for p in ports]
    if len(set(upper)) != len(upper):
        twice = sorted({p for p in ports if upper.count(p.upper()) > 1})
        raise ValueError(f"port {twice[0]!r} is named twice (names are told apart upper-cased)")
    for c in checks:
        if c.port not in ports:
            raise ValueError(f"check on port {c.port!r}, which the order does not name")
        if c.kind not in CHECK_KINDS:
            raise ValueError(f"check kind {c.kind!r}: use {' or '.join(CHECK_KINDS)}")
        if c.kind == "http" and not c.path.startswith("/"):
            raise ValueError(f"http check on port {c.port!r}: its path must start with /")


class Bid(Message, kw_only=True):
    order_id: OrderId
    region: Region
    resources: Resources
    image: Image
    constraints: Labels = {}
    exclude_workers: Annotated[list[WorkerId], msgspec.Meta(max_length=1024)] = []
    hold_ms: Annotated[int, msgspec.Meta(ge=1, le=MAX_HOLD_MS)]
    # Unique per auction run, so a Release from one run never drops the hold
    # of a retry of the same order, and a bid that arrives after its own release is ignored.
    auction_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # A worker whose free capacity is only taken by other orders' HOLDS (not by
    # committed machines) may keep the bid up to wait_ms and answer as soon as a hold is
    # released. 0 = answer now or stay silent. This keeps concurrent orders from starving
    # each other when every order holds on every fitting worker.
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_DEADLINE_MS)] = 0
    # The auction takes an ``Offers`` message (several offers in one reply); a
    # supplier process may then answer with one message for all its offers. Without it (an
    # older auction), every offer is an ``Offer`` message of its own.
    batch_offers: bool = False
    # Only with ``batch_offers``: the auction ranks the offers itself. A
    # supplier process answers at once, without its score-spread delays, with ONE Offers
    # message naming itself (``responder``) and giving each offer the delay it would have
    # waited (``delay_ms``), or an empty Offers when it has nothing to offer now. The auction
    # commits the best offer once every process it knows in the region has answered, else
    # when the best offer's delay has passed (docs/protocol.md §4.4.3).
    prompt_offers: bool = False
    # The image's content, resolved where the order entered (§4.3a): its manifest digest and
    # its layers, so a worker prices the bytes it lacks without asking anyone. Both empty for
    # a name no image store knows (a worker's catalog image).
    image_digest: Digest = ""
    layers: Layers = []
    # The order's named ports: a worker offers only with a free host port for each.
    ports: Ports = []


class Offer(Message, kw_only=True):
    order_id: OrderId
    worker_id: WorkerId
    region: Region
    score: Score
    subscores: dict[str, float] = {}
    image_cached: bool = False
    hold_expires_at_ms: Millis = 0
    # Set when this worker already runs a machine for this order id, so a
    # retried order is answered with the machine it already has (I3).
    machine_id: MachineId | None = None
    # The bid's auction_id, echoed so the
    # signature binds the offer to one auction run; the signer's public user nkey (U...);
    # the ed25519 signature (base64url, no padding) of exchange/signing.offer_signing_bytes.
    auction_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    signer: Annotated[str, msgspec.Meta(max_length=64)] = ""
    sig: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # Only in an Offers answering a Bid with ``prompt_offers``: the score-spread
    # delay the worker would have waited before sending this offer alone (ms). The auction
    # takes the offer as if it had arrived that much later unless every known process has
    # answered. A ranking hint: not signed.
    delay_ms: Annotated[float, msgspec.Meta(ge=0, le=MAX_DEADLINE_MS)] = 0.0


class Offers(Message, kw_only=True):
    """Sent only in answer to a Bid with ``batch_offers``: the offers of one
    supplier process for the bid, in one message, each an ``Offer`` as it would be sent
    alone (signed on its own, checked on its own: foreign ones are dropped one by one). It
    goes out at its best offer's delay; for a Bid with ``prompt_offers``, at once, with
    ``responder`` set, and empty when the process has nothing to offer."""

    offers: Annotated[list[Offer], msgspec.Meta(max_length=MAX_BATCH_OFFERS)]
    # With ``prompt_offers``: the answering supplier process (an id it picks at
    # start, unique among the region's processes), so the auction knows who has answered.
    responder: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # With ``prompt_offers``: the bid's auction_id, echoed (an empty answer has
    # no offer to carry it; an ``Answers`` message is routed by it).
    auction_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # This process also takes ``Batch`` messages (§4.4.4) on its regions'
    # ``<root>.bid.<region>.batch``.
    batches: bool = False


class Waiting(Message, kw_only=True):
    """Sent only in answer to a Bid with ``wait_ms > 0``: this worker cannot offer
    now only because other orders HOLD its capacity; it will send an Offer within ``wait_ms``
    if they are released. A later Waiting with ``wait_ms = 0`` withdraws (the capacity went to
    committed machines). The auction keeps listening while a worker waits."""

    order_id: OrderId
    worker_id: WorkerId
    region: Region
    wait_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_DEADLINE_MS)]


class Commit(Message, kw_only=True):
    order_id: OrderId
    worker_id: WorkerId
    resources: Resources
    image: Image
    metadata: Metadata = {}
    # The auction's id, and "once placed, drop this order's other holds
    # of that auction in your process yourself": every offer came from this process, so
    # the auction sends no region release.
    auction_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    release_others: bool = False
    # The content the machine runs (the Bid's image_digest): "" for a catalog image.
    image_digest: Digest = ""
    # The order's ports, environment, checks and restart policy, kept with the machine.
    ports: Ports = []
    env: Env = {}
    checks: Checks = []
    restart: RestartField = ""

    def __post_init__(self) -> None:
        check_ports(self.ports, self.checks)
        check_restart(self.restart)


class Placed(Message, kw_only=True):
    order_id: OrderId
    machine_id: MachineId
    worker_id: WorkerId
    region: Region
    score: Score
    image_cached: bool
    elapsed_ms: Annotated[float, msgspec.Meta(ge=0)]
    # Why this worker won (the winning offer's subscores), and whether this
    # reply re-reports a machine that an earlier attempt with the same order id created.
    subscores: dict[str, float] = {}
    existing: bool = False
    # The content the machine runs: "" for a catalog image.
    image_digest: Digest = ""
    # Where its named ports are reached: name -> "host:port" (the worker's advertised host).
    addresses: Addresses = {}
    # The worker runs nothing (its driver is ``sim``): the machine exists on the market
    # only. An answer from an existing-machine offer does not say (false).
    simulated: bool = False
    # Its address in its network of its own (§4.12; "" when it shares its host's network;
    # an answer from an existing-machine offer does not say).
    private_address: PrivateAddress = ""

    # The three ways a Placed is made, in one home (docs/protocol.md §4.7).
    @classmethod
    def of_machine(
        cls,
        m: Machine,
        *,
        image_cached: bool,
        elapsed_ms: float,
        subscores: dict[str, float] | None = None,
        existing: bool = False,
    ) -> Placed:
        """A worker's commit reply for machine ``m`` (``existing``: it re-reports a machine
        an earlier commit of the same order id created)."""
        return cls(
            order_id=m.order_id,
            machine_id=m.machine_id,
            worker_id=m.worker_id,
            region=m.region,
            score=m.score,
            image_cached=image_cached,
            elapsed_ms=elapsed_ms,
            subscores=subscores or {},
            existing=existing,
            image_digest=m.image_digest,
            addresses=m.addresses,
            simulated=m.simulated,
            private_address=m.private_address,
        )

    @classmethod
    def of_commit(cls, reply: Placed, offer: Offer, *, elapsed_ms: float) -> Placed:
        """The auction's answer for a committed offer: the machine (and ``existing``) as the
        worker reports it, the score, cache flag and subscores of the offer that won."""
        return cls(
            order_id=reply.order_id,
            machine_id=reply.machine_id,
            worker_id=reply.worker_id,
            region=reply.region,
            score=offer.score,
            image_cached=offer.image_cached,
            elapsed_ms=elapsed_ms,
            subscores=offer.subscores,
            existing=reply.existing,
            image_digest=reply.image_digest,
            addresses=reply.addresses,
            simulated=reply.simulated,
            private_address=reply.private_address,
        )

    @classmethod
    def of_offer(cls, offer: Offer, *, elapsed_ms: float, image_digest: str = "") -> Placed:
        """The auction's answer to an existing-machine offer (``offer.machine_id`` set: the
        order was placed before on that worker): no commit, ``existing`` true, no subscores;
        ``image_digest``: the machine's, as its worker shows it."""
        if offer.machine_id is None:
            raise ValueError(f"offer from {offer.worker_id} names no machine")
        return cls(
            order_id=offer.order_id,
            machine_id=offer.machine_id,
            worker_id=offer.worker_id,
            region=offer.region,
            score=offer.score,
            image_cached=offer.image_cached,
            elapsed_ms=elapsed_ms,
            existing=True,
            image_digest=image_digest,
        )


class Rejected(Message, kw_only=True):
    order_id: OrderId
    worker_id: WorkerId
    reason: RejectReason
    detail: str = ""


class Unfilled(Message, kw_only=True):
    order_id: OrderId
    region: Region
    reason: UnfilledReason
    offers: Annotated[int, msgspec.Meta(ge=0)]
    commits_tried: Annotated[int, msgspec.Meta(ge=0)]
    elapsed_ms: Annotated[float, msgspec.Meta(ge=0)]
    detail: str = ""


# Error.reason of a refusal for overload (admission or the order backlog): nothing was bid;
# try again later or elsewhere.
OVERLOADED_REASON = "overloaded"
# A machine was placed but the order's claim could not name it: send the order again under
# the same id (docs/protocol.md §5.3c).
UNRECORDED_REASON = "unrecorded"
# The order claims' store is full: nothing was placed; send the order again later under the
# same id (docs/protocol.md §5.3c).
STORE_FULL_REASON = "store_full"
# The exchange stopped before the order had an outcome: send it again under the same id
# (docs/protocol.md §5.5).
SHUTTING_DOWN_REASON = "shutting_down"
# The order's image names a digest the image store does not hold: nothing was bid
# (docs/protocol.md §4.3a).
IMAGE_UNKNOWN_REASON = "image_unknown"


class Error(Message, kw_only=True):
    code: ErrorCode
    detail: str
    # A machine-readable refinement of ``code`` (a free string, so a peer that
    # does not know a value still decodes it; "" = none). Today: OVERLOADED_REASON,
    # UNRECORDED_REASON, STORE_FULL_REASON, SHUTTING_DOWN_REASON and IMAGE_UNKNOWN_REASON.
    reason: str = ""


class BatchBid(msgspec.Struct, kw_only=True, gc=False):
    """One bid of a ``Batch``, with the reply subject it would have been published with."""

    reply: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SUBJECT)]
    bid: Bid


class Batch(Message, kw_only=True):
    """The bids and region releases one auction process sent to one
    region in the same instant, in one message on ``<root>.bid.<region>.batch``, to the
    supplier processes that said they take it (``Offers.batches``). Each bid is answered
    as if it had come alone to its ``reply``; a process may instead send its prompt answers
    (``Offers``) to all of them as one ``Answers`` message to ``answers_to``."""

    bids: Annotated[list[BatchBid], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = []
    releases: Annotated[list[Release], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = []
    answers_to: Annotated[str, msgspec.Meta(max_length=MAX_SUBJECT)] = ""


class Answers(Message, kw_only=True):
    """One supplier process's prompt answers (``Offers`` with
    ``auction_id``) to the bids of one ``Batch``, sent to its ``answers_to``."""

    answers: Annotated[list[Offers], msgspec.Meta(max_length=MAX_BATCH_ITEMS)]


class Release(Message, kw_only=True):
    """Drop the hold for an order. On a worker's subject ``worker_id`` is that worker; on a
    region's release subject it is empty and every worker of the region drops its hold.

    ``abort_commit``: the auction gave up waiting for this worker's commit
    reply; if the commit went through, the worker destroys that never-started machine so
    the ``Unfilled`` the buyer saw stays true (I4).
    """

    order_id: OrderId
    worker_id: OptionalWorkerId = ""
    auction_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    abort_commit: bool = False


class StatusRequest(Message, kw_only=True):
    """Scatter-gather: every worker of the region answers with its WorkerStatus."""


class WorkerStatus(Message, kw_only=True):
    worker_id: WorkerId
    region: Region
    labels: dict[str, str]
    capacity: Amount
    committed: Amount
    held: Amount
    images: list[str]
    machines: Annotated[int, msgspec.Meta(ge=0)]
    draining: bool
    holds: Annotated[int, msgspec.Meta(ge=0)] = 0  # number of live holds
    # Why the worker is draining ("configured", "store: database or disk is
    # full", ...); "" when it is not.
    drain_reason: str = ""
    # How its machines are held to what was sold (§4.12); "" from older workers.
    confinement: Confinement = ""
    # False when its supplier runs without JetStream (``--no-jetstream``, the
    # degraded mode: its events at most once); True from older workers, which do not say.
    jetstream: bool = True
    # Its image cache (§6.10): bytes used on disk and its budget, and the manifest digests
    # of the images it holds unpacked (0 / [] from a worker without one).
    cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    cache_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    image_digests: Annotated[list[Digest], msgspec.Meta(max_length=4096)] = []
    # How it runs machines: its driver ("sim", "process", "oci") and, for "oci", the
    # runtime and its version ("runc 1.1.5"); "" from a worker that does not say.
    driver: Annotated[str, msgspec.Meta(max_length=32)] = ""
    runtime: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # The host its machines' addresses name, and its port range ("20000-20999"; "": none).
    advertise_host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    port_range: Annotated[str, msgspec.Meta(max_length=32)] = ""
    # What its machines have of their own (§4.12): "users,network", "users" or "none".
    isolation: IsolationLevel = ""


# -- the state stream (docs/protocol.md §4.21) ------------------------------------------------
# A heartbeat names at most this many workers; a process with more sends one heartbeat per
# this many (each keyed by its first worker).
MAX_BEAT_WORKERS = 4096


class WorkerRow(Message, kw_only=True):
    """A worker as its supplier has it now, on ``<prefix>.v1.state.fleet.worker.<region>.
    <worker_id>`` of the state stream (§4.21): published when it changes (its free capacity,
    its drain, its image cache), the stream keeping the last one. ``free`` is its capacity
    less its committed machines (holds are left out: they last seconds). ``beat`` names the
    heartbeat that says it is alive: the worker whose ``state.fleet.beat`` subject its
    process beats on (§4.21)."""

    worker_id: WorkerId
    region: Region
    beat: WorkerId
    labels: dict[str, str] = {}
    capacity: Amount
    free: Amount
    machines: Annotated[int, msgspec.Meta(ge=0)] = 0
    draining: bool = False
    drain_reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    driver: Annotated[str, msgspec.Meta(max_length=32)] = ""
    runtime: Annotated[str, msgspec.Meta(max_length=128)] = ""
    confinement: Confinement = ""
    cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    cache_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    advertise_host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    port_range: Annotated[str, msgspec.Meta(max_length=32)] = ""
    # The supplier's version (its package's), for an operator rolling an upgrade out.
    version: Annotated[str, msgspec.Meta(max_length=64)] = ""
    at_ms: Millis = 0
    # What its machines have of their own (as in WorkerStatus, §4.12); "" unsaid.
    isolation: IsolationLevel = ""


class Heartbeat(Message, kw_only=True):
    """A supplier process is alive, on ``<prefix>.v1.state.fleet.beat.<region>.<beat>`` of
    the state stream (§4.21), every ``interval_ms``: ONE message for all its workers (up to
    MAX_BEAT_WORKERS: a process with more sends one per that many), named here. ``beat`` is
    the first of ``workers`` and the subject's last token; each worker's row names it. A
    view calls a worker ``gone`` once the heartbeat that names it is 3 intervals (at least
    3 s) old."""

    beat: WorkerId
    workers: Annotated[list[WorkerId], msgspec.Meta(max_length=MAX_BEAT_WORKERS)]
    at_ms: Millis
    interval_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 1000
    version: Annotated[str, msgspec.Meta(max_length=64)] = ""


class StateEpoch(Message, kw_only=True):
    """Who the state stream is, on ``<prefix>.v1.state.fleet.epoch`` (§4.21): a random id
    written once by whoever makes the stream (the exchange at its start, ``bourse jetstream
    init``), when the stream has none, and never replaced (no TTL). A stream made again
    has another one: a view built from the first rebuilds. ``at_ms``: when it was written."""

    epoch: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z]+\Z")]
    at_ms: Millis = 0


# Machines one EdgeActivity names at most (an edge with more sends the most recent).
MAX_ACTIVITY_MACHINES = 4096


class EdgeActivity(Message, kw_only=True):
    """An edge's requests per machine, on ``<prefix>.v1.edge.activity.<edge>`` (§4.23),
    every ``interval_ms``: each machine it sent a request to, with when the last one
    began (ms; one still in flight: ``at_ms``). Every edge reads every edge's; a machine
    none of them names for its app's idle time is idle. ``edge`` is the subject's last
    token; an edge that sends none for 3 intervals is gone."""

    edge: Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
    at_ms: Millis
    interval_ms: Annotated[int, msgspec.Meta(ge=1, le=60_000)] = 1000
    machines: Annotated[
        dict[MachineId, Millis], msgspec.Meta(max_length=MAX_ACTIVITY_MACHINES)
    ] = {}


class MachineRequest(Message, kw_only=True):
    """Body of machine.get / start / stop / destroy / logs."""

    machine_id: MachineId
    tail: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100  # logs only
    # Logs only: a byte offset from a previous MachineLogs.end; the reply then
    # holds the complete lines after it (``buyer machines logs --follow``); -1: the tail.
    since: Annotated[int, msgspec.Meta(ge=-1)] = -1
    # stop / destroy through the exchange only: when the worker does not answer, the
    # exchange keeps the request as a MachineCommand for it (§4.20) and answers with it.
    queue_if_away: bool = False


# The verbs a MachineCommand may carry (§4.20).
COMMAND_VERBS = ("stop", "destroy")
CommandVerb = Literal["stop", "destroy"]
# Who asked for a MachineCommand: the operator's key, the exchange for the shared buyer
# key, or the exchange for a tenant ("tenant:<name>", checked by the worker against the
# machine's order id).
OPERATOR_REQUESTER = "operator"
EXCHANGE_REQUESTER = "exchange"
TENANT_REQUESTER = "tenant:"
Requester = Annotated[
    str, msgspec.Meta(pattern=r"^(operator|exchange|tenant:[a-z0-9][a-z0-9-]{0,62})\Z")
]


class MachineCommand(Message, kw_only=True):
    """A lifecycle command kept for a worker that did not answer (§4.20): stored on
    ``<prefix>.v1.command.<worker_id>`` until that worker applies it, before it resumes its
    machines. Also the exchange's answer to a ``queue_if_away`` request it queued."""

    command_id: OrderId  # also its Nats-Msg-Id: the stream drops a second copy
    machine_id: MachineId
    worker_id: WorkerId  # the worker it is kept for (the machine's, by its id)
    verb: CommandVerb
    requested_by: Requester
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    at_ms: Millis = 0


# -- the operator's verbs on one worker (§4.22) ----------------------------------------------
# drain: it offers nothing more (its machines run on); stop: it leaves the market (answers
# nothing but these verbs; its machines stop as its supplier's stop would stop them);
# start: it serves again (a stopped one applies its kept commands before its machines
# resume; the operator's drain is lifted).
WorkerAction = Literal["drain", "stop", "start"]


class WorkerControl(Message, kw_only=True):
    """The operator's verb on one worker, request-reply on
    ``<prefix>.v1.control.<worker_id>``, answered by the supplier that hosts the worker,
    whether it serves or is stopped."""

    worker_id: WorkerId
    action: WorkerAction


class WorkerState(Message, kw_only=True):
    """The reply to a WorkerControl: the worker as it is after the verb."""

    worker_id: WorkerId
    region: Region
    # It answers the market (bids, status, its machines' verbs); False: stopped.
    serving: bool
    draining: bool
    drain_reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    machines: Annotated[int, msgspec.Meta(ge=0)] = 0  # its live machines


class ListMachines(Message, kw_only=True):
    """Body of machine.list. Through the exchange, ``worker_id`` says which worker to ask.

    The same body asks every worker of a region (or of
    every region) on ``<prefix>.v1.machines[.<region>]``, where ``worker_id`` "" means every
    worker the subject reaches; the filters below are applied by the worker; ``cursor``
    pages a worker's own ``machine.list``."""

    worker_id: OptionalWorkerId = ""
    include_destroyed: bool = False
    # Only machines in one of these states ([]: every state; "destroyed" here
    # lists destroyed machines even without include_destroyed).
    states: Annotated[list[MachineState], msgspec.Meta(max_length=8)] = []
    # Only machines whose metadata has app=<app> ("": any). Shorthand for
    # labels={"app": ...}: a deploy's machines carry their app's name there.
    app: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # Only machines whose METADATA has every key=value given. An order's
    # constraints (worker labels) are not stored on its machine; its metadata is.
    labels: Metadata = {}
    # machine.list only: None = the whole list in one reply (as before; it may
    # exceed max_payload); a string = one page, of the machines whose id sorts after it
    # ("" for the first page), under a byte budget; MachineList.next_cursor says what to
    # send for the next one.
    cursor: Annotated[str, msgspec.Meta(max_length=128)] | None = None


class LastExit(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """How the machine's process last ended."""

    reason: Literal["exit", "signal", "oom"]
    code: int | None = None  # reason "exit": the exit code
    signal: int | None = None  # reason "signal" / "oom": the signal that killed it (9: oom)
    at_ms: Millis = 0
    # Why a start ended before its command ran (code 125), e.g. "pull_failed: ..." (§6.8).
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Machine(Message, kw_only=True):
    machine_id: MachineId
    order_id: OrderId
    worker_id: WorkerId
    region: Region
    state: MachineState
    resources: Resources
    image: Image
    metadata: dict[str, str] = {}
    score: Score = 0.0
    created_at_ms: Millis = 0
    updated_at_ms: Millis = 0
    # Destroyed because the auction gave up on its commit (Release.abort_commit);
    # such a machine does not hold its order id, so the order can be retried.
    aborted: bool = False
    # How its process last ended (None: it never ended), and how many times
    # the driver restarted it under its restart policy.
    last_exit: LastExit | None = None
    restarts: Annotated[int, msgspec.Meta(ge=0)] = 0
    # The constraints of the order it was placed for (with its region, resources, image and
    # metadata: what makes an order id's second order the same order, §5.3); None from a
    # worker that does not record them.
    constraints: Labels | None = None
    # The content it runs (the manifest digest it was placed with; a tag moved later does
    # not change it): "" for a catalog image.
    image_digest: Digest = ""
    # Where its named ports are reached (name -> "host:port"), held while it is reserved,
    # starting or started; its checks and what they say (None: it has no checks).
    addresses: Addresses = {}
    checks: Checks = []
    health: Health | None = None
    # The names of its order's environment variables (their values are not sent back).
    env_keys: Annotated[list[EnvKey], msgspec.Meta(max_length=MAX_ENV)] = []
    # Its restart policy, as its order gave it in the field of that name ("": none, or
    # given as v1's metadata["restart"]).
    restart: RestartField = ""
    # Its worker runs nothing (driver ``sim``): the machine exists on the market only.
    simulated: bool = False
    # Its address in its network of its own, kept from its commit to its destroy (§4.12):
    # its worker's host reaches it there; "" when it shares the host's network.
    private_address: PrivateAddress = ""


class MachineList(Message, kw_only=True):
    worker_id: WorkerId
    machines: list[Machine]
    # A paged list (ListMachines.cursor set) that has more: the cursor of the
    # next page. None: this was the last page (or the list was not paged).
    next_cursor: str | None = None


class MachinePage(Message, kw_only=True):
    """One page of one worker's machines, in answer to
    a ListMachines on ``<prefix>.v1.machines[.<region>]``. Every worker reached answers with
    pages 1..``pages`` (``last`` on the last), at least one even when nothing matches, each
    at most 60 KiB unless a single machine is larger (then it is alone on its page)."""

    worker_id: WorkerId
    region: Region
    page: Annotated[int, msgspec.Meta(ge=1)] = 1
    pages: Annotated[int, msgspec.Meta(ge=1)] = 1
    last: bool = True
    machines: list[Machine] = []


class MachineLogs(Message, kw_only=True):
    """Reply to machine.logs, the last lines of the machine's output (the
    process driver's log file; the sim driver has none)."""

    machine_id: MachineId
    lines: list[str]
    truncated: bool = False  # older lines (or over-long ones) were left out
    # The log's byte offset just past the last complete line read (pass it as
    # MachineRequest.since to get what follows); None from a worker older than the field.
    end: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Event(Message, kw_only=True):
    kind: str
    region: Region
    worker_id: WorkerId
    at_ms: Millis
    order_id: str = ""
    machine_id: str = ""
    detail: str = ""
    # The content concerned (placed, pulled, started ...): "" for a catalog image.
    image_digest: Digest = ""
    # A pull (kind "pulled"): the bytes fetched from the store and the seconds it took.
    bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    seconds: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # The machine's addresses (placed, started), and its health (kind "check").
    addresses: Addresses = {}
    health: Health | None = None
    # Its private address (placed, started: §4.12), "" when it has none.
    private_address: PrivateAddress = ""


# -- a command run inside a machine (§4.24) --------------------------------------------------
# Its verb on the machine subjects (request, then a stream: not one of MACHINE_VERBS, whose
# answer is one reply).
EXEC_VERB = "exec"
ExecSession = Annotated[str, msgspec.Meta(pattern=EXEC_SESSION_PATTERN)]
OptionalExecSession = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z0-9]{1,64})?\Z")]
ExecChunk = Annotated[bytes, msgspec.Meta(max_length=MAX_EXEC_CHUNK)]
TermSize = Annotated[int, msgspec.Meta(ge=1, le=10_000)]


class ExecRequest(Message, kw_only=True):
    """Run ``command`` inside a started machine, as the machine runs (its users, namespaces,
    cgroups, environment and working directory), on ``<prefix>.v1.machine.exec`` (a
    tenant's: ``tenant.<name>.machine.exec``); the exchange forwards it to
    ``worker.<id>.machine.exec`` with ``session`` and ``requester`` set. Its answers come on
    the request's reply subject: ExecStarted (or Error), ExecOutput and ExecAck, ExecExit."""

    machine_id: MachineId
    command: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_EXEC_ARG)]],
        msgspec.Meta(min_length=1, max_length=MAX_EXEC_ARGS),
    ]
    tty: bool = False  # a terminal (a pty): its output comes as stdout only
    stdin: bool = False  # input follows (ExecInput); False: the command's stdin is empty
    env: Env = {}  # over the machine's own
    rows: TermSize = 24  # the terminal's size (tty)
    cols: TermSize = 80
    timeout_s: Annotated[int, msgspec.Meta(ge=1, le=MAX_EXEC_TIMEOUT_S)] = DEFAULT_EXEC_TIMEOUT_S
    # Output bytes the worker may send before the client acknowledges them (ExecAck).
    window_bytes: Annotated[int, msgspec.Meta(ge=MAX_EXEC_CHUNK, le=MAX_EXEC_WINDOW_BYTES)] = (
        EXEC_WINDOW_BYTES
    )
    # Set by the exchange (whatever a client sent): the session's id and who asked
    # ("exchange" for the shared buyer key, "tenant:<name>"), for the machine's event.
    session: OptionalExecSession = ""
    requester: Annotated[str, msgspec.Meta(max_length=128)] = ""


class ExecStarted(Message, kw_only=True):
    """The command runs: ``input`` is where its ExecInput, ExecAck, ExecResize and
    ExecCancel go (``<prefix>.v1.exec.<session>``, a tenant's
    ``tenant.<name>.exec.<session>``; from the worker to the exchange, an inbox)."""

    session: ExecSession
    machine_id: MachineId
    input: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SUBJECT)]
    window_bytes: Annotated[int, msgspec.Meta(ge=MAX_EXEC_CHUNK, le=MAX_EXEC_WINDOW_BYTES)] = (
        EXEC_WINDOW_BYTES
    )


class ExecOutput(Message, kw_only=True):
    """A chunk of the command's output; ``offset``: the output's bytes before it (stdout and
    stderr counted together), so that a lost chunk is seen."""

    session: ExecSession
    stream: Literal["stdout", "stderr"] = "stdout"
    offset: Annotated[int, msgspec.Meta(ge=0)]
    data: ExecChunk


class ExecInput(Message, kw_only=True):
    """A chunk of the command's input (``offset``: the input's bytes before it); ``eof``:
    nothing follows (its stdin is closed)."""

    session: ExecSession
    offset: Annotated[int, msgspec.Meta(ge=0)]
    data: ExecChunk = b""
    eof: bool = False


class ExecAck(Message, kw_only=True):
    """``received``: the bytes of the other side's stream taken so far (the client: output
    written; the worker: input written to the command). Also says the sender is there:
    each side sends one at least every EXEC_KEEPALIVE_S."""

    session: ExecSession
    received: Annotated[int, msgspec.Meta(ge=0)]


class ExecResize(Message, kw_only=True):
    """The client's terminal changed size (tty)."""

    session: ExecSession
    rows: TermSize
    cols: TermSize


class ExecCancel(Message, kw_only=True):
    """End the command now (it is killed); ExecExit follows."""

    session: ExecSession


class ExecExit(Message, kw_only=True):
    """The command ended (the session's last message): its exit code, or the signal that
    killed it; ``detail`` says why when the worker ended it (time limit, cancel, silence) or
    could not run it (code 126/127)."""

    session: ExecSession
    code: int | None = None
    signal: int | None = None
    detail: Annotated[str, msgspec.Meta(max_length=1024)] = ""


# -- "why not": explain an order on every worker (§4.15) ---------
# A worker's answer to an ExplainRequest: it would offer (with its score), it already has a
# machine for the order, it would wait (only holds are in the way), or it declines. The
# client adds "no_answer" for a worker it knows (from status) that sent no verdict: a
# supplier that does not implement explain.
VerdictKind = Literal["offer", "existing", "wait", "decline", "no_answer"]
# A supplier answers an ExplainRequest in pages of at most this many bytes each (well under
# the server's 1 MiB max_payload), so a process of 10,000 workers answers in a few dozen.
EXPLAIN_PAGE_BYTES = 60 * 1024


class ExplainRequest(Message, kw_only=True):
    """ "Where would this order go, and why not elsewhere?" Scatter-gather on
    ``<prefix>.v1.explain.<region>``; every supplier answers for EVERY worker of the region
    (no sample), holding nothing. The order's fields as in a Bid, without ``hold_ms``."""

    order_id: OrderId = msgspec.field(default_factory=new_order_id)
    region: Region
    resources: Resources
    image: Image
    constraints: Labels = {}
    exclude_workers: Annotated[list[WorkerId], msgspec.Meta(max_length=1024)] = []
    # As in a Bid: the image's content, resolved where the request entered.
    image_digest: Digest = ""
    layers: Layers = []
    ports: Ports = []


class Reason(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One reason in a worker's verdict (nested, no ``type``). ``code`` is one of the named
    reasons of docs/protocol.md §6.2 (``draining``, ``excluded``, ``constraint_mismatch``,
    ``insufficient``, ``blocked_by_holds``, ``image_not_runnable``, ``commit_under_way``) or
    the price note ``image_not_cached``; ``detail`` says it in one line with the numbers.
    The other fields carry those numbers for scripts; a field that does not apply is
    left out."""

    code: str
    detail: str
    resource: str = ""  # insufficient / blocked_by_holds: the resource that is short
    want: int = 0  # ... how much the order wants of it
    free: int = 0  # ... capacity - committed - held
    capacity: int = 0
    committed: int = 0
    held: int = 0  # live holds of OTHER orders
    label: str = ""  # constraint_mismatch: the label key
    expected: str = ""  # ... the value the order requires
    actual: str | None = None  # ... the worker's value; None (left out) when it has none
    cost: float = 0.0  # image_not_cached: the score the image term costs (image_weight)


class WorkerVerdict(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One worker's answer to an ExplainRequest (nested, no ``type``)."""

    worker_id: WorkerId
    verdict: VerdictKind
    score: Score = 0.0  # offer / wait: the score it would offer with (as in an Offer)
    subscores: dict[str, float] = {}
    image_cached: bool = False
    machine_id: str = ""  # existing: the machine this order already has there
    reasons: list[Reason] = []  # decline / wait: why; offer: price notes (image_not_cached)


class Explanation(Message, kw_only=True):
    """One page of a supplier process's answer to an ExplainRequest. A process
    sends its verdicts in pages of at most EXPLAIN_PAGE_BYTES each; ``responder`` (random
    per answer) groups the pages of one process, ``page`` counts from 1 to ``pages`` and
    ``last`` is true on page ``pages``."""

    order_id: OrderId
    region: Region
    responder: Annotated[str, msgspec.Meta(max_length=64)]
    page: Annotated[int, msgspec.Meta(ge=1)] = 1
    pages: Annotated[int, msgspec.Meta(ge=1)] = 1
    last: bool = True
    verdicts: list[WorkerVerdict] = []


# A worker asks about at most this many of its reserved machines in one ReclaimCheck.
RECLAIM_BATCH = 100
ReclaimVerdictKind = Literal["keep", "orphan", "wait"]


class ReclaimCheck(Message, kw_only=True):
    """A worker asks whether its machines still
    ``reserved`` a while after their commit are their orders' machines. Request on
    ``<prefix>.v1.reclaim.<worker_id>`` (exchange queue group); each machine as the
    ``Placed`` that reports it (every one of the worker's own)."""

    worker_id: WorkerId
    machines: Annotated[list[Placed], msgspec.Meta(max_length=RECLAIM_BATCH)]


class ReclaimVerdict(msgspec.Struct, kw_only=True, gc=False):
    """One machine's verdict (nested, no ``type``): ``keep`` it, destroy it as an
    ``orphan``, or ``wait`` and ask again later."""

    machine_id: MachineId
    verdict: ReclaimVerdictKind
    detail: str = ""


class ReclaimVerdicts(Message, kw_only=True):
    """The reply to a ReclaimCheck, one verdict per machine asked about."""

    verdicts: list[ReclaimVerdict]


# An upload's id: it names the tenant's staged chunks (``<root>.stage.<tenant>.<upload>.…``).
UploadId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9]{1,64}\Z")]


class ImagePush(Message, kw_only=True):
    """A tenant asks the exchange to publish an image it staged (docs/protocol.md §4.18):
    the manifest ``manifest`` (of ``manifest_size`` bytes) and the blobs it names, each
    taken from the image store when it is there already, else from the staging stream's
    subject ``<root>.stage.<tenant>.<upload>.<hex>`` (checked against its digest and size),
    then the tag ``reference`` written."""

    reference: Image
    upload: UploadId
    manifest: Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}\Z")]
    manifest_size: Annotated[int, msgspec.Meta(ge=1, le=4 * 1024 * 1024)]


class ImageTag(Message, kw_only=True):
    """A tenant asks the exchange to give the image ``source`` names (a tag or a digest)
    the tag ``reference`` (§4.18)."""

    source: Image
    reference: Image


class ImageUntag(Message, kw_only=True):
    """A tenant asks the exchange to remove its tag ``reference`` (§4.18)."""

    reference: Image


class ImageTagged(Message, kw_only=True):
    """The answer to ImagePush, ImageTag and ImageUntag: the tag and the manifest digest it
    names now (for an untag: named until now)."""

    reference: Image
    digest: Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}\Z")]
    size: Annotated[int, msgspec.Meta(ge=0)] = 0  # a push: the image's bytes
    uploaded_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # a push: copied from staging
    reused_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0  # a push: in the store already


# Replies a requester may get, per request kind.
BidReply = Offer | Offers | Waiting
OrderReply = Placed | Unfilled | Error
CommitReply = Placed | Rejected | Error
MachineReply = Machine | MachineList | MachineLogs | MachineCommand | Error
ExplainReply = Explanation | Error
MachinesReply = MachinePage | Error  # machines.<region>
ReclaimReply = ReclaimVerdicts | Error
ControlReply = WorkerState | Error  # control.<worker_id>
ImageReply = ImageTagged | Error  # tenant.<name>.image.<verb>
ExecReply = ExecStarted | ExecOutput | ExecAck | ExecExit | Error  # machine.exec's answers
ExecFeed = ExecInput | ExecAck | ExecResize | ExecCancel  # on ExecStarted.input
# What the state stream holds (§4.21): a machine's row is the Machine as its worker has it.
StateRow = Machine | WorkerRow | Heartbeat | StateEpoch
