"""Who may do what on the bus: one NATS user per role, its subject permissions, and the
nats-server ``authorization`` block that enforces them (``bourse auth init`` writes it:
bourse/nats/authdir.py; the keys: bourse/nats/auth.py).

Roles (``R`` is ``<prefix>.v1``; every user may also subscribe to its own inbox prefix
``_INBOX.<its public nkey>``, so no user can read another user's replies). What each may do
with the market's JetStream (streams, buckets, consumers) is one table,
bourse/nats/grants.py; docs/security.md shows both, rendered by bourse/nats/permtable.py.

- ``operator``: the market's JetStream set-up (``bourse jetstream init``, limits, image
  pushes and their gc); of the market's subjects only the fleet's status and machine
  listings of every region (``R.status``, ``R.machines``: which images are in use),
  ``R.command.*`` (a stop or destroy kept for a worker that was away) and
  ``R.control.*`` (a worker drained, stopped, started: §4.22) and ``R.state.fleet.epoch``
  (the state stream's epoch, written once as it makes the stream).
- ``buyer``: publish ``R.order.*``, ``R.machine.*``, ``R.status.*``, ``R.status`` (every
  region), ``R.explain.*``, ``R.machines.*`` and ``R.machines`` (listings of every
  machine), ``R.exec.*`` (an exec session's input, §4.24); subscribe ``R.event.>``. A
  tenant (``buyer:<name>``) may not list every machine: it lists through the exchange
  (bourse/wire/tenancy.py); it pushes images through the exchange too, publishing its
  blobs' chunks on ``R.stage.<name>.>`` (bourse/images/staging.py) and asking on
  ``R.tenant.<name>.image.*``; its exec sessions' input goes on ``R.tenant.<name>.exec.*``.
- ``exchange``: publish ``R.bid.>``, ``R.release.*``, ``R.worker.*.commit|release|machine.*``,
  ``R.machines.*`` (a region's listing of a worker's reserved machines, which vouches for a
  reclaimed one, §5.3d), ``R.event.*.exchange.unfilled`` (order outcomes), ``R.command.*``
  (a buyer's or tenant's stop or destroy kept for a worker that does not answer),
  ``R.state.fleet.epoch`` (the state stream's epoch, written once as it makes it); subscribe
  ``R.order.*``, ``R.machine.*``, ``R.reclaim.*`` and the tenants' subjects (orders,
  machines, images) only in the queue group ``exchange``, and the exec sessions' input it
  relays (``R.exec.<session>``, ``R.tenant.<name>.exec.<session>``: one instance each);
  answers buyers and suppliers: it may publish into their inboxes (and its own).
- ``supplier:<name>``: one user per supplier process, covering exactly its workers. Subscribe
  its regions' ``R.bid.<region>``, ``R.bid.<region>.*``, ``R.release.<region>``,
  ``R.status.<region>``, ``R.explain.<region>``, ``R.machines.<region>``, ``R.status`` and
  ``R.machines`` (every region) and its workers' ``R.worker.<id>.>`` and
  ``R.control.<id>``; publish only its workers' ``R.event.<region>.<id>.*``,
  ``R.worker.<id>.machine.list`` (the start-up check that no other process serves the same
  worker id), ``R.reclaim.<id>`` (asking about its own reserved machines, §5.3d) and their
  rows of the state stream, ``R.state.fleet.*.<region>.<id>`` (a worker's row, the
  heartbeat keyed by it) and ``R.state.machine.*.<region>.<id>.*`` (its machines', §4.21);
  answers the exchange, buyers and the operator: it may publish into their inboxes (and
  its own).

Answers go by explicit inbox allows, not nats-server's ``allow_responses``: a responder with
``allow_responses`` may publish to whatever reply subject a requester handed it, even a
subject its publish ``deny`` list names (tested with nats-server 2.15: the response grant is
checked after the deny and overrides it), so a buyer could make a supplier publish on
``R.worker.<id>.commit`` (a confused deputy). With ``_INBOX.<key>.>`` allows a reply can
only land in an inbox (tests/security/test_attacks.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bourse.nats import grants
from bourse.nats.auth import AuthError, inbox_prefix_for, public_key_of
from bourse.nats.grants import (
    ROLE_BUYER,
    ROLE_EDGE,
    ROLE_EXCHANGE,
    ROLE_OPERATOR,
    ROLE_SUPPLIER,
    ROLE_TENANT,
)
from bourse.wire.messages import EXCHANGE_EVENT_WORKER, UNFILLED_EVENT
from bourse.wire.subjects import EXCHANGE_QUEUE, Subjects

# A tenant (``auth init --buyer NAME``, user ``buyer:NAME``) orders and acts on machines
# only under ``R.tenant.NAME.``, so the exchange knows who asks and lets it reach only its
# own machines (bourse/wire/tenancy.py). The shared ``buyer`` user acts on every machine and
# reads every event: a key for operators.
__all__ = [
    "ROLE_BUYER",
    "ROLE_EDGE",
    "ROLE_EXCHANGE",
    "ROLE_OPERATOR",
    "ROLE_SUPPLIER",
    "ROLE_TENANT",
    "Permissions",
    "User",
    "buyer_permissions",
    "exchange_permissions",
    "operator_permissions",
    "permissions_for",
    "render_authorization",
    "supplier_permissions",
    "tenant_permissions",
]
SEED_SUFFIX = ".nk"


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class User:
    name: str  # "operator", "buyer", "buyer:<tenant>", "exchange", "supplier:<name>"
    role: str
    seed: str = field(repr=False)
    workers: tuple[tuple[str, str], ...] = ()

    @property
    def public_key(self) -> str:
        return public_key_of(self.seed)

    @property
    def file_name(self) -> str:
        return self.name.replace(":", "-") + SEED_SUFFIX

    @property
    def tenant(self) -> str:
        return self.name.partition(":")[2] if self.role == ROLE_TENANT else ""


def operator_permissions(s: Subjects, inbox: str) -> Permissions:
    """The market's JetStream set-up: its streams and buckets, their limits and consumers
    (grants.py); of the market's subjects only the gathers that say which images are in
    use (every worker's status and machines, read-only): it neither orders nor serves."""
    return Permissions(
        publish=(
            s.status_every,
            s.machines_every,
            s.command_all,  # a stop or destroy kept for a worker (§4.20)
            s.control_all,  # a worker drained, stopped, started (§4.22)
            s.state_epoch,  # the state stream's epoch, as it makes the stream (§4.21)
            *grants.allows(ROLE_OPERATOR, s.prefix),
        ),
        subscribe=(f"{inbox}.>",),
    )


def buyer_permissions(s: Subjects, inbox: str) -> Permissions:
    return Permissions(
        publish=(
            s.order("*"),
            s.machine("*"),
            s.status("*"),
            s.status_every,
            s.explain("*"),
            s.machines("*"),  # every machine of a region (§4.17): the operator's view
            s.machines_every,
            s.exec_input("*"),  # input to its exec sessions (§4.24)
            *grants.allows(ROLE_BUYER, s.prefix),
        ),
        # the edges' activity (§4.23): a deploy's drain hears when requests have finished
        subscribe=(s.events(), s.edge_activity(), f"{inbox}.>"),
    )


def tenant_permissions(s: Subjects, tenant: str, inbox: str) -> Permissions:
    """A tenant: its own order, machine and image subjects (the exchange takes its
    identity from them) and its own staging subjects (the chunks of what it pushes), fleet
    status and explain, reading the image store, and its own apps' keys (under its name,
    grants.py); no events and no ``R.machines[.*]`` listings (they carry every tenant's
    machines: a tenant lists worker by worker through the exchange, which keeps only its
    own)."""
    return Permissions(
        publish=(
            s.tenant_order(tenant, "*"),
            s.tenant_machine(tenant, "*"),
            s.tenant_image(tenant, "*"),
            s.exec_input("*", tenant),  # input to its exec sessions (§4.24)
            s.stage_tenant(tenant),
            s.status("*"),
            s.status_every,
            s.explain("*"),
            *grants.allows(ROLE_TENANT, s.prefix, tenant),
        ),
        # the edges' activity at its own machines (§4.23): its deploy's drain hears it
        subscribe=(s.edge_activity_of(tenant), f"{inbox}.>"),
    )


def edge_permissions(s: Subjects, inbox: str) -> Permissions:
    """``edge serve``: a machine's start (a request found none able to take it), a failed
    machine's stop kept for its worker and a new spare's order (its controller), an app's
    missing machine's order (a request found none to start), each
    through the exchange as the shared buyer's; why an order went unfilled; the machine
    listings (its routes where the market has no state stream); every edge's activity
    (§4.23: what stops an idle machine); the market's live events (its page's stream: what
    they say of a machine its view holds already). Its JetStream: grants.py."""
    return Permissions(
        publish=(
            s.order("*"),
            s.machine("*"),
            s.explain("*"),
            s.machines("*"),
            s.machines_every,
            s.edge_activity(),  # its requests per machine (§4.23): one key for every edge
            s.edge_activity_of(),  # ... and each tenant's share, on a subject of its own
            *grants.allows(ROLE_EDGE, s.prefix),
        ),
        subscribe=(s.edge_activity(), s.events(), f"{inbox}.>"),
    )


def exchange_permissions(s: Subjects, inbox: str, answers: Sequence[str] = ()) -> Permissions:
    """``answers``: the inbox prefixes it may answer into (the buyers', and the suppliers'
    for their reclaim checks)."""
    return Permissions(
        publish=(
            f"{s.root}.bid.>",
            s.region_release("*"),
            s.commit("*"),
            s.release("*"),
            s.worker_machine("*", "*"),
            s.machines("*"),  # a region vouches for a machine a worker reclaims (§5.3d)
            s.event("*", EXCHANGE_EVENT_WORKER, UNFILLED_EVENT),  # order outcomes (§6.9)
            s.command_all,  # a stop or destroy kept for a worker that does not answer
            s.state_epoch,  # the state stream's epoch, as it makes the stream (§4.21)
            *grants.allows(ROLE_EXCHANGE, s.prefix),
            *_inboxes(inbox, answers),
        ),
        subscribe=(
            f"{s.order_all} {EXCHANGE_QUEUE}",
            f"{s.machine_all} {EXCHANGE_QUEUE}",
            f"{s.reclaim_all} {EXCHANGE_QUEUE}",
            f"{s.tenant_order_all} {EXCHANGE_QUEUE}",
            f"{s.tenant_machine_all} {EXCHANGE_QUEUE}",
            f"{s.tenant_image_all} {EXCHANGE_QUEUE}",
            s.exec_input("*"),  # an exec session's input, by the instance relaying it
            s.exec_input("*", "*"),
            f"{inbox}.>",
        ),
    )


def _inboxes(own: str, answers: Sequence[str]) -> tuple[str, ...]:
    """Publish allows for answering: its own inbox and each given one, ``<prefix>.>``."""
    return tuple(f"{p}.>" for p in dict.fromkeys([own, *answers]))


def supplier_permissions(
    s: Subjects, workers: Sequence[tuple[str, str]], inbox: str, answers: Sequence[str] = ()
) -> Permissions:
    """``answers``: the inbox prefixes it may answer into (the exchange's, the buyers')."""
    regions = sorted({region for _, region in workers})
    sub = [f"{inbox}.>", s.status_every, s.machines_every]
    for r in regions:
        sub += [s.bid(r), f"{s.bid(r)}.*", s.region_release(r), s.status(r), s.explain(r)]
        sub.append(s.machines(r))
    sub += [s.worker_all(wid) for wid, _ in workers]
    sub += [s.control(wid) for wid, _ in workers]  # the operator's verbs (§4.22)
    pub = [s.events(region, wid) for wid, region in workers]
    pub += [s.worker_machine(wid, "list") for wid, _ in workers]
    pub += [s.reclaim(wid) for wid, _ in workers]  # its own reserved machines (§5.3d)
    # its workers' rows of the state stream: theirs and their machines' (any owner's), §4.21
    pub += [s.state_fleet_rows(region, wid) for wid, region in workers]
    pub += [s.state_machines("*", region, wid) for wid, region in workers]
    pub += grants.allows(ROLE_SUPPLIER, s.prefix, workers=[wid for wid, _ in workers])
    pub += _inboxes(inbox, answers)
    return Permissions(publish=tuple(pub), subscribe=tuple(sub))


def permissions_for(user: User, s: Subjects, users: Sequence[User] = ()) -> Permissions:
    """``users``: everyone in the config; whom ``user`` answers is found among them (the
    exchange answers buyers and suppliers; a supplier answers the exchange and buyers)."""
    inbox = inbox_prefix_for(user.public_key)
    buyers = [inbox_prefix_for(u.public_key) for u in users if u.role in (ROLE_BUYER, ROLE_TENANT)]
    exchanges = [inbox_prefix_for(u.public_key) for u in users if u.role == ROLE_EXCHANGE]
    operators = [inbox_prefix_for(u.public_key) for u in users if u.role == ROLE_OPERATOR]
    suppliers = [inbox_prefix_for(u.public_key) for u in users if u.role == ROLE_SUPPLIER]
    edges = [inbox_prefix_for(u.public_key) for u in users if u.role == ROLE_EDGE]
    if user.role == ROLE_OPERATOR:
        return operator_permissions(s, inbox)
    if user.role == ROLE_BUYER:
        return buyer_permissions(s, inbox)
    if user.role == ROLE_TENANT:
        return tenant_permissions(s, user.tenant, inbox)
    if user.role == ROLE_EXCHANGE:
        return exchange_permissions(s, inbox, [*buyers, *suppliers, *edges])  # reclaim: §5.3d
    if user.role == ROLE_SUPPLIER:
        answers = [*exchanges, *buyers, *operators, *edges]  # edges: listings, explains
        return supplier_permissions(s, user.workers, inbox, answers)
    if user.role == ROLE_EDGE:
        return edge_permissions(s, inbox)
    raise AuthError(f"unknown role {user.role!r}")


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def render_authorization(users: Sequence[User], s: Subjects) -> str:
    """The ``authorization { users = [...] }`` block: each user's nkey and permissions."""
    out = [
        f"# Generated by `bourse auth init` for subject prefix {s.prefix!r}: regenerate, do not",
        '# edit. Include it from a nats-server config: include "auth.conf"',
        "authorization {",
        "  users = [",
    ]
    for u in users:
        p = permissions_for(u, s, users)
        workers = f" ({', '.join(w for w, _ in u.workers)})" if u.workers else ""
        out += [
            f"    # {u.name}{workers}",
            "    {",
            f"      nkey: {json.dumps(u.public_key)}",
            "      permissions: {",
            f"        publish: {{ allow: {_list(p.publish)} }}",
            f"        subscribe: {{ allow: {_list(p.subscribe)} }}",
            "      }",
            "    }",
        ]
    out += ["  ]", "}", ""]
    return "\n".join(out)
