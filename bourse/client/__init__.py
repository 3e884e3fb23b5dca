"""The buyer's client library: place orders, read the fleet, manage machines.

Its modules, by job:

- ``client``: ``BourseClient``, thin typed methods over NATS request-reply (through the
  exchange, or ``direct=True``: the auction run in this process against the suppliers);
- ``errors``: ``ClientError`` and its codes, an order's refusal as one;
- ``ranking``: a dry run's verdicts ranked (``rank``, ``DryRun``) and an unfilled order's
  detail said from them (``why_unfilled``);
- ``gathers``: what a scatter-gather's pages add up to (a dry run's, a machine listing's:
  ``Listing``);
- ``render``, ``fleet``, ``policy``, ``events``, ``follow``, ``starting``, ``images``,
  ``orderflags``, ``apps``: printing, the fleet's tables, client-side policy (failover), the
  event feed, log following, whether a started machine stays up, image commands, order
  flags, apps.

The names other code uses are importable from the package itself, each from its module
when first asked for: a command that prints a table from the view (``render``) loads
neither nats-py nor the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bourse.client.client import BourseClient
    from bourse.client.errors import (
        IMAGE_UNKNOWN_CODE,
        OVERLOADED_CODE,
        UNRECORDED_CODE,
        ClientError,
    )
    from bourse.client.gathers import Listing
    from bourse.client.ranking import DryRun, rank, why_unfilled

__all__ = [
    "IMAGE_UNKNOWN_CODE",
    "OVERLOADED_CODE",
    "UNRECORDED_CODE",
    "BourseClient",
    "ClientError",
    "DryRun",
    "Listing",
    "rank",
    "why_unfilled",
]

# name -> the module that holds it
_HOMES = {
    "BourseClient": "client",
    "IMAGE_UNKNOWN_CODE": "errors",
    "OVERLOADED_CODE": "errors",
    "UNRECORDED_CODE": "errors",
    "ClientError": "errors",
    "Listing": "gathers",
    "DryRun": "ranking",
    "rank": "ranking",
    "why_unfilled": "ranking",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"bourse.client.{home}"), name)
