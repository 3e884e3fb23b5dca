"""What travels in a machine's ``metadata`` with a meaning of its own, named once.

The v1 contract gives ``metadata`` no keys; these are the ones Bourse's clients and workers
read and write:

- an app's machines (docs/protocol.md §4.19): ``app``, ``role`` (:data:`PRIMARY` or
  :data:`SPARE`), ``slot`` (its index in its region), ``gen`` (the generation it was
  made in) and ``fields`` (the fingerprints of the spec fields it was made from);
- ``restart``: the machine's restart policy (:data:`RESTART_POLICIES`), as v1 carried it.
  The optional field ``restart`` of PlaceOrder, Commit and Machine says the same and wins
  when both are there; a client sends both, so that workers older than the field still
  honour it.
"""

from __future__ import annotations

from typing import Literal

APP = "app"
ROLE = "role"
SLOT = "slot"
GEN = "gen"
FIELDS = "fields"
RESTART = "restart"

PRIMARY = "primary"
SPARE = "spare"

RestartPolicy = Literal["no", "on-failure", "always"]
RESTART_POLICIES: tuple[RestartPolicy, ...] = ("no", "on-failure", "always")

# Keys an app's spec may not set in its own metadata: the worker and the client own them.
RESERVED = frozenset({APP, ROLE, SLOT, GEN, FIELDS, RESTART})


def check_restart(value: str) -> None:
    """ValueError naming the allowed policies unless ``value`` is one ("" is none)."""
    if value and value not in RESTART_POLICIES:
        raise ValueError(f"restart policy {value!r}: use one of {', '.join(RESTART_POLICIES)}")
