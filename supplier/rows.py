"""A supplier process's rows in the state stream (docs/protocol.md §4.21): each of its
machines' rows after every change, each of its workers' rows when it changes, and one
heartbeat a second for up to MAX_BEAT_WORKERS of its workers.

Off the hot path: a change only marks its machine in a dict (supplier/rowwindow.py); one
task sends the marked rows in rounds, at once after a quiet spell and at most one round each
FLUSH_S (what is marked meanwhile goes together), without waiting for the answers to the
rows before: up to WINDOW rows are in flight at once, one a machine (a machine changed again
while its row is in flight goes once that row is answered, as its latest). A row the stream
did not acknowledge (refused, or no answer in ACK_TIMEOUT_S) is marked again, and the next
rows wait a pause that grows while no stream takes them: a supplier that cannot publish
keeps its machines running and, once it can, sends their current rows. Every row goes out
at the start, and again whenever a heartbeat finds its previous heartbeat gone from the
stream (a purge, the stream made again): each heartbeat is published with the stream
sequence of the one before it as its expected last subject sequence, which the stream
checks.

A worker's row is compared every heartbeat (cheap tuples) and sent when it differs: a change
of its drain at once (the next heartbeat), a change of its counts (its free capacity, machine
count and image cache use, which a busy worker changes with every commit) in turns: at most
COUNTS_PER_BEAT workers' rows a heartbeat go for counts alone, those sent longest ago first.
A small fleet's rows follow every change within a heartbeat; a busy supplier of many workers
refreshes each one's counts every few seconds (1,000 busy workers: every 10 s), so its rows
stay a small share of its messages (the machines' rows say what changed, each at once).

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

from bourse.nats.acks import Answer, StreamAcks
from bourse.nats.state import BEAT_INTERVAL_MS, HEADER_TTL, RETENTION_S
from bourse.wire.codec import encode
from bourse.wire.messages import MAX_BEAT_WORKERS, Heartbeat, Machine, WorkerRow, now_ms
from bourse.wire.subjects import Subjects
from bourse.wire.tenancy import owner_token
from supplier.rowwindow import RowWindow

log = structlog.get_logger("bourse.supplier")

# Rows sent and not yet answered, at most (the window).
WINDOW = 1024
# Rounds of sends are this far apart at least: a change after a quiet spell goes at once,
# a busy supplier's go together (a round costs ~0.1 ms of CPU whatever it holds).
FLUSH_S = 0.01
# A row not answered in this long is given up (and marked again), looked for this often.
ACK_TIMEOUT_S = 5.0
EXPIRE_S = 1.0
BEAT_ACK_S = 2.0
# After a round the stream did not acknowledge, the next waits this, doubled while it
# keeps failing, up to RETRY_MAX_S.
RETRY_S = 0.25
RETRY_MAX_S = 5.0
HEADER_EXPECTED = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails
# Workers' rows sent for their counts alone, at most, each heartbeat (see the module doc).
COUNTS_PER_BEAT = 100


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
    def row_counts(self) -> tuple[object, ...]: ...


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


Compared = tuple[tuple[object, ...], tuple[object, ...]]  # a worker's row key and counts


def workers_due(
    now: Mapping[str, Compared],
    sent: Mapping[str, Compared],
    sent_at: Mapping[str, float],
    budget: int = COUNTS_PER_BEAT,
) -> list[str]:
    """The workers whose row goes at this heartbeat: each never sent or whose key differs
    from the one sent, then up to ``budget`` whose counts alone differ, those sent longest
    ago first."""
    due: list[str] = []
    counted: list[str] = []
    for wid, (key, counts) in now.items():
        last = sent.get(wid)
        if last is None or last[0] != key:
            due.append(wid)
        elif last[1] != counts:
            counted.append(wid)
    if len(counted) > budget:
        counted.sort(key=lambda wid: sent_at.get(wid, 0.0))
    return due + counted[:budget]


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
        # marked and in flight: a machine's row by its id, a worker's (made as it goes) by its id
        self._rows: RowWindow[str, Machine | str] = RowWindow(WINDOW)
        # the rows in flight: each publish's ticket -> its row's key and window ticket
        self._tickets: dict[int, tuple[str, int]] = {}
        self._acks = StreamAcks(nc, self._answer)
        self._failing = False  # a row was not stored: the next wait a pause
        self._answered = asyncio.Event()  # a row in flight was answered (close waits on it)
        # each worker's last row as compared (its key, its counts), and when it went
        self._keys: dict[str, Compared] = {}
        self._sent_at: dict[str, float] = {}
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
        for wid in changed:
            self._rows.mark(wid, wid)
        self._beat_now.set()
        if changed:
            self._ready.set()

    @property
    def backlog(self) -> int:
        """Rows marked or in flight: not yet acknowledged."""
        return self._rows.backlog

    # -- marking (the hot path: a dict) ---------------------------------------------------------
    def machine(self, m: Machine) -> None:
        """``m`` changed (durably): its row goes out with the next round (its worker's, if
        that changed with it, at the next heartbeat)."""
        self._rows.mark(m.machine_id, m)
        self._ready.set()

    def everything(self) -> None:
        """Every row again: each worker's, each machine's but those destroyed longer ago
        than the retention window (they have left the stream)."""
        now = now_ms()
        for wid, w in self.workers.items():
            self._rows.again(wid, wid)
            for m in w.machines.values():
                if m.state != "destroyed" or ttl_of(m, now):
                    self._rows.again(m.machine_id, m)
        self.resyncs += 1
        self._ready.set()

    def _changed_workers(self) -> None:
        """Mark the workers whose row is due (:func:`workers_due`)."""
        now = {wid: (w.row_key(), w.row_counts()) for wid, w in self.workers.items()}
        for wid in workers_due(now, self._keys, self._sent_at):
            self._rows.mark(wid, wid)
        if self._rows.waiting():
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
            tasks.start_soon(self._expiries)
            task_status.started()

    async def _beats(self) -> None:
        while True:
            self._changed_workers()
            self._beat_now.clear()
            await self.beat()
            with anyio.move_on_after(self.interval_ms / 1000):  # the heartbeat's pace
                await self._beat_now.wait()

    async def _rounds(self) -> None:
        last = -FLUSH_S
        while True:
            await self._ready.wait()
            wait = last + FLUSH_S - time.monotonic()
            if wait > 0:  # a round at most each FLUSH_S: what is marked meanwhile goes with it
                await anyio.sleep(wait)
            self._ready.clear()
            last = time.monotonic()
            if self._failing:  # a row was not stored: a pause, or until a stream is back
                self._failing = False
                self._back.clear()
                with anyio.move_on_after(self._retry_s()):
                    await self._back.wait()
            await self.send()

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
    async def send(self) -> None:
        """Send the marked rows the window has room for (see supplier/rowwindow.py), without
        waiting for their answers (they come back on one subscription, bourse/nats/acks.py).
        Nothing is sent while the connection is away (the client would buffer it): the rows
        stay marked, tried again after a pause."""
        if not self._rows.waiting():
            return
        if not self.nc.is_connected:
            self._failing = True
            self._ready.set()  # after the pause, tried again
            return
        now = now_ms()
        for key, what, ticket in self._rows.due(time.monotonic()):
            subject, data, headers = self._row(what, now)
            try:
                sent = await self._acks.publish(subject, data, headers)
            except Exception as exc:  # a closed connection, a stalled client: tried again
                log.debug("state_rows_not_sent", error=repr(exc))
                self._given_up(key, ticket)
                continue
            self._tickets[sent] = (key, ticket)

    def _row(self, what: Machine | str, now: int) -> tuple[str, bytes, dict[str, str] | None]:
        """A row's subject, payload and headers (a destroyed machine's: its TTL); a worker's
        row is made as it goes."""
        if isinstance(what, str):
            w = self.workers[what]
            self._keys[what] = (w.row_key(), w.row_counts())
            self._sent_at[what] = time.monotonic()
            row = encode(w.row(self.beat_of[what], self.version))
            return self.subjects.state_worker(w.region, what), row, None
        subject = self.subjects.state_machine(
            owner_token(what.order_id), what.region, what.worker_id, what.machine_id
        )
        ttl = ttl_of(what, now)
        return subject, encode(what), {HEADER_TTL: str(ttl)} if ttl else None

    def _answer(self, sent: int, answer: Answer) -> None:
        """A row's answer: stored, or refused (no stream took it, or the stream's error);
        one given up already is ignored."""
        row = self._tickets.pop(sent, None)
        self._answered.set()
        if row is None:
            return  # given up already (timed out)
        key, ticket = row
        if not answer.stored:
            if answer.no_stream:
                self._missing(nats.js.errors.NoStreamResponseError())
            else:
                log.debug("state_row_refused", error=answer.error)
            self._given_up(key, ticket)
            return
        if self._rows.acked(key, ticket):
            self.published += 1
        self._wait_s = RETRY_S
        self._found()
        if self._rows.waiting():
            self._ready.set()

    def _given_up(self, key: str, ticket: int) -> None:
        """A row not stored: marked again (a worker's made anew), the next rows after a
        pause."""
        if not self._rows.failed(key, ticket):
            return  # given up already (timed out)
        self.failed += 1
        self._keys.pop(key, None)  # a worker's: compared again
        self._failing = True
        self._ready.set()

    async def _expiries(self) -> None:
        """Give up the rows not answered in time, looked for every EXPIRE_S (not in each
        round: a timeout a round is a cancel scope a row)."""
        while True:
            await anyio.sleep(EXPIRE_S)
            self._expire()

    def _expire(self) -> None:
        """Give up the rows not answered in ACK_TIMEOUT_S (an answer that comes later is
        ignored)."""
        expired = self._rows.expired(time.monotonic(), ACK_TIMEOUT_S)
        if not expired:
            return
        given_up = set(expired)
        self._tickets = {s: row for s, row in self._tickets.items() if row not in given_up}
        for key, ticket in expired:
            self._given_up(key, ticket)

    async def close(self, timeout_s: float) -> None:
        """Send what is marked (a stop's last changes) and wait for the answers, for at most
        ``timeout_s``; no more once a row was not stored or the connection is away."""
        self._failing = False
        with anyio.move_on_after(timeout_s, shield=True):
            while self._rows.backlog and not self._failing and self.nc.is_connected:
                self._answered.clear()
                await self.send()
                if self._rows.flying:
                    await self._answered.wait()
        await self._acks.close()
