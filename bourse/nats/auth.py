"""Keys and credentials: user nkeys (made, checked, their public keys and inbox prefixes) and
what a ``--creds`` file holds (an nkey seed file or a JWT ``.creds`` file, as nats-py connect
options; a tenant's name; the seed a supplier signs with).

Credentials are nkey seed files (``SU...``), written 0600 by ``bourse auth init``
(bourse/nats/authdir.py). Every user may subscribe to its own inbox prefix
``_INBOX.<its public nkey>`` only (bourse/nats/permissions.py), so no user can read another
user's replies, and a program answers only into inboxes (``is_inbox``).
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Any

import nkeys

from bourse.errors import BourseError
from bourse.wire.subjects import is_valid_id

# The line of a tenant's seed file that names the tenant (seed readers skip ``#`` lines).
TENANT_LINE = "# bourse tenant: "
INBOX_ROOT = "_INBOX"


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
