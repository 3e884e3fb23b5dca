"""An app's slots: where each machine belongs (region, index), the order id a slot's
machine is placed under, and what a machine records of the spec it was made from. Pure."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from bourse.client.apps.spec import AppSpec
from bourse.wire.limits import ORDER_ID_MAX
from bourse.wire.metadata import APP, GEN, RESTART, ROLE, SLOT
from bourse.wire.metadata import FIELDS as FIELDS_KEY

# A tenant's scope (up to 64 characters and ':') goes in front of the id on the market.
ORDER_ID_LIMIT = ORDER_ID_MAX - 65

# The fields of a spec a machine is made from, each fingerprinted in its metadata ``fields``
# so a plan can say which differ (the machine does not carry env or secrets).
FIELDS = ("image", "resources", "env", "ports", "checks", "restart", "labels", "metadata")
SECRETS = "secrets"
NO_SECRETS = "-"  # the secrets' fingerprint of an app without any


def slot_key(region: str, index: int) -> str:
    """The key of a slot in the app's record: ``mad.0``."""
    return f"{region}.{index}"


def order_id(app: str, generation: int, region: str, index: int, attempt: int = 0) -> str:
    """The order id of a slot's machine: ``<app>.g<generation>.<region>.<index>``, with
    ``.r<attempt>`` when the slot is filled again in the same generation (its machine was
    lost). A re-run of a cut-off deploy places under the same ids (the claims hand back what
    was placed); a new generation, or a new attempt, never gets an earlier machine back."""
    tail = f".{index}" + (f".r{attempt}" if attempt else "")
    oid = f"{app}.g{generation}.{region}{tail}"
    if len(oid) > ORDER_ID_LIMIT:
        # long names: a digest of app and region stands for them (one id per slot still)
        short = hashlib.sha256(f"{app}|{region}".encode()).hexdigest()[:12]
        oid = f"{app[:24]}-{short}.g{generation}{tail}"
    return oid


def attempt_of(oid: str) -> int:
    """The attempt an order id of a slot names (``….r2`` -> 2; none: 0)."""
    _, dot, tail = oid.rpartition(".r")
    return int(tail) if dot and tail.isdigit() else 0


def _fp(value: Any) -> str:
    doc = msgspec.json.encode(value, order="sorted")
    return hashlib.sha256(doc).hexdigest()[:10]


def fingerprints(spec: AppSpec, secrets_revision: str) -> dict[str, str]:
    """Each field's fingerprint (the image by its reference; its digest is compared on
    the machine itself), and the secrets' revision."""
    fps = {f: _fp(msgspec.to_builtins(getattr(spec, f))) for f in FIELDS}
    return fps | {SECRETS: secrets_revision or NO_SECRETS}


def encode_fields(fps: dict[str, str]) -> str:
    """The metadata value: ``image=ab12…,resources=…``."""
    return ",".join(f"{k}={v}" for k, v in sorted(fps.items()))


def decode_fields(text: str) -> dict[str, str]:
    """The metadata value back (a machine placed before apps had fields: {})."""
    return dict(p.split("=", 1) for p in text.split(",") if "=" in p)


def machine_metadata(
    spec: AppSpec, role: str, index: int, generation: int, secrets_revision: str
) -> dict[str, str]:
    """What a slot's machine carries: its app, role and slot, the generation it was made
    in and the fingerprints of the fields it was made from (plus the spec's metadata)."""
    meta = {
        APP: spec.app,
        ROLE: role,
        SLOT: str(index),
        GEN: str(generation),
        FIELDS_KEY: encode_fields(fingerprints(spec, secrets_revision)),
    }
    return dict(spec.metadata) | meta | ({RESTART: spec.restart} if spec.restart else {})


class SlotRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the app's record keeps of a slot: its role (a promoted spare's slot is a
    primary from then on), the generation and attempt its machine was placed under, and
    that machine (so a machine lost in this generation is replaced under a new attempt)."""

    role: str
    generation: int = 0
    attempt: int = 0
    machine_id: str = ""
