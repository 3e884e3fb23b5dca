"""Who may do what on the bus: one NATS user per role, its nkey, its subject permissions,
and the nats-server ``authorization`` block that enforces them (``bourse auth init``).

Roles (``R`` is ``<prefix>.v1``; every user may also subscribe to its own inbox prefix
``_INBOX.<its public nkey>``, so no user can read another user's replies). What each may do
with the market's JetStream (streams, buckets, consumers) is one table,
bourse/nats/grants.py; docs/security.md shows both, rendered by bourse/nats/permtable.py.

- ``operator``: the market's JetStream set-up (``bourse jetstream init``, limits, image
  pushes and their gc); of the market's subjects only the fleet's status and machine
  listings of every region (``R.status``, ``R.machines``: which images are in use), and
  ``R.command.*`` (a stop or destroy kept for a worker that was away).
- ``buyer``: publish ``R.order.*``, ``R.machine.*``, ``R.status.*``, ``R.status`` (every
  region), ``R.explain.*``, ``R.machines.*`` and ``R.machines`` (listings of every
  machine); subscribe ``R.event.>``. A tenant (``buyer:<name>``) may not list every
  machine: it lists through the exchange (bourse/wire/tenancy.py); it pushes images
  through the exchange too, publishing its blobs' chunks on ``R.stage.<name>.>``
  (bourse/images/staging.py) and asking on ``R.tenant.<name>.image.*``.
- ``exchange``: publish ``R.bid.>``, ``R.release.*``, ``R.worker.*.commit|release|machine.*``,
  ``R.machines.*`` (a region's listing of a worker's reserved machines, which vouches for a
  reclaimed one, §5.3d), ``R.event.*.exchange.unfilled`` (order outcomes), ``R.command.*``
  (a buyer's or tenant's stop or destroy kept for a worker that does not answer); subscribe
  ``R.order.*``, ``R.machine.*``, ``R.reclaim.*`` and the tenants' subjects (orders,
  machines, images) only in the queue group ``exchange``; answers buyers and suppliers: it
  may publish into their inboxes (and its own).
- ``supplier:<name>``: one user per supplier process, covering exactly its workers. Subscribe
  its regions' ``R.bid.<region>``, ``R.bid.<region>.*``, ``R.release.<region>``,
  ``R.status.<region>``, ``R.explain.<region>``, ``R.machines.<region>``, ``R.status`` and
  ``R.machines`` (every region) and its
  workers' ``R.worker.<id>.>``; publish only its workers' ``R.event.<region>.<id>.*``,
  ``R.worker.<id>.machine.list`` (the start-up check that no other process serves the same
  worker id) and ``R.reclaim.<id>`` (asking about its own reserved machines, §5.3d);
  answers the exchange, buyers and the operator: it may publish into their inboxes (and
  its own).

Answers go by explicit inbox allows, not nats-server's ``allow_responses``: a responder with
``allow_responses`` may publish to whatever reply subject a requester handed it, even a
subject its publish ``deny`` list names (tested with nats-server 2.15: the response grant is
checked after the deny and overrides it), so a buyer could make a supplier publish on
``R.worker.<id>.commit`` (a confused deputy). With ``_INBOX.<key>.>`` allows a reply can
only land in an inbox (tests/security/test_attacks.py).

Credentials are nkey seed files (``SU...``), written 0600. ``read_credentials`` turns a
``--creds`` file (an nkey seed file, or a JWT ``.creds`` file) into nats-py connect options.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys

from bourse.errors import BourseError
from bourse.nats import grants
from bourse.nats.grants import ROLE_BUYER, ROLE_EXCHANGE, ROLE_OPERATOR, ROLE_SUPPLIER, ROLE_TENANT
from bourse.wire.messages import EXCHANGE_EVENT_WORKER, UNFILLED_EVENT
from bourse.wire.subjects import EXCHANGE_QUEUE, Subjects, is_valid_id

# A tenant (``auth init --buyer NAME``, user ``buyer:NAME``) orders and acts on machines
# only under ``R.tenant.NAME.``, so the exchange knows who asks and lets it reach only its
# own machines (bourse/wire/tenancy.py). The shared ``buyer`` user acts on every machine and
# reads every event: a key for operators.
__all__ = ["ROLE_BUYER", "ROLE_EXCHANGE", "ROLE_OPERATOR", "ROLE_SUPPLIER", "ROLE_TENANT"]
# The line of a tenant's seed file that names the tenant (seed readers skip ``#`` lines).
TENANT_LINE = "# bourse tenant: "
INBOX_ROOT = "_INBOX"
AUTH_CONF = "auth.conf"
SERVER_CONF = "server.conf"
TRUST_FILE = "trust.json"
SEED_SUFFIX = ".nk"


class AuthError(BourseError, ValueError):
    """Bad input to credential generation, or an unreadable credentials file."""


def new_seed() -> str:
    """A fresh user nkey seed (``SU...``) from 32 random bytes of the OS."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def decode_nkey(text: str) -> bytes:
    """The bytes of an encoded nkey (a seed or a public key) without its CRC-16, which is
    checked (nkeys.decode_seed does not: a typo would only show as a refused login)."""
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise AuthError("not an nkey: not base32") from None
    if len(raw) < 3 or bytes(nkeys.crc16_checksum(raw[:-2])) != raw[-2:]:
        raise AuthError("nkey checksum mismatch (a typo or a truncated key?)")
    return raw[:-2]


