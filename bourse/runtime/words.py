"""Errors as a person reads them: the characters a value may have said in words, not as the
regular expression that checks it (``1 to 63 characters: a-z, 0-9 and '-', the first a-z or
0-9``), and the name a misspelt one most likely meant (``did you mean 'regions'?``).

Pure and standard library only (a command line's error path imports it)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

# msgspec's words for a string that does not match a pattern (with our \Z shown as $).
_MATCHING = re.compile(r"Expected `str` matching regex '(?P<pattern>(?:[^'\\]|\\.)*)'")
# The patterns a value of the wire has: a first character, then up to N more (or only up
# to N of one set), anchored.
_END = r"(?:\\\\?Z|\$)"  # \Z (written once or twice over) or $
_FIRST_THEN = re.compile(r"\^\[(?P<first>[^\]]+)\]\[(?P<rest>[^\]]+)\]\{0,(?P<n>\d+)\}" + _END)
_ONLY = re.compile(r"\^\[(?P<rest>[^\]]+)\]\{0,(?P<n>\d+)\}" + _END)
# A range of a class, in words: as many of them, and one of them.
_RANGES = {
    "letters": ("letters", "a letter"),  # A-Z and a-z together
    "a-z": ("lowercase letters", "a lowercase letter"),
    "A-Z": ("capital letters", "a capital letter"),
    "0-9": ("digits", "a digit"),
    "a-f": ("letters a-f", "a letter a-f"),
}


def _members(cls: str) -> list[str]:
    """A character class's members: its ranges by name (A-Z with a-z: "letters"), then
    each other character quoted."""
    ranges: list[str] = []
    chars: list[str] = []
    i = 0
    while i < len(cls):
        if cls[i : i + 3] in _RANGES:
            ranges.append(cls[i : i + 3])
            i += 3
            continue
        escaped = cls[i] == "\\" and i + 1 < len(cls)
        chars.append(f"'{cls[i + 1] if escaped else cls[i]}'")
        i += 2 if escaped else 1
    if "A-Z" in ranges and "a-z" in ranges:
        ranges = ["letters", *(r for r in ranges if r not in ("A-Z", "a-z"))]
    return [*ranges, *chars]


def characters(cls: str, one: bool = False) -> str:
    """A character class in words: ``a-z0-9-`` -> ``lowercase letters, digits and '-'``
    (``one``: ``a lowercase letter, a digit or '-'``)."""
    parts = [_RANGES[m][one] if m in _RANGES else m for m in _members(cls)]
    last = " or " if one else " and "
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])}{last}{parts[-1]}"


def pattern_in_words(pattern: str) -> str | None:
    """What a value matching ``pattern`` is, in words; None for a pattern of another shape."""
    if m := _FIRST_THEN.fullmatch(pattern):
        n = int(m.group("n")) + 1
        first = characters(m.group("first"), one=True)
        return f"1 to {n} characters: {characters(m.group('rest'))}, the first {first}"
    if m := _ONLY.fullmatch(pattern):
        return f"up to {m.group('n')} characters: {characters(m.group('rest'))}"
    return None


def in_words(detail: str) -> str:
    """A validation error with each pattern it names said in words (``expected 1 to 63
    characters: …``); a pattern of another shape is left as it is."""

    def said(m: re.Match[str]) -> str:
        words = pattern_in_words(m.group("pattern"))
        return f"expected {words}" if words is not None else m.group(0)

    return _MATCHING.sub(said, detail)


def nearest(word: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` that ``word`` most likely meant (the same but for case, else the
    closest by difflib's ratio, at least 0.6), or None."""
    names = sorted(set(names) - {word})
    for name in names:
        if name.lower() == word.lower():
            return name
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """``" (did you mean 'mad'?)"`` for the nearest of ``names``, or ``""``."""
    found = nearest(word, names)
    return f" (did you mean {found!r}?)" if found is not None else ""
