"""Errors in words (bourse/runtime/words.py): the wire's patterns said as the characters
they allow, and the nearest name to a misspelt one."""

from __future__ import annotations

import pytest

from bourse.runtime.words import did_you_mean, in_words, nearest, pattern_in_words
from bourse.wire import limits


@pytest.mark.parametrize(
    ("pattern", "said"),
    [
        (limits.ID_PATTERN, "1 to 63 characters: lowercase letters, digits and '-', the first "
                            "a lowercase letter or a digit"),
        (limits.IMAGE_PATTERN, "1 to 255 characters: letters, digits, '.', '_', '/', ':', '@', "
                               "'+' and '-', the first a letter or a digit"),
        (limits.LABEL_KEY_PATTERN, "1 to 63 characters: letters, digits, '.', '_', '/' and '-', "
                                   "the first a letter or a digit"),
        (limits.LABEL_VALUE_PATTERN, "up to 128 characters: letters, digits, '.', '_', ':', '/' "
                                     "and '-'"),
        (limits.PORT_NAME_PATTERN, "1 to 32 characters: letters, digits and '_', the first a "
                                   "letter or '_'"),
        (limits.ORDER_ID_PATTERN, "1 to 128 characters: letters, digits, '.', '_', ':' and '-', "
                                  "the first a letter or a digit"),
        (limits.MACHINE_ID_PATTERN, None),  # another shape: left as it is
    ],
)  # fmt: skip
def test_a_pattern_is_said_as_the_characters_it_allows(pattern: str, said: str | None) -> None:
    assert pattern_in_words(pattern) == said
    assert pattern_in_words(pattern.replace("\\Z", "$")) == said  # as codec shows it


def test_a_validation_error_names_no_regular_expression() -> None:
    raw = "Expected `str` matching regex '^[a-z0-9][a-z0-9-]{0,62}$' - at `$.region`"
    assert in_words(raw) == (
        "expected 1 to 63 characters: lowercase letters, digits and '-', the first a lowercase "
        "letter or a digit - at `$.region`"
    )
    other = "Expected `str` matching regex '^(sha256:[0-9a-f]{64})?$' - at `$.image_digest`"
    assert in_words(other) == other
    assert in_words("Expected `int` >= 1") == "Expected `int` >= 1"


@pytest.mark.parametrize(
    ("word", "names", "meant"),
    [
        ("region", ["regions", "image", "app"], "regions"),
        ("Mad", ["mad", "fra"], "mad"),  # but for case
        ("madd", ["mad", "fra", "sjc"], "mad"),
        ("helo", ["hello", "hello:latest", "web"], "hello"),
        ("zzz", ["mad", "fra"], None),  # nothing near
        ("mad", ["mad"], None),  # the word itself is no suggestion
    ],
)
def test_the_nearest_name(word: str, names: list[str], meant: str | None) -> None:
    assert nearest(word, names) == meant
    assert did_you_mean(word, names) == (f" (did you mean {meant!r}?)" if meant else "")