def public_key_of(seed: str) -> str:
    """The user's public nkey (``U...``) for a seed; AuthError if it is not a user seed."""
    try:
        decode_nkey(seed.strip())
        kp = nkeys.from_seed(seed.strip().encode())
        public = kp.public_key.decode()
    except (nkeys.NkeysError, ValueError) as exc:
        raise AuthError(f"not a valid nkey seed: {exc}") from None
    if not public.startswith("U"):
        raise AuthError("the nkey seed is not a USER seed (SU...)")
    return public


def inbox_prefix_for(public_key: str) -> str:
    """The inbox prefix a user's connection uses; its permissions allow only this one."""
    return f"{INBOX_ROOT}.{public_key}"


def is_inbox(subject: str) -> bool:
    """Whether a reply subject is an inbox (``_INBOX.<...>``, the per-user prefixes
    included): the only subjects a Bourse program answers to (bourse/nats/responder.py)."""
    return (
        subject.startswith(INBOX_ROOT + ".")
        and len(subject) > len(INBOX_ROOT) + 1
        and not any(c in subject for c in " \t*>")
    )


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SupplierSpec:
    """One supplier process: its user name suffix and the (worker_id, region) it hosts."""

    name: str
    workers: tuple[tuple[str, str], ...]


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
            *grants.allows(ROLE_BUYER, s.prefix),
        ),
        subscribe=(s.events(), f"{inbox}.>"),
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
            s.stage_tenant(tenant),
            s.status("*"),
            s.status_every,
            s.explain("*"),
            *grants.allows(ROLE_TENANT, s.prefix, tenant),
        ),
        subscribe=(f"{inbox}.>",),
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
    pub = [s.events(region, wid) for wid, region in workers]
    pub += [s.worker_machine(wid, "list") for wid, _ in workers]
    pub += [s.reclaim(wid) for wid, _ in workers]  # its own reserved machines (§5.3d)
    pub += grants.allows(ROLE_SUPPLIER, s.prefix)
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
    if user.role == ROLE_OPERATOR:
        return operator_permissions(s, inbox)
    if user.role == ROLE_BUYER:
        return buyer_permissions(s, inbox)
    if user.role == ROLE_TENANT:
        return tenant_permissions(s, user.tenant, inbox)
    if user.role == ROLE_EXCHANGE:
        return exchange_permissions(s, inbox, [*buyers, *suppliers])  # reclaim: §5.3d
    if user.role == ROLE_SUPPLIER:
        return supplier_permissions(s, user.workers, inbox, [*exchanges, *buyers, *operators])
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


