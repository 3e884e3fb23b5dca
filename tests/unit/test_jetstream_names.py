"""Stream and bucket names: one market, one name (two prefixes never share a bucket)."""

from __future__ import annotations

import itertools

import pytest

from bourse.images.store import bucket_names
from bourse.nats.jetstream import claims_bucket_name, prefix_token, stream_name

NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


@pytest.mark.parametrize(
    ("prefix", "token"),
    [
        ("bourse", "BOURSE"),
        ("t.x", "T_X"),
        ("eu-1.market", "EU-1_MARKET"),
        ("Bourse", "_x42OURSE"),
        ("t_x", "T_x5fX"),
    ],
)
def test_a_prefix_token_keeps_the_usual_names(prefix: str, token: str) -> None:
    assert prefix_token(prefix) == token


def test_prefixes_that_differ_only_in_dot_underscore_or_case_get_different_names() -> None:
    prefixes = [
        "t.x",
        "t_x",
        "T.x",
        "T_X",
        "t.X",
        "tx",
        "t.x.y",
        "t_x.y",
        "t.x_y",
        "BOURSE",
        "bourse",
    ]
    for make in (stream_name, claims_bucket_name, lambda p: bucket_names(p)[0]):
        names = [make(p) for p in prefixes]
        assert len(set(names)) == len(names), names
        assert all(set(n) <= NAME_CHARS for n in names)


def test_no_two_prefixes_of_a_small_alphabet_share_a_token() -> None:
    """Every prefix of up to four characters over the characters that make collisions."""
    alphabet = "aA_.x5-"
    seen: dict[str, str] = {}
    for n in range(1, 5):
        for chars in itertools.product(alphabet, repeat=n):
            prefix = "".join(chars)
            token = prefix_token(prefix)
            assert seen.setdefault(token, prefix) == prefix, (prefix, seen[token])
