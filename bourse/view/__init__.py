"""``bourse.view``: the market's state stream (docs/protocol.md §4.21) materialized into a
local SQLite database, read with SQL, with its freshness (Fly's Corrosion, on NATS).

- rows.py: what one message of the stream means (columns, or why it is dropped), pure;
- schema.py: the tables and their indexes; db.py: a batch applied with its sequences,
  liveness (gone workers, their machines ``unknown``);
- feed.py: one consumer of the stream (its filter in the subject that makes it);
- view.py: View and open_view (resume, rebuild, catch up, follow);
- stored.py: a view read as it stands, without NATS (caught up a moment ago);
- reads.py: what the CLI asks of it; query.py: read-only SQL (``buyer query``);
- cache.py: where the CLI keeps its view.

View, ViewUnavailable and open_view are imported from view.py when first asked for (they
load nats-py): the modules that read a stored view do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bourse.view.stored import Freshness

if TYPE_CHECKING:
    from bourse.view.view import View, ViewUnavailable, open_view

__all__ = ["Freshness", "View", "ViewUnavailable", "open_view"]


def __getattr__(name: str) -> Any:
    if name in ("View", "ViewUnavailable", "open_view"):
        from bourse.view import view

        return getattr(view, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
