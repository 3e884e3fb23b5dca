"""A supplier process's rows in the state stream (docs/protocol.md §4.21): each of its
machines' rows after every change, each of its workers' rows when it changes, and one
heartbeat a second for up to MAX_BEAT_WORKERS of its workers.

Off the hot path: a change only marks its machine (and its worker) in a dict; one task
sends the latest row of every marked one a few milliseconds later (a machine changed twice
meanwhile is sent once), their acknowledgements awaited together. A row the stream did not
acknowledge stays marked and is tried again (with a growing pause while no stream takes
them): a supplier that cannot publish keeps its machines running and, once it can, sends
their current rows. Every row goes out at the start, and again whenever a heartbeat finds
its previous heartbeat gone from the stream (a purge, the stream made again): each
heartbeat is published with the stream sequence of the one before it as its expected last
subject sequence, which the stream checks.

A worker's row is compared every heartbeat (its committed capacity, drain, image cache: a
tuple, cheap) and sent when it differs: at most once a heartbeat, however many machines it
placed or destroyed meanwhile (a busy worker's free capacity changes with every commit).

A worker the operator stopped (§4.22) is left out of its heartbeat, as if its supplier had
stopped: a view calls it gone 3 s after its last row (the stop's: it drains, ``stopped``),
and its machines unknown; started, it is named again and back at once.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from collections.abc import Mapping
from typing import Protocol

import anyio
import anyio.abc
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import PubAck

from bourse.nats.state import BEAT_INTERVAL_MS, HEADER_TTL, RETENTION_S
from bourse.wire.codec import encode
from bourse.wire.messages import MAX_BEAT_WORKERS, Heartbeat, Machine, WorkerRow, now_ms
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import owner_token

log = structlog.get_logger("bourse.supplier")

# How long a marked row waits for others to go out with it: the batch window.
FLUSH_S = 0.01
# Rows whose acknowledgements are awaited together.
ROWS_BATCH = 1024
ACK_TIMEOUT_S = 5.0
BEAT_ACK_S = 2.0
# After a round the stream did not acknowledge, the next waits this, doubled while it
# keeps failing, up to RETRY_MAX_S.
RETRY_S = 0.25
RETRY_MAX_S = 5.0
HEADER_EXPECTED = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails


def version() -> str:
    """This supplier's version (its package's), or "" when it is not installed."""
    try:
        return importlib.metadata.version("bourse")
    except importlib.metadata.PackageNotFoundError:
        return ""


class Rowed(Protocol):
    """What the rows read of a worker (supplier/worker.py ``Worker``)."""

    @property
    def region(self) -> str: ...
    @property
    def serving(self) -> bool: ...
    @property
    def machines(self) -> dict[str, Machine]: ...
    def row(self, beat: str, version: str = "") -> WorkerRow: ...
    def row_key(self) -> tuple[object, ...]: ...


def beat_groups(workers: list[tuple[str, str]]) -> list[tuple[str, str, list[str]]]:
    """The heartbeats of a process's ``(worker_id, region)``: ``(beat, its region, the
    workers it names)`` for each MAX_BEAT_WORKERS of them, keyed by the first."""
    out = []
    for i in range(0, len(workers), MAX_BEAT_WORKERS):
        chunk = workers[i : i + MAX_BEAT_WORKERS]
        out.append((chunk[0][0], chunk[0][1], [wid for wid, _ in chunk]))
    return out


def regrouped(
    workers: list[tuple[str, str, bool]], was: Mapping[str, str]
) -> tuple[list[tuple[str, str, list[str]]], dict[str, str], list[str]]:
    """The heartbeats of a process's ``(worker_id, region, serving)``: only the workers that
    serve are named (one the operator stopped, docs/protocol.md §4.22, is left out, so a view
    calls it gone as if its supplier had stopped); the heartbeat each worker's row names (a
    stopped one's: the one it had, ``was``, else its own id); the workers whose heartbeat
    changed from ``was`` (their rows go again: a row names its heartbeat)."""
    groups = beat_groups([(wid, region) for wid, region, serving in workers if serving])
    beat_of = {wid: beat for beat, _, wids in groups for wid in wids}
    for wid, _, _ in workers:
        beat_of.setdefault(wid, was.get(wid, wid))
    changed = [wid for wid, _, _ in workers if was and was.get(wid) != beat_of[wid]]
    return groups, beat_of, changed


def ttl_of(m: Machine, now: int) -> int:
    """The seconds a machine's row stays in the stream: a destroyed one's what is left of the
    retention window since its destroy (at least 1; 0 when it has left already), else 0
    (for good)."""
    if m.state != "destroyed":
        return 0
    left = RETENTION_S - (now - m.updated_at_ms) // 1000
    return max(left, 0) if m.updated_at_ms else RETENTION_S


class StateRows:
    """The rows of one supplier process's workers (see the module doc). ``machine`` is
    the hook every recorded change calls; :meth:`run` publishes until cancelled."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        workers: Mapping[str, Rowed],
        interval_ms: int = BEAT_INTERVAL_MS,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=ACK_TIMEOUT_S)
        self.subjects = subjects
        self.workers = workers
        self.interval_ms = interval_ms
        self.version = version()
        self.groups: list[tuple[str, str, list[str]]] = []
        self.beat_of: dict[str, str] = {}
        self._machines: dict[str, Machine] = {}  # marked: the latest row of each
        self._workers: set[str] = set()  # marked workers
        self._keys: dict[str, tuple[object, ...]] = {}  # each worker's last row, compared
        self._beat_seq: dict[str, int] = {}  # a heartbeat's last stream sequence
        self._lost = False  # no stream took a row or heartbeat: every row again once one does
        self._beat_now = asyncio.Event()  # the stream is back: beat without waiting
        self._back = asyncio.Event()  # ... and send the rows without waiting
        self._ready = asyncio.Event()
        self._wait_s = RETRY_S
        self.stream_missing = False
        self.published = 0  # rows acknowledged
        self.failed = 0  # rows not acknowledged (tried again)
        self.resyncs = 0  # every row sent again (the start, a purge, a stream made again)
        self.regroup()

    def regroup(self) -> None:
        """The heartbeats name the workers that serve now (the operator stopped or started
        one, §4.22): the rows of the workers whose heartbeat changed go again, and the
        heartbeats go now."""
        workers = [(wid, w.region, w.serving) for wid, w in self.workers.items()]
        self.groups, self.beat_of, changed = regrouped(workers, self.beat_of)
        beats = {beat for beat, _, _ in self.groups}
        for beat in [b for b in self._beat_seq if b not in beats]:
            del self._beat_seq[beat]  # not sent any more: no expectation when it is again
        self._workers.update(changed)
        self._beat_now.set()
        if changed:
            self._ready.set()

    @property
    def backlog(self) -> int:
        """Rows marked and not yet acknowledged."""
        return len(self._machines) + len(self._workers)

    # -- marking (the hot path: a dict and a set) --------------------------------------------
    def machine(self, m: Machine) -> None:
        """``m`` changed (durably): its row goes out with the next round (its worker's, if
        that changed with it, at the next heartbeat)."""
        self._machines[m.machine_id] = m
        self._ready.set()

    def everything(self) -> None:
        """Every row again: each worker's, each machine's but those destroyed longer ago
        than the retention window (they have left the stream)."""
        now = now_ms()
        for wid, w in self.workers.items():
            self._workers.add(wid)
            for m in w.machines.values():
                if m.state != "destroyed" or ttl_of(m, now):
                    self._machines.setdefault(m.machine_id, m)
        self.resyncs += 1
        self._ready.set()

    def _changed_workers(self) -> None:
        """Mark the workers whose row differs from the one last sent."""
        for wid, w in self.workers.items():
            if self._keys.get(wid) != w.row_key():
                self._workers.add(wid)
        if self._workers:
            self._ready.set()

    # -- the task ----------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Send every row, then the heartbeats and the marked rows, until cancelled."""
        self.everything()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._beats)
            tasks.start_soon(self._rounds)
            task_status.started()

    async def _beats(self) -> None:
        while True:
            self._changed_workers()
            self._beat_now.clear()
            await self.beat()
            with anyio.move_on_after(self.interval_ms / 1000):  # the heartbeat's pace
                await self._beat_now.wait()

    async def _rounds(self) -> None:
        while True:
            await self._ready.wait()
            await anyio.sleep(FLUSH_S)  # the batch window: what is marked meanwhile goes too
            self._ready.clear()
            if not await self.flush():
                self._back.clear()
                with anyio.move_on_after(self._retry_s()):  # or as soon as a stream is back
                    await self._back.wait()
                self._ready.set()

    def _retry_s(self) -> float:
        wait, self._wait_s = self._wait_s, min(2 * self._wait_s, RETRY_MAX_S)
        return wait

    # -- heartbeats --------------------------------------------------------------------------
    async def beat(self) -> None:
        """One heartbeat per group; a heartbeat whose previous one left the stream (or that
        no stream takes, until one does) sends every row again."""
        for beat, region, wids in self.groups:
            hb = Heartbeat(
                beat=beat,
                workers=wids,
                at_ms=now_ms(),
                interval_ms=self.interval_ms,
                version=self.version,
            )
            await self._beat(self.subjects.state_beat(region, beat), beat, encode(hb))

    async def _beat(self, subject: str, beat: str, data: bytes) -> None:
        if not self.nc.is_connected:  # nothing buffered while away: a stale beat says nothing
            return
        headers = {HEADER_TTL: str(RETENTION_S)}
        expected = self._beat_seq.pop(beat, None)
        if expected is not None:
            headers[HEADER_EXPECTED] = str(expected)
        try:
            ack = await self.js.publish(subject, data, timeout=BEAT_ACK_S, headers=headers)
        except nats.js.errors.APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                log.warning("state_rows_lost", beat=beat, detail="sending every row again")
                self.everything()
                return  # the next heartbeat goes without the expectation
            self._missing(exc)
            return
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("heartbeat_not_acked", beat=beat, error=repr(exc))
            return  # not known whether it was stored: the next goes without expectation
        self._beat_seq[beat] = ack.seq
        self._found()

    def _found(self) -> None:
        """A stream took a row or a heartbeat: after none did, every row again, and the
        heartbeats now (a view calls workers gone without them)."""
        if self.stream_missing:
            self.stream_missing = False
            log.info("state_stream_found")
        if self._lost:
            self._lost = False
            self.everything()
            self._beat_now.set()
            self._back.set()

    def _missing(self, exc: Exception) -> None:
        if isinstance(exc, nats.js.errors.NoStreamResponseError):
            self._lost = True
            if not self.stream_missing:
                self.stream_missing = True
                log.warning(
                    "state_stream_missing",
                    detail="rows wait until the stream takes them (an exchange's start or "
                    "`bourse jetstream init` makes it)",
                )
        else:
            log.warning("heartbeat_refused", error=repr(exc))

    # -- rows ----------------------------------------------------------------------------------
    async def flush(self) -> bool:
        """Send every marked row, ROWS_BATCH at a time; False when some were not
        acknowledged (they stay marked). Nothing is sent while the connection is away (the
        client would buffer it): the rows stay marked until it is back."""
        if not self.nc.is_connected:
            return False
        machines, self._machines = self._machines, {}
        wids, self._workers = self._workers, set()
        now = now_ms()
        rows: list[tuple[str, bytes, int, Machine | str]] = []
        for m in machines.values():
            subject = self.subjects.state_machine(
                owner_token(m.order_id), m.region, m.worker_id, m.machine_id
            )
            rows.append((subject, encode(m), ttl_of(m, now), m))
        for wid in wids:
            w = self.workers[wid]
            self._keys[wid] = w.row_key()
            row = w.row(self.beat_of[wid], self.version)
            rows.append((self.subjects.state_worker(w.region, wid), encode(row), 0, wid))
        ok = True
        for i in range(0, len(rows), ROWS_BATCH):
            ok = await self._send(rows[i : i + ROWS_BATCH]) and ok
        if ok:
            self._wait_s = RETRY_S
            if rows:
                self._found()
        return ok

    async def _send(self, rows: list[tuple[str, bytes, int, Machine | str]]) -> bool:
        futures: list[asyncio.Future[PubAck]] = []
        try:
            for subject, data, ttl, _ in rows:
                headers = {HEADER_TTL: str(ttl)} if ttl else None
                futures.append(await self.js.publish_async(subject, data, headers=headers))
            with anyio.move_on_after(ACK_TIMEOUT_S):
                if futures:
                    await asyncio.wait(futures)
        except Exception as exc:  # a closed connection, a stalled client: tried again
            log.debug("state_rows_not_sent", error=repr(exc))
        done = 0
        for n, (_, _, _, what) in enumerate(rows):
            fut = futures[n] if n < len(futures) else None
            if fut is not None and fut.done() and not fut.cancelled() and not fut.exception():
                done += 1
                continue
            if fut is not None and fut.done() and not fut.cancelled():
                self._missing_row(fut.exception())
            self._again(what)
        for fut in futures:
            fut.cancel()  # no-op when done; else frees its slot in the client's window
        self.published += done
        self.failed += len(rows) - done
        return done == len(rows)

    def _missing_row(self, exc: BaseException | None) -> None:
        if isinstance(exc, nats.js.errors.NoStreamResponseError):
            self._missing(exc)
        elif exc is not None:
            log.debug("state_row_refused", error=repr(exc))

    def _again(self, what: Machine | str) -> None:
        """A row not acknowledged: marked again, unless a newer one is marked already."""
        if isinstance(what, str):
            self._workers.add(what)
            self._keys.pop(what, None)
        else:
            self._machines.setdefault(what.machine_id, what)

    async def close(self, timeout_s: float) -> None:
        """Send what is marked (a stop's last changes), for at most ``timeout_s``."""
        started = time.monotonic()
        with anyio.move_on_after(timeout_s, shield=True):
            while self.backlog and time.monotonic() - started < timeout_s:
                if not await self.flush():
                    return
