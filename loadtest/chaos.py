"""Faults under load: real processes killed, stalled, cut off from NATS or short of disk,
while a client keeps placing orders and records what it saw.

Used by the fault tests (``tests/faults``) and by the soak mode (``bourse loadtest --soak``).
Every fault is done to a real process or file: SIGKILL, SIGSTOP/SIGCONT, a nats-server
stopped and started again on the same port, a supplier's state file filled up to its cap.
The end of a run is :meth:`ChaosRun.finish`: wait out the longest hold TTL, collect the
workers' status, stop everything and audit the SQLite files against the client's records.

What a fault is done with (a program handle, the state-file filler, the bad input) is
loadtest/faults.py; what a run records and reports, loadtest/chaos_report.py.

Every task has an owner (anyio task groups): :meth:`ChaosRun.load` owns the sends and the
lifecycles of the machines they placed; a fault's waits are plain awaits of its caller.
What a fault changes is undone in ``finally`` (a stalled process resumed, a filled file
freed), and :meth:`ChaosRun.close` releases everything under shielded, bounded scopes, so a
run that is cancelled (Ctrl-C on a soak) leaves no process or nats-server behind.
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog
from nats.aio.client import Client as NATS

from bourse.auction.core import AuctionConfig
from bourse.client import BourseClient, ClientError
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.supercluster import Supercluster
from bourse.runtime.launcher import stop_all
from bourse.runtime.supervise import cleanup_scope
from bourse.wire.codec import decode
from bourse.wire.messages import Amount, Error, Placed, WorkerStatus
from bourse.wire.subjects import Subjects
from loadtest.audit import AuditResult, OrderRecord, audit
from loadtest.chaos_report import ChaosStats, FaultRecord, chaos_report
from loadtest.faults import GARBAGE, Managed, fill_store, free_store
from loadtest.runner import HIST_MAX_US, fleet_specs, fresh_run_dir
from loadtest.workload import Profile, TraceOrder, fleet

log = structlog.get_logger("bourse.chaos")

FAULTS = (
    "kill-supplier",
    "kill-exchange",
    "restart-nats",
    "stall-supplier",
    "fill-disk",
    "bad-input",
)
RETRY_BACKOFF_S = 0.2


class ChaosRun:
    """A fleet of real processes on an embedded nats-server, a client placing orders with
    retries (same order id), and the faults. ``async with ChaosRun(...) as run:``."""

    def __init__(
        self,
        profile: Profile,
        root: Path,
        *,
        retries: int = 5,
        max_db_mb: int | None = None,
        supplier_env: dict[int, dict[str, str]] | None = None,
        exchange_env: dict[str, str] | None = None,
        seed: int = 1,
        nats_nodes: int = 1,
        duplicates: int = 1,
    ) -> None:
        """``duplicates``: every order is sent this many times at once, the first through
        the exchanges, the others alternately through a direct-mode buyer and the
        exchanges as retries (a duplicate storm: one machine per id, I3)."""
        self.p = profile
        self.duplicates = duplicates
        self.root = root
        self.retries = retries
        self.max_db_mb = max_db_mb
        self.supplier_env = supplier_env or {}
        self.exchange_env = exchange_env or {}
        self.rng = random.Random(seed)
        self.subjects = Subjects(f"chaos{uuid.uuid4().hex[:8]}")
        self.server: EmbeddedNats | None = None
        self.nats_nodes = nats_nodes
        self.cluster: Supercluster | None = None  # nats_nodes > 1: one cluster of that many
        self.suppliers: list[Managed] = []
        self.exchanges: list[Managed] = []
        self.records: dict[str, OrderRecord] = {}
        self.stats = ChaosStats()
        self.t0 = time.monotonic()
        self.destroyed: set[str] = set()  # order ids whose machine the client destroyed
        self.nc: NATS | None = None
        workers = fleet(profile)
        self.capacity = {
            str(w["worker_id"]): msgspec.convert(w["capacity"], Amount) for w in workers
        }
        self.region_of = {str(w["worker_id"]): str(w["region"]) for w in workers}
        # the longest a hold may live: deadline + commit grace + hold margin (AuctionConfig)
        cfg = AuctionConfig()
        self.max_hold_s = (profile.deadline_ms + cfg.commit_grace_ms + cfg.hold_margin_ms) / 1e3

    # -- life ---------------------------------------------------------------------------------
    async def __aenter__(self) -> ChaosRun:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """The nats-server(s), every program (each ready), the client's connection. If any
        step fails (or is cancelled), what was started is stopped again."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        fresh_run_dir(self.root)  # a soak into an earlier one's directory audits only its own
        if self.nats_nodes > 1:
            # JetStream on, as in production: claims (R3), durable events
            self.cluster = Supercluster(self.root / "nats", {"c": self.nats_nodes})
            await anyio.to_thread.run_sync(self.cluster.start)
            urls = self.cluster.urls("c")  # every program gets every URL: it can fail over
        else:
            self.server = EmbeddedNats(workdir=self.root / "nats").start()
            urls = [self.server.url]
        extra = ["--max-db-mb", str(self.max_db_mb)] if self.max_db_mb else []
        # info: the drain/resume and reconnect lines are part of what the tests read
        for spec in fleet_specs(self.p, urls, self.subjects, self.root, extra, log_level="info"):
            if spec.module == "supplier":
                spec.env.update(self.supplier_env.get(len(self.suppliers), {}))
                self.suppliers.append(Managed(spec))
            else:
                spec.env.update(self.exchange_env)
                self.exchanges.append(Managed(spec))
        for m in self.suppliers + self.exchanges:
            await m.start()
        # The client reconnects forever, like a service: a nats-server restart is a fault
        # of the system under test, not of the load generator.
        self.nc = await connect(urls, name="bourse-chaos", service=True)
        self.market = BourseClient(self.nc, self.subjects)
        self.direct = BourseClient(self.nc, self.subjects, direct=True)
        self.t0 = time.monotonic()

    async def close(self) -> None:
        """Release everything, whatever state the run is in: the client's connection
        closed, every program stopped (SIGKILL after a short grace), the nats-server(s)
        stopped. Shielded and bounded: safe in a ``finally`` of a cancelled run."""
        try:
            if self.nc is not None:
                with cleanup_scope():
                    await shutdown(self.nc)  # bounds itself; the scope bounds the rest
                self.nc = None
            managed = self.exchanges + self.suppliers
            for m in managed:
                m.wake()
            await stop_all([m.prog for m in managed if m.prog is not None])
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None
            if self.cluster is not None:
                self.cluster.stop()
                self.cluster = None

    async def keep_machines(self) -> None:
        """Keep the machines placed so far (before re-placing them): :meth:`load` ends the
        lifecycles of what it placed when it returns, so nothing destroys them any more,
        and an order placed on its own (:meth:`place` without a group) is never destroyed.
        Kept as the point where a test says it relies on that."""

    # -- load ---------------------------------------------------------------------------------
    async def load(self, orders: list[TraceOrder]) -> None:
        """Send ``orders`` at their due times (open loop); returns when all have answered.
        Each order is a task of this call's group; the machines placed are destroyed at the
        end of their lifetime by tasks of a second group, cancelled once the last answer is
        in (as :class:`loadtest.runner.Generator` does): what is left runs until the end."""
        start = time.monotonic()
        async with anyio.create_task_group() as lifecycles:
            async with anyio.create_task_group() as sends:
                for t in orders:
                    wait = start + t.due_s - time.monotonic()
                    if wait > 0:
                        await anyio.sleep(wait)
                    sends.start_soon(self.place, t, lifecycles)
                    for copy in range(1, self.duplicates):
                        sends.start_soon(self.duplicate, t, copy)
            lifecycles.cancel_scope.cancel()

    async def duplicate(self, t: TraceOrder, copy: int) -> None:
        """An extra send of ``t``'s order id, at once with the first, through another path:
        whatever it is told goes into the order's record (the audit's I3 as the client saw
        it: every Placed of one id names one machine)."""
        client = self.direct if copy % 2 else self.market
        self.stats.duplicate_sends += 1
        for attempt in range(self.retries + 1):
            try:
                r = await client.place(msgspec.structs.replace(t.order, retry=True))
            except ClientError:
                await anyio.sleep(min(RETRY_BACKOFF_S * 2**attempt, 1.0))
                continue
            if isinstance(r, Placed):
                self.stats.duplicate_placed += 1
                rec = self.records.get(t.order.order_id)
                if rec is not None:
                    rec.machine_ids.append(r.machine_id)
            return

    async def place(
        self, t: TraceOrder, lifecycles: anyio.abc.TaskGroup | None = None
    ) -> OrderRecord:
        """One order with up to ``retries`` retries after an error, always the same id.
        A machine placed is destroyed after ``t.lifetime_s`` by a task in ``lifecycles``;
        without a group it is kept for the rest of the run."""
        o = t.order
        rec = self.records.setdefault(
            o.order_id, OrderRecord(o.order_id, o.region, o.resources, o.deadline_ms)
        )
        self.stats.sent += 1
        for attempt in range(self.retries + 1):
            rec.attempts += 1
            self.stats.attempts += 1
            sent = time.monotonic()
            # a retry says so: the worker that may have placed it gets to answer first (I3)
            order = msgspec.structs.replace(o, retry=True) if attempt else o
            try:
                r = await self.market.place(order)
            except ClientError as exc:
                rec.outcome = f"error:{exc.code}"
                if attempt < self.retries:
                    self.stats.retried_errors[exc.code] += 1
                    # exponential, capped: a retry budget (~3.4 s) outlasts a server restart
                    await anyio.sleep(min(RETRY_BACKOFF_S * 2**attempt, 1.0))
                    continue
                break
            finally:
                took = (time.monotonic() - sent) * 1000
                rec.slowest_ms = max(rec.slowest_ms, took)
            self.stats.slowest_ms = max(self.stats.slowest_ms, took)
            self.stats.answer_us.record_value(max(1, min(int(took * 1000), HIST_MAX_US)))
            if isinstance(r, Placed):
                rec.outcome = "placed"
                rec.machine_ids.append(r.machine_id)
                rec.worker_id = r.worker_id
                if lifecycles is not None:
                    lifecycles.start_soon(
                        self._destroy_later, o.order_id, r.machine_id, t.lifetime_s
                    )
            else:
                rec.outcome = f"unfilled:{r.reason}"
            break
        rec.answered_at_s = time.monotonic() - self.t0
        if rec.outcome == "placed":
            self.stats.placed += 1
        elif rec.outcome.startswith("unfilled"):
            self.stats.unfilled[rec.outcome.split(":", 1)[1]] += 1
        else:
            self.stats.failed[rec.outcome.split(":", 1)[1]] += 1
        return rec

    async def _destroy_later(self, order_id: str, machine_id: str, after_s: float) -> None:
        await anyio.sleep(after_s)
        self.destroyed.add(order_id)  # before the request: it may land even if cancelled
        try:
            await self.direct.machine("destroy", machine_id)
        except ClientError:
            self.stats.destroy_errors += 1  # its supplier is down: the machine stays

    # -- faults -------------------------------------------------------------------------------
    def _note(self, kind: str, target: str, detail: str = "") -> None:
        self.stats.faults.append(FaultRecord(time.monotonic() - self.t0, kind, target, detail))
        log.info("fault_injected", kind=kind, target=target, detail=detail)

    async def kill_supplier(self, i: int, down_s: float = 0.0) -> None:
        m = self.suppliers[i]
        await m.kill9()
        self._note("kill-supplier", m.name, f"down {down_s:.1f}s")
        if down_s:
            await anyio.sleep(down_s)
        await m.start()

    async def kill_exchange(self, i: int, down_s: float = 0.0, restart: bool = True) -> None:
        m = self.exchanges[i]
        await m.kill9()
        self._note("kill-exchange", m.name, f"down {down_s:.1f}s" if restart else "for good")
        if not restart:
            return
        if down_s:
            await anyio.sleep(down_s)
        await m.start()

    async def stall_supplier(self, i: int, stall_s: float) -> None:
        m = self.suppliers[i]
        m.stall()
        self._note("stall-supplier", m.name, f"SIGSTOP {stall_s:.1f}s")
        try:
            await anyio.sleep(stall_s)
        finally:
            m.resume()  # also when cancelled: a process left stopped would hang the stop

    async def restart_nats(self, down_s: float = 0.5) -> float:
        """Stop the nats-server, start it again on the same port; returns the outage (s)."""
        assert self.server is not None
        port, workdir = self.server.port, self.server.workdir
        t = time.monotonic()
        self.server.stop()
        self._note("restart-nats", f"nats :{port}", f"down {down_s:.1f}s")
        await anyio.sleep(down_s)
        restarted = EmbeddedNats(workdir=workdir, port=port or -1)
        self.server = await anyio.to_thread.run_sync(restarted.start)
        return time.monotonic() - t

    async def kill_nats_node(self, i: int, down_s: float = 0.5) -> None:
        """SIGKILL node ``i`` of the cluster (its clients must fail over to the others),
        then start it again and wait until the cluster is meshed again."""
        assert self.cluster is not None, "kill_nats_node needs nats_nodes > 1"
        name = f"c-{i + 1}"
        self.cluster.kill(name)
        self._note("kill-nats-node", name, f"down {down_s:.1f}s")
        await anyio.sleep(down_s)
        await anyio.to_thread.run_sync(self.cluster.restart, name)

    async def fill_disk(self, i: int, full_s: float) -> None:
        """Fill supplier ``i``'s capped state file (run with ``max_db_mb``) from outside,
        keep it full for ``full_s``, then free the space again."""
        if not self.max_db_mb:
            raise ValueError("fill_disk needs the suppliers to run with max_db_mb")
        path = self.db_path(i)
        self._note("fill-disk", self.suppliers[i].name, f"full {full_s:.1f}s")
        await anyio.to_thread.run_sync(fill_store, path, self.max_db_mb)
        try:
            await anyio.sleep(full_s)
        finally:
            with anyio.CancelScope(shield=True):  # bounded by SQLite's busy timeout
                await anyio.to_thread.run_sync(free_store, path)

    async def bad_input(self) -> None:
        """Requests with malformed payloads on public subjects: each must get an Error."""
        assert self.nc is not None
        s, region = self.subjects, self.p.region_names()[0]
        worker = next(iter(self.region_of))
        subject = {
            "order": s.order(region),
            "commit": s.commit(worker),
            "machine": s.machine("get"),
            "status": s.status(region),
        }
        self._note("bad-input", "every service", f"{len(GARBAGE)} requests")
        for kind, payload in GARBAGE:
            self.stats.bad_input_sent += 1
            try:
                msg = await self.nc.request(subject[kind], payload, timeout=5)
                reply = decode(msg.data, Error)
            except Exception as exc:  # no answer, or not an Error: that is the finding
                self.stats.violations.append(f"I6 {kind} {payload[:30]!r}: no Error ({exc})")
                continue
            if not reply.detail:
                self.stats.violations.append(f"I6 {kind} {payload[:30]!r}: Error without detail")

    async def random_fault(self) -> None:
        kinds = [k for k in FAULTS if self.max_db_mb or k != "fill-disk"]  # needs a cap
        kind = self.rng.choice(kinds)
        down = self.rng.uniform(0.2, 1.5)
        if kind == "kill-supplier":
            await self.kill_supplier(self.rng.randrange(len(self.suppliers)), down)
        elif kind == "kill-exchange":
            await self.kill_exchange(self.rng.randrange(len(self.exchanges)), down)
        elif kind == "restart-nats" and self.cluster is not None:
            await self.kill_nats_node(self.rng.randrange(self.nats_nodes), down)
        elif kind == "restart-nats":
            await self.restart_nats(down)
        elif kind == "stall-supplier":
            await self.stall_supplier(self.rng.randrange(len(self.suppliers)), down)
        elif kind == "fill-disk":
            await self.fill_disk(self.rng.randrange(len(self.suppliers)), down)
        else:
            await self.bad_input()

    # -- the end ------------------------------------------------------------------------------
    def db_path(self, i: int) -> Path:
        data_dir = self.suppliers[i].spec.data_dir
        assert data_dir is not None
        return data_dir / "supplier.db"

    async def statuses(self, within_s: float = 10.0) -> list[WorkerStatus]:
        """Every worker's status; asks again until all answer or ``within_s`` passes."""
        want = len(self.region_of)
        end = time.monotonic() + within_s
        got: dict[str, WorkerStatus] = {}
        while len(got) < want and time.monotonic() < end:
            for region in self.p.region_names():
                for st in await self.direct.status(region, within_s=1.0):
                    got[st.worker_id] = st
        return sorted(got.values(), key=lambda s: s.worker_id)

    async def settle(self) -> list[WorkerStatus]:
        """After the load: wait until no hold can be alive and every orphan is reclaimed,
        then every worker's status. Holds still there after their TTL (plus the sweep), or
        machines of unfilled orders after the reclaim bound, are I4 violations."""
        # An orphan (a lost abort when a supplier is killed, a duplicate's second machine)
        # is reclaimed within its bound (protocol §5.3d): the audit comes after that too.
        wait_s = max(self.max_hold_s, 1.5 * self.p.reclaim_after_s + 1.0)
        await anyio.sleep(wait_s + 0.2)  # the TTL and the reclaim bound are under test
        st = await self.statuses()
        if len(st) < len(self.region_of):
            self.stats.violations.append(
                f"only {len(st)} of {len(self.region_of)} workers answered status"
            )
        return st

    async def finish(self) -> AuditResult:
        """Settle, stop every program (their files are then complete) and audit them."""
        statuses = await self.settle()
        for group in (self.exchanges, self.suppliers):  # the exchanges first, as ever
            async with anyio.create_task_group() as stops:
                for m in group:
                    stops.start_soon(m.stop)
        stores = [self.db_path(i) for i in range(len(self.suppliers))]
        result = audit(list(self.records.values()), stores, self.capacity, self.region_of, statuses)
        result.violations[:0] = self.stats.violations
        return result

    def report(self, result: AuditResult) -> dict[str, Any]:
        """What this run saw and its audit found (``chaos_report``)."""
        return chaos_report(self.stats, result)
