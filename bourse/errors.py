"""The one base of every error Bourse raises on purpose.

A ``BourseError`` is an expected failure with a message a person can act on (bad input, a
refused order, a busy state directory, an unreachable server); the CLIs turn it into one
``error: …`` line on stderr (and, with ``--json``, one JSON object on stdout) and exit 1.
Anything else that escapes is a bug. Subclasses keep their older builtin base too
(``ValueError``, ``RuntimeError``) so callers that caught those still do.
"""

from __future__ import annotations

__all__ = ["BourseError"]


class BourseError(Exception):
    """An error Bourse raises on purpose: its message says what went wrong and what to do."""
