"""Signed offers: a supplier signs each Offer with its user nkey (ed25519); the auction,
given a trust file (worker id -> public nkey, written by ``bourse auth init``), takes only
offers signed by the key of the worker they name.

What is signed (``offer_signing_bytes``): the UTF-8 bytes of a JSON array without
whitespace, strings escaped to ASCII (as Python's ``json.dumps(..., ensure_ascii=True,
separators=(",", ":"))`` writes it)::

    ["bourse.v1.offer", order_id, auction_id, worker_id, region, score, image_cached,
     hold_expires_at_ms, machine_id or "", [[subscore name, value], ...]]

floats (``score`` and the subscore values) as strings formatted ``%.17g`` (exact for an
IEEE double, the same in every language's printf), subscores sorted by name,
``image_cached`` a JSON boolean, ``hold_expires_at_ms`` a JSON integer. The signature is
the 64-byte ed25519 signature of those bytes, base64url without padding, in ``Offer.sig``;
``Offer.signer`` is the public nkey (``U...``) that made it.

The auction_id binds an offer to one auction run, so an offer recorded from one run cannot
be replayed into a retry of the same order.
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

import msgspec
import nkeys
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from bourse.errors import BourseError
from bourse.nats.auth import AuthError, decode_nkey
from bourse.wire.messages import Offer
from bourse.wire.subjects import is_valid_id

SIGNING_CONTEXT = "bourse.v1.offer"

# Why an offer failed the check (logged and counted by the auction).
UNSIGNED = "unsigned"
UNKNOWN_WORKER = "unknown_worker"
WRONG_KEY = "wrong_key"
BAD_SIGNATURE = "bad_signature"


class TrustError(BourseError, ValueError):
    """A trust file or key that cannot be used; the message names the problem."""


def _g(x: float) -> str:
    return format(x, ".17g")


def offer_signing_bytes(offer: Offer) -> bytes:
    """The canonical bytes a worker signs for ``offer`` (see the module docstring)."""
    fields = [
        SIGNING_CONTEXT,
        offer.order_id,
        offer.auction_id,
        offer.worker_id,
        offer.region,
        _g(offer.score),
        offer.image_cached,
        offer.hold_expires_at_ms,
        offer.machine_id or "",
        [[name, _g(value)] for name, value in sorted(offer.subscores.items())],
    ]
    return json.dumps(fields, ensure_ascii=True, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def raw_public_key(public_nkey: str) -> bytes:
    """The 32 ed25519 key bytes inside a public user nkey (``U...``), checksum checked."""
    try:
        raw = decode_nkey(public_nkey)
    except AuthError as exc:
        raise TrustError(f"{public_nkey!r}: {exc}") from None
    if len(raw) != 33 or raw[0] != nkeys.PREFIX_BYTE_USER:
        raise TrustError(f"{public_nkey!r} is not a public USER nkey (U..., 56 characters)")
    return raw[1:]


class OfferSigner:
    """Signs offers with one user nkey seed (the supplier process's own)."""

    def __init__(self, seed: str) -> None:
        try:
            self._kp = nkeys.from_seed(seed.strip().encode())
            self.public_key = self._kp.public_key.decode()
        except (nkeys.NkeysError, ValueError) as exc:
            raise TrustError(f"not a valid nkey seed: {exc}") from None

    def sign(self, offer: Offer) -> Offer:
        sig = self._kp.sign(offer_signing_bytes(offer))
        return msgspec.structs.replace(offer, signer=self.public_key, sig=_b64(sig))


class TrustStore:
    """worker id -> the public nkey whose signature its offers must carry."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = dict(keys)
        self._verifiers = {
            wid: Ed25519PublicKey.from_public_bytes(raw_public_key(pk))
            for wid, pk in self.keys.items()
        }

    @classmethod
    def load(cls, path: str | Path) -> TrustStore:
        """Read a trust file ``{"workers": {worker_id: public nkey}}``; TrustError names
        the problem (the file, the worker, the key)."""
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as exc:
            raise TrustError(f"cannot read trust file {path}: {exc.strerror}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise TrustError(f"trust file {path} is not JSON: {exc}") from None
        workers = doc.get("workers") if isinstance(doc, dict) else None
        if not isinstance(workers, dict):
            raise TrustError(f'trust file {path}: expected {{"workers": {{worker_id: key}}}}')
        for wid, key in workers.items():
            if not is_valid_id(wid):
                raise TrustError(f"trust file {path}: invalid worker id {wid!r}")
            if not isinstance(key, str):
                raise TrustError(f"trust file {path}: key of worker {wid!r} is not a string")
        try:
            return cls(workers)
        except TrustError as exc:
            raise TrustError(f"trust file {path}: {exc}") from None

    def check(self, offer: Offer) -> str | None:
        """None if ``offer`` is signed by its worker's key, else why not."""
        if not offer.sig:
            return UNSIGNED
        verifier = self._verifiers.get(offer.worker_id)
        if verifier is None:
            return UNKNOWN_WORKER
        if offer.signer and offer.signer != self.keys[offer.worker_id]:
            return WRONG_KEY
        try:
            verifier.verify(_unb64(offer.sig), offer_signing_bytes(offer))
        except (InvalidSignature, binascii.Error, ValueError):
            return BAD_SIGNATURE
        return None