def parse_worker_flag(value: str) -> tuple[str, str]:
    """``mad-1=mad`` -> (worker_id, region), or AuthError naming the bad value."""
    wid, sep, region = value.partition("=")
    if not sep:
        raise AuthError(f"--worker {value!r} must look like WORKER_ID=REGION")
    for what, v in (("worker id", wid), ("region", region)):
        if not is_valid_id(v):
            raise AuthError(f"--worker {value!r}: invalid {what} {v!r}: use [a-z0-9][a-z0-9-]*")
    return wid, region


def check_suppliers(suppliers: Sequence[SupplierSpec]) -> None:
    """Every worker id in exactly one supplier, every supplier name once, and no worker
    named as the exchange's reserved event token."""
    owner: dict[str, str] = {}
    names: set[str] = set()
    for sup in suppliers:
        if not is_valid_id(sup.name):
            raise AuthError(f"invalid supplier name {sup.name!r}: use [a-z0-9][a-z0-9-]*")
        if sup.name in names:
            raise AuthError(f"two suppliers are named {sup.name!r}: rename a fleet file")
        names.add(sup.name)
        if not sup.workers:
            raise AuthError(f"supplier {sup.name!r} hosts no worker")
        for wid, _ in sup.workers:
            if wid == EXCHANGE_EVENT_WORKER:
                raise AuthError(
                    f"worker id {wid!r} is reserved: the exchange publishes order outcomes "
                    "under it (docs/protocol.md §6.9); name the worker otherwise"
                )
            if wid in owner:
                raise AuthError(
                    f"worker {wid!r} is in both supplier {owner[wid]!r} and {sup.name!r}: "
                    "one worker id must have one key"
                )
            owner[wid] = sup.name


def check_tenants(names: Sequence[str]) -> None:
    """Every ``--buyer NAME`` a valid id, once."""
    seen: set[str] = set()
    for name in names:
        if not is_valid_id(name):
            raise AuthError(f"invalid buyer name {name!r}: use [a-z0-9][a-z0-9-]*")
        if name in seen:
            raise AuthError(f"buyer {name!r} is given twice")
        seen.add(name)


def tenant_of(path: str | Path) -> str:
    """The tenant a ``--creds`` file is for (its ``# bourse tenant: NAME`` line, written by
    ``auth init --buyer NAME``), or "" (an operator, exchange or supplier key)."""
    for line in _read(path).splitlines():
        if line.startswith(TENANT_LINE):
            name = line[len(TENANT_LINE) :].strip()
            if not is_valid_id(name):
                raise AuthError(f"credentials file {path}: invalid tenant name {name!r}")
            return name
    return ""


@dataclass(frozen=True, slots=True)
class AuthFiles:
    out: Path
    users: tuple[User, ...]
    auth_conf: Path
    server_conf: Path
    trust: Path

    def seed_file(self, name: str) -> Path:
        """The seed file of the user named ``name`` (``buyer``, ``supplier:mad-1``...)."""
        for u in self.users:
            if u.name == name:
                return self.out / u.file_name
        raise KeyError(name)


