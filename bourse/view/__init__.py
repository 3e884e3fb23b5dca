"""``bourse.view``: the market's state stream (docs/protocol.md §4.21) materialized into a
local SQLite database, read with SQL, with its freshness (Fly's Corrosion, on NATS).

- rows.py: what one message of the stream means (columns, or why it is dropped), pure;
- db.py: the tables (workers, machines, apps, beats, meta), a batch applied with its
  sequences, liveness (gone workers, their machines ``unknown``);
- feed.py: one consumer of the stream (its filter in the subject that makes it);
- view.py: View and open_view (resume, rebuild, catch up, follow);
- reads.py: what the CLI asks of it; query.py: read-only SQL (``buyer query``);
- cache.py: where the CLI keeps its view.
"""

from __future__ import annotations

from bourse.view.view import Freshness, View, ViewUnavailable, open_view

__all__ = ["Freshness", "View", "ViewUnavailable", "open_view"]
