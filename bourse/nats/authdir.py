"""``bourse auth init``: a market's keys and server config written to a directory, every
user's seed file (0600), ``auth.conf`` (the ``authorization`` block,
bourse/nats/permissions.py), ``trust.json`` (each worker's key, for signed offers) and a
``server.conf`` that includes them; and the checks of what it is given (suppliers and
their workers, tenants).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bourse.nats.auth import TENANT_LINE, AuthError, new_seed
from bourse.nats.grants import (
    ROLE_BUYER,
    ROLE_EDGE,
    ROLE_EXCHANGE,
    ROLE_OPERATOR,
    ROLE_SUPPLIER,
    ROLE_TENANT,
)
from bourse.nats.permissions import User, render_authorization
from bourse.wire.messages import EXCHANGE_EVENT_WORKER
from bourse.wire.subjects import Subjects, is_valid_id

AUTH_CONF = "auth.conf"
SERVER_CONF = "server.conf"
TRUST_FILE = "trust.json"


@dataclass(frozen=True, slots=True)
class SupplierSpec:
    """One supplier process: its user name suffix and the (worker_id, region) it hosts."""

    name: str
    workers: tuple[tuple[str, str], ...]


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
        User("edge", ROLE_EDGE, new_seed()),
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
