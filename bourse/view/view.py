"""A view of the market: the state stream (docs/protocol.md §4.21) materialized into a
SQLite database (bourse/view/db.py) by one consumer (a tenant's: two, the fleet rows and
its own machines'; bourse/view/feed.py), resumed from the last sequence it applied, rebuilt
from sequence 1 when it was away longer than the retention window or the stream was made
again (its epoch is another than the one the view was built from: ViewDB.stale). Queries
say how fresh they are (:meth:`View.freshness`: ``as of seq N, T ms ago``).

Open one with :func:`open_view` (caught up when it returns), follow it with
:meth:`View.follow` (each applied batch, and the sweeps that find workers gone).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from bourse.errors import BourseError
from bourse.nats.state import state_stream_name
from bourse.runtime import logs
from bourse.view.db import SCHEMA_VERSION, Batch, ViewDB
from bourse.view.feed import Feed
from bourse.view.rows import Op, Reader
from bourse.view.stored import Freshness
from bourse.wire.codec import BadMessage, decode
from bourse.wire.messages import StateEpoch, now_ms
from bourse.wire.subjects import Subjects

log = logs.get_logger("bourse.view")  # structlog imported at its first line

# Rows applied in one transaction at most (of each feed).
BATCH = 4096
# While catching up, rows wait at most this long for a batch to fill.
FILL_S = 0.05
# How often a following view looks for workers gone (and removes old destroyed rows).
SWEEP_S = 0.5
# A view looks for workers gone only when every feed heard from the server this recently:
# one that was busy longer (applying a build's backlog, its event loop blocked) may have
# heartbeats unread on its socket. A live supplier's last heartbeat is then at most ~1.5 s
# old, well within the 3 s that call its workers gone.
HEARD_S = 0.5
# How long opening a view may take to catch up before it says it cannot.
CATCH_UP_S = 30.0
RETRY_S = 0.5


class ViewUnavailable(BourseError, RuntimeError):
    """The view cannot read the state stream (no stream, no JetStream, a refusal)."""


class View:
    """One view (see the module doc): ``db`` its tables, ``tenant`` "" for every row (the
    shared buyer's and the operator's keys) or a tenant's name (its grants reach the
    fleet's rows and its own machines' only)."""

    def __init__(self, nc: NATS, subjects: Subjects, db: ViewDB, tenant: str = "") -> None:
        self.nc = nc
        self.subjects = subjects
        self.db = db
        self.tenant = tenant
        self.stream = state_stream_name(subjects.prefix)
        self.reader = Reader(subjects, tenant)
        self._ready = asyncio.Event()
        filters = (
            [subjects.state_fleet, subjects.state_owned(tenant)] if tenant else [subjects.state_all]
        )
        self.feeds = [Feed(nc, self.stream, f, self._ready) for f in filters]
        self.dropped: Counter[str] = db.counts()
        self.rebuilds = 0
        self._filling = 0.0  # when the rows queued began to wait for a batch to fill
        # Told each batch's rows once they are applied (a harness measures their delay).
        self.observe: Callable[[list[tuple[Op, int, int]]], None] | None = None

    # -- starting ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume from the sequences applied (or rebuild: see :meth:`stale`) and start every
        feed. ViewUnavailable says why the stream cannot be read."""
        why = await self.stale()
        if why:
            self._rebuild(why)
        self._identify()
        seqs = self.db.seqs()
        for feed in self.feeds:
            await self._start(feed, seqs.get(feed.filter, 0))

    async def stale(self) -> str:
        """Why what the database holds cannot be resumed from ("" when it can):
        :meth:`ViewDB.stale`, with the stream's epoch now (asked only when something was
        applied)."""
        epoch = await self.stream_epoch() if self.db.seqs() else None
        return self.db.stale(self.stream, self.tenant, epoch, now_ms())

    async def stream_epoch(self) -> str | None:
        """The stream's epoch (a direct get of its subject, which every view's grant
        reaches; §4.21), or None when it has none (or one that does not decode)."""
        subject = f"$JS.API.DIRECT.GET.{self.stream}.{self.subjects.state_epoch}"
        try:
            msg = await self.nc.request(subject, b"", timeout=2.0)
        except nats.errors.NoRespondersError:
            raise ViewUnavailable(
                f"no state stream {self.stream} (an exchange's start or `bourse jetstream "
                "init` makes it)"
            ) from None
        except nats.errors.TimeoutError:
            raise ViewUnavailable(f"the state stream {self.stream} does not answer") from None
        if (msg.headers or {}).get("Status"):  # 404: none
            return None
        try:
            return decode(msg.data, StateEpoch).epoch
        except BadMessage as exc:
            log.warning("view_epoch_malformed", stream=self.stream, error=str(exc))
            return None

    def _rebuild(self, why: str) -> None:
        log.info("view_rebuilt", stream=self.stream, why=why)
        self.db.wipe()
        self.dropped.clear()
        self.rebuilds += 1

    def _identify(self) -> None:
        with self.db.transaction():
            self.db.put("schema", str(SCHEMA_VERSION))
            self.db.put("stream", self.stream)
            self.db.put("tenant", self.tenant)

    async def _start(self, feed: Feed, after: int) -> None:
        try:
            await feed.start(after)
        except nats.js.errors.NotFoundError:
            raise ViewUnavailable(f"no state stream {self.stream}") from None
        except (nats.js.errors.Error, nats.errors.Error) as exc:
            raise ViewUnavailable(f"cannot read the state stream {self.stream}: {exc!r}") from None

    # -- applying ------------------------------------------------------------------------------
    @property
    def current(self) -> bool:
        return all(f.current for f in self.feeds)

    def apply(self) -> Batch:
        """Apply what the feeds have queued (up to BATCH rows each) in one transaction."""
        ops: list[tuple[Op, int, int]] = []
        self._filling = 0.0
        for feed in self.feeds:
            for d in feed.take(BATCH):
                ops.append((self.reader.read(d.subject, d.data), d.seq, d.at_ms))
        if not ops:
            if self.current:
                self.db.refresh_apps()
                self.db.put("synced_ms", str(now_ms()))
            return Batch()
        meta: dict[str, object] = {"seqs": {f.filter: f.last_seq for f in self.feeds}}
        current = self.current
        if current:
            meta["synced_ms"] = str(now_ms())
        # while it catches up, the apps wait for the end (a build touches each again and again)
        batch = self.db.apply(ops, meta, now_ms(), apps=current)
        if current:
            self.db.refresh_apps()
        if self.observe is not None:
            self.observe(ops)
        for reason, n in batch.dropped.items():
            if not self.dropped[reason]:
                log.warning("view_rows_dropped", reason=reason)
            self.dropped[reason] += n
        return batch

    def freshness(self) -> Freshness:
        seq = max((f.last_seq for f in self.feeds), default=0)
        return Freshness(seq, max(0, now_ms() - int(self.db.get("synced_ms", "0"))))

    async def catch_up(self, timeout_s: float = CATCH_UP_S) -> None:
        """Apply until every feed has handed over all the stream held when it started (or
        since), then sweep for gone workers. ViewUnavailable after ``timeout_s``.

        Its timeouts are asyncio's, not anyio's: the CLI opens a view and answers, and
        anyio's asyncio backend, imported at its first timeout, would cost it 16 ms."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._catch_up()
        except TimeoutError:
            raise ViewUnavailable(
                f"the view did not catch up with {self.stream} in {timeout_s} s"
            ) from None

    async def _catch_up(self) -> None:
        while True:
            await self._repair()
            if self._fill() or all(f.caught_up for f in self.feeds):
                self.apply()
                await self._flow()
            if self.current and self._heard():
                self.db.sweep(now_ms())
                self.db.refresh_apps()
                self.db.put("synced_ms", str(now_ms()))
                return
            self._ready.clear()
            with suppress(TimeoutError):
                async with asyncio.timeout(FILL_S if self._queued() else RETRY_S):
                    await self._ready.wait()

    async def _flow(self) -> None:
        for f in self.feeds:
            await f.flow()

    def _heard(self) -> bool:
        return all(f.heard_within(HEARD_S) for f in self.feeds)

    def _queued(self) -> int:
        return sum(len(f.queue) for f in self.feeds)

    def _fill(self) -> bool:
        """Whether a batch is full enough to apply while catching up (a build applies a few
        large transactions, not many small ones): BATCH rows queued, or the oldest queued
        for FILL_S."""
        if self._queued() >= BATCH:
            return True
        if not self._queued():
            self._filling = 0.0
            return False
        if not self._filling:
            self._filling = time.monotonic()
        return time.monotonic() - self._filling >= FILL_S

    async def follow(self) -> AsyncIterator[Batch]:
        """Apply and sweep until cancelled, yielding each batch that changed something
        (rows applied, workers gone or back)."""
        last_sweep = time.monotonic()
        while True:
            with anyio.move_on_after(SWEEP_S):
                await self._ready.wait()
            self._ready.clear()
            await self._repair()
            batch = self.apply()
            await self._flow()
            while any(f.queue for f in self.feeds):
                more = self.apply()
                await self._flow()
                batch.applied += more.applied
                batch.changed += more.changed
            if time.monotonic() - last_sweep >= SWEEP_S and self._heard():
                last_sweep = time.monotonic()
                batch.changed += self.db.sweep(now_ms())
            if batch.applied or batch.changed:
                yield batch

    async def _repair(self) -> None:
        """Make again every feed that is broken or silent, from the last sequence applied
        (or rebuild, when the stream was made again)."""
        bad = [f for f in self.feeds if f.broken or f.stalled()]
        if not bad:
            return
        for f in bad:
            log.warning("view_feed_restarted", filter=f.filter, why=f.broken or "silent")
        try:
            why = await self.stale()
        except ViewUnavailable as exc:
            log.warning("view_stream_unavailable", error=str(exc))
            return  # tried again at the next turn
        if why:
            self._rebuild(why)
            self._identify()
            bad = self.feeds
        seqs = self.db.seqs()
        for f in bad:
            with suppress(ViewUnavailable):
                await self._start(f, seqs.get(f.filter, 0))

    async def close(self) -> None:
        for f in self.feeds:
            await f.stop()


@asynccontextmanager
async def open_view(
    nc: NATS,
    subjects: Subjects,
    path: Path | str = ":memory:",
    tenant: str = "",
    catch_up_s: float = CATCH_UP_S,
) -> AsyncIterator[View]:
    """A view of the market in the database at ``path`` (made if missing), resumed or
    rebuilt, caught up with the stream; closed (its consumers left) at the end."""
    db = ViewDB(path)
    view = View(nc, subjects, db, tenant)
    try:
        await view.start()
        await view.catch_up(catch_up_s)
        yield view
    finally:
        await view.close()
        db.close()