def _write_secret(path: Path, text: str) -> None:
    """Create ``path`` readable by its owner only (0600) before any secret is in it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def write_auth_dir(
    out: Path,
    subjects: Subjects,
    suppliers: Sequence[SupplierSpec],
    *,
    force: bool = False,
    extra_includes: Sequence[str] = (),
    buyers: Sequence[str] = (),
) -> AuthFiles:
    """Generate every user's seed, ``auth.conf``, ``trust.json`` and a ``server.conf`` that
    includes them. Refuses to overwrite an existing ``auth.conf`` unless ``force``: new keys
    lock out every program still holding the old ones. ``buyers``: tenant names, one user
    (``buyer:<name>``, seed file ``buyer-<name>.nk``) each."""
    check_suppliers(suppliers)
    check_tenants(buyers)
    out.mkdir(parents=True, exist_ok=True)
    auth_conf = out / AUTH_CONF
    if auth_conf.exists() and not force:
        raise AuthError(
            f"{auth_conf} exists: pass --force to replace every key (running programs holding "
            "the old keys will be locked out)"
        )
    users = [
        User("operator", ROLE_OPERATOR, new_seed()),
        User("buyer", ROLE_BUYER, new_seed()),
        User("exchange", ROLE_EXCHANGE, new_seed()),
    ]
    users += [User(f"buyer:{name}", ROLE_TENANT, new_seed()) for name in buyers]
    users += [
        User(f"supplier:{s.name}", ROLE_SUPPLIER, new_seed(), tuple(s.workers)) for s in suppliers
    ]
    for u in users:
        named = f"{TENANT_LINE}{u.tenant}\n" if u.tenant else ""
        _write_secret(out / u.file_name, named + u.seed + "\n")
    auth_conf.write_text(render_authorization(users, subjects))
    trust = out / TRUST_FILE
    trust_map = {wid: u.public_key for u in users for wid, _ in u.workers}
    trust.write_text(json.dumps({"workers": trust_map}, indent=2, sort_keys=True) + "\n")
    server_conf = out / SERVER_CONF
    includes = [AUTH_CONF, *extra_includes]
    server_conf.write_text(
        "# A nats-server config for Bourse (listen address from the command line or add it\n"
        "# here): nats-server -c server.conf\n"
        + "".join(f'include "{name}"\n' for name in includes)
    )
    return AuthFiles(out, tuple(users), auth_conf, server_conf, trust)


# -- reading a --creds file ---------------------------------------------------------------------
JWT_MARKER = "BEGIN NATS USER JWT"


def read_seed_file(path: str | Path) -> str:
    """The nkey seed in an nkey seed file (blank and ``#`` lines are skipped)."""
    text = _read(path)
    lines = [ln.strip() for ln in text.splitlines()]
    seeds = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(seeds) != 1 or not seeds[0].startswith("SU"):
        raise AuthError(
            f"credentials file {path} is neither a NATS .creds file (with a user JWT) nor an "
            "nkey seed file (one line starting with SU)"
        )
    try:
        public_key_of(seeds[0])
    except AuthError as exc:
        raise AuthError(f"credentials file {path}: {exc}") from None
    return seeds[0]


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise AuthError(f"cannot read credentials file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise AuthError(f"credentials file {path} is not text") from None


def read_credentials(path: str | Path) -> dict[str, Any]:
    """nats-py connect options for a ``--creds`` file, detected by its content: a JWT
    ``.creds`` file -> ``user_credentials``; an nkey seed file -> ``nkeys_seed_str`` and the
    user's own ``inbox_prefix`` (the only inbox its permissions allow)."""
    if JWT_MARKER in _read(path):
        return {"user_credentials": str(path)}
    seed = read_seed_file(path)
    return {"nkeys_seed_str": seed, "inbox_prefix": inbox_prefix_for(public_key_of(seed))}


def signing_seed(path: str | Path) -> str:
    """The user seed in a ``--creds`` file (either kind): the key a supplier signs with."""
    text = _read(path)
    if JWT_MARKER not in text:
        return read_seed_file(path)
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if "BEGIN USER NKEY SEED" in line and i + 1 < len(lines):
            seed = lines[i + 1]
            try:
                public_key_of(seed)
            except AuthError as exc:
                raise AuthError(f"credentials file {path}: {exc}") from None
            return seed
    raise AuthError(f"credentials file {path} has a user JWT but no USER NKEY SEED block")
