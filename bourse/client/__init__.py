"""The buyer's client library: place orders, read the fleet, manage machines.

Its modules, by job:

- ``client``: ``BourseClient``, thin typed methods over NATS request-reply (through the
  exchange, or ``direct=True``: the auction run in this process against the suppliers);
- ``errors``: ``ClientError`` and its codes, an order's refusal as one;
- ``ranking``: a dry run's verdicts ranked (``rank``, ``DryRun``) and an unfilled order's
  detail said from them (``why_unfilled``);
- ``gathers``: what a scatter-gather's pages add up to (a dry run's, a machine listing's:
  ``Listing``);
- ``render``, ``policy``, ``events``, ``follow``, ``starting``, ``images``, ``orderflags``,
  ``apps``: printing, client-side policy (failover), the event feed, log following,
  whether a started machine stays up, image commands, order flags, apps.

The names other code uses are importable from the package itself.
"""

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
