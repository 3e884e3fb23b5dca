"""Who may do what with the market's JetStream, as ONE table (:data:`GRANTS`): the server
config grants each verb's API subjects from it (bourse/nats/permissions.py), docs/security.md
shows it (bourse/nats/permtable.py renders it), and tests/security/test_jetstream_grants.py
finds the same table again in the generated config and, verb by verb, on a live server.

Deny by default: a role may use a verb on a stream or bucket only where the table says so,
and no role may use JetStream on anything else (another stream, the account's listing).
Streams, buckets and their limits are made by the operator's set-up (``bourse jetstream
init``) or by the exchange at its start; no supplier, buyer or tenant key can create,
change, delete or purge one, or touch a consumer it did not make.

The resources of a market (names from bourse/nats/jetstream.py, one to one with the subject
prefix): the event stream ``<PREFIX>_EVENTS``, the order-claims KV bucket
``<PREFIX>_ORDERS``, the image store's Object Store ``<PREFIX>_IMAGES`` and its tag KV
bucket ``<PREFIX>_IMAGE_TAGS``, the image staging stream ``<PREFIX>_IMAGE_STAGING`` (a
tenant's pushes on their way in: it publishes its chunks on its own subjects, the subject
table; the exchange reads and clears them, bourse/images/staging.py); the apps' KV buckets
``<PREFIX>_APPS`` (specs) and ``<PREFIX>_APP_SECRETS``; the command stream
``<PREFIX>_COMMANDS`` (stops and destroys kept for a worker that was away: published by
the operator and the exchange on the subject table's ``R.command.<worker>``, read by each
worker through a durable consumer of its own, bourse/nats/commands.py); and the account
(JetStream as a whole).

A tenant's verbs on the apps' buckets are its *own* ones (``read own``, ``write own``,
``list own``): their subjects carry its keys' scope, ``<tenant>.``, so it reaches only
the keys under its name. A listing is a consumer made with its filter in the subject that
makes it (``CONSUMER.CREATE.<stream>.<name>.<filter>``: the server refuses a body whose
filter differs), and a tenant may not look a bucket up (a stream's info lists its
subjects: every tenant's keys).

A supplier's verbs on the command stream are its *own workers'* (``consumers own``, ``pull
own``): their subjects carry each of its workers' durable consumer, ``cmd-<worker>``, made
only with that worker's subject as its filter (in the subject that makes it), so a supplier
key makes, fetches from and acknowledges only its own workers' consumers, never another
worker's queued command.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bourse.nats.commands import command_stream_name, consumer_name
from bourse.nats.jetstream import (
    apps_bucket_name,
    claims_bucket_name,
    prefix_token,
    secrets_bucket_name,
    stream_name,
)
from bourse.nats.state import state_stream_name
from bourse.wire.subjects import Subjects

ROLE_OPERATOR = "operator"
ROLE_BUYER = "buyer"
ROLE_EXCHANGE = "exchange"
ROLE_SUPPLIER = "supplier"
# A buyer of its own (``auth init --buyer NAME``, user ``buyer:NAME``): bourse/nats/permissions.py.
ROLE_TENANT = "tenant"
# ``edge serve`` (every edge process shares one user): bourse/nats/permissions.py.
ROLE_EDGE = "edge"
ROLES = (ROLE_OPERATOR, ROLE_EXCHANGE, ROLE_SUPPLIER, ROLE_BUYER, ROLE_TENANT, ROLE_EDGE)

API = "$JS.API"
# A name the probes use where a verb's subject takes one (a consumer, a key, a stream that
# is none of the market's).
PROBE = "PROBE"
# Whose a verb's own subjects are: a tenant's (its keys), a worker's (its consumer).
OWN_TENANT = "tenant"
OWN_WORKER = "worker"


@dataclass(frozen=True, slots=True)
class Resource:
    """A stream or bucket of the market (``kind``: stream, kv, objects), or the account."""

    key: str
    title: str
    kind: str
    bucket: Callable[[str], str]  # prefix -> the stream's or bucket's name

    def stream(self, prefix: str) -> str:
        """The JetStream stream behind it (a bucket's is prefixed ``KV_`` or ``OBJ_``)."""
        name = self.bucket(prefix)
        return {"kv": f"KV_{name}", "objects": f"OBJ_{name}"}.get(self.kind, name)

    def data(self, prefix: str) -> str:
        """The subjects its entries are written to (a bucket's; the state stream's rows),
        "" for another stream."""
        if self.kind == "state":
            return f"{Subjects(prefix).root}.state"
        name = self.bucket(prefix)
        return {"kv": f"$KV.{name}", "objects": f"$O.{name}"}.get(self.kind, "")


EVENTS = Resource("events", "event stream", "stream", stream_name)
CLAIMS = Resource("claims", "order claims", "kv", claims_bucket_name)
IMAGES = Resource("images", "image blobs", "objects", lambda p: f"{prefix_token(p)}_IMAGES")
IMAGE_TAGS = Resource("tags", "image tags", "kv", lambda p: f"{prefix_token(p)}_IMAGE_TAGS")
STAGING = Resource(
    "staging", "image staging", "stream", lambda p: f"{prefix_token(p)}_IMAGE_STAGING"
)
APPS = Resource("apps", "app specs", "kv", apps_bucket_name)
APP_SECRETS = Resource("secrets", "app secrets", "kv", secrets_bucket_name)
COMMANDS = Resource("commands", "machine commands", "stream", command_stream_name)
STATE = Resource("state", "state stream", "state", state_stream_name)
ACCOUNT = Resource("account", "account", "account", lambda p: "")
RESOURCES: tuple[Resource, ...] = (EVENTS, CLAIMS, IMAGES, IMAGE_TAGS, STAGING, APPS)
RESOURCES += (APP_SECRETS, COMMANDS, STATE, ACCOUNT)


@dataclass(frozen=True, slots=True)
class Verb:
    """One thing a key may do with a resource: what the docs call it, and its API subjects
    for a resource's stream ``s`` and data prefix ``d`` (the grants, with wildcards). The
    tests try it by publishing its :meth:`probes`."""

    name: str
    what: str
    kinds: frozenset[str]
    allows: Callable[[str, str], tuple[str, ...]]
    # subjects tried besides the grants' own (each ``>`` and ``*`` made a concrete token)
    more: Callable[[str, str], tuple[str, ...]] = lambda s, d: ()
    # whose own (OWN_TENANT, OWN_WORKER; "": anyone's): a tenant's ``d`` is its keys'
    # subjects, ``$KV.<bucket>.<tenant>`` (the state stream's: its machines' rows,
    # ``R.state.machine.<tenant>``); a worker's its consumer and that consumer's filter,
    # ``cmd-<worker>.<R>.command.<worker>``; ``within`` the verb that grants it on every key
    # or consumer (a verb with ``within`` is never granted beside that one)
    own: str = ""
    within: str = ""

    def probes(self, s: str, d: str) -> tuple[str, ...]:
        """Concrete subjects a client publishes to use the verb."""
        concrete = (a.replace(">", PROBE).replace("*", PROBE) for a in self.allows(s, d))
        return tuple(concrete) + self.more(s, d)

    def data(self, resource: Resource, prefix: str, owner: str) -> str:
        """What the verb's subjects are made with: the data prefix, or a tenant's own keys',
        or a worker's own consumer and its filter."""
        if self.own == OWN_WORKER:
            return f"{consumer_name(owner)}.{Subjects(prefix).command(owner)}"
        d = resource.data(prefix)
        if not self.own:
            return d
        return f"{d}.machine.{owner}" if resource.kind == "state" else f"{d}.{owner}"


def _consumer(d: str) -> str:
    """A worker's own verb's consumer name (``d``'s first token: ``cmd-<worker>``)."""
    return d.partition(".")[0]


def _stream_op(op: str, what: str) -> Verb:
    return Verb(op.lower(), what, MARKET, lambda s, d: (f"{API}.STREAM.{op}.{s}",))


MARKET = frozenset({"stream", "kv", "objects", "state"})
BUCKETS = frozenset({"kv", "objects"})
INFO = _stream_op("INFO", "look it up: its settings and state")
CREATE = _stream_op("CREATE", "make it, with its limits")
UPDATE = _stream_op("UPDATE", "change its subjects or limits")
DELETE = _stream_op("DELETE", "delete it, and all it holds")
PURGE = _stream_op("PURGE", "empty it (an object store's delete of one object is one)")
READ = Verb(
    "read",
    "get a message or a key",
    MARKET,
    lambda s, d: (f"{API}.DIRECT.GET.{s}", f"{API}.DIRECT.GET.{s}.>", f"{API}.STREAM.MSG.GET.{s}"),
)
ERASE = Verb(
    "erase", "remove one stored message", MARKET, lambda s, d: (f"{API}.STREAM.MSG.DELETE.{s}",)
)
WRITE = Verb(
    "write",
    "put or delete a key, put an object (a KV delete is a put of a marker)",
    BUCKETS,
    lambda s, d: (f"{d}.>",),
    lambda s, d: (f"{d}.M.{PROBE}", f"{d}.C.{PROBE}"),  # an object's meta and chunks
)
REPLAY = Verb(
    "replay",
    "read it from a sequence or a time, then follow (an ordered consumer of its own, and "
    "its state: a KV watch asks how much is pending)",
    MARKET - {"state"},  # its filter is in no subject: the state stream is read by views
    lambda s, d: (
        f"{API}.CONSUMER.CREATE.{s}",
        f"{API}.CONSUMER.INFO.{s}.>",
        f"$JS.FC.{s}.>",
    ),
)
CONSUMERS = Verb(
    "consumers",
    "make, change, list and delete named and durable consumers",
    MARKET,
    lambda s, d: (
        f"{API}.CONSUMER.CREATE.{s}.>",
        f"{API}.CONSUMER.DURABLE.CREATE.{s}.>",
        f"{API}.CONSUMER.DELETE.{s}.>",
        f"{API}.CONSUMER.LIST.{s}",
        f"{API}.CONSUMER.NAMES.{s}",
    ),
    lambda s, d: (f"{API}.CONSUMER.CREATE.{s}.{PROBE}.{PROBE}",),  # named, with a filter
)
PULL = Verb(
    "pull",
    "take and acknowledge messages of a durable consumer",
    MARKET,
    lambda s, d: (f"{API}.CONSUMER.MSG.NEXT.{s}.>", f"$JS.ACK.{s}.>"),
)
DETECT = Verb(
    "detect",
    "ask whether the server has JetStream, and the account's usage",
    frozenset({"account"}),
    lambda s, d: (f"{API}.INFO",),
)
OTHERS = Verb(
    "others",
    "list the account's streams, or make, change or delete one that is none of the market's "
    "(no role may)",
    frozenset({"account"}),
    lambda s, d: (),
    lambda s, d: (
        f"{API}.STREAM.NAMES",
        f"{API}.STREAM.LIST",
        f"{API}.STREAM.CREATE.{PROBE}",
        f"{API}.STREAM.UPDATE.{PROBE}",
        f"{API}.STREAM.DELETE.{PROBE}",
    ),
)
KV = frozenset({"kv"})
READ_OWN = Verb(
    "read own",
    "get a key under its own name",
    KV,
    lambda s, d: (f"{API}.DIRECT.GET.{s}.{d}.>",),
    own=OWN_TENANT,
    within=READ.name,
)
WRITE_OWN = Verb(
    "write own",
    "put or delete a key under its own name",
    KV,
    lambda s, d: (f"{d}.>",),
    own=OWN_TENANT,
    within=WRITE.name,
)
LIST_OWN = Verb(
    "list own",
    "list the keys under its own name (a consumer whose filter is in the subject that makes "
    "it; removed by the server once unused)",
    KV,
    lambda s, d: (f"{API}.CONSUMER.CREATE.{s}.*.{d}.>",),
    own=OWN_TENANT,
    within=CONSUMERS.name,
)
STREAM = frozenset({"stream"})
CONSUMERS_OWN = Verb(
    "consumers own",
    "make its own workers' durable consumers (`cmd-<worker>`, each with its worker's "
    "subject as its filter, in the subject that makes it)",
    STREAM,
    lambda s, d: (f"{API}.CONSUMER.CREATE.{s}.{d}",),
    own=OWN_WORKER,
    within=CONSUMERS.name,
)
PULL_OWN = Verb(
    "pull own",
    "take and acknowledge messages of its own workers' durable consumers",
    STREAM,
    lambda s, d: (f"{API}.CONSUMER.MSG.NEXT.{s}.{_consumer(d)}", f"$JS.ACK.{s}.{_consumer(d)}.>"),
    own=OWN_WORKER,
    within=PULL.name,
)
# Views of the state stream (bourse/view): a consumer of its own whose filter is in the
# subject that makes it (the server refuses a body whose filter differs), its flow control,
# and the stream's epoch (a direct get: has the stream been made again?).
STATE_KIND = frozenset({"state"})
VIEW = Verb(
    "view",
    "read every row (a consumer of its own over the whole stream)",
    STATE_KIND,
    lambda s, d: (f"{API}.CONSUMER.CREATE.{s}.*.{d}.>",),
)
VIEW_FLEET = Verb(
    "view fleet",
    "read the worker rows and heartbeats (a consumer of its own over them), with the "
    "flow control of its consumers and the stream's epoch (a direct get)",
    STATE_KIND,
    lambda s, d: (
        f"{API}.CONSUMER.CREATE.{s}.*.{d}.fleet.>",
        f"$JS.FC.{s}.>",
        f"{API}.DIRECT.GET.{s}.{d}.fleet.epoch",
    ),
)
VIEW_OWN = Verb(
    "view own",
    "read the rows of its own machines (a consumer of its own over them)",
    STATE_KIND,
    lambda s, d: (f"{API}.CONSUMER.CREATE.{s}.*.{d}.>",),
    own=OWN_TENANT,
    within=VIEW.name,
)
VERBS: tuple[Verb, ...] = (INFO, CREATE, UPDATE, DELETE, PURGE, READ, ERASE, WRITE, REPLAY)
VERBS += (CONSUMERS, PULL, READ_OWN, WRITE_OWN, LIST_OWN, CONSUMERS_OWN, PULL_OWN)
VERBS += (VIEW, VIEW_FLEET, VIEW_OWN)
VERBS += (DETECT, OTHERS)


def applies(verb: Verb, resource: Resource) -> bool:
    return resource.kind in verb.kinds


def _all(resource: Resource) -> frozenset[str]:
    return frozenset(
        v.name for v in VERBS if applies(v, resource) and v is not OTHERS and not v.within
    )


def _of(*verbs: Verb) -> frozenset[str]:
    return frozenset(v.name for v in verbs)


# Reading the image store: its tags (a lookup, or a watched copy) and its blobs.
_READ_IMAGES = _of(INFO, READ, REPLAY)

# THE table: role -> resource key -> the verbs it may use there (absent: none).
GRANTS: dict[str, dict[str, frozenset[str]]] = {
    # the market's set-up (``bourse jetstream init``, ``nats stream edit``), image pushes
    ROLE_OPERATOR: {r.key: _all(r) for r in RESOURCES},
    # makes the event stream, the claims bucket and the image store at its start; runs the
    # auctions' claims; resolves orders' images (a watched copy of the tags, manifests);
    # publishes the images tenants staged (reads and clears their uploads; writes the
    # blobs the store lacks, and tags)
    ROLE_EXCHANGE: {
        EVENTS.key: _of(INFO, CREATE),
        CLAIMS.key: _of(INFO, CREATE, READ, WRITE),
        IMAGES.key: _of(INFO, CREATE, READ, WRITE, REPLAY),
        IMAGE_TAGS.key: _of(INFO, CREATE, READ, WRITE, REPLAY),
        STAGING.key: _of(INFO, CREATE, READ, PURGE),
        COMMANDS.key: _of(INFO, CREATE),  # its commands: the subject table
        STATE.key: _of(INFO, CREATE),
        ACCOUNT.key: _of(DETECT),
    },
    # checks the event stream is there (its events: the subject table); reads images; reads
    # an app's secrets by key when it starts the app's machine; takes the commands kept for
    # its workers (a durable consumer per worker, each command acknowledged), only its own
    # workers' (never another worker's queued stop)
    ROLE_SUPPLIER: {
        EVENTS.key: _of(INFO),
        COMMANDS.key: _of(INFO, CONSUMERS_OWN, PULL_OWN),
        IMAGES.key: _READ_IMAGES,
        IMAGE_TAGS.key: _READ_IMAGES,
        APP_SECRETS.key: _of(INFO, READ),
        ACCOUNT.key: _of(DETECT),
    },
    # replays events (``buyer watch --since``); reads images (``--direct`` orders resolve
    # them, dry runs, ``bourse image ls`` and ``inspect``); deploys apps (their records:
    # the buckets made by the operator's set-up); writes their secrets, never reads one
    # (their names are in the apps' records)
    ROLE_BUYER: {
        EVENTS.key: _of(INFO, REPLAY),
        IMAGES.key: _READ_IMAGES,
        IMAGE_TAGS.key: _READ_IMAGES,
        APPS.key: _of(INFO, READ, WRITE, REPLAY),
        APP_SECRETS.key: _of(INFO, WRITE),
        STATE.key: _of(VIEW, VIEW_FLEET),
        ACCOUNT.key: _of(DETECT),
    },
    # reads images (dry runs, ``ls``, ``inspect``, what a push need not send); pushes
    # through the exchange (its staged chunks: the subject table); deploys its own apps
    # (their records, under its name) and writes their secrets, never reads one
    ROLE_TENANT: {
        IMAGES.key: _READ_IMAGES,
        IMAGE_TAGS.key: _READ_IMAGES,
        APPS.key: _of(READ_OWN, WRITE_OWN, LIST_OWN),
        APP_SECRETS.key: _of(WRITE_OWN),
        STATE.key: _of(VIEW_FLEET, VIEW_OWN),
    },
    # routes and heals from a view of every row; follows the apps' records (their specs'
    # service sections: how it serves each; how many machines one wants, its shape for a
    # new spare); nothing else of JetStream (its starts, stops and orders go through the
    # exchange: the subject table)
    ROLE_EDGE: {
        APPS.key: _of(INFO, READ, REPLAY),
        STATE.key: _of(VIEW, VIEW_FLEET),
    },
}


def granted(role: str, resource: Resource) -> frozenset[str]:
    """The verbs ``role`` may use on ``resource``."""
    return GRANTS[role].get(resource.key, frozenset())


def allows(
    role: str, prefix: str, tenant: str = "", workers: Sequence[str] = ()
) -> tuple[str, ...]:
    """The publish allows of ``role``'s JetStream grants for a market's ``prefix`` (a
    tenant's own verbs: under ``tenant``; a worker's own: for each of ``workers``)."""
    out: list[str] = []
    for r in RESOURCES:
        for v in VERBS:
            if v.name not in granted(role, r):
                continue
            for owner in workers if v.own == OWN_WORKER else (tenant,):
                out += v.allows(r.stream(prefix), v.data(r, prefix, owner))
    return tuple(dict.fromkeys(out))
