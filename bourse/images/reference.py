"""Image references and the tag bucket's keys (pure).

A reference is ``name[:tag]`` (the tag defaults to ``latest``), ``name@sha256:<hex>``, or
``name:tag@sha256:<hex>`` (the digest decides; the tag is only a label). A name is one or
more lowercase components separated by ``/``, each ``[a-z0-9]`` runs joined by ``.``,
``_``, ``__`` or dashes (the OCI distribution grammar, without a registry host: the store
is the registry); at most 255 characters. A tag is ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``.

Tags live in a JetStream KV bucket whose keys allow only ``[-/_=.a-zA-Z0-9]``, where ``.``
separates subject tokens. ``tag_key`` writes ``name:tag`` with every other character
(``:`` and ``.`` included) as ``=XX`` (its UTF-8 bytes in hex), one to one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bourse.images.errors import BadReference

DEFAULT_TAG = "latest"
NAME_MAX = 255
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_GRAMMAR = "expected name[:tag] or name@sha256:<hex>"


@dataclass(frozen=True, slots=True)
class Reference:
    """A parsed reference: ``digest`` set means the image is pinned by it, whatever ``tag``
    says; otherwise ``tag`` names it (``latest`` when the reference had none)."""

    name: str
    tag: str = DEFAULT_TAG
    digest: str = ""

    @classmethod
    def parse(cls, text: str) -> Reference:
        """The reference ``text`` names; ``BadReference`` says what part is wrong."""
        if not text:
            raise BadReference(f"empty image reference: {_GRAMMAR}")
        rest, at, digest = text.partition("@")
        if at:
            check_digest(digest, f"image reference {text!r}")
        name, colon, tag = rest.rpartition(":") if ":" in rest else (rest, "", "")
        if colon and not _TAG.fullmatch(tag):
            raise BadReference(
                f"image reference {text!r}: tag {tag!r} must be 1 to 128 of [A-Za-z0-9_.-], "
                "not starting with '.' or '-' (a registry host:port is not part of a reference)"
            )
        _check_name(name, text)
        if not tag and not digest:
            tag = DEFAULT_TAG
        return cls(name, tag, digest)

    @property
    def tagged(self) -> str:
        """``name:tag``: the tag bucket's entry this reference names (without a digest)."""
        return f"{self.name}:{self.tag}"

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"{self.name}{tag}{digest}"


def check_digest(digest: str, where: str = "digest") -> str:
    """``digest`` if it is ``sha256:<64 lowercase hex>``; else ``BadReference``."""
    if not _DIGEST.fullmatch(digest):
        raise BadReference(f"{where}: digest {digest!r} is not sha256:<64 lowercase hex>")
    return digest


def _check_name(name: str, text: str) -> None:
    if not name:
        raise BadReference(f"image reference {text!r} has no name: {_GRAMMAR}")
    if len(name) > NAME_MAX:
        raise BadReference(f"image reference {text!r}: name longer than {NAME_MAX} characters")
    if not _NAME.fullmatch(name):
        raise BadReference(
            f"image reference {text!r}: name {name!r} must be lowercase components of "
            "[a-z0-9] joined by '.', '_', '__' or '-', separated by '/'"
        )


_KEY_SAFE = frozenset("-/_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_ESCAPE = re.compile(r"=([0-9A-F]{2})")


def encode_key(text: str) -> str:
    """``text`` as a KV key: characters outside ``[-/_a-zA-Z0-9]`` become ``=XX``."""
    return "".join(c if c in _KEY_SAFE else "".join(f"={b:02X}" for b in c.encode()) for c in text)


def decode_key(key: str) -> str:
    """The text ``encode_key`` made ``key`` from."""
    raw = bytearray()
    i = 0
    while i < len(key):
        m = _ESCAPE.match(key, i)
        if m:
            raw.append(int(m.group(1), 16))
            i = m.end()
        else:
            raw += key[i].encode()
            i += 1
    return raw.decode()


def tag_key(ref: Reference) -> str:
    """The tag bucket's key of ``ref``'s ``name:tag``."""
    return encode_key(ref.tagged)


def reference_of_key(key: str) -> Reference:
    """The ``name:tag`` reference a tag bucket key stands for (``BadReference`` if none)."""
    ref = Reference.parse(decode_key(key))
    if ref.digest:
        raise BadReference(f"tag key {key!r} names a digest, not name:tag")
    return ref
