"""Image references: the grammar (each refusal names what is wrong) and the tag bucket's
keys (one to one, only characters a KV key allows)."""

from __future__ import annotations

import re

import pytest

from bourse.images.errors import BadReference
from bourse.images.reference import (
    Reference,
    decode_key,
    encode_key,
    reference_of_key,
    tag_key,
)

HEX = "a" * 64
DIGEST = f"sha256:{HEX}"


@pytest.mark.parametrize(
    ("text", "name", "tag", "digest"),
    [
        ("busybox", "busybox", "latest", ""),
        ("busybox:1.36", "busybox", "1.36", ""),
        ("acme/web:v1.2-rc_3", "acme/web", "v1.2-rc_3", ""),
        ("docker.io/library/busybox", "docker.io/library/busybox", "latest", ""),
        ("a__b.c-d--e/f", "a__b.c-d--e/f", "latest", ""),
        (f"web@{DIGEST}", "web", "", DIGEST),
        (f"web:v1@{DIGEST}", "web", "v1", DIGEST),  # the digest decides, the tag is a label
        ("web:_x", "web", "_x", ""),
    ],
)
def test_a_valid_reference_parses_into_its_parts(
    text: str, name: str, tag: str, digest: str
) -> None:
    ref = Reference.parse(text)
    assert (ref.name, ref.tag, ref.digest) == (name, tag, digest)
    assert Reference.parse(str(ref)) == ref


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty image reference"),
        (":v1", "has no name"),
        ("Web", "name 'Web' must be lowercase"),
        ("web/", "name 'web/' must be lowercase"),
        ("we..b", "name 'we..b' must be lowercase"),
        ("-web", "name '-web' must be lowercase"),
        ("web:", "tag '' must be"),
        ("web:.v1", "tag '.v1' must be"),
        ("web:" + "v" * 129, "tag 'vvv"),
        ("localhost:5000/web", "registry host:port is not part of a reference"),
        ("web@sha256:abc", "digest 'sha256:abc' is not sha256:<64 lowercase hex>"),
        (f"web@sha512:{HEX}", "digest 'sha512:"),
        (f"web@sha256:{HEX.upper()}", "is not sha256:<64 lowercase hex>"),
        ("a" * 256, "longer than 255"),
    ],
)
def test_a_bad_reference_is_refused_naming_the_part(text: str, says: str) -> None:
    with pytest.raises(BadReference, match=re.escape(says)):
        Reference.parse(text)


@pytest.mark.parametrize(
    "text",
    ["busybox:latest", "acme/web:v1.2", "a.b/c_d:x.y.", "a:b..c", "w:=x", "ünï:cödé", ""],
)
def test_a_tag_key_round_trips_and_holds_only_key_characters(text: str) -> None:
    key = encode_key(text)
    assert re.fullmatch(r"[-/_=a-zA-Z0-9]*", key)  # no dots: no empty subject token
    assert decode_key(key) == text


def test_the_tag_key_of_a_reference_gives_the_reference_back() -> None:
    ref = Reference.parse("acme/web:v1.2")
    assert tag_key(ref) == "acme/web=3Av1=2E2"
    assert reference_of_key(tag_key(ref)) == ref


def test_a_key_that_names_no_tag_is_refused() -> None:
    with pytest.raises(BadReference, match="names a digest"):
        reference_of_key(encode_key(f"web@{DIGEST}"))
    with pytest.raises(BadReference, match="must be lowercase"):
        reference_of_key("NOPE")
